"""Issue 23 item 5: would a Hadamard rotation on the tensor cores make the prefill's Q+K pass cost what the plain
pass costs? (GPU, CUDA-graph medians; ``--dry-run`` checks the math in the Triton interpreter.)

The rotated Q+K pass (``quant._quant_qk_kernel`` with ROTATE) runs ``hadamard_rows``: log2(N) butterfly stages whose
layout changes cost ~24 SASS instructions an element against the plain pass's ~3.5 (PERF_NOTES session 30): 6.8 ->
12.8 us at a Llama-3-8B layer's 1k prompt (+8.4 % of the prefill's kernels; the bar is 3 %). ``x . H+-1`` is a
matmul with an exact +-1 matrix, so here it is one ``tl.dot`` per 128 channels: the bf16 input splits into
``PIECES`` exact bf16 parts (1 for a bf16 row, 3 for an fp32 row — 24 bits — as after a smoothing factor) whose
products with +-1 are exact; the tensor cores sum them in fp32. head_dim 256 (N = 256) = two 128-channel dots and one
butterfly stage across the halves, which needs no layout change. The +-1 matrix is made in registers from
``popcount(i & j)`` (MODE 2) or read from a global bf16 copy (MODE 3). The probe quantizes per token (INT8 codes +
scale) one ``[heads, L, d]`` tensor per mode:

* MODE 0: plain (no rotation), the production tile (64 / 32 rows, 4 warps);
* MODE 1: the butterfly (``hadamard.hadamard_rows``), the production rotated tile (one warp, 2048 channels of rows);
* MODE 2 / 3: the dot, BT rows on W warps (swept), TPP tiles of a head per program.

Each mode's codes are compared with MODE 1's (fraction of codes that differ, largest difference; the scales'
largest relative difference): the sums' order differs, so a code at a rounding boundary may move by one.

    python -m eval.experiments.rotation_mma_probe --out eval/results/rotation_mma_probe_h200.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import triton
import triton.language as tl

from turbo_attn_hf.kernels.hadamard import hadamard_rows
from turbo_attn_hf.kernels.quant import _to_int8_half_away
from turbo_attn_hf.kernels.reference import hadamard_pm1

from .decode_rotation_ab import _graph_timer


@triton.jit
def pm1_matrix(BK: tl.constexpr, N: tl.constexpr):
    """``[BK, BK]`` bf16 ``H+-1`` (``hadamard_rows``' matrix, BK <= 256) made in registers from the parity of the bits
    of ``i & j`` inside a block: block-diagonal with blocks of min(N, BK) channels."""
    NB: tl.constexpr = N if N < BK else BK
    i = tl.arange(0, BK)[:, None]
    j = tl.arange(0, BK)[None, :]
    v = i & j & (NB - 1)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)  # bit 0: the parity of the 8 bits of v
    return tl.where((i // NB) == (j // NB), 1.0 - 2.0 * (v & 1).to(tl.float32), 0.0).to(tl.bfloat16)


@triton.jit
def dot_pm1(x, h, PIECES: tl.constexpr, DOT: tl.constexpr):
    """``x [R, BK]`` fp32 times ``h = pm1_matrix(BK, N)`` on the tensor cores: x as PIECES exact bf16 parts (1: bf16
    numbers; 3: any fp32), each product with +-1 exact, the sums in fp32. DOT: the operands' type (bf16; fp32
    holding the same values in the interpreter, whose bf16 ``tl.dot`` is wrong in Triton 3.6)."""
    hi = x.to(tl.bfloat16)
    acc = tl.dot(hi.to(DOT), h.to(DOT), out_dtype=tl.float32)
    if PIECES > 1:
        r = x - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        acc = tl.dot(mid.to(DOT), h.to(DOT), acc)
        if PIECES > 2:
            acc = tl.dot((r - mid.to(tl.float32)).to(tl.bfloat16).to(DOT), h.to(DOT), acc)
    return acc


@triton.jit
def _probe_kernel(X, F, HG, X8, S, L, NT, stride_xh, stride_xl, scale,
                  D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, N: tl.constexpr, MODE: tl.constexpr,
                  PIECES: tl.constexpr, HAS_FACTOR: tl.constexpr, TPP: tl.constexpr, DOT: tl.constexpr):
    """grid (heads * cdiv(NT, TPP),): TPP consecutive BT-row tiles of one head of ``X [heads, L, D]`` (bf16) ->
    int8 codes ``X8 [heads, L, D]`` and scales ``S [heads, L]`` (amax / 127 * scale); F: ``[D]`` fp32 factors
    multiplied in first (HAS_FACTOR)."""
    pid = tl.program_id(0)
    n_p = tl.cdiv(NT, TPP)
    i_h = (pid // n_p).to(tl.int64)
    t0 = (pid % n_p) * TPP
    p_x = X + i_h * stride_xh
    p_8 = X8 + i_h * L * D
    p_s = S + i_h * L
    HB: tl.constexpr = BD if BD < 128 else 128  # channels a dot takes
    o_c = tl.arange(0, HB)
    o_d = tl.arange(0, BD)
    if MODE >= 2:
        if MODE == 2:
            h = pm1_matrix(HB, N)
        else:
            h = tl.load(HG + o_c[:, None] * HB + o_c[None, :])
        f0 = tl.full([HB], 1.0, tl.float32)
        f1 = tl.full([HB], 1.0, tl.float32)
        if HAS_FACTOR:
            f0 = tl.load(F + o_c, mask=o_c < D, other=1.0)
            if BD > 128:
                f1 = tl.load(F + 128 + o_c, mask=128 + o_c < D, other=1.0)
    for j in range(TPP):
        o_t = (t0 + j) * BT + tl.arange(0, BT)
        m_t = o_t < L
        if MODE >= 2:
            m0 = m_t[:, None] & (o_c < D)[None, :]
            x0 = tl.load(p_x + o_t[:, None] * stride_xl + o_c[None, :], mask=m0, other=0.0).to(tl.float32)
            y0 = dot_pm1(x0 * f0[None, :], h, PIECES, DOT)
            if BD > 128:
                m1 = m_t[:, None] & (128 + o_c < D)[None, :]
                x1 = tl.load(p_x + o_t[:, None] * stride_xl + 128 + o_c[None, :], mask=m1, other=0.0).to(tl.float32)
                y1 = dot_pm1(x1 * f1[None, :], h, PIECES, DOT)
                if N > 128:  # the last butterfly stage pairs channel c with c + 128: no layout change
                    y0, y1 = y0 + y1, y0 - y1
                amax = tl.maximum(tl.max(tl.abs(y0), 1), tl.max(tl.abs(y1), 1))
            else:
                amax = tl.max(tl.abs(y0), 1)
            safe = tl.where(amax > 0, amax, 1.0)
            inv = tl.where(amax > 0, tl.math.div_rn(tl.full([BT], 127.0, tl.float32), safe), 0.0)[:, None]
            tl.store(p_8 + o_t[:, None] * D + o_c[None, :], _to_int8_half_away(y0, inv), mask=m0)
            if BD > 128:
                tl.store(p_8 + o_t[:, None] * D + 128 + o_c[None, :], _to_int8_half_away(y1, inv), mask=m1)
        else:
            m_x = m_t[:, None] & (o_d < D)[None, :]
            x = tl.load(p_x + o_t[:, None] * stride_xl + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
            if HAS_FACTOR:
                x = x * tl.load(F + o_d, mask=o_d < D, other=1.0)[None, :]
            if MODE == 1:
                x = hadamard_rows(x, N)
            amax = tl.max(tl.abs(x), 1)
            safe = tl.where(amax > 0, amax, 1.0)
            inv = tl.where(amax > 0, tl.math.div_rn(tl.full([BT], 127.0, tl.float32), safe), 0.0)[:, None]
            tl.store(p_8 + o_t[:, None] * D + o_d[None, :], _to_int8_half_away(x, inv), mask=m_x)
        tl.store(p_s + o_t, tl.math.div_rn(amax, tl.full([BT], 127.0, tl.float32)) * scale, mask=m_t)


@functools.lru_cache(maxsize=None)  # built once: session 39's run rebuilt it per call inside the timed graph
def _pm1_bf16(n: int, device: str) -> torch.Tensor:
    """MODE 3's operand: ``reference.hadamard_pm1(n)`` in bf16 (exact), on ``device``."""
    return hadamard_pm1(n, device).to(torch.bfloat16).contiguous()


