"""eval/multi_gpu.py on the CPU: transformers' tensor parallelism over 2 gloo ranks (``torchrun``) with turbo_int8's
PyTorch twins — each rank's TurboCache holds its own KV heads, ``mixed``'s 2-bit heads are spread over the ranks as
the single-process layer map has them, and greedy tokens equal TP 1's — plus the device map and the comparison."""

import json
import os
import subprocess
import sys

import pytest

from eval import multi_gpu
from turbo_attn_hf.loading import LOAD_KWARGS


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "model"
    multi_gpu.make_model(str(path), tiny=True)
    return path


def test_tensor_parallel_two_ranks_hold_their_heads_and_match_one_rank(tiny_model, tmp_path):
    tp1, tp2 = tmp_path / "tp1.json", tmp_path / "tp2.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # turbo's PyTorch twins: fast on CPU
    args = ["-m", "eval.multi_gpu", "tp", "--model", str(tiny_model), "--new-tokens", "16"]
    subprocess.run([sys.executable, *args, "--out", str(tp1), "--bench", "1x32", "--bench-tokens", "2",
                    "--bench-reps", "1"], env=env, check=True, capture_output=True, timeout=600)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args, "--out",
                           str(tp2)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads(p.read_text()) for p in (tp1, tp2))
    assert two["world"] == 2 and one["world"] == 1
    # timings recorded per config (their values are the CPU's noise here: no sign asserted)
    assert all(set(r["bench"]) >= {"ttft_ms", "decode_ms_per_step"} and r["bench"]["context"] == 32
               for r in one["rows"] if r["config"] != "turbo_mixed_map")
    rows1 = {r["config"]: r for r in one["rows"]}
    for r in two["rows"]:
        ranks = r["ranks"]
        assert len(ranks) == 2
        if r["config"] == "sdpa":
            continue
        assert all(x["cache"] == "TurboCache" and x["layer0_kv_heads"] == 1 for x in ranks), r
        # the ranks' head bits side by side are the single-process layer's map (mixed: [2, 4]; mixed_map: its
        # explicit row, sliced)
        assert [b for x in ranks for b in x["layer0_head_bits"]] == rows1[r["config"]]["layer0_head_bits"]
        assert len(r["sampled"]) == 16 and len(r["beam"]) == 16
    res = multi_gpu.compare(str(tp1), str(tp2))
    assert set(res) == {"sdpa", "turbo_int8", "turbo_int4", "turbo_mixed", "turbo_mixed_map"}
    assert all(v["equal"] for k, v in res.items() if k != "sdpa"), res
    # teacher-forced through the cache: the same choice at every step
    assert all(v["forced"]["differ"] == 0 and v["forced"]["steps"] == 96 for k, v in res.items() if k != "sdpa"), res


def test_split_map_and_compare(tmp_path):
    m = multi_gpu._split_map(5, [0, 1])
    assert [m[f"model.layers.{i}"] for i in range(5)] == [0, 0, 0, 1, 1]
    assert m["model.embed_tokens"] == 0 and m["lm_head"] == 1 and m["model.norm"] == 1
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": [{"config": "x", "greedy": [1, 2, 3]}, {"config": "y", "greedy": [1, 2]}]}))
    b.write_text(json.dumps({"rows": [{"config": "x", "greedy": [1, 5, 3]}, {"config": "y", "greedy": [1, 2]}]}))
    assert multi_gpu.compare(str(a), str(b)) == {"x": dict(equal=False, first_difference=1, tokens=3),
                                                 "y": dict(equal=True, first_difference=None, tokens=2)}


def test_split_map_keeps_a_tied_head_with_the_embeddings():
    m = multi_gpu._split_map(4, [0, 1], tied=True)
    assert m["lm_head"] == m["model.embed_tokens"] == 0 and m["model.norm"] == 1


def test_widen_heads_computes_the_same_function_with_heads_two_ranks_split(tmp_path):
    """SmolLM2's shape (9 query / 3 KV heads, which TP 2 cannot split) widened to 12 / 6: the same logits, also
    after a save and reload, so the TP runs on real weights compare one model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
                      num_hidden_layers=2, intermediate_size=256, vocab_size=128, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ref = model(ids).logits
        wide = multi_gpu.widen_heads(model)
        assert (wide.config.num_attention_heads, wide.config.num_key_value_heads) == (12, 6)
        torch.testing.assert_close(wide(ids).logits, ref, rtol=0, atol=1e-5)
        wide.save_pretrained(tmp_path)
        again = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", **LOAD_KWARGS).eval()
        torch.testing.assert_close(again(ids).logits, ref, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_device_map_over_two_gpus_equals_one_gpu(tiny_model, tmp_path):
    """The layers split over 2 GPUs (a TurboCache layer on each) give one GPU's greedy tokens for every config
    (SmolLM2 at 128 tokens: ``eval/results/multi_gpu_device_map_compare_h200x2.json``)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    args = [sys.executable, "-m", "eval.multi_gpu", "device-map", "--model", str(tiny_model), "--new-tokens", "32"]
    subprocess.run([*args, "--single", "--out", str(one)], check=True, capture_output=True, timeout=600)
    subprocess.run([*args, "--out", str(two)], check=True, capture_output=True, timeout=600)
    rows = json.loads(two.read_text())["rows"]
    assert all(r["layer_devices"] == ["cuda:0", "cuda:1"] for r in rows if r["config"] != "sdpa"), rows
    assert all(v["equal"] for v in multi_gpu.compare(str(one), str(two)).values())
