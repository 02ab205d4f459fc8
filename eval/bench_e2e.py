"""End-to-end benchmark: a Llama-3-8B-shaped model with random bf16 weights, sdpa + DynamicCache vs turbo_int8.

    python -m eval.bench_e2e [--quick] [--layers N] [--contexts 8k,32k] [--batches 1,8,32] [--out DIR]
    python -m eval.bench_e2e --dry-run      # CPU: a 2-layer toy config, checks the set-up

Model: ``LlamaConfig`` with 32 layers (``--layers N`` to shrink for time), hidden 4096, 32 query / 8 KV heads
(head_dim 128), intermediate 14336, vocab 128256, random bf16 weights (speed needs no trained weights).
Configurations: ``sdpa`` (+ DynamicCache, the transformers default) and ``turbo_int8`` with each preset
(+ TurboCache, what a plain ``generate()`` of a turbo_int8 model uses).
Measured, each on a fresh cache:
  prefill    latency of one forward over a batch-1 prompt of 8k / 32k tokens (``logits_to_keep=1``),
             median of ``--reps`` runs after one warm-up; KV-cache bytes after it; peak GPU memory.
  decode     tokens/s = batch × steps / time of ``--steps`` single-token forwards on a cache already holding
             the context (batch 1 / 8 / 32 at 8k / 32k). The context is written into the cache directly from
             random K/V (``cache.update`` per layer) instead of a prefill forward: same cache contents and
             format, minutes less GPU time. Peak GPU memory of the step; OOM is reported as such.
  longest    the longest batch-1 context whose KV cache fits: (free memory after weights - workspace) /
             measured KV bytes per token, and (``--verify-longest``) one decode step at that length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

from turbo_attn_hf.generation import cache_arg

from .bench_common import (
    free_gpu_memory,
    gib,
    is_oom,
    machine_info,
    machine_line,
    parse_int_list,
    print_table,
    require_cuda,
    save_results,
    write_json,
)

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)
TOY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
           vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5)
PRESETS = ("int8", "int4", "mixed")
FORMULAS = {
    "prefill ms": "median wall time of model(ids, past_key_values=fresh cache, logits_to_keep=1), CUDA synced",
    "decode tokens_per_s": "batch / median time of one single-token forward on a cache holding `context` tokens "
                           "(written from random K/V with cache.update)",
    "kv_bytes_per_token": "cache bytes (TurboCache.memory_bytes() or DynamicCache tensors) / (batch x tokens)",
    "kv_bytes_per_token_format": "TurboCache.bytes_per_token(): full packed blocks incl. scale/zero, without the "
                                 "fixed INT8 buffer (sink + recent blocks + tail) that memory_bytes() also counts",
    "longest_tokens_est": "(free memory after weights - 4 GiB workspace) / kv_bytes_per_token",
    "x_sdpa": "prefill: sdpa ms / impl ms; decode: impl tokens/s / sdpa tokens/s",
}
WORKSPACE_BYTES = 4 << 30  # kept free for activations / allocator slack in the "longest context" estimate


def build_model(layers: int, shape: dict, device, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import turbo_attn_hf  # noqa: F401  (registers turbo_int8)

    cfg = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=1 << 20, tie_word_embeddings=False,
                      attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():  # keep activations tame: small random weights
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval()


def set_impl(model, impl) -> None:
    """``"sdpa"``, or turbo_int8 with ``impl`` as its TurboConfig (a preset name, dict or TurboConfig)."""
    import turbo_attn_hf

    if impl == "sdpa":
        model.set_attn_implementation("sdpa")
    else:
        model.set_attn_implementation(turbo_attn_hf.ATTN_NAME)
        turbo_attn_hf.set_turbo_config(model, impl)


def new_cache(model, impl):
    """A fresh cache for ``impl``: ``"sdpa"`` a DynamicCache, else a TurboCache of that preset name / TurboConfig."""
    from transformers import DynamicCache

    from turbo_attn_hf import TurboCache

    if impl == "sdpa":
        return DynamicCache(config=model.config)
    return TurboCache(impl, config=model.config)


def cache_bytes(cache) -> int:
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total


def timed_prefill(model, ids, impl: str, hooks=(None, None)) -> tuple:
    """One prefill forward of ``ids`` (``logits_to_keep=1``) over a fresh cache of ``impl``, the GPU drained before:
    ``(host ms to issue it, the thread's CPU ms meanwhile, wall ms)``. ``hooks``: ``(on, off)`` called just inside
    the host clock's window (a profiler, the garbage collector)."""
    import torch

    set_impl(model, impl)
    cache = new_cache(model, impl)
    _sync()
    on, off = hooks
    if on is not None:
        on()
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.no_grad():
        model(ids, **cache_arg(cache), logits_to_keep=1, use_cache=True)
    t1, c1 = time.perf_counter(), time.thread_time()
    if off is not None:
        off()
    _sync()
    return (t1 - t0) * 1e3, (c1 - c0) * 1e3, (time.perf_counter() - t0) * 1e3


def alternating(cfgs, rounds: int, fn, warm: int = 3, abba: bool = False, more=None) -> list:
    """``fn(cfg)`` ``warm`` times per config, then ``rounds`` rounds of one call per config in turn:
    ``[(round, cfg, result)]`` — the configs alternate, so the host's drift falls on all of them alike. ``abba``:
    every other round runs the configs in reverse order, so a drift within rounds does not fall on the later configs
    of a round more than on the first (in a fixed order the last config ran ``len(cfgs) - 1`` turns after the
    first in every round). ``more()``: asked before each round; False ends the rounds there (a deadline)."""
    for c in cfgs:
        for _ in range(warm):
            fn(c)
    order = [list(cfgs), list(reversed(cfgs)) if abba else list(cfgs)]
    out = []
    for r in range(rounds):
        if more is not None and not more():
            break
        out += [(r, c, fn(c)) for c in order[r % 2]]
    return out


_BATCH_BYTES = None  # first_prefill's default, read at the first first_stores_per_layer call


def first_stores_per_layer(config: str) -> str:
    """``PRESET@perlayer`` (session 20's A/B in one process): each layer's first store launched at once instead of a
    forward's together (``first_prefill.BATCH_BYTES = 0``), any other name queued as usual; returns the name
    without ``@perlayer``."""
    from turbo_attn_hf import first_prefill

    global _BATCH_BYTES
    if _BATCH_BYTES is None:
        _BATCH_BYTES = first_prefill.BATCH_BYTES
    name, _, mode = config.partition("@")
    first_prefill.BATCH_BYTES = 0 if mode == "perlayer" else _BATCH_BYTES
    return name if mode == "perlayer" else config


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak():
    import torch

    free_gpu_memory()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> Optional[float]:
    import torch

    return gib(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


def prefill(model, impl: str, T: int, reps: int) -> dict:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, T), device=model.device)
    times, nbytes = [], 0
    _reset_peak()
    for i in range(reps + 1):
        cache = new_cache(model, impl)
        _sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
        _sync()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        nbytes = cache_bytes(cache)
        per_token = _bytes_per_token_format(cache, nbytes / T)
        del cache
    return {"ms": statistics.median(times), "kv_bytes": nbytes, "kv_bytes_per_token": nbytes / T,
            "kv_bytes_per_token_format": per_token, "peak_gib": _peak()}