def quantize(x, mode: int, bt: int, warps: int, tpp: int = 1, factor=None, pieces: int | None = None):
    """Per-token INT8 of ``x [heads, L, d]`` bf16 (rotated unless mode 0): ``(codes, scales)``."""
    hh, L, d = x.shape
    bd = 1 << (d - 1).bit_length()
    n = d & -d
    x8 = torch.empty(hh, L, d, dtype=torch.int8, device=x.device)
    s = torch.empty(hh, L, dtype=torch.float32, device=x.device)
    nt = -(-L // bt)
    hb = min(bd, 128)
    if n < hb:
        raise ValueError(f"head_dim {d}: the probe's dots take Hadamard blocks of >= {hb} channels (d 128, 256)")
    hg = _pm1_bf16(hb, str(x.device))
    if pieces is None:
        pieces = 3 if factor is not None else 1
    f = factor if factor is not None else s
    grid = (hh * -(-nt // tpp),)
    _probe_kernel[grid](x, f, hg, x8, s, L, nt, x.stride(0), x.stride(1), 1.0 / n ** 0.5 if mode else 1.0,
                        D=d, BD=bd, BT=bt, N=n, MODE=mode, PIECES=pieces, HAS_FACTOR=factor is not None, TPP=tpp,
                        DOT=tl.float32 if x.device.type == "cpu" else tl.bfloat16, num_warps=warps)
    return x8, s


def _compare(a, b):
    (c0, s0), (c1, s1) = a, b
    diff = (c0.int() - c1.int()).abs()
    rel = ((s0 - s1).abs() / s1.abs().clamp_min(1e-30)).max().item()
    return dict(code_diff_frac=diff.ne(0).float().mean().item(), code_diff_max=int(diff.max().item()),
                scale_rel_max=rel)


SHAPES = (("llama3-8b q+k", 40, 128), ("gemma3-270m q+k", 5, 256))
VARIANTS = ((2, 64, 4, 1), (2, 64, 4, 4), (2, 128, 8, 1), (2, 128, 4, 1), (3, 64, 4, 1), (3, 64, 4, 4),
            (2, 32, 4, 1), (2, 64, 8, 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dry-run", action="store_true", help="interpreter check of the math at one small shape")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    dev = "cpu" if a.dry_run else "cuda"
    lens = [96] if a.dry_run else [int(x) for x in a.lens.split(",")]
    variants = ((2, 32, 4, 1), (3, 32, 4, 2)) if a.dry_run else VARIANTS
    rows = []
    for name, heads, d in SHAPES:
        for L in lens:
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(heads, L, d, generator=g, device=dev).mul_(
                1 + 20 * (torch.rand(d, generator=g, device=dev) > 0.97)).to(torch.bfloat16)
            fac = torch.rand(d, generator=g, device=dev).mul_(3).add_(0.2)
            prod = (64 if d <= 128 else 32, 4) if not a.dry_run else (32, 4)
            bfly = (max(8, 2048 // d), 1) if not a.dry_run else (32, 4)
            for with_f in (False, True):
                f = fac if with_f else None
                calls = {"plain": lambda f=f: quantize(x, 0, *prod, factor=f),
                         "butterfly": lambda f=f: quantize(x, 1, *bfly, factor=f)}
                for mode, bt, w, tpp in variants:
                    calls[f"dot{'_reg' if mode == 2 else '_gmem'} bt{bt} w{w} tpp{tpp}"] = (
                        lambda mode=mode, bt=bt, w=w, tpp=tpp, f=f: quantize(x, mode, bt, w, tpp, factor=f))
                ref = calls["butterfly"]()
                row = dict(shape=name, heads=heads, d=d, L=L, factor=with_f, checks={}, us={})
                for k, fn in calls.items():
                    if k.startswith("dot"):
                        row["checks"][k] = _compare(fn(), ref)
                if not a.dry_run:
                    timers = {k: _graph_timer(fn) for k, fn in calls.items()}
                    samples = {k: [] for k in timers}
                    for _ in range(a.rounds):
                        for k, t in timers.items():
                            samples[k].append(t())
                    row["us"] = {k: round(statistics.median(v), 2) for k, v in samples.items()}
                rows.append(row)
                print(json.dumps(row))
    if a.out:
        meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
                    torch=torch.__version__, triton=triton.__version__,
                    note="per-token INT8 of one [heads, L, d] bf16 tensor (Q and K heads of one layer) per mode; "
                         "us: CUDA graph of 20 calls, median of rounds; checks: against the butterfly's codes")
        with open(a.out, "w") as fh:
            json.dump(dict(meta, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
