"""Prefill quantization passes: the separate passes vs K and V fused in one launch (``quant.quantize_kv``).

    python -m eval.bench_quant [--quick] [--dims 64,128,256] [--lens 1k,4k,16k] [--layout hf|contig] [--out DIR]
    python -m eval.bench_quant --dry-run    # CPU: tiny shapes through the Triton interpreter, bit checks only

Shapes: the FA3 protocol (16k tokens: batch = 16384 / L; hidden 2048: heads = 2048 / d), bf16 Q, K, V in HF's
layout (``[b, L, H, d]`` storage viewed as ``[b, H, L, d]``, what the attention interface receives) or
contiguous ``[b, H, L, d]``; V block = turbo_attention's default block_n (``reference.default_block_n(d)``).
Passes, each timed alone (``triton.testing.do_bench`` median, µs; GB/s = (bytes read + bytes written) / time):
  q          quantize_per_token(q, scale)              read q;              write q8, sq
  k_mean     k_smooth_mean(k) (torch mean)             read k;              write mean
  k          quantize_per_token(k, smooth=mean)        read k, mean;        write k8, sk
  v          quantize_v_blocks(v, block_n)             read v;              write v8t, sv
  kv_fused   quantize_kv(k, v, smooth=mean, block_n)   read k, v, mean;     write k8, sk, v8t, sv
  k_nohint / v_nohint / kv_fused_nohint: the same with the 16-byte load hint off (VEC = 1, as before it)
  kv_fused_w8: kv_fused with 8 warps instead of 4; separate_nohint: the separate path as it was before the hint
Paths, the passes in sequence timed as one call (and replayed from a CUDA graph: ``us_graph``, no launch gaps):
  separate   q + k_mean + k + v            turbo_attention's quantization before the fused pass
  fused      q + k_mean + kv_fused         turbo_attention's quantization now (v_scale="block")
``copy_us`` = the row's bytes at the device-to-device copy rate measured in the same process
(bench_common.copy_ceiling). Every shape checks fused == separate bit for bit (k8, sk, v8t, sv).
Writes ``<out>/bench_quant.json`` (rows + machine line + protocol).
"""

from __future__ import annotations

import argparse
import os
import sys
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
    require_cuda,
    write_json,
)

TOTAL_TOKENS = 16384
HIDDEN = 2048
QUICK_SHAPES = [(128, 4096), (64, 4096), (256, 4096), (128, 16384)]
GBPS_FORMULA = "(bytes read + bytes written) / median time; int8 codes 1 B, scales and mean fp32"


def _inputs(b, h, L, d, layout, device, dtype):
    import torch

    g = torch.Generator(device=device).manual_seed(0)

    def one(shift):
        x = torch.randn(b, L, h, d, device=device, generator=g, dtype=torch.float32) + shift
        x = x.to(dtype).transpose(1, 2)  # HF: [b, L, H, d] storage
        return x.contiguous() if layout == "contig" else x

    return one(0.0), one(0.5), one(0.0)