def _bytes_per_token_format(cache, measured: float) -> float:
    """Bytes per token of long sequences: the format arithmetic (TurboCache.bytes_per_token: full packed
    blocks, without the fixed INT8 buffer of sink / recent blocks), or the measured value for DynamicCache."""
    return float(cache.bytes_per_token()) if hasattr(cache, "bytes_per_token") else measured


def fill_cache(model, impl: str, batch: int, T: int):
    """A cache holding ``T`` tokens of random K/V in every layer (same format as after a prefill)."""
    import torch

    cfg = model.config
    hk, d = cfg.num_key_value_heads, cfg.head_dim
    cache = new_cache(model, impl)
    g = torch.Generator(device=model.device).manual_seed(0)
    for li in range(cfg.num_hidden_layers):
        k = torch.randn(batch, hk, T, d, device=model.device, dtype=model.dtype, generator=g)
        v = torch.randn(batch, hk, T, d, device=model.device, dtype=model.dtype, generator=g)
        cache.update(k, v, li)
        del k, v
    return cache


def decode(model, impl: str, batch: int, T: int, steps: int) -> dict:
    import torch

    _reset_peak()
    cache = fill_cache(model, impl, batch, T)
    tok = torch.randint(0, model.config.vocab_size, (batch, 1), device=model.device)
    nbytes = cache_bytes(cache)
    times = []
    with torch.inference_mode():
        for i in range(steps + 2):
            _sync()
            t0 = time.perf_counter()
            out = model(input_ids=tok, **cache_arg(cache), use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            _sync()
            if i >= 2:  # two warm-up steps (compilation, allocator)
                times.append(time.perf_counter() - t0)
    del cache, out
    step = statistics.median(times)
    return {"ms_per_step": step * 1e3, "tokens_per_s": batch / step, "kv_bytes": nbytes,
            "kv_bytes_per_token": nbytes / (batch * T), "peak_gib": _peak()}


def longest(model, impl: str, bytes_per_token: float, verify: bool) -> dict:
    import torch

    free_gpu_memory()
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    est = int(max(free - WORKSPACE_BYTES, 0) / bytes_per_token) if bytes_per_token else 0
    row = {"free_gib_after_weights": gib(free), "kv_bytes_per_token": bytes_per_token, "longest_tokens_est": est}
    if verify and est > 0:
        T = (int(est * 0.95) // 1024) * 1024
        try:
            r = decode(model, impl, 1, T, steps=1)
            row.update(verified_tokens=T, verified_peak_gib=r["peak_gib"])
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            row.update(verified_tokens=None, verify_error="OOM at 95% of the estimate")
    free_gpu_memory()  # after the except block: the traceback no longer pins the failed step's tensors
    return row


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turbo-attn bench-e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="prefill 8k/32k x 1 rep, decode 8k/32k x batch 1/8/32, 8 steps")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B; fewer for time)")
    ap.add_argument("--impls", default="sdpa," + ",".join(PRESETS))
    ap.add_argument("--prefill-contexts", default="8k,32k")
    ap.add_argument("--contexts", default="8k,32k", help="decode contexts")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    ap.add_argument("--reps", type=int, default=3, help="timed prefill runs")
    ap.add_argument("--verify-longest", action="store_true", help="run one decode step at ~95%% of the estimate")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="2-layer toy model on CPU/GPU, tiny sizes")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    impls = [p.strip() for p in args.impls.split(",") if p.strip()]
    import torch

    if args.dry_run:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shape, layers = TOY, 2
        pre_ctx, ctxs, batches, steps, reps = [70], [70], [1, 2], 1, 1
    else:
        require_cuda("bench_e2e")
        device, shape, layers = "cuda", LLAMA3_8B, args.layers
        pre_ctx, ctxs = parse_int_list(args.prefill_contexts), parse_int_list(args.contexts)
        batches = parse_int_list(args.batches)
        steps, reps = (8, 1) if args.quick else (args.steps, args.reps)
    info = machine_info()
    print(machine_line(info), flush=True)
    t0 = time.perf_counter()
    model = build_model(layers, shape, device, torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama-3-8B-shaped, {layers} layers, {n_params / 1e9:.2f} B params, bf16, built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    pre_rows, dec_rows, long_rows = [], [], []

    def payload() -> dict:
        return {
            "benchmark": "e2e", "machine": info, "dry_run": args.dry_run, "quick": args.quick,
            "config": {"model": "LlamaConfig, Llama-3-8B shape" if not args.dry_run else "toy", "layers": layers,
                       **shape, "params": n_params, "dtype": "bfloat16", "weights": "random N(0, 0.02)",
                       "decode_steps": steps, "prefill_reps": reps},
            "formulas": FORMULAS, "prefill": pre_rows, "decode": dec_rows, "longest": long_rows,
        }

    name = "bench_e2e" + ("_dryrun" if args.dry_run else "")
    for impl in impls:
        set_impl(model, impl)
        for T in pre_ctx:
            row = {"impl": impl, "context": T, "batch": 1}
            try:
                row.update(prefill(model, impl, T, reps))
                row["tokens_per_s"] = T / (row["ms"] * 1e-3)
            except Exception as e:  # noqa: BLE001
                row["error"] = "OOM" if is_oom(e) else f"{type(e).__name__}: {str(e)[:160]}"
            free_gpu_memory()  # outside the except block, so the traceback's frames (and tensors) are gone
            pre_rows.append(row)
            print(f"  prefill {impl} {T}: {row.get('ms', row.get('error'))}", flush=True)
        for T in ctxs:
            for b in batches:
                row = {"impl": impl, "context": T, "batch": b}
                try:
                    row.update(decode(model, impl, b, T, steps))
                except Exception as e:  # noqa: BLE001
                    row["error"] = "OOM" if is_oom(e) else f"{type(e).__name__}: {str(e)[:160]}"
                free_gpu_memory()
                dec_rows.append(row)
                print(f"  decode {impl} ctx {T} batch {b}: {row.get('tokens_per_s', row.get('error'))}", flush=True)
        if not args.dry_run:
            bpt = next((r["kv_bytes_per_token"] for r in dec_rows[::-1] if r["impl"] == impl and "kv_bytes_per_token" in r),
                       None)
            if bpt:
                long_rows.append({"impl": impl, **longest(model, impl, bpt, args.verify_longest)})
        write_json(name, payload(), args.out)  # partial results survive a timeout
    for rows in (pre_rows, dec_rows):
        base = {(r["context"], r["batch"]): r for r in rows if r["impl"] == "sdpa"}
        for r in rows:
            b_ = base.get((r["context"], r["batch"]))
            key = "ms" if rows is pre_rows else "tokens_per_s"
            if b_ and b_.get(key) and r.get(key):
                r["x_sdpa"] = (b_[key] / r[key]) if key == "ms" else (r[key] / b_[key])
    print("\nprefill (batch 1):")
    print_table(pre_rows, ["impl", "context", "ms", "tokens_per_s", "x_sdpa", "kv_bytes_per_token", "peak_gib", "error"])
    print("\ndecode:")
    print_table(dec_rows, ["impl", "context", "batch", "ms_per_step", "tokens_per_s", "x_sdpa", "kv_bytes_per_token",
                           "peak_gib", "error"])
    if long_rows:
        print("\nlongest batch-1 context:")
        print_table(long_rows, ["impl", "kv_bytes_per_token", "free_gib_after_weights", "longest_tokens_est",
                                "verified_tokens"])
    save_results(name, payload(), args.out, None if args.no_plot or args.dry_run else "plot_e2e")
    return 0


if __name__ == "__main__":
    sys.exit(main())
