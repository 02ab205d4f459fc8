"""Issue 23 item 5 through a model's whole first prefill: what ``rotate_qk`` adds to the GPU time of a prompt's forward
as plain ``generate()`` runs it (GPU).

``rotation_cost.py`` times one layer's first store on its own: at Gemma-3-270M's one KV head every kernel of it is
latency-bound (~24 µs for 1k tokens), so the smoothing factors' pass reads +50 % of that store. In a forward the
cache queues the first stores of all layers after the first and launches them together (``turbo_attn_hf.
first_prefill``); the smoothing factors of those layers are made by the same flush in one launch
(``smooth_factors_layers``) — in the row ``smooth_hadamard_per_layer_factors`` patched back to one launch per layer
(the tree before). This probe builds a random-weight model of a q/k-norm family, runs prompt forwards over a fresh
TurboCache and reads, per forward (torch profiler, means over calls: ``rotation_cost._kernel_us``): every kernel's
device µs, the cache's kernels' share, the forward's total, and the wall time (CUDA events, median; host-bound at
short prompts). Each ``rotate_qk`` row is compared with the
``none`` row of the same shape, and sdpa + DynamicCache is the reference row. ``--decode``: the same for a decode
step (one token a row over a filled cache): the step's kernels and the attention kernel's part; the shape
``gemma3-270m-vocab262k`` has the real model's vocabulary (its tied lm_head is in every step).

    python -m eval.experiments.first_prefill_rotation --out eval/results/first_prefill_rotation_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

#: random-weight stand-ins of q/k-norm models: (name, config class, model class, config kwargs)
SHAPES = {
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, vocab_size=32768, sliding_window=512)),
    # the real model's vocabulary (its tied lm_head is part of every decode step); the row above keeps earlier files'
    "gemma3-270m-vocab262k": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                              dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                                   sliding_window=512)),
    "qwen3-8b-8l": ("Qwen3Config", "Qwen3ForCausalLM",
                    dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=8, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=32768)),
}
CACHE_KERNELS = ("_stats_kernel", "_store_kv_kernel", "_smooth_stats_kernel", "_store_tokens_kernel")


def build(name: str):
    import transformers

    import turbo_attn_hf  # noqa: F401  (registers turbo_int8)

    cfg_cls, model_cls, kw = SHAPES[name]
    cfg = getattr(transformers, cfg_cls)(max_position_embeddings=1 << 17, attn_implementation="sdpa", **kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval()


def per_layer_factors():
    """Patch: every smooth_hadamard layer makes its factors in its own launch before its store is queued (the tree
    before ``smooth_factors_layers``); returns the undo."""
    from turbo_attn_hf.cache import TurboLayer

    orig = TurboLayer._replay_first_prefill

    def replay(self, k, v, batch=None):
        if self.smoothed and self.qk_smooth is None and k.dim() == 4 and k.shape[2] > 0 and self._fused(k):
            self._fix_smooth_factors(k)
        return orig(self, k, v, batch)

    TurboLayer._replay_first_prefill = replay
    return lambda: setattr(TurboLayer, "_replay_first_prefill", orig)


def _kernel_sums(us: dict, name: str, part: tuple) -> dict:
    """``rotation_cost._kernel_us``'s ``{kernel: µs}``, its total and, as ``name``, the kernels named in ``part``."""
    return {"kernels_us": us, "total_us": round(sum(us.values()), 1),
            name: round(sum(v for k, v in us.items() if any(c in k for c in part)), 1)}


def forward_kernels(model, impl, ids, calls: int) -> dict:
    """Per forward over a fresh cache: ``{kernel: device µs}`` (means over ``calls`` profiled forwards, after a
    warm-up), the cache kernels' part and the median wall ms of ``calls`` more (CUDA events)."""
    from eval.bench_e2e import new_cache, set_impl

    from .rotation_cost import _kernel_us

    set_impl(model, impl)

    def fwd():
        with torch.no_grad():
            model(ids, past_key_values=new_cache(model, impl), logits_to_keep=1, use_cache=True)

    r = _kernel_sums(_kernel_us(fwd, calls), "cache_us", CACHE_KERNELS)
    walls = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fwd()
        b.record()
        b.synchronize()
        walls.append(a.elapsed_time(b))
    return {**r, "wall_ms": round(statistics.median(walls), 3)}


