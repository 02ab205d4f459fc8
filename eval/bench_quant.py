"""Prefill quantization passes, each timed alone: Q and K per token, K's channel mean, V per block (``kernels.quant``).

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
  k_nohint / v_nohint: the same with the 16-byte load hint off (VEC = 1, as before it)
Path, the passes in sequence timed as one call (and replayed from a CUDA graph: ``us_graph``, no launch gaps):
  separate   q + k_mean + k + v            turbo_attention's quantization
  separate_nohint: the same with the 16-byte load hint off
``copy_us`` = the row's bytes at the device-to-device copy rate measured in the same process
(bench_common.copy_ceiling). Bit check, per head_dim on a small shape (batch 1, 2 heads, 133 tokens: tails of
the row tile and of the V block) in the same layout: q, k and v with the hint on and off == ``kernels.reference``
on the CPU, codes and scales bit for bit (``bit_equal`` on every row of that head_dim).
The committed eval/results/bench_quant_h100.json was written by the earlier version of this script, which also
timed K and V fused in one launch (``quantize_kv``, 0.96-1.00x the speed of the separate passes, since removed;
git history has that version).
Writes ``<out>/bench_quant.json`` (rows + machine line + protocol).
"""

from __future__ import annotations

import argparse
import contextlib
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

from .bench_prefill import HIDDEN, TOTAL_TOKENS  # the prefill protocol's shapes (FA3: 16k tokens, hidden 2048)
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


CHECK_BATCH, CHECK_HEADS, CHECK_LEN = 1, 2, 133


