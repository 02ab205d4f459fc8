"""Kernel accuracy against fp64 attention: INT-FlashAttention's MRE tables and FlashAttention-3's outlier RMSE.

    python -m eval.kernel_accuracy [--quick] [--out DIR]
    python -m eval.kernel_accuracy --dry-run     # CPU: tiny shapes through the Triton interpreter

1. MRE tables (INT-FlashAttention, arXiv 2409.16997, "quantization accuracy" experiment): Q, K, V drawn
   i.i.d. from N(0, 1) and from U(-0.5, 0.5), L in {1k, 2k, 4k, 8k, 16k}, head_dim 128, non-causal.
   The paper reports a "mean relative error" without printing its formula in the text we could read; we use
       MRE = mean(|O - O_ref|) / mean(|O_ref|)        (means over every element of the output)
   (an element-wise mean of |O - O_ref| / |O_ref| is dominated by outputs near zero, which uniform
   inputs produce in numbers). O_ref is exact attention in float64 (``kernels.reference.attention_fp64``).
   Its full-INT8 figures, the issue's targets: 4.05-4.52 % (normal) and 1.62-1.85 % (uniform).
2. FA3's numerical-error test (FlashAttention-3 §4.3): entries ~ N(0, 1) + N(0, 100)·Bernoulli(0.001), i.e. a
   standard normal plus, with probability 0.001, an outlier of variance 100 (std 10); RMSE =
   sqrt(mean((O - O_ref)^2)) against fp64. FA3 reports 1.9e-4 (FP16), 2.4e-2 (FP8 per-tensor baseline),
   9.1e-3 (FA3 FP8 with block quantization + incoherent processing): the issue's target is <= 9.1e-3.
Rows: turbo_exact / turbo_sas (the shipped kernel: ``turbo_attention`` with its defaults), turbo_static
(the INT-FlashAttention P scale 1/127, ``p_scale="static"``), turbo_intfa (static P scale and one V scale per
channel, ``v_scale="channel"``: INT-FlashAttention's own choices, the closest like-for-like row), and, as
context, SDPA on bf16 and fp16 inputs (no 8-bit anywhere).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from .bench_common import machine_info, machine_line, parse_int_list, print_table, require_cuda, write_json

MRE_FORMULA = "MRE = mean(|O - O_ref|) / mean(|O_ref|), means over all output elements; O_ref = fp64 attention"
RMSE_FORMULA = "RMSE = sqrt(mean((O - O_ref)^2)) over all output elements; O_ref = fp64 attention"
FA3_DIST = "N(0,1) + N(0,100)*Bernoulli(0.001): standard normal plus, w.p. 0.001, an outlier with variance 100"
TARGETS = {
    "mre_normal_int_flashattention_full_int8": [0.0405, 0.0452],
    "mre_uniform_int_flashattention_full_int8": [0.0162, 0.0185],
    "fa3_rmse_fp8": 9.1e-3,
    "fa3_rmse_fp16": 1.9e-4,
}
PROVIDERS = ("turbo_exact", "turbo_sas", "turbo_static", "turbo_intfa", "sdpa_bf16", "sdpa_fp16")


def sample(dist: str, shape, device, gen):
    import torch

    if dist == "normal":
        return torch.randn(shape, device=device, dtype=torch.float32, generator=gen)
    if dist == "uniform":
        return torch.rand(shape, device=device, dtype=torch.float32, generator=gen) - 0.5
    if dist == "fa3_outlier":
        x = torch.randn(shape, device=device, dtype=torch.float32, generator=gen)
        mask = torch.rand(shape, device=device, generator=gen) < 1e-3
        return x + mask * (10.0 * torch.randn(shape, device=device, dtype=torch.float32, generator=gen))
    raise ValueError(f"unknown distribution {dist!r}")


def outputs(q32, k32, v32, causal: bool, providers) -> dict:
    """Provider -> output ``[b, L, H, d]`` (fp32) for fp32 inputs ``[b, H, L, d]``; the inputs each provider
    sees are the fp32 values rounded to its input dtype (bf16 for turbo), the reference sees the fp32 ones."""
    import torch
    import torch.nn.functional as F

    from turbo_attn_hf.kernels import prefill

    res = {}
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q32, k32, v32))
    for name in providers:
        try:
            if name == "turbo_exact":
                o = prefill.turbo_attention(qb, kb, vb, causal=causal, softmax="exact")
            elif name == "turbo_sas":
                o = prefill.turbo_attention(qb, kb, vb, causal=causal, softmax="sas")
            elif name == "turbo_static":
                o = prefill.turbo_attention(qb, kb, vb, causal=causal, softmax="exact", p_scale="static")
            elif name == "turbo_intfa":  # INT-FlashAttention's choices: static P scale, one V scale per channel
                o = prefill.turbo_attention(qb, kb, vb, causal=causal, softmax="exact", p_scale="static",
                                            v_scale="channel")
            elif name in ("sdpa_bf16", "sdpa_fp16"):
                dt = torch.bfloat16 if name == "sdpa_bf16" else torch.float16
                o = F.scaled_dot_product_attention(q32.to(dt), k32.to(dt), v32.to(dt), is_causal=causal).transpose(1, 2)
            else:
                raise ValueError(name)
            res[name] = o.float()
        except Exception as e:  # noqa: BLE001 - report, keep going
            res[name] = e
    return res


def metrics(o, ref) -> dict:
    import torch

    o = o.double()
    diff = o - ref
    return {
        "mre": float(diff.abs().mean() / ref.abs().mean()),
        "rmse": float(torch.sqrt((diff * diff).mean())),
        "rel_l2": float(diff.norm() / ref.norm()),
        "max_abs": float(diff.abs().max()),
    }


def run(cases: list[tuple[str, int]], *, b: int, h: int, d: int, causal: bool, providers, device, seed: int = 0):
    import torch

    from turbo_attn_hf.kernels.reference import attention_fp64

    rows = []
    for dist, L in cases:
        gen = torch.Generator(device=device).manual_seed(seed)
        q, k, v = (sample(dist, (b, h, L, d), device, gen) for _ in range(3))
        # the reference sees the values every provider starts from: the bf16-rounded inputs
        qr, kr, vr = (t.to(torch.bfloat16).double() for t in (q, k, v))
        ref = attention_fp64(qr, kr, vr, causal=causal)
        outs = outputs(q, k, v, causal, providers)
        for name, o in outs.items():
            row = {"dist": dist, "L": L, "provider": name, "b": b, "heads": h, "d": d, "causal": causal}
            if isinstance(o, Exception):
                row["error"] = f"{type(o).__name__}: {str(o).splitlines()[0][:160] if str(o) else ''}"
            else:
                row.update(metrics(o, ref))
            rows.append(row)
        del q, k, v, qr, kr, vr, ref, outs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def check_targets(rows: list[dict]) -> dict:
    """Worst turbo_exact value per table against the issue's targets."""
    out = {}
    for dist, key in (("normal", "mre_normal_int_flashattention_full_int8"),
                      ("uniform", "mre_uniform_int_flashattention_full_int8")):
        for prov in ("turbo_exact", "turbo_sas", "turbo_static", "turbo_intfa"):
            sel = [r["mre"] for r in rows if r["dist"] == dist and r["provider"] == prov and "mre" in r]
            if sel:
                out[f"{prov}_{dist}_max_mre"] = max(sel)
                out[f"{prov}_{dist}_mre_at_or_below_int_fa"] = max(sel) <= TARGETS[key][0]
    for prov in ("turbo_exact", "turbo_sas", "turbo_static", "turbo_intfa"):
        sel = [r["rmse"] for r in rows if r["dist"] == "fa3_outlier" and r["provider"] == prov and "rmse" in r]
        if sel:
            out[f"{prov}_fa3_max_rmse"] = max(sel)
            out[f"{prov}_fa3_rmse_at_or_below_9.1e-3"] = max(sel) <= TARGETS["fa3_rmse_fp8"]
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turbo-attn accuracy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="MRE at L 1k/4k/16k, FA3 test at L 4k")
    ap.add_argument("--lens", default="1k,2k,4k,8k,16k", help="MRE table lengths")
    ap.add_argument("--fa3-lens", default="1k,4k,16k", help="lengths of the FA3 outlier test")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true", help="causal attention (default: non-causal, as the papers)")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    bad = [p for p in providers if p not in PROVIDERS]
    if bad:
        raise SystemExit(f"unknown providers {bad}; choose from {PROVIDERS}")
    import torch

    if args.dry_run:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        b, h, d = 1, 2, 64
        cases = [("normal", 80), ("uniform", 80), ("fa3_outlier", 80)]
    else:
        require_cuda("kernel_accuracy")
        device = "cuda"
        b, h, d = args.batch, args.heads, args.head_dim
        lens = [1024, 4096, 16384] if args.quick else parse_int_list(args.lens)
        fa3 = [4096] if args.quick else parse_int_list(args.fa3_lens)
        cases = [(dist, L) for dist in ("normal", "uniform") for L in lens] + [("fa3_outlier", L) for L in fa3]
    info = machine_info()
    print(machine_line(info), flush=True)
    rows = run(cases, b=b, h=h, d=d, causal=args.causal, providers=providers, device=device)
    print_table(rows, ["dist", "L", "provider", "mre", "rmse", "rel_l2", "max_abs"])
    for r in rows:
        if "error" in r:
            print(f"  {r['provider']} {r['dist']} L={r['L']}: {r['error']}")
    summary = check_targets(rows)
    for k_, v_ in summary.items():
        print(f"  {k_}: {v_}")
    payload = {
        "benchmark": "kernel_accuracy", "machine": info, "dry_run": args.dry_run, "quick": args.quick,
        "config": {"batch": b, "heads": h, "head_dim": d, "causal": args.causal, "input_dtype": "bfloat16 (turbo, "
                   "sdpa_bf16), float16 (sdpa_fp16); O_ref from the same bf16-rounded values in float64"},
        "formulas": {"mre": MRE_FORMULA, "rmse": RMSE_FORMULA, "rel_l2": "||O - O_ref||_2 / ||O_ref||_2",
                     "fa3_outlier_distribution": FA3_DIST,
                     "mre_note": "INT-FlashAttention (arXiv 2409.16997) names the metric 'mean relative error' "
                                 "without a formula in the text we read; this is the formula used here"},
        "targets": TARGETS, "summary": summary, "rows": rows,
    }
    path = write_json("kernel_accuracy" + ("_dryrun" if args.dry_run else ""), payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
