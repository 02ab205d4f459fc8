"""eval/long_context.py: method parsing, position buckets, cache byte counting, and the whole runner end to end
on a random 2-layer model (--quick --tiny) on the CPU."""

import json

import pytest
import torch

from turbo_attn_hf.eval import long_context as lc


def test_method_names():
    assert lc.method("eager-fp32").attn == "eager" and lc.method("eager-fp32").dtype == torch.float32
    assert lc.method("sdpa-bf16").attn == "sdpa" and lc.method("sdpa-bf16").bits == 16
    t = lc.method("turbo-mixed")
    assert t.attn == "turbo_int8" and t.preset == "mixed" and t.bits == "mixed"
    assert lc.method("turbo-int4").bits == 4
    h = lc.method("hf-hqq-int2")
    assert (h.attn, h.backend, h.nbits, h.bits) == ("sdpa", "hqq", 2, 2)
    assert lc.method("hf-fp8").backend == "fp8"
    for bad in ("hf-quanto-int3", "hf-foo-int4", "sdpa"):
        with pytest.raises(ValueError, match="unknown method"):
            lc.method(bad)


def test_bucket_of():
    pos = torch.tensor([0, 2047, 2048, 4095, 4096, 8191, 9000])
    assert lc.bucket_of(pos, [0, 2048, 4096, 8192]).tolist() == [0, 0, 1, 1, 2, 2, 2]


def test_cache_bytes_dynamic_and_turbo():
    from transformers import DynamicCache, LlamaConfig

    import turbo_attn_hf

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2)
    k = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    dc = DynamicCache(config=cfg)
    for i in range(2):
        dc.update(k, k, i)
    assert lc.cache_bytes(dc) == 2 * 2 * k.numel() * 2  # layers x (K, V) x bf16
    tc = turbo_attn_hf.TurboCache("int4", config=cfg)
    for i in range(2):
        tc.update(k, k, i)
    assert lc.cache_bytes(tc) == tc.memory_bytes() > 0


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10, dtype=torch.float32)
    assert lc._tensor_bytes({"x": a, "y": [a, a[2:]], "z": (a.view(2, 5),)}, set()) == 40


def test_quick_tiny_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    # turbo's PyTorch twins instead of the Triton interpreter that conftest turns on: the kernels have their own
    # tests, and this one checks the runner (interpreted, it takes minutes). Through the environment, which Triton's
    # knob reads on every access: setting the knob itself would leave an explicit override behind at teardown
    # (monkeypatch restores the value it read), and every later test would see the interpreter forced on.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    try:
        from turbo_attn_hf.chat import ChatError, embedded_model

        embedded_model()
    except ChatError as e:
        pytest.skip(str(e))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"Line {i}: the value of item {i} is {i * 7 % 13}." for i in range(400)))
    res = lc.main(["--quick", "--tiny", "--text", f"file:{text}", "--out", str(tmp_path), "--tag", "t"])
    d = json.loads((tmp_path / "long_context_t.json").read_text())
    md = (tmp_path / "long_context_t.md").read_text()
    assert set(d["methods"]) == {"sdpa-bf16", "turbo-int4"} and not d["unavailable"]
    assert d["buckets"] == ["0-256", "256-512"]
    for name, r in res["methods"].items():
        assert "error" not in r, r.get("error")
        assert set(r["passkey"]) >= {"256", "512", "all", "by_depth"} and r["passkey"]["n"] == 4
        assert r["ppl"]["all"]["n_tokens"] == 511
        assert r["ppl"]["0-256"]["n_tokens"] + r["ppl"]["256-512"]["n_tokens"] == 511
        assert r["decode"]["steps"] == 2 and r["decode"]["ms_median"] > 0
        assert f"| {name} |" in md
    # sdpa-bf16 against the fp32 reference: small KL (random weights: a near-uniform distribution), and the
    # bf16 DynamicCache stores 2 layers x 2 KV heads x 64 x (K, V) x 2 bytes per token
    assert res["methods"]["sdpa-bf16"]["ppl"]["all"]["kl"] < 1e-3
    assert res["methods"]["sdpa-bf16"]["kv_bytes_per_token"] == 2 * 2 * 64 * 2 * 2
    assert res["methods"]["turbo-int4"]["kv_bytes_per_token"] < res["methods"]["sdpa-bf16"]["kv_bytes_per_token"]
    assert d["reference_ppl"]["all"]["ppl"] > 1
    assert "passkey 256 %" in md and "KV B/token" in md


def test_unpack_bits_matches_quanto_packing():
    # quanto packs value i of each byte at bits*i (optimum/quanto/tensor/packed.py pack_weights); 2 and 4 bits
    for bits in (2, 4):
        per = 8 // bits
        vals = torch.randint(0, 2**bits, (per * 3, 5), dtype=torch.uint8)
        rows = vals.shape[0] // per
        packed = torch.zeros(rows, 5, dtype=torch.uint8)
        for i in range(per):
            packed |= vals[i * rows:(i + 1) * rows] << (bits * i)
        assert torch.equal(lc.unpack_bits(packed, bits), vals)


def test_unpack_bits_round_trips_quanto_pack_weights():
    packed_mod = pytest.importorskip("optimum.quanto.tensor.packed")
    for bits in (2, 4):
        vals = torch.randint(0, 2**bits, (64, 7), dtype=torch.uint8)
        assert torch.equal(lc.unpack_bits(packed_mod.pack_weights(vals, bits), bits), vals)
