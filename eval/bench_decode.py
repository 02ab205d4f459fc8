"""Decode attention benchmark over a packed TurboCache (DESIGN.md §6, issue 3 item 5).

    python -m eval.bench_decode [--quick] [--contexts 1k,...,128k] [--batches 1,2,4,8,16,32,64] [--out DIR]
    python -m eval.bench_decode --dry-run      # CPU: tiny shapes through the Triton interpreter
    python -m eval.bench_decode --layer-step   # host cost of one cache layer's decode step (writes layer_step.json)
    python -m eval.bench_decode --quick --shape 4x1x256 --presets int4,int4:packed_k_bits=8  # Gemma-3-270M's heads

One layer, GQA 32 query / 8 KV heads, head_dim 128 (``--shape HQxHKxD``), one new query token per sequence, bf16.
For each (context, batch) the K/V of the context are random bf16; every provider reads the same tokens:
  sdpa_flash     torch SDPA (FlashAttention-2 backend) over the bf16 cache; the 4 query heads of a KV head are
                 folded into the query length (q ``[b, 8, 4, d]``), so K/V are read once, never repeated
  sdpa_cudnn     the same with the cuDNN backend
  turbo_<preset> ``kernels.decode.turbo_decode_attention`` over the TurboCache layer built by
                 ``TurboCache(preset).update(k, v)`` (prefill: context tokens; then one decode token appended,
                 so the INT8 tail is in play), for the presets int8 / int4 / mixed (``name:key=value,..``
                 overrides a preset's fields, ``TurboConfig.from_spec``)
  dequant_<preset> "dequantize then SDPA", what HF's QuantizedCache and KIVI-style caches do every step:
                 unpack every block to INT8 (``PackedKV.unpack_block``), rescale to a bf16 copy of the
                 whole cache, then sdpa_flash on it
Reported: median time (``triton.testing.do_bench``), bytes read, effective bandwidth = bytes read / time
and its fraction of the device-to-device copy ceiling measured in the same run, KV bytes per token
(``TurboCache.bytes_per_token()`` vs bf16), speed-up over sdpa_flash, relative L2 error vs sdpa_flash.
Bytes read: sdpa = 2·b·Hk·T·d·2 (K and V, bf16); turbo = the layer's cache bytes (packed blocks + scales/zeros
+ INT8 tail + universal scales, ``TurboLayer.memory_bytes()``); dequant = packed bytes + the bf16 copy written
and read back (2 × sdpa bytes) — what actually crosses HBM. Query/output bytes are negligible and left out.

``--layer-step`` times one whole decode step of one cache layer instead: ``TurboCache.update`` (1 token) +
``layer.attention``, per preset at batch 1 / 8k and batch 8 / 32k: median wall time per step with a sync after
it, the host part (until the calls return), and the pipelined time per step (50 steps, one sync), each with the
step's store fused into one Triton launch (``cache.FUSED_STORE``, the default) and with the PyTorch path. A
model's decode step is bound by this host work (eval/PERF_NOTES.md, decode round 3).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Optional

from .bench_common import (
    bench_graph_ms,
    bench_ms,
    copy_ceiling,
    free_gpu_memory,
    machine_info,
    machine_line,
    parse_int_list,
    print_table,
    split_presets,
    require_cuda,
    save_results,
    write_json,
)

HQ, HK, D = 32, 8, 128
PRESETS = ("int8", "int4", "mixed")
FORMULAS = {
    "GBps": "bytes_read / median time",
    "bytes_read": "sdpa: 2*b*Hk*T*d*2 (bf16 K+V); turbo: TurboLayer.memory_bytes() (packed blocks + "
                  "scale/zero + INT8 tail + universal scales); dequant: turbo bytes + 2 x sdpa bytes "
                  "(bf16 copy written then read)",
    "frac_ceiling": "GBps / measured device-to-device copy GB/s (read + write)",
    "kv_bytes_per_token": "per layer, all KV heads, K+V: TurboLayer.bytes_per_token() (the format's arithmetic, "
                          "full blocks); bf16 = 2*Hk*d*2",
    "held_bytes_per_token": "bytes the cache holds / (batch * tokens): packed blocks, the INT8 tail buffer (full "
                            "capacity) and the fp32 universal scales included",
    "x_sdpa": "sdpa_flash median / provider median (do_bench: includes Python launch overhead)",
    "ms_graph": "median of CUDA-graph replays (triton.testing.do_bench_cudagraph): GPU time without launch "
                "overhead; x_sdpa_graph, GBps_graph, frac_ceiling_graph are computed from it",
    "err": "relative L2 of the output vs sdpa_flash on the bf16 cache",
}
QUICK = {"contexts": [4096, 32768], "batches": [1, 8, 32]}
FULL = {"contexts": [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072], "batches": [1, 2, 4, 8, 16, 32, 64]}


def build_layer(k, v, k1, v1, preset: str):
    """A one-layer TurboCache: prefill ``k, v [b, Hk, T, d]``, then append the decode token ``k1, v1``. ``preset``:
    a name or YAML path with optional overrides (``int4:packed_k_bits=8``: ``TurboConfig.from_spec``)."""
    from turbo_attn_hf.cache import TurboCache
    from turbo_attn_hf.config import TurboConfig

    cache = TurboCache(TurboConfig.from_spec(preset))
    cache.update(k, v, 0)
    cache.update(k1, v1, 0)
    return cache, cache.layers[0]


def turbo_fn(layer, q):
    from turbo_attn_hf.kernels.decode import turbo_decode_attention

    args, kw = layer.decode_inputs()
    return lambda: turbo_decode_attention(q, *args, **kw)


def dequantize_layer(layer, dtype):
    """The whole layer back to ``(k, v) [b, Hk, T, d]`` in ``dtype`` (the KIVI / QuantizedCache way)."""
    import torch


    b, hk, d, bs = layer.batch, layer.n_kv_heads, layer.head_dim, layer.turbo_config.block_size
    nb, nt, p0 = layer.n_blocks, layer.n_tail, layer.n_sink  # packed block t: positions p0 + t*bs ..
    T = nb * bs + nt
    k8 = torch.empty(b, hk, T, d, dtype=torch.int8, device=layer.device)
    v8 = torch.empty(b, hk, T, d, dtype=torch.int8, device=layer.device)
    for g in layer.groups:
        H = len(g.heads)
        idx = g.heads.long()
        if nb:
            kb, vb = zip(*(g.unpack_block(t) for t in range(nb)))  # [b, H, bs, d] each
            k8[:, idx, p0:p0 + nb * bs] = torch.cat(kb, 2)
            v8[:, idx, p0:p0 + nb * bs] = torch.cat(vb, 2)
    slot = torch.arange(nt, device=layer.device)  # INT8 buffer: sinks at 0.., the rest after the blocks
    pos = torch.where(slot < p0, slot, slot + nb * bs)
    k8[:, :, pos] = layer.k_tail[:, :, :nt]
    v8[:, :, pos] = layer.v_tail[:, :, :, :nt].transpose(-1, -2)
    k = k8.float() * layer.k_scale[:, :, None, :]
    if layer.k_mean is not None:
        k += layer.k_mean[:, :, None, :]
    v = v8.float() * layer.v_scale[:, :, None, :]
    return k.to(dtype), v.to(dtype)


def sdpa_fold(q, k, v, backend=None):
    """Decode attention of ``q [b, HQ, 1, d]`` over ``k, v [b, HK, T, d]`` with SDPA, GQA folded into the
    query length (``[b, HK, g, d]``): each KV head is read once. Returns ``[b, 1, HQ, d]``."""
    import torch.nn.functional as F

    b, hq, _, d = q.shape
    hk = k.shape[1]
    qf = q.reshape(b, hk, hq // hk, d)
    if backend is None:
        o = F.scaled_dot_product_attention(qf, k, v)
    else:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qf, k, v)
    return o.reshape(b, hq, 1, d).transpose(1, 2)


def rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(contexts, batches, presets, *, hq=HQ, hk=HK, d=D, dry_run=False, ceiling=None, mem_frac=0.6,
        warmup=25, rep=100, with_dequant=True, with_cudnn=True, save=None, cuda_graph=True) -> list[dict]:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for T in contexts:
        for b in batches:
            bf16_bytes = 2 * b * hk * (T + 1) * d * 2  # the context + the decode token, K and V
            if dev == "cuda":
                free = torch.cuda.mem_get_info()[0]
                if bf16_bytes * 2.2 > mem_frac * free:
                    rows.append({"provider": "all", "context": T, "batch": b,
                                 "error": f"skipped: bf16 K/V {bf16_bytes / 2**30:.1f} GiB too large for free memory"})
                    continue
            torch.manual_seed(0)
            k = torch.randn(b, hk, T, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(b, hk, T, d, device=dev, dtype=torch.bfloat16)
            q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16)
            base = {"context": T + 1, "batch": b}
            ref = None
            providers = []
            setup_failed = False
            try:
                k1 = torch.randn_like(k[:, :, :1])
                v1 = torch.randn_like(v[:, :, :1])
                caches = {p: build_layer(k, v, k1, v1, p) for p in presets}
                kf = torch.cat([k, k1], dim=2)
                vf = torch.cat([v, v1], dim=2)
                del k, v
                if dry_run and dev == "cpu":
                    providers.append(("sdpa_flash", lambda: sdpa_fold(q, kf, vf), bf16_bytes, 2 * hk * d * 2))
                else:
                    from torch.nn.attention import SDPBackend

                    providers.append(("sdpa_flash", lambda: sdpa_fold(q, kf, vf, SDPBackend.FLASH_ATTENTION),
                                      bf16_bytes, 2 * hk * d * 2))
                    if with_cudnn:
                        providers.append(("sdpa_cudnn", lambda: sdpa_fold(q, kf, vf, SDPBackend.CUDNN_ATTENTION),
                                          bf16_bytes, 2 * hk * d * 2))
                for p in presets:
                    _, layer = caches[p]
                    nbytes = layer.memory_bytes()
                    providers.append((f"turbo_{p}", turbo_fn(layer, q), nbytes, layer.bytes_per_token()))
                    if with_dequant:
                        def deq(layer=layer):
                            kd, vd = dequantize_layer(layer, torch.bfloat16)
                            return sdpa_fold(q, kd, vd, None if dev == "cpu" else _flash())
                        providers.append((f"dequant_{p}", deq, nbytes + 2 * bf16_bytes, layer.bytes_per_token()))
            except Exception as e:  # noqa: BLE001
                rows.append({**base, "provider": "setup", "error": f"{type(e).__name__}: {str(e)[:160]}"})
                setup_failed = True
            if setup_failed:
                k = v = kf = vf = caches = providers = None
                free_gpu_memory()
                continue
            for name, fn, nbytes, bpt in providers:
                held = nbytes - 2 * bf16_bytes if name.startswith("dequant") else nbytes
                row = {**base, "provider": name, "bytes_read": nbytes, "kv_bytes_per_token": bpt,
                       "held_bytes_per_token": held / (b * (T + 1))}
                try:
                    o = fn()
                    if name == "sdpa_flash":
                        ref = o
                    elif ref is not None and not name.startswith("sdpa"):
                        row["err"] = rel_l2(o, ref)
                    t = bench_ms(fn, warmup=warmup, rep=rep) if not dry_run else {"ms": float("nan")}
                    row.update(t)
                    row["GBps"] = nbytes / (t["ms"] * 1e-3) / 1e9
                    if cuda_graph and not dry_run:
                        row.update(bench_graph_ms(fn))
                        if row.get("ms_graph"):
                            row["GBps_graph"] = nbytes / (row["ms_graph"] * 1e-3) / 1e9
                            if ceiling:
                                row["frac_ceiling_graph"] = row["GBps_graph"] / ceiling
                    if ceiling:
                        row["frac_ceiling"] = row["GBps"] / ceiling
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                if "error" in row:
                    free_gpu_memory()
                rows.append(row)
            mine = rows[-len(providers):]
            for key, out in (("ms", "x_sdpa"), ("ms_graph", "x_sdpa_graph")):
                ref_ms = next((r.get(key) for r in mine if r["provider"] == "sdpa_flash"), None)
                for r in mine:
                    if ref_ms and r.get(key) and math.isfinite(r[key]):
                        r[out] = ref_ms / r[key]
            providers = ref = caches = kf = vf = q = None
            free_gpu_memory()
            if save is not None:
                save(rows)  # partial results survive a timeout
    return rows


def _flash():
    from torch.nn.attention import SDPBackend

    return SDPBackend.FLASH_ATTENTION


def summarize(rows, presets=PRESETS, hk=HK, d=D) -> dict:
    """Issue-3 targets at 32k context: speed-ups over sdpa_flash, bandwidth fraction, KV bytes ratio."""
    out = {}
    bf16_bpt = 2 * hk * d * 2
    for p in presets:
        sel = [r for r in rows if r.get("provider") == f"turbo_{p}" and r.get("context", 0) >= 32768
               and r.get("context", 0) < 65536 and r.get("x_sdpa")]
        for r in sel:
            for key, label in (("x_sdpa", "x_sdpa_flash"), ("x_sdpa_graph", "x_sdpa_flash_graph"),
                               ("frac_ceiling", "frac_copy_ceiling"), ("frac_ceiling_graph", "frac_copy_ceiling_graph")):
                if r.get(key) is not None:
                    out[f"{p}_ctx32k_b{r['batch']}_{label}"] = r[key]
        bpt = [r["kv_bytes_per_token"] for r in rows if r.get("provider") == f"turbo_{p}" and "kv_bytes_per_token" in r]
        if bpt:
            out[f"{p}_kv_bytes_per_token_vs_bf16"] = bpt[0] / bf16_bpt
    return out


def layer_step_times(preset: str, b: int, T: int, fused_store: bool, *, hq=HQ, hk=HK, d=D) -> dict:
    """One decode step of one cache layer (update of 1 token + attention) at context ``T``, batch ``b``: median
    step time (synced), its host part, and the pipelined time per step; ``fused_store`` picks the store path."""
    import torch

    from turbo_attn_hf import cache as C
    from turbo_attn_hf.cache import TurboCache
    from turbo_attn_hf.config import TurboConfig

    C.FUSED_STORE = fused_store
    try:
        k = torch.randn(b, hk, T, d, device="cuda", dtype=torch.bfloat16)
        cache = TurboCache(TurboConfig.from_spec(preset))
        cache.update(k, k, 0)
        layer = cache.layers[0]
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        k1 = torch.randn(b, hk, 1, d, device="cuda", dtype=torch.bfloat16)
        step, host = [], []
        for i in range(80):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            kk, vv = cache.update(k1, k1, 0)
            layer.attention(q, kk, vv)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            if i >= 5:  # warm-up: compilation, allocator
                host.append(t1 - t0)
                step.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            kk, vv = cache.update(k1, k1, 0)
            layer.attention(q, kk, vv)
        torch.cuda.synchronize()
        pipelined = (time.perf_counter() - t0) / 50
    finally:
        C.FUSED_STORE = True
    return {"preset": preset, "batch": b, "context": T, "fused_store": fused_store,
            "step_us": statistics.median(step) * 1e6, "host_us": statistics.median(host) * 1e6,
            "pipelined_us": pipelined * 1e6}


def layer_step(presets, out) -> int:
    """``--layer-step``: :func:`layer_step_times` for every preset, shape and store path -> ``layer_step.json``."""
    require_cuda("bench_decode --layer-step")
    info = machine_info()
    print(machine_line(info), flush=True)
    rows = [layer_step_times(p, b, T, f) for b, T in ((1, 8192), (8, 32768)) for p in presets for f in (False, True)]
    print_table(rows, ["preset", "batch", "context", "fused_store", "step_us", "host_us", "pipelined_us"])
    write_json("layer_step", {"benchmark": "layer_step", "machine": info, "rows": rows}, out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turbo-attn bench-decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="contexts 4k/32k x batch 1/8/32")
    ap.add_argument("--contexts", default=",".join(str(c) for c in FULL["contexts"]))
    ap.add_argument("--batches", default=",".join(str(c) for c in FULL["batches"]))
    ap.add_argument("--presets", default=",".join(PRESETS),
                    help="preset names / YAML paths, each with optional overrides (int4:packed_k_bits=8)")
    ap.add_argument("--shape", default=f"{HQ}x{HK}x{D}",
                    help="query heads x KV heads x head dim (Gemma-3-270M: 4x1x256)")
    ap.add_argument("--no-dequant", action="store_true", help="skip the dequantize-then-SDPA baseline")
    ap.add_argument("--no-cuda-graph", action="store_true", help="skip the CUDA-graph timing (ms_graph)")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, no timing (CPU: Triton interpreter)")
    ap.add_argument("--layer-step", action="store_true",
                    help="time one cache layer's whole decode step (store + attention, host part) instead (GPU)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    presets = split_presets(args.presets)
    if args.layer_step:
        return layer_step(presets, args.out)
    import torch

    if args.dry_run:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        contexts, batches, shape = [133], [2], dict(hq=4, hk=2, d=64)
    else:
        require_cuda("bench_decode")
        contexts = QUICK["contexts"] if args.quick else parse_int_list(args.contexts)
        batches = QUICK["batches"] if args.quick else parse_int_list(args.batches)
        try:
            hq, hk, d = (int(x) for x in args.shape.lower().split("x"))
        except ValueError:
            raise SystemExit(f"error: --shape {args.shape!r} must be HQxHKxD, e.g. 32x8x128") from None
        shape = dict(hq=hq, hk=hk, d=d)
    info = machine_info()
    print(machine_line(info), flush=True)
    ceil = copy_ceiling() if torch.cuda.is_available() and not args.dry_run else None
    if ceil:
        print(f"copy ceiling: {ceil['GBps_read_plus_write']:.0f} GB/s (read + write, {ceil['bytes_copied'] / 2**30:.0f} GiB copy)")
    name = "bench_decode" + ("_dryrun" if args.dry_run else "")

    def payload(rows, summary=None) -> dict:
        return {
            "benchmark": "decode", "machine": info, "dry_run": args.dry_run, "quick": args.quick,
            "config": {"q_heads": shape["hq"], "kv_heads": shape["hk"], "head_dim": shape["d"], "dtype": "bfloat16",
                       "new_tokens": 1, "presets": presets},
            "copy_ceiling": ceil, "formulas": FORMULAS, "summary": summary or {}, "rows": rows,
        }

    rows = run(contexts, batches, presets, dry_run=args.dry_run, ceiling=ceil and ceil["GBps_read_plus_write"],
               warmup=args.warmup, rep=args.rep, with_dequant=not args.no_dequant,
               with_cudnn=not args.dry_run, save=lambda r: write_json(name, payload(r), args.out),
               cuda_graph=not args.no_cuda_graph, **shape)
    print_table(rows, ["provider", "context", "batch", "ms", "ms_graph", "GBps_graph", "frac_ceiling_graph", "x_sdpa",
                       "x_sdpa_graph", "kv_bytes_per_token", "held_bytes_per_token", "err"])
    for r in rows:
        if "error" in r:
            print(f"  {r['provider']} ctx={r.get('context')} b={r.get('batch')}: {r['error']}")
    summary = summarize(rows, presets, shape["hk"], shape["d"]) if not args.dry_run else {}
    for k_, v_ in summary.items():
        print(f"  {k_}: {v_:.3f}")
    save_results(name, payload(rows, summary), args.out,
                 None if args.no_plot or args.dry_run else "plot_decode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
