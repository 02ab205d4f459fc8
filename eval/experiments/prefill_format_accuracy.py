"""Issue 20, first step: which 8-bit prefill formats meet the accuracy bounds, before any kernel is written (CPU).

Plain-PyTorch emulation of a flash-attention loop (blocks of 64 keys, online softmax kept in fp64 so that only the
formats' rounding shows) over bf16-rounded inputs, against fp64 attention, on the inputs of ``eval.kernel_accuracy``:
INT-FlashAttention's MRE tables (N(0, 1), U(-0.5, 0.5)) and FlashAttention-3's outlier RMSE. Non-causal, head_dim 128.

Formats, "Q·Kᵀ / P·V" (K's channel mean subtracted first in every row: softmax-invariant, SageAttention's smoothing):
  int8 / int8   today's kernel: Q, K per-token symmetric INT8; P relative to the block's reference point c =
                max(block max, running max - P_BLOCK_GAP) (the kernel's "block" P scale: p <= 1) as round(127 p) /
                127; V INT8 per channel and block of 64 keys
  int8 / fp8    SageAttention2's split: Q·Kᵀ as above; P as e4m3(448 p) / 448 (same reference point), V e4m3 per
                channel (amax / 448 over the whole sequence); products summed in fp32 (the two-level accumulation
                that keeps an FP8 wgmma's ~22-bit accumulator out of the sum is assumed, not emulated)
  int8 / fp8p, int8 / fp8v   one of the two in FP8: P only (V INT8 as today) or V only (P INT8 as today)
  fp8 / fp8     FlashAttention-3's FP8: Q and K e4m3 with one scale per block of 64 rows (amax / 448); P, V as above
  +had          the same with Q and K first rotated by an orthonormal Hadamard matrix (FA3's incoherent processing)
The row ``int8 / int8 (shipped)`` is ``reference.turbo_attention`` itself, the check that the emulation reads as
the kernel's twin does.

    python -m eval.experiments.prefill_format_accuracy [--lens 1024,4096] [--out eval/results]
"""

from __future__ import annotations

import argparse
import math

import torch

from eval.bench_common import machine_info, parse_int_list, print_table, write_json
from eval.kernel_accuracy import FA3_DIST, MRE_FORMULA, RMSE_FORMULA, TARGETS, metrics, sample
from turbo_attn_hf.kernels import reference as R

BLOCK = 64
E4M3_MAX = 448.0
FORMATS = ("int8/int8", "int8/fp8", "int8/fp8p", "int8/fp8v", "fp8/fp8", "fp8/fp8+had")
GAP = R.P_BLOCK_GAP * math.log(2.0)  # the kernel's block reference point, in natural-log units


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 (round to nearest even), as fp64."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float64)


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric INT8 (round half away), dequantized: ``reference.quantize_per_token``'s codes x scale."""
    x8, s = R.quantize_per_token(x)
    return x8.double() * s.double()[..., None]


def _fp8_blocks(x: torch.Tensor) -> torch.Tensor:
    """e4m3 with one scale (amax / 448) per block of BLOCK rows, dequantized."""
    *lead, n, d = x.shape
    xb = x.double().reshape(*lead, -1, BLOCK, d)
    s = (xb.abs().amax(dim=(-1, -2), keepdim=True) / E4M3_MAX).clamp_min(1e-30)
    return (_e4m3(xb / s) * s).reshape(*lead, n, d)


def _v_int8_blocks(v: torch.Tensor) -> torch.Tensor:
    """V INT8 per channel and block of BLOCK keys (the kernel's default ``v_scale``), dequantized."""
    *lead, n, d = v.shape
    vb = v.double().reshape(*lead, -1, BLOCK, d)
    s = (vb.abs().amax(dim=-2, keepdim=True) / 127.0).clamp_min(1e-30)
    return (R._round_half_away(vb / s).clamp(-127, 127) * s).reshape(*lead, n, d)


def _v_fp8_channels(v: torch.Tensor) -> torch.Tensor:
    s = (v.double().abs().amax(dim=-2, keepdim=True) / E4M3_MAX).clamp_min(1e-30)
    return _e4m3(v.double() / s) * s


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Non-causal attention of ``q, k, v [b, h, L, d]`` through the 8-bit format ``fmt`` -> ``[b, L, h, d]`` (bf16
    values, as fp64)."""
    qk, pv = fmt.split("+")[0].split("/")
    d = q.shape[-1]
    k = k - k.mean(dim=-2, keepdim=True)
    if fmt.endswith("+had"):
        q, k = (R.fwht_rows(t.float()) / math.sqrt(d) for t in (q, k))
    qd, kd = (_int8_rows(t) for t in (q, k)) if qk == "int8" else (_fp8_blocks(t) for t in (q, k))
    vd = _v_fp8_channels(v) if pv in ("fp8", "fp8v") else _v_int8_blocks(v)
    p_fp8 = pv in ("fp8", "fp8p")
    scale = d ** -0.5
    m = torch.full(q.shape[:-1], -math.inf, dtype=torch.float64)
    c = m.clone()
    l = torch.zeros_like(m)
    acc = torch.zeros(*q.shape[:-1], d, dtype=torch.float64)
    for j in range(0, k.shape[-2], BLOCK):
        s = (qd @ kd[..., j:j + BLOCK, :].transpose(-1, -2)) * scale
        bmax = s.amax(-1)
        m = torch.maximum(m, bmax)
        c_new = torch.maximum(bmax, m - GAP)  # acc and l are kept relative to exp(c)
        p = torch.exp(s - c_new[..., None])  # <= 1
        p = _e4m3(E4M3_MAX * p) / E4M3_MAX if p_fp8 else torch.round(127 * p) / 127
        r = torch.exp(c - c_new)
        l = l * r + p.sum(-1)  # the P that multiplies V, as the kernel sums it
        acc = acc * r[..., None] + p @ vd[..., j:j + BLOCK, :]
        c = c_new
    return (acc / l[..., None]).transpose(1, 2).to(torch.bfloat16).double()  # the kernels write bf16


def run(lens: list[int], fa3_lens: list[int], b: int = 1, h: int = 2, d: int = 128, seed: int = 0) -> list[dict]:
    rows = []
    cases = [(dist, L) for dist in ("normal", "uniform") for L in lens] + [("fa3_outlier", L) for L in fa3_lens]
    for dist, L in cases:
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (sample(dist, (b, h, L, d), "cpu", gen).to(torch.bfloat16).float() for _ in range(3))
        ref = R.attention_fp64(q.double(), k.double(), v.double(), causal=False)
        outs = {f: attend(q, k, v, f) for f in FORMATS}
        outs["int8/int8 (shipped)"] = R.turbo_attention(q, k, v, causal=False).double()
        for name, o in outs.items():
            rows.append({"dist": dist, "L": L, "format": name, **metrics(o, ref)})
        print_table(rows[-len(outs):], ["dist", "L", "format", "mre", "rmse", "rel_l2"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="1024,4096")
    ap.add_argument("--fa3-lens", default="1024,4096")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    rows = run(parse_int_list(args.lens), parse_int_list(args.fa3_lens))
    write_json("prefill_format_accuracy_cpu", {
        "experiment": "prefill_format_accuracy", "machine": machine_info(), "block": BLOCK, "head_dim": 128,
        "formats": FORMATS, "formulas": {"mre": MRE_FORMULA, "rmse": RMSE_FORMULA, "fa3": FA3_DIST},
        "targets": TARGETS, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