def _bytes(b, h, L, d, block, es):
    """Bytes read + written per pass (es: input element size)."""
    lpad = -(-max(L, 1) // block) * block
    x, mean = b * h * L * d * es, b * h * d * 4
    tok = b * h * L * d + b * h * L * 4  # per-token codes + scales
    vout = b * h * d * lpad + b * h * (lpad // block) * d * 4
    out = {"q": x + tok, "k_mean": x + mean, "k": x + mean + tok, "v": x + vout}
    out["separate"] = out["q"] + out["k_mean"] + out["k"] + out["v"]
    return out


@contextlib.contextmanager
def _hint(on: bool):
    """The 16-byte load hint of kernels.quant on (as shipped) or off (``_vec`` -> 1: 2-byte loads, as before it)."""
    from turbo_attn_hf.kernels import quant

    saved = quant._vec
    if not on:
        quant._vec = lambda *xs: 1
    try:
        yield
    finally:
        quant._vec = saved


def check_reference(d, layout="hf") -> Optional[str]:
    """q, k (mean-smoothed) and v passes, hint on and off, vs ``kernels.reference`` on the CPU on a small shape:
    None when every code and scale is equal, else what differs."""
    import torch

    from turbo_attn_hf.kernels import quant, reference as R

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block = R.default_block_n(d)
    q, k, v = _inputs(CHECK_BATCH, CHECK_HEADS, CHECK_LEN, d, layout, dev, torch.bfloat16)
    mean = R.k_smooth_mean(k)
    scale = d ** -0.5 * R.LOG2E
    ref = {"q": R.quantize_per_token(q.cpu(), scale=scale), "k": R.quantize_per_token(k.cpu(), smooth=mean.cpu()),
           "v": R.quantize_v_blocks(v.cpu(), block)}
    for on in (True, False):
        try:
            with _hint(on):
                got = {"q": quant.quantize_per_token(q, scale=scale), "k": quant.quantize_per_token(k, smooth=mean),
                       "v": quant.quantize_v_blocks(v, block)}
        except Exception as e:  # noqa: BLE001 - reported as the check's failure
            return f"{'' if on else 'nohint: '}{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        for name, outs in got.items():
            for what, a, r in zip(("codes", "scales"), outs, ref[name]):
                a = a.cpu()
                if a.shape != r.shape or not torch.equal(a, r):
                    n = int((a != r).sum()) if a.shape == r.shape else "shape"
                    return f"{name}{'' if on else '_nohint'} {what} differ ({n})"
    return None


def run_shape(d, L, *, layout="hf", dry_run=False, extras=True, warmup=25, rep=100, copy_gbps=None,
              bit_error=None) -> list[dict]:
    """Rows of one shape: every pass and the separate path (``extras``: also with the hint off). A dry run calls
    each once (no timing). ``bit_error``: this head_dim's ``check_reference`` result."""
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
    }

    def separate():
        quant.quantize_per_token(q, scale=scale)
        m = reference.k_smooth_mean(k)
        return quant.quantize_per_token(k, smooth=m), quant.quantize_v_blocks(v, block)

    variants = [(n, fn, True) for n, fn in passes.items()] + [("separate", separate, True)]
    if extras:
        variants += [(f"{n}_nohint", passes[n], False) for n in ("k", "v")] + [("separate_nohint", separate, False)]
    nbytes = _bytes(b, h, L, d, block, q.element_size())
    base = {"d": d, "L": L, "batch": b, "heads": h, "block": block, "layout": layout}
    rows = []
    for name, fn, hint in variants:
        row = dict(base, run=name, bytes=nbytes[name.replace("_nohint", "")])
        try:
            with _hint(hint):
                if dry_run:
                    fn()
                else:
                    row.update(bench_ms(fn, warmup=warmup, rep=rep))
                    if name.startswith("separate"):
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
        row["bit_equal"] = bit_error is None
        rows.append(row)
    del q, k, v, mean
    free_gpu_memory()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per shape: the separate path (do_bench and CUDA-graph µs), at the copy rate, and without the hint."""
    out = []
    for d, L in dict.fromkeys((r["d"], r["L"]) for r in rows):
        by = {r["run"]: r for r in rows if (r["d"], r["L"]) == (d, L)}
        sep, nohint = by.get("separate", {}), by.get("separate_nohint", {})
        if sep.get("us"):
            out.append({"d": d, "L": L, "separate_us": sep["us"], "separate_graph_us": sep.get("us_graph"),
                        "separate_copy_us": sep.get("copy_us"), "nohint_us": nohint.get("us"),
                        "hint_x": nohint["us"] / sep["us"] if nohint.get("us") else None})
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval.bench_quant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"{', '.join(f'd{d} L{L}' for d, L in QUICK_SHAPES)}; the *_nohint rows at the first only")
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
    checks = {}
    for d in dict.fromkeys(d for d, _ in shapes):
        checks[d] = check_reference(d, args.layout)
        print(f"d={d}: passes == kernels.reference (CPU), hint on and off: {checks[d] or 'yes'}", flush=True)
    rows = []
    for d, L in shapes:
        extras = not args.quick or (d, L) == QUICK_SHAPES[0]
        rows += run_shape(d, L, layout=args.layout, dry_run=args.dry_run, extras=extras, warmup=args.warmup,
                          rep=args.rep, copy_gbps=copy and copy["GBps_read_plus_write"], bit_error=checks[d])
    print_table(rows, ["run", "d", "L", "batch", "heads", "block", "us", "us_graph", "GBps", "copy_us", "bit_equal"])
    for r in rows:
        if "error" in r:
            print(f"  {r['run']} d={r['d']} L={r['L']}: {r['error']}")
    ok = all(r["bit_equal"] and "error" not in r for r in rows)
    print("passes == reference, bit for bit, and no errors:", "yes" if ok else "NO", flush=True)
    summary = summarize(rows)
    if summary:
        print_table(summary, ["d", "L", "separate_us", "separate_graph_us", "separate_copy_us", "nohint_us",
                              "hint_x"])
    payload = {
        "benchmark": "quant", "machine": info, "dry_run": args.dry_run, "quick": args.quick, "copy": copy,
        "protocol": {"total_tokens": TOTAL_TOKENS, "hidden": HIDDEN, "dtype": "bfloat16", "layout": args.layout,
                     "timer": f"triton.testing.do_bench median (warmup {args.warmup} ms, rep {args.rep} ms); "
                              "us_graph: do_bench_cudagraph median",
                     "GBps": GBPS_FORMULA, "block": "reference.default_block_n(d)",
                     "bit_check": f"batch {CHECK_BATCH}, heads {CHECK_HEADS}, L {CHECK_LEN}, per d: q, k, v with the "
                                  "hint on and off vs kernels.reference on the CPU",
                     "runs": {n: __doc__.split(f"\n  {n} ", 1)[1].split("\n", 1)[0].strip()
                              for n in ("q", "k_mean", "k", "v", "separate")}},
        "bit_check": {str(d): err or "equal" for d, err in checks.items()},
        "all_bit_equal": ok, "summary": summary, "rows": rows,
    }
    if not args.dry_run or args.out:  # a dry run writes only where asked (its rows hold no timings)
        print(f"wrote {write_json('bench_quant' + ('_dryrun' if args.dry_run else ''), payload, args.out)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