def decode_kernels(model, impl, batch: int, context: int, steps: int) -> dict:
    """A decode step (one token a row) over a cache filled by a ``batch`` x ``context`` prompt: ``{kernel: device
    µs}`` per step (means over ``steps`` profiled steps, after a warm-up), their total and the attention kernels'
    part."""
    from eval.bench_e2e import new_cache, set_impl

    from .rotation_cost import _kernel_us

    set_impl(model, impl)
    cache = new_cache(model, impl)
    g = torch.Generator("cuda").manual_seed(context + batch)
    tok = torch.randint(0, 32000, (batch, 1), device="cuda", generator=g)
    with torch.no_grad():
        model(torch.randint(0, 32000, (batch, context), device="cuda", generator=g), past_key_values=cache,
              logits_to_keep=1, use_cache=True)
        return _kernel_sums(_kernel_us(lambda: model(tok, past_key_values=cache, use_cache=True), steps),
                            "attention_us", ("_decode", "sdpa", "fmha", "flash"))


def _rotations(base):
    return [(m, dataclasses.replace(base, rotate_qk=m)) for m in ("none", "hadamard", "smooth_hadamard")]


def _decode_rows(a, base, log) -> None:
    for name in a.shapes.split(","):
        model = build(name)
        for spec in a.decode.split(","):
            context, batch = (int(x) for x in spec.split("x"))
            plain = None
            for label, impl in _rotations(base):
                r = decode_kernels(model, impl, batch, context, a.calls * 4)
                row = {"shape": name, "context": context, "batch": batch, "rotate_qk": label, "preset": a.preset, **r}
                if plain is None:
                    plain = r
                else:
                    row["total_pct"] = round(100 * (r["total_us"] - plain["total_us"]) / plain["total_us"], 2)
                    row["attention_pct"] = round(100 * (r["attention_us"] - plain["attention_us"])
                                                 / plain["attention_us"], 2)
                    # the attention kernel is the only one the rotation changes (the others: same code and shapes,
                    # their difference is run-to-run noise): its extra over the plain step's total
                    row["attention_of_step_pct"] = round(100 * (r["attention_us"] - plain["attention_us"])
                                                         / plain["total_us"], 2)
                log.add("decode", row)
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--preset", default="int4")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--decode", default="4096x1,4096x8,32768x1,32768x8",
                    help="CONTEXTxBATCH decode steps to profile ('' for none)")
    ap.add_argument("--skip-prefill", action="store_true")
    a = ap.parse_args(argv)
    from turbo_attn_hf.config import TurboConfig

    from ..bench_common import RowLog, machine_info

    log = RowLog(a.out, {"machine": machine_info(),
                         "note": "per prompt forward over a fresh cache (logits_to_keep=1, random weights): device µs "
                                 "per kernel (torch profiler, mean of --calls forwards), their total, the cache "
                                 "kernels' part (stats, store, smoothing factors), wall ms (median, CUDA events); "
                                 "decode: per step, the attention kernels' part; *_pct: over the same shape's "
                                 "rotate_qk none row"})
    base = TurboConfig.preset(a.preset)
    if a.decode:
        _decode_rows(a, base, log)
    if a.skip_prefill:
        return
    for name in a.shapes.split(","):
        model = build(name)
        for L in (int(x) for x in a.lens.split(",")):
            ids = torch.randint(0, 32000, (1, L), device="cuda", generator=torch.Generator("cuda").manual_seed(L))
            plain = None
            configs = [("sdpa", "sdpa", None)] + [(m, impl, None) for m, impl in _rotations(base)]
            configs.append(("smooth_hadamard_per_layer_factors", configs[-1][1], per_layer_factors))
            for label, impl, patch in configs:
                undo = patch() if patch is not None else None
                try:
                    r = forward_kernels(model, impl, ids, a.calls)
                finally:
                    if undo is not None:
                        undo()
                row = {"shape": name, "L": L, "rotate_qk": label, "preset": a.preset if impl != "sdpa" else "sdpa",
                       **r}
                if label == "none":
                    plain = r
                elif plain is not None:
                    row["total_pct"] = round(100 * (r["total_us"] - plain["total_us"]) / plain["total_us"], 2)
                    row["cache_pct"] = round(100 * (r["cache_us"] - plain["cache_us"]) / plain["cache_us"], 2)
                    row["extra_us"] = round(r["total_us"] - plain["total_us"], 1)
                log.add("forward", row)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
