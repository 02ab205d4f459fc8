"""Issue 22's checks on several devices: generate() with the model split over GPUs by ``device_map`` (one process)
and by transformers' tensor parallelism (``torchrun``, one process a rank), turbo_int8 against sdpa.

Each run loads the model once and generates with sdpa and with turbo_int8 (``set_attn_implementation``) in every
preset (``set_turbo_config``): greedy tokens (``--new-tokens``, 128 by default, no early end), one seeded sampling
run and one 2-beam run (they must finish; their tokens are recorded), the cache's class, and where the cache lives:

* ``device-map``: the layers split in two halves over the first two GPUs (an explicit map: a 135M model would sit on
  one GPU under ``"auto"``), or ``--single`` on one device — the reference. Records each TurboCache layer's device.
* ``tp``: ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` under
  ``torchrun --nproc-per-node N`` (TP 1 without torchrun).
  Rank 0 writes the file. Records layer 0's KV heads and head bits on every rank (gathered): each rank holds only its
  heads, ``mixed``'s 2-bit heads spread over the ranks (``turbo_mixed_map``: an explicit map, sliced). SmolLM2's
  9 / 3 heads do not split over 2 ranks, so TP runs on ``make-model --widen-gguf`` (SmolLM2 as 12 / 6 heads, the
  same function) or a random Llama with 8 KV heads (``make-model``).
* ``--bench BxL`` (either mode): decode ms/step and TTFT per config at batch B × context L
  (``bench_generate.measure``: t(1 + N) − t(1) over N, medians of ``--bench-reps``, the cache's path checked), for
  issue 22's TP 2 vs single-GPU ratio at 8 × 16k.
* ``compare A B``: per config, whether the greedy tokens are equal and the first index where they differ, and, teacher
  forced through the cache over a fixed continuation (``_teacher_forced``), the steps whose next-token choice differs
  and A's top-2 logit gap at them: one flipped near tie sends a greedy run elsewhere, so this is the check of TP.
* ``make-model DIR``: a random Llama (``--tiny`` for the CPU test, else 8 layers, 16 query / 8 KV heads of 128), or
  ``--widen-gguf FILE``: that GGUF's model through ``widen_heads``.

    python -m eval.multi_gpu device-map --gguf DIR/SmolLM2-135M-Instruct.Q4_1.gguf --single --out one.json
    python -m eval.multi_gpu device-map --gguf DIR/SmolLM2-135M-Instruct.Q4_1.gguf --out two.json
    python -m eval.multi_gpu compare one.json two.json
    python -m eval.multi_gpu make-model /tmp/tpm [--widen-gguf FILE]
    python -m eval.multi_gpu tp --model /tmp/tpm --out tp1.json
    torchrun --nproc-per-node 2 -m eval.multi_gpu tp --model /tmp/tpm --out tp2.json [--bench 8x16k]
    python -m eval.multi_gpu compare tp1.json tp2.json

On CPU (no GPU) ``tp`` runs with the gloo backend and turbo's PyTorch twins (``tests/eval/test_multi_gpu.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

from turbo_attn_hf.loading import LOAD_KWARGS

from .bench_common import machine_info
from .bench_e2e import PRESETS, new_cache, set_impl
from .bench_generate import _out_cache, measure, parse_config, parse_shapes

PROMPT = "Question: A farmer has 17 sheep and buys 5 more, then sells 8. How many sheep are left? Answer step by step."


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _split_map(n_layers: int, devices: list, tied: bool = False) -> dict:
    """An explicit device_map: the decoder layers in equal runs over ``devices``, embeddings on the first, the final
    norm and the head on the last — or, ``tied`` (``tie_word_embeddings``), the head beside the embeddings: the two
    share one weight, which a split would leave on the head's device under an embedding hook moving ids elsewhere."""
    per = -(-n_layers // len(devices))
    m = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[-1],
         "lm_head": devices[0] if tied else devices[-1]}
    for i in range(n_layers):
        m[f"model.layers.{i}"] = devices[i // per]
    return m


def _tp_config():
    """transformers' tensor-parallel request: ``DistributedConfig(tp_plan="auto")`` (5.17 through 5.24; the bare
    ``tp_plan=`` keyword of ``from_pretrained`` is deprecated)."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_plan="auto")


def _load(args):
    """The model with turbo_int8 (sdpa by ``set_attn_implementation``) placed as the mode asks, and its tokenizer
    (None for a model without one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import turbo_attn_hf  # noqa: F401  (registers turbo_int8)

    src = args.model or os.path.dirname(args.gguf)
    src_kw = dict(gguf_file=os.path.basename(args.gguf)) if args.gguf else {}
    kw = dict(src_kw)
    if args.mode == "tp" and _world() > 1:
        kw["distributed_config"] = _tp_config()
    elif torch.cuda.is_available():  # CPU: the one device
        if args.mode == "tp" or args.single or torch.cuda.device_count() < 2:
            kw["device_map"] = {"": 0}
        else:
            cfg = AutoConfig.from_pretrained(src, **src_kw)
            kw["device_map"] = _split_map(cfg.num_hidden_layers, [0, 1], bool(getattr(cfg, "tie_word_embeddings", 0)))
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, attn_implementation="turbo_int8", **kw,
                                                 **LOAD_KWARGS).eval()
    try:
        tok = AutoTokenizer.from_pretrained(src, **src_kw)
    except Exception:  # noqa: BLE001 - a random model has no tokenizer: fixed token ids
        tok = None
    return model, tok


def _inputs(model, tok):
    import torch

    dev = model.get_input_embeddings().weight.device
    if tok is not None and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    elif tok is not None:
        ids = tok(PROMPT, return_tensors="pt").input_ids
    else:
        ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    return ids.to(dev)


def _mixed_map(model_config):
    """``mixed`` with an explicit ``head_bits`` map (as ``calibrate`` writes one): 2 bits where head + layer is even.
    Tensor parallelism slices a given map, so TP 2 runs TP 1's map; ``head_select: prompt`` instead picks each
    rank's share of 2-bit heads on its own (ranks stay balanced), which need not be the map one process picks."""
    from turbo_attn_hf.config import TurboConfig

    hk = model_config.num_key_value_heads
    rows = [[2 if (h + i) % 2 == 0 else 4 for h in range(hk)] for i in range(model_config.num_hidden_layers)]
    return dict(TurboConfig.preset("mixed").to_dict(), head_bits=rows)


ANSWER = (" The farmer starts with 17 sheep. He buys 5 more, so he has 17 + 5 = 22 sheep. Then he sells 8 of them, so"
          " 22 - 8 = 14 sheep are left. Let us check: 14 + 8 = 22 and 22 - 5 = 17, which is where he started. So the"
          " farmer has 14 sheep left. The answer is 14.")


def _teacher_forced(model, ids, tok) -> dict:
    """The next-token choice at each step of a fixed continuation (``ANSWER``; 96 seeded ids for a model without a
    tokenizer) fed one token at a time through the cache (``fidelity.next_token_logprobs``' decode mode), and the
    top-2 gap there. Free of the chaos of greedy runs, where one flipped near tie changes everything after it:
    ``compare`` counts the steps where two runs choose differently and the gaps at those steps."""
    import torch

    import turbo_attn_hf

    from .fidelity import next_token_logprobs

    if tok is not None:
        cont = tok(ANSWER, add_special_tokens=False).input_ids
    else:
        cont = torch.randint(0, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(2)).tolist()
    impl = "sdpa" if model.config._attn_implementation == "sdpa" else turbo_attn_hf.get_turbo_config(model)
    n = ids.shape[1]
    lp = next_token_logprobs(model, torch.cat([ids[0].cpu(), torch.tensor(cont)]), mode="decode", prompt_len=n,
                             cache_factory=lambda: new_cache(model, impl))[n - 1:]
    top = lp.topk(2, dim=-1)
    return dict(argmax=top.indices[:, 0].tolist(), gap=(top.values[:, 0] - top.values[:, 1]).tolist())


def _cache_facts(cache) -> dict:
    """Where a generate()'s cache lives: its class, each TurboCache layer's device, layer 0's KV heads and bits."""
    out = {"cache": type(cache).__name__}
    layers = [l for l in getattr(cache, "layers", []) if hasattr(l, "n_kv_heads")]
    if layers:
        out["layer_devices"] = sorted({str(l.device) for l in layers if getattr(l, "device", None) is not None})
        out["layer0_kv_heads"] = layers[0].n_kv_heads
        out["layer0_head_bits"] = list(getattr(layers[0], "head_bits", None) or [])
    return out


def _generate(model, ids, n: int, **kw):
    """(the new tokens of row 0, the cache generate() used)."""
    import torch

    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences[0, ids.shape[1]:].tolist(), _out_cache(out)


def run_tokens(args) -> dict:
    import torch

    if args.mode == "tp" and _world() > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend)
    rows = []
    model, tok = _load(args)  # loaded once (a GGUF load is the slow part); sdpa by switching
    ids = _inputs(model, tok)
    for impl in ("sdpa", *PRESETS, "mixed_map"):
        set_impl(model, _mixed_map(model.config) if impl == "mixed_map" else impl)
        name = f"turbo_{impl}" if impl != "sdpa" else "sdpa"
        # min_new_tokens: every config compares the same number of tokens (no early end of sequence)
        greedy, cache = _generate(model, ids, args.new_tokens, do_sample=False, min_new_tokens=args.new_tokens)
        torch.manual_seed(0)
        sampled, _ = _generate(model, ids, 16, do_sample=True, top_k=20, temperature=0.8)
        beam, _ = _generate(model, ids, 16, do_sample=False, num_beams=2)
        facts = _cache_facts(cache)
        if args.mode == "tp" and _world() > 1:
            gathered = [None] * _world()
            torch.distributed.all_gather_object(gathered, facts)
            facts = {"ranks": gathered}
        row = dict(config=name, greedy=greedy, sampled=sampled, beam=beam, forced=_teacher_forced(model, ids, tok),
                   **facts)
        # bench_generate's protocol and path check, eager (every rank runs it: TP collectives)
        if args.bench and impl != "mixed_map":
            (b, L), = parse_shapes(args.bench)
            spec = parse_config(f"{name}_eager" if impl != "sdpa" else "sdpa_dynamic")
            row["bench"] = dict(batch=b, context=L, new_tokens=args.bench_tokens,
                                **measure(model, spec, b, L, args.bench_tokens, args.bench_reps,
                                          model.config.num_hidden_layers, profile_steps=args.profile_steps,
                                          steps=args.step_times))
        rows.append(row)
        if _rank() == 0:
            print(json.dumps({"config": name, "greedy": greedy[:12]}), flush=True)
    devices = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available()
               else ["cpu"])
    return dict(mode=args.mode, world=_world(), single=bool(args.single), machine=machine_info(), devices=devices,
                new_tokens=args.new_tokens, source=args.gguf or args.model, rows=rows)