def _bytes(b, h, L, d, block, es):
    """Bytes read + written per pass (es: input element size)."""
    lpad = -(-max(L, 1) // block) * block
    x, mean = b * h * L * d * es, b * h * d * 4
    tok = b * h * L * d + b * h * L * 4  # per-token codes + scales
    vout = b * h * d * lpad + b * h * (lpad // block) * d * 4
    out = {"q": x + tok, "k_mean": x + mean, "k": x + mean + tok, "v": x + vout}
    out["kv_fused"] = out["k"] + out["v"]
    out["separate"] = out["q"] + out["k_mean"] + out["k"] + out["v"]
    out["fused"] = out["q"] + out["k_mean"] + out["kv_fused"]
    return out


class _Patched:
    """Private knobs of kernels.quant for one measurement: VEC hint off (``_vec`` -> 1), fused kernel warps."""

    def __init__(self, nohint=False, kv_warps=None):
        self.nohint, self.kv_warps = nohint, kv_warps

    def __enter__(self):
        from turbo_attn_hf.kernels import quant

        self.saved = quant._vec, quant._KV_NUM_WARPS
        if self.nohint:
            quant._vec = lambda *xs: 1
        if self.kv_warps:
            quant._KV_NUM_WARPS = self.kv_warps

    def __exit__(self, *exc):
        from turbo_attn_hf.kernels import quant

        quant._vec, quant._KV_NUM_WARPS = self.saved


def _check_equal(fused, separate) -> Optional[str]:
    import torch

    for name, a, r in zip(("k8", "sk", "v8t", "sv"), fused, separate):
        if a.shape != r.shape or not torch.equal(a, r):
            return f"{name} differs ({int((a != r).sum()) if a.shape == r.shape else 'shape'})"
    return None


def run_shape(d, L, *, layout="hf", dry_run=False, extras=True, warmup=25, rep=100, copy_gbps=None) -> list[dict]:
    """Rows of one shape: every pass and path (``extras``: also the no-hint and 8-warp variants)."""
    import torch

    from turbo_attn_hf.kernels import quant, reference

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b, h = (1, 2) if dry_run else (max(1, TOTAL_TOKENS // L), HIDDEN // d)
    block = reference.default_block_n(d)
    q, k, v = _inputs(b, h, L, d, layout, dev, torch.bfloat16)
    mean = reference.k_smooth_mean(k)
    scale = d ** -0.5 * reference.LOG2E
    passes = {
        "q": lambda: quant.quantize_per_token(q, scale=scale),
        "k_mean": lambda: reference.k_smooth_mean(k),
        "k": lambda: quant.quantize_per_token(k, smooth=mean),
        "v": lambda: quant.quantize_v_blocks(v, block),
        "kv_fused": lambda: quant.quantize_kv(k, v, smooth=mean, block=block),
    }

    def separate():
        quant.quantize_per_token(q, scale=scale)
        m = reference.k_smooth_mean(k)
        return quant.quantize_per_token(k, smooth=m), quant.quantize_v_blocks(v, block)

    def fused():
        quant.quantize_per_token(q, scale=scale)
        return quant.quantize_kv(k, v, smooth=reference.k_smooth_mean(k), block=block)

    variants = [(n, fn, {}) for n, fn in passes.items()] + [("separate", separate, {}), ("fused", fused, {})]
    if extras:
        variants += [(f"{n}_nohint", passes[n], dict(nohint=True)) for n in ("k", "v", "kv_fused")]
        variants += [("kv_fused_w8", passes["kv_fused"], dict(kv_warps=8)),
                     ("separate_nohint", separate, dict(nohint=True))]
    nbytes = _bytes(b, h, L, d, block, q.element_size())
    base = {"d": d, "L": L, "batch": b, "heads": h, "block": block, "layout": layout}
    rows = []
    (k8, sk), (v8t, sv) = separate()
    bad = _check_equal(fused(), (k8, sk, v8t, sv))
    for name, fn, knobs in variants:
        row = dict(base, run=name, bytes=nbytes[name.replace("_nohint", "").replace("_w8", "")])
        try:
            with _Patched(**knobs):
                if name.endswith(("_nohint", "_w8")) and name.startswith("kv_fused"):
                    err = _check_equal(fn(), (k8, sk, v8t, sv))
                    if err:
                        row["error"] = f"not bit-equal: {err}"
                if not dry_run:
                    row.update(bench_ms(fn, warmup=warmup, rep=rep))
                    if name in ("separate", "fused"):
                        row.update(bench_graph_ms(fn))
        except Exception as e:  # noqa: BLE001 - one variant failing must not stop the table
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if "ms" in row:
            row["us"] = row["ms"] * 1e3
            row["GBps"] = row["bytes"] / (row["ms"] * 1e-3) / 1e9
        if "ms_graph" in row:
            row["us_graph"] = row["ms_graph"] * 1e3
        if copy_gbps:
            row["copy_us"] = row["bytes"] / (copy_gbps * 1e9) * 1e6
        row["bit_equal"] = bad is None
        rows.append(row)
    if bad:
        print(f"  d={d} L={L}: fused != separate: {bad}", flush=True)
    del q, k, v, mean, k8, sk, v8t, sv
    free_gpu_memory()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per shape: separate vs fused path (do_bench and CUDA-graph µs), speed-up, and both at the copy rate."""
    out = []
    for d, L in dict.fromkeys((r["d"], r["L"]) for r in rows):
        by = {r["run"]: r for r in rows if (r["d"], r["L"]) == (d, L)}
        sep, fus = by.get("separate", {}), by.get("fused", {})
        if sep.get("us") and fus.get("us"):
            out.append({"d": d, "L": L, "separate_us": sep["us"], "fused_us": fus["us"],
                        "x": sep["us"] / fus["us"], "separate_graph_us": sep.get("us_graph"),
                        "fused_graph_us": fus.get("us_graph"), "fused_copy_us": fus.get("copy_us")})
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval.bench_quant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"{', '.join(f'd{d} L{L}' for d, L in QUICK_SHAPES)}; the *_nohint / *_w8 rows at the "
                         "first only")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--lens", default="1k,4k,16k")
    ap.add_argument("--layout", default="hf", choices=("hf", "contig"),
                    help="hf: [b, L, H, d] storage viewed as [b, H, L, d] (default); contig: [b, H, L, d]")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--out", default=None, help="output folder (default eval/results)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes, no timing, bit checks only (CPU: Triton interpreter); writes JSON only "
                         "with --out")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if not args.dry_run:
        require_cuda("bench_quant")
    elif not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import triton
    if args.dry_run:
        shapes = [(64, 70), (128, 130)]
    elif args.quick:
        shapes = QUICK_SHAPES
    else:
        shapes = [(d, L) for d in parse_int_list(args.dims) for L in parse_int_list(args.lens)]
    info = machine_info()
    print(machine_line(info), flush=True)
    copy = None if args.dry_run else copy_ceiling((256 << 20) if args.quick else (2 << 30))
    if copy:
        print(f"copy rate: {copy['GBps_read_plus_write']:.0f} GB/s (read + write)", flush=True)
    rows = []
    for d, L in shapes:
        extras = not args.quick or (d, L) == QUICK_SHAPES[0]
        rows += run_shape(d, L, layout=args.layout, dry_run=args.dry_run, extras=extras, warmup=args.warmup,
                          rep=args.rep, copy_gbps=copy and copy["GBps_read_plus_write"])
    print_table(rows, ["run", "d", "L", "batch", "heads", "block", "us", "us_graph", "GBps", "copy_us", "bit_equal"])
    for r in rows:
        if "error" in r:
            print(f"  {r['run']} d={r['d']} L={r['L']}: {r['error']}")
    ok = all(r["bit_equal"] and "error" not in r for r in rows)
    print("fused == separate, bit for bit:", "yes" if ok else "NO", flush=True)
    summary = summarize(rows)
    if summary:
        print_table(summary, ["d", "L", "separate_us", "fused_us", "x", "separate_graph_us", "fused_graph_us",
                              "fused_copy_us"])
    payload = {
        "benchmark": "quant", "machine": info, "dry_run": args.dry_run, "quick": args.quick, "copy": copy,
        "protocol": {"total_tokens": TOTAL_TOKENS, "hidden": HIDDEN, "dtype": "bfloat16", "layout": args.layout,
                     "timer": f"triton.testing.do_bench median (warmup {args.warmup} ms, rep {args.rep} ms); "
                              "us_graph: do_bench_cudagraph median",
                     "GBps": GBPS_FORMULA, "block": "reference.default_block_n(d)",
                     "runs": {n: __doc__.split(f"\n  {n} ", 1)[1].split("\n", 1)[0].strip()
                              for n in ("q", "k_mean", "k", "v", "kv_fused", "separate", "fused")}},
        "all_bit_equal": ok, "summary": summary, "rows": rows,
    }
    if not args.dry_run or args.out:  # a dry run writes only where asked (its rows hold no timings)
        print(f"wrote {write_json('bench_quant' + ('_dryrun' if args.dry_run else ''), payload, args.out)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
