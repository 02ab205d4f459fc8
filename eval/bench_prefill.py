"""Prefill attention benchmark (DESIGN.md §6, the FlashAttention-3 protocol).

    python -m eval.bench_prefill [--quick] [--dims 64,128,256] [--lens 512,1k,2k,4k,8k,16k] [--out DIR]
    python -m eval.bench_prefill --dry-run      # CPU: tiny shapes through the Triton interpreter (set-up check)

Shapes: 16k tokens in all (batch = 16384 / L), hidden 2048 (heads = 2048 / d), d in {64, 128, 256},
L in {512, 1k, 2k, 4k, 8k, 16k}, causal and not, bf16 Q/K/V ``[b, H, L, d]``.
Providers, timed in the same process with ``triton.testing.do_bench`` (median, 20/80 % quantiles):
  sdpa_cudnn    torch SDPA, cuDNN backend (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``)
  sdpa_flash    torch SDPA, FlashAttention-2 backend (``SDPBackend.FLASH_ATTENTION``)
  sage          SageAttention-1 ``sageattn`` (``sageattention==1.0.6``), when importable
  turbo_exact   ``turbo_attention``: bf16 Q/K/V -> quantization -> the portable INT8 kernel -> bf16 O, exact exp2
  turbo_sas     the same with SAS softmax
  kernel_exact  ``int8_flash_attention`` alone (portable kernel), on operands quantized beforehand (kernel only)
  kernel_sas    the same with SAS softmax
  turbo_hopper  ``turbo_exact`` with the Gluon Hopper kernel (``TURBO_PREFILL_KERNEL=hopper``, the default
                ``auto`` on sm_90; issue 20)
  kernel_hopper ``prefill_hopper.launch_ws`` alone, on V's operand as turbo_attention writes it (16-bit V padded to
                whole blocks for bf16 / fp16 inputs, else INT8 V^T in its operand order)
TFLOP/s = 4·b·h·L²·d / time (halved when causal) for every provider (INT8 "TOPS" for turbo, the same count).
Each turbo output is checked against sdpa_flash (relative L2 error, column ``err``).
Writes ``<out>/bench_prefill.json`` (rows + machine line + formulas) and, with matplotlib, a PNG.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Optional

from .bench_common import (
    bench_ms,
    free_gpu_memory,
    machine_info,
    machine_line,
    parse_int_list,
    print_table,
    require_cuda,
    save_results,
)

TOTAL_TOKENS = 16384
HIDDEN = 2048
FLOPS_FORMULA = "4 * batch * heads * L^2 * head_dim, halved when causal; TFLOP/s = FLOPs / median time"
ALL_PROVIDERS = ("sdpa_cudnn", "sdpa_flash", "sage", "turbo_exact", "turbo_sas", "kernel_exact", "kernel_sas",
                 "turbo_hopper", "kernel_hopper")
QUICK_SHAPES = [(128, 1024), (128, 4096), (128, 8192), (128, 16384), (64, 4096), (256, 4096)]


def flops(b: int, h: int, L: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * L * L * d
    return f / 2 if causal else f


def rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_providers(q, k, v, causal: bool, names, dry_run: bool = False) -> dict[str, Callable]:
    """Provider name -> zero-argument callable returning ``o [b, L, H, d]``; unavailable ones are skipped."""
    import torch
    import torch.nn.functional as F

    from turbo_attn_hf.kernels import prefill, quant, reference

    out: dict[str, Callable] = {}

    def sdpa(backend):
        def run():
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
        return run

    if dry_run:
        out["sdpa_flash"] = sdpa(None)  # CPU: the math backend stands in
    else:
        from torch.nn.attention import SDPBackend

        if "sdpa_cudnn" in names:
            out["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        if "sdpa_flash" in names:
            out["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        if "sage" in names:
            try:
                from sageattention import sageattn

                out["sage"] = lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=causal).transpose(1, 2)
            except Exception:  # noqa: BLE001 - not installed / no kernel for this GPU
                pass
    def turbo(m, kernel):
        def run():
            with prefill.chosen_kernel(kernel):
                return prefill.turbo_attention(q, k, v, causal=causal, softmax=m)
        return run

    for m in ("exact", "sas"):
        if f"turbo_{m}" in names:
            out[f"turbo_{m}"] = turbo(m, "portable")
    if "turbo_hopper" in names:
        out["turbo_hopper"] = turbo("exact", "hopper")
    if any(n.startswith("kernel_") for n in names):
        d = q.shape[-1]
        q8, sq = quant.quantize_per_token(q, scale=d ** -0.5 * reference.LOG2E)
        k8, sk = quant.quantize_per_token(k, smooth=reference.k_smooth_mean(k))
        # mirror turbo_attention's defaults: KV block (= V quantization block) and V scale granularity
        bn = reference.default_block_n(d) if hasattr(reference, "default_block_n") else reference.DEFAULT_BLOCK_N
        by_channel = getattr(reference, "DEFAULT_V_SCALE", "block") == "channel"
        v8t, sv = (quant.quantize_v_channels if by_channel else quant.quantize_v_blocks)(v, bn)
        L = k.shape[2]
        for m in ("exact", "sas"):
            if f"kernel_{m}" in names:
                out[f"kernel_{m}"] = (lambda m=m: prefill.int8_flash_attention(
                    q8, sq, k8, sk, v8t, sv, causal=causal, softmax=m, Lk=L, out_dtype=q.dtype,
                    block_n=bn if by_channel else None, _kernel="portable"))
        if "kernel_hopper" in names and not by_channel:  # V's operand as turbo_attention's plan writes it
            from turbo_attn_hf.kernels import prefill_hopper

            why = prefill.hopper_takes(q.device, d, bn, window=None, softcap=None, key_valid=None, softmax="exact",
                                       p_scale="block", pv_half=v.dtype in prefill_hopper.PV_HALF_DTYPES)
            if v.dtype in prefill_hopper.PV_HALF_DTYPES:  # P.V on V itself, padded to whole blocks
                v8m = quant.v_operand_half(v, bn)
            else:
                v8m = quant.quantize_v_blocks(v, bn, mma_order=True)[0]
            o = torch.empty(q.shape[0], L, q.shape[1], d, dtype=q.dtype, device=q.device)

            def kernel_hopper():
                if why:
                    raise ValueError(f"the Hopper prefill kernel cannot run this call: {why}")
                return prefill_hopper.launch_ws(q8, sq, k8, sk, v8m, sv, o, causal=causal, Lk=L, v8t_in_mma_order=True)
            out["kernel_hopper"] = kernel_hopper
    return {n: out[n] for n in names if n in out}


def run(shapes: list[tuple[int, int]], causals: list[bool], providers: list[str], *, dry_run: bool = False,
        warmup: int = 25, rep: int = 100) -> list[dict]:
    import torch

    dev = "cuda" if not dry_run else ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for d, L in shapes:
        if dry_run:
            b, h = 1, 2
        else:
            b, h = max(1, TOTAL_TOKENS // L), HIDDEN // d
        for causal in causals:
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, L, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
            fns = make_providers(q, k, v, causal, providers, dry_run=dry_run)
            ref = None
            for name, fn in fns.items():
                row = {"provider": name, "d": d, "L": L, "batch": b, "heads": h, "causal": causal}
                try:
                    o = fn()
                    if name == "sdpa_flash":
                        ref = o
                    if ref is not None and name != "sdpa_flash":
                        row["err"] = rel_l2(o, ref)
                    t = bench_ms(fn, warmup=warmup, rep=rep) if not dry_run else {"ms": float("nan")}
                    row.update(t)
                    row["tflops"] = flops(b, h, L, d, causal) / (t["ms"] * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001 - one provider failing must not stop the table
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                if "error" in row:
                    free_gpu_memory()
                rows.append(row)
            by = {r["provider"]: r for r in rows if (r["d"], r["L"], r["causal"]) == (d, L, causal)}
            for r in by.values():
                for base in ("sdpa_flash", "sdpa_cudnn"):
                    if base in by and by[base].get("ms") and r.get("ms") and math.isfinite(r["ms"]):
                        r[f"x_{base.split('_')[1]}"] = by[base]["ms"] / r["ms"]
            del q, k, v, fns, ref
            free_gpu_memory()
    return rows


def summarize(rows: list[dict]) -> dict:
    """Headline: turbo_exact speed-up over sdpa_flash / sdpa_cudnn at d=128, L >= 4k (DESIGN §6 target)."""
    out = {}
    for causal in (False, True):
        sel = [r for r in rows if r["provider"] == "turbo_exact" and r["d"] == 128 and r["L"] >= 4096
               and r["causal"] == causal and r.get("x_flash")]
        if sel:
            out[f"d128_L>=4k_{'causal' if causal else 'noncausal'}"] = {
                "min_speedup_vs_flash": min(r["x_flash"] for r in sel),
                "min_speedup_vs_cudnn": min((r.get("x_cudnn") or float("nan")) for r in sel),
                "lens": [r["L"] for r in sel],
            }
    return out


def _turbo_defaults() -> dict:
    from turbo_attn_hf.kernels import reference as R

    out = {k: getattr(R, k) for k in ("DEFAULT_P_SCALE", "DEFAULT_V_SCALE", "DEFAULT_BLOCK_N") if hasattr(R, k)}
    if hasattr(R, "default_block_n"):
        out["block_n_by_head_dim"] = {d: R.default_block_n(d) for d in (64, 128, 256)}
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turbo-attn bench-prefill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"d=128 at 1k/4k/8k/16k, d=64/256 at 4k ({len(QUICK_SHAPES)} shapes)")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--lens", default="512,1k,2k,4k,8k,16k")
    ap.add_argument("--causal", default="both", choices=("both", "causal", "noncausal"))
    ap.add_argument("--providers", default=",".join(ALL_PROVIDERS))
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--out", default=None, help="output folder (default eval/results)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, no timing: checks the set-up (CPU ok)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    bad = [p for p in providers if p not in ALL_PROVIDERS]
    if bad:
        raise SystemExit(f"unknown providers {bad}; choose from {ALL_PROVIDERS}")
    causals = {"both": [False, True], "causal": [True], "noncausal": [False]}[args.causal]
    if args.dry_run:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        shapes = [(64, 80)]
    else:
        require_cuda("bench_prefill")
        if args.quick:
            shapes = QUICK_SHAPES
        else:
            shapes = [(d, L) for d in parse_int_list(args.dims) for L in parse_int_list(args.lens)]
    info = machine_info()
    print(machine_line(info), flush=True)
    rows = run(shapes, causals, providers, dry_run=args.dry_run, warmup=args.warmup, rep=args.rep)
    print_table(rows, ["provider", "d", "L", "batch", "heads", "causal", "ms", "tflops", "x_flash", "x_cudnn", "err"])
    for r in rows:
        if "error" in r:
            print(f"  {r['provider']} d={r['d']} L={r['L']} causal={r['causal']}: {r['error']}")
    payload = {
        "benchmark": "prefill", "machine": info, "dry_run": args.dry_run, "quick": args.quick,
        "protocol": {"total_tokens": TOTAL_TOKENS, "hidden": HIDDEN, "dtype": "bfloat16", "layout": "[b, H, L, d]",
                     "timer": f"triton.testing.do_bench median (warmup {args.warmup} ms, rep {args.rep} ms)",
                     "flops": FLOPS_FORMULA, "err": "relative L2 of the output vs sdpa_flash",
                     "turbo_defaults": "turbo_attention's defaults (KV block reference.default_block_n(d), V scale "
                                       "reference.DEFAULT_V_SCALE, P scale reference.DEFAULT_P_SCALE); kernel_* "
                                       "quantize with the same block and V scale",
                     "providers": {p: __doc__.split(p, 1)[1].split("\n", 1)[0].strip() for p in providers}},
        "turbo_defaults": _turbo_defaults(), "summary": summarize(rows), "rows": rows,
    }
    if payload["summary"]:
        print("summary:", payload["summary"])
    save_results("bench_prefill" + ("_dryrun" if args.dry_run else ""), payload, args.out,
                 None if args.no_plot or args.dry_run else "plot_prefill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