def compare(a_path: str, b_path: str) -> dict:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    bs = {r["config"]: r for r in b["rows"]}
    out = {}
    for r in a["rows"]:
        other = bs.get(r["config"])
        if other is None:
            continue
        x, y = r["greedy"], other["greedy"]
        first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if first is None and len(x) != len(y):
            first = min(len(x), len(y))
        out[r["config"]] = dict(equal=first is None, first_difference=first, tokens=len(x))
        if "forced" in r and "forced" in other:
            fa, fb = r["forced"], other["forced"]
            diff = [i for i, (u, v) in enumerate(zip(fa["argmax"], fb["argmax"])) if u != v]
            out[r["config"]]["forced"] = dict(steps=len(fa["argmax"]), differ=len(diff),
                                              gaps_where_differ=[round(fa["gap"][i], 4) for i in diff],
                                              min_gap=round(min(fa["gap"]), 4))
    return out


def widen_heads(model, world: int = 2):
    """``model`` (a Llama-layout causal LM) rewritten to compute the same function with KV and query head counts that
    ``world`` tensor-parallel ranks can split, in place: each KV head repeated ``world`` times, each query group
    padded with copies of its first head whose ``o_proj`` columns are zero (they add exact zeros; a copy, not a zero
    query, keeps every quantizer's scale finite). SmolLM2's 9 / 3 heads become 12 / 6: real weights under TP 2."""
    import torch

    cfg = model.config
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    g = hq // hk
    g_new = -(-g // world)  # queries per new KV head; the new KV heads of one old head serve world * g_new slots
    slots = world * g_new
    src = [j * g + (s if s < g else 0) for j in range(hk) for s in range(slots)]
    live = torch.tensor([s < g for _ in range(hk) for s in range(slots)])
    kv = [j for j in range(hk) for _ in range(world)]
    rows = lambda idx: torch.cat([torch.arange(i * d, (i + 1) * d) for i in idx])  # noqa: E731
    with torch.no_grad():
        for layer in model.model.layers:
            at = layer.self_attn
            at.q_proj.weight = torch.nn.Parameter(at.q_proj.weight[rows(src)].clone())
            if at.q_proj.bias is not None:
                at.q_proj.bias = torch.nn.Parameter(at.q_proj.bias[rows(src)].clone())
            for proj in (at.k_proj, at.v_proj):
                proj.weight = torch.nn.Parameter(proj.weight[rows(kv)].clone())
                if proj.bias is not None:
                    proj.bias = torch.nn.Parameter(proj.bias[rows(kv)].clone())
            o = at.o_proj.weight[:, rows(src)].clone()
            o[:, ~live.repeat_interleave(d)] = 0
            at.o_proj.weight = torch.nn.Parameter(o)
            at.num_key_value_groups = g_new  # the one head count Llama's attention keeps (it reshapes by head_dim)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = hk * slots, hk * world, d
    return model


def make_model(path: str, tiny: bool, widen_gguf: str = "") -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if widen_gguf:
        kw = dict(gguf_file=os.path.basename(widen_gguf))
        src = os.path.dirname(widen_gguf)
        gguf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw, **LOAD_KWARGS)
        cfg = copy.deepcopy(gguf.config)  # a plain model of the dequantized weights: a GGUF one does not save
        cfg.__dict__.pop("quantization_config", None)
        model = type(gguf)(cfg)
        model.load_state_dict(gguf.state_dict())
        widen_heads(model).to(torch.bfloat16).save_pretrained(path)
        AutoTokenizer.from_pretrained(src, **kw).save_pretrained(path)
        return
    if tiny:
        cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          num_hidden_layers=2, intermediate_size=512, vocab_size=512, max_position_embeddings=4096)
    else:
        cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                          num_hidden_layers=8, intermediate_size=5632, vocab_size=32000,
                          max_position_embeddings=32768)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("device-map", "tp", "compare", "make-model"))
    ap.add_argument("paths", nargs="*", help="compare: two result files; make-model: the output folder")
    ap.add_argument("--gguf", default="", help="a GGUF file (its folder is the model's)")
    ap.add_argument("--model", default="", help="a model folder")
    ap.add_argument("--single", action="store_true", help="device-map: the whole model on one device (reference)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="make-model: the CPU test's 2-layer model")
    ap.add_argument("--widen-gguf", default="", help="make-model: this GGUF's model with heads TP 2 can split "
                    "(widen_heads: the same function)")
    ap.add_argument("--bench", default="", help="also time decode per config at BATCHxCONTEXT (e.g. 8x16k)")
    ap.add_argument("--bench-tokens", type=int, default=32)
    ap.add_argument("--bench-reps", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="--bench: also a torch.profiler trace of P decode steps per config (bench_generate's "
                         "profile: host ms, launches, sync time a step; each rank profiles its own)")
    ap.add_argument("--step-times", action="store_true", help="--bench: also each decode step's time (a steady "
                    "excess or a periodic one)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.mode == "compare":
        if len(a.paths) != 2:
            ap.error("compare takes two result files")
        res = compare(*a.paths)
        print(json.dumps(res, indent=1))
        if a.out:
            json.dump(dict(files=a.paths, configs=res), open(a.out, "w"), indent=1)
        return 0
    if a.mode == "make-model":
        if len(a.paths) != 1:
            ap.error("make-model takes one output folder")
        make_model(a.paths[0], a.tiny, a.widen_gguf)
        return 0
    if not (a.gguf or a.model):
        ap.error("give --gguf FILE or --model DIR")
    res = run_tokens(a)
    if _rank() == 0 and a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    if a.mode == "tp" and _world() > 1:
        import torch

        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
