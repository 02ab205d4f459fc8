"""Plain-PyTorch twin of the kernels' quantized math (the oracle), plus fp64 exact attention.

Two references, two tolerances (STYLE.md, "References beside kernels"):
  * ``turbo_attention`` / ``int8_flash_attention`` / ``quantize_per_token`` / ``quantize_v_blocks`` /
    ``sas_exp2`` compute exactly what ``kernels/quant.py``, ``kernels/prefill.py`` and ``kernels/softmax.py``
    compute, in the same order of fp32 operations where that matters (tight match; the quantizers bit-exact);
  * ``attention_fp64`` is exact attention in float64 (the accuracy budget).

This module imports torch only (no triton), so it runs anywhere, fp32 inputs included.

The math (INT-FlashAttention, Chen et al. 2024, Alg. 1; TurboAttention §4 for SAS; SageAttention §3 for
K smoothing; FlashAttention-3 §3.3 for the transposed V layout):
  * Q, K: per-token symmetric INT8, ``s = amax|x_row| / 127``; the softmax scale and log2(e) are folded into
    Q's scale once, so ``S2 = (q8 . k8^T)_int32 * sq * sk`` are base-2 logits. K is first centred by its
    per-(batch, head, channel) mean over all keys (``smooth_k``; off with softcap).
  * V: per block of ``block_n`` tokens and per channel (``v_scale="block"``) or per channel over the whole
    sequence (``"channel"``), ``sv = amax / 127``, stored transposed ``[d, L]``.
  * Online softmax in base 2 with fp32 ``m, l, acc``; ``P`` quantized as ``p8 = floor(127 p + 0.5)``
    (static scale 1/127, ``p_scale="static"``) or relative to the block's row max (``p_scale="block"``,
    see ``int8_flash_attention``); ``l`` accumulates exactly the weights that multiply V.

Float <-> int conversions. The quantizers round half away from zero, ``trunc(x + copysign(0.5, x))``
(bit-exact in the Triton pass). Inside the attention loop the kernel avoids the GPU's conversion unit (16
results/clock/SM on Hopper, as slow as MUFU.EX2) with the "magic number" C = 1.5 * 2^23: for an integer
|i| < 2^22, ``float(i) = bitcast_f32(i + bits(C)) - C`` (exact), and ``p8 = bits(127 p + C) - bits(C)``
rounds 127 p to nearest, ties to even: ``floor(127 p + 0.5)`` except at exact ties. This module computes
the same formulas in fp32 (the GPU fuses ``127 p + C`` into one FMA; the interpreter does not).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .rotation import hadamard_matrix, rotation_block

__all__ = [
    "LOG2E",
    "LN2",
    "SAS_POLY",
    "SAS_POLY_BASE2",
    "SUPPORTED_HEAD_DIMS",
    "SOFTMAX_MODES",
    "P_SCALE_MODES",
    "V_SCALE_MODES",
    "DEFAULT_V_SCALE",
    "DEFAULT_BLOCK_N",
    "default_block_n",
    "DEFAULT_P_SCALE",
    "P_BLOCK_GAP",
    "sas_exp2",
    "quantize_p",
    "fma",
    "i32_scaled",
    "INT_TO_FLOAT_MODES",
    "k_smooth_mean",
    "quantize_per_token",
    "hadamard_pm1",
    "fwht_rows",
    "quantize_v_blocks",
    "quantize_v_channels",
    "int8_flash_attention",
    "turbo_attention",
    "nonfinite_rows",
    "attention_fp64",
]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

#: TurboAttention §4: cubic fit of e^(-x) on [0, 1], highest power first: c3 x^3 + c2 x^2 + c1 x + c0.
SAS_POLY = (-0.1025, 0.4626, -0.9922, 0.9996)
#: The same polynomial evaluated at x = f * ln2 (f in [0, 1)), ln2 powers folded into the coefficients,
#: so that POLY3(f ln2) ~ 2^(-f): a3 f^3 + a2 f^2 + a1 f + a0 (highest power first).
SAS_POLY_BASE2 = tuple(c * LN2 ** (3 - i) for i, c in enumerate(SAS_POLY))

#: head dims the prefill kernel supports (non-powers of two run with BLOCK_D = next power of two, masked).
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
SOFTMAX_MODES = ("exact", "sas")
#: "static": p8 = round(127 p), p relative to the running row max (INT-FlashAttention).
#: "block": p8 = round(127 p / pmax_block), pmax_block = max of the block's p per row, folded back in fp32.
P_SCALE_MODES = ("static", "block")
#: "block": V scale per block of block_n tokens and per channel; "channel": one scale per channel over the
#: whole sequence (INT-FlashAttention's choice, what the KV cache uses), sv ``[b, H, 1, d]``.
V_SCALE_MODES = ("block", "channel")
DEFAULT_V_SCALE = "block"
#: tokens per KV block: the kernel's BLOCK_N, and the V quantization block when v_scale == "block".
#: The default of the quantizers and of ``int8_flash_attention`` with per-channel V scales;
#: ``turbo_attention`` takes ``default_block_n(head_dim)``.
DEFAULT_BLOCK_N = 128


def default_block_n(head_dim: int) -> int:
    """KV block of ``turbo_attention`` when none is given: 128 for every head_dim. d <= 128: on an H200 1.3-1.4x
    the kernel speed of 64, for N(0,1) MRE 1.6 -> 1.8 % and FA3 outlier RMSE 4.3e-3 -> 5.2e-3 at L 1k; d 256: on
    an H100 1.33-1.42x (kernel 355 / 312 TFLOP/s full / causal vs 250 / 234, eval/results/prefill_sweep_d256_h100.json;
    see eval/PERF_NOTES.md)."""
    return DEFAULT_BLOCK_N
#: "block" P scale: a block is quantized relative to c = max(block max, running max - P_BLOCK_GAP) (log2
#: units), so the accumulator, kept relative to c, stays below 2^(P_BLOCK_GAP + 50) (no fp32 overflow).
P_BLOCK_GAP = 32.0
#: V's types the P.V runs on as they are (the Gluon prefill's 16-bit P.V: ``int8_flash_attention`` with a 16-bit v8t)
PV_HALF_DTYPES = (torch.bfloat16, torch.float16)
#: the 16-bit P.V's KV block (P's reference point c is taken per block) by head dim where it is not DEFAULT_BLOCK_N: at
#: head_dim 64 the Gluon kernel runs two CTAs an SM, whose registers hold 64-key blocks (PERF_NOTES session 49)
PV_HALF_BLOCK_N = {64: 64}
#: lower clamp of the query scale sq (an all-zero query row has sq = 0; -inf * 0 would give NaN).
SQ_MIN = 2.0 ** -100
#: a decode tile whose largest P·V weight is at or below this (relative to the running max) adds nothing to P·V: its
#: 127 / max w overflows fp32 below ~3.7e-37 (p subnormal: every logit of the tile > 126 base-2 units under the
#: running max, as with Q/K outlier channels), and 0 * inf gave NaN outputs. Its share of the output is < 2^-100.
W_MIN = 2.0 ** -100
#: default P scale: "block" meets FA3's outlier RMSE bound, "static" does not (measured, see
#: tests/kernels/test_reference.py::test_p_scale_accuracy and the module docstring of prefill.py).
DEFAULT_P_SCALE = "block"

#: C = 1.5 * 2^23 and its bit pattern: round-to-integer and int<->float conversion by one add.
MAGIC = 12582912.0
MAGIC_BITS = 0x4B400000


def psum_bias(block_n: int) -> int:
    """``block_n`` times bits(C) as a wrapped int32: the INT8 kernels' row sum of P's code bits (each bits(C) + p8,
    added in int32 mod 2^32) minus it is the row sum of the codes."""
    return (block_n * MAGIC_BITS + 2**31) % 2**32 - 2**31


#: largest y = -x that sas_exp2 keeps (thresholds above are capped): 2^-125 * POLY3 stays a normal float
SAS_MAX_Y = 125.0


# --------------------------------------------------------------------------------------------- helpers
def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """trunc(x + copysign(0.5, x)) in x's dtype: the kernels' float -> int rounding."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


def _symmetric_int8(x: torch.Tensor, amax: torch.Tensor, dim: int) -> torch.Tensor:
    """int8 codes of fp32 ``x`` with step amax/127 (amax broadcast along ``dim``); amax == 0 gives codes 0."""
    # correctly rounded 127 / amax (kernel: div_rn); note `127.0 / tensor` would be reciprocal() * 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xs = x * inv.unsqueeze(dim)
    return _round_half_away(xs).clamp_(-127, 127).to(torch.int8)


def _div127(amax: torch.Tensor) -> torch.Tensor:
    """amax / 127 correctly rounded (kernel: div_rn); on CUDA `tensor / 127.0` multiplies by 1/127."""
    return amax / torch.full_like(amax, 127.0)


def sas_exp2(x: torch.Tensor, threshold2) -> torch.Tensor:
    """SAS approximation of ``exp2(x)`` for x <= 0 (TurboAttention §4, in base 2), fp32.

    ``y = -x``; 0 where ``y > min(threshold2, SAS_MAX_Y)`` (the sparse part: threshold2 = sas_threshold *
    log2(e), a float or a tensor broadcasting against x); otherwise ``y = n + f`` with integer n and f in
    [0, 1], and ``2^(-n) * POLY3(f ln2)``, the polynomial in Horner form ((a3 f + a2) f + a1) f + a0.
    n = floor(y) is computed without a conversion instruction as ``r = (y - 0.5) + C``, ``n = r - C`` (round
    to nearest even of y - 0.5: floor(y), or y - 1 with f = 1 when y is an integer, which is as exact), and
    2^(-n) is applied in the exponent field: ``bits(POLY3) - (bits(r) << 23)`` (mod 2^32), since
    bits(r) = bits(C) + n and bits(C)'s nine low bits are 0. SAS_MAX_Y keeps the result normal
    (POLY3 in [0.49, 1]). Adds, FMAs and integer ops only: the kernels keep it off the MUFU unit.
    """
    x = x.float()
    y = -x
    r = (y - 0.5) + MAGIC
    n = r - MAGIC
    f = y - n
    a3, a2, a1, a0 = SAS_POLY_BASE2
    poly = ((a3 * f + a2) * f + a1) * f + a0
    bits = (poly.view(torch.int32).long() - (r.view(torch.int32).long() << 23)) % 2**32
    p = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    thr = torch.clamp(torch.as_tensor(threshold2, dtype=torch.float32), max=SAS_MAX_Y)
    return torch.where(y > thr, torch.zeros_like(poly), p)


def fma(a, b, c) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once, as the GPU's FFMA (and ``tl.math.fma``): computed in float64 (the
    product of two fp32 values is exact there) and rounded to fp32 (double rounding: differs from one
    rounding only on exact float64 ties, which never matter here)."""
    f64 = torch.float64
    a, b, c = (x.to(f64) if isinstance(x, torch.Tensor) else x for x in (a, b, c))
    return (a * b + c).to(torch.float32)


def quantize_p(p: torch.Tensor) -> torch.Tensor:
    """P codes as fp32 integers in [0, 127]: ``fma(p, 127, C) - C`` (round to nearest, ties even)."""
    return fma(p, 127.0, MAGIC) - MAGIC


#: how the INT8 kernels turn an int32 dot into a scaled float: "magic" ``fma(C + x, s, -(C s))`` (the portable
#: kernel: the + C rides in the dot's accumulator), "exact" one rounding of ``x s`` (I2F + FMUL: the Gluon kernel)
INT_TO_FLOAT_MODES = ("magic", "exact")


def i32_scaled(x: torch.Tensor, s: torch.Tensor, mode: str = "magic") -> torch.Tensor:
    """The kernel's ``float(x) * s`` for integer-valued ``x`` (|x| < 2^22). "magic": ``fma(C + x, s, -(C s))``
    with ``C s`` rounded to fp32 (prefill.py ``_i32_scaled``): error <= half an ulp of C s, ~0.75 |s|; "exact":
    ``x s`` rounded once (x is exact in fp32)."""
    s = s.float()
    if mode == "exact":
        return x.float() * s
    return fma(x.float() + MAGIC, s, -(s * MAGIC))


def _tanh_softcap_base2(s2: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma-2 softcap on base-2 logits: S2' = softcap * tanh(S2 ln2 / softcap) * log2(e).

    tanh(z) = 1 - 2 / (2^(2 z log2 e) + 1) with 2 z log2(e) = 2 S2 / softcap: exactly the kernel's formula.
    """
    e = torch.exp2(s2 * (2.0 / softcap))
    t = 1.0 - 2.0 / (e + 1.0)
    return t * (softcap * LOG2E)


def _check_head_dim(d: int) -> None:
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {d} is not supported {SUPPORTED_HEAD_DIMS}; "
            "load the model with attn_implementation='sdpa'"
        )


# ------------------------------------------------------------------------------------------ quantizers
def k_smooth_mean(k: torch.Tensor) -> torch.Tensor:
    """Per-(..., channel) mean of K over its tokens: ``[..., L, d] -> [..., d]`` fp32, the sum taken in fp64 and
    ``fl32(sum / L)`` (one fp64 division, one rounding to fp32).

    A 16-bit key's fp64 sum over up to 2^13 (fp16) or, for real data, far more (bf16) tokens is exact, so it does not
    depend on the order of the additions: the store's stats kernel (``store._finish_head``, sums in its own tile
    order) and this reduction give the same mean bit for bit on any device.
    """
    return (k.sum(dim=-2, dtype=torch.float64) / k.shape[-2]).float()


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` where finite, else 0 (quant.py ``_finite_or_zero``: an unsmoothed channel of K's mean)."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _finite_token_amax(v: torch.Tensor) -> torch.Tensor:
    """Per-channel max of |v| over the tokens, ``[b, H, L, d] -> fp32 [b, H, d]``, skipping every token that
    holds a NaN/Inf (quant.py's V channel scale; exact in v's dtype, then widened)."""
    va = v.abs()
    bad = ~torch.isfinite(va.amax(dim=-1, keepdim=True))  # amax propagates NaN
    return va.masked_fill_(bad, 0).amax(dim=2).float()


def hadamard_pm1(d: int, device="cpu") -> torch.Tensor:
    """fp32 ``[d, d]`` +-1 (block-diagonal) Sylvester Hadamard: ``rotation.hadamard_matrix(d) * sqrt(n)``, exact
    (``hadamard.hadamard_rows`` computes its product)."""
    return (hadamard_matrix(d, torch.float64) * math.sqrt(rotation_block(d))).round().to(device=device,
                                                                                          dtype=torch.float32)


def fwht_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x [..., d] . H+-1`` (blocks of ``rotation_block(d)``) as the kernels compute it (``hadamard.hadamard_rows``):
    the butterfly stages ``(a + b, a - b)`` over channel pairs ``(i, i + h)``, h = 1, 2, ..., in the same order, so
    kernel and twin agree bit for bit (fp32 sums, no bf16 rounding)."""
    d, n = x.shape[-1], rotation_block(x.shape[-1])
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        x = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2).reshape(*lead, d)
        h *= 2
    return x


def quantize_per_token(x: torch.Tensor, *, scale: float = 1.0, smooth: Optional[torch.Tensor] = None,
                       rotate: bool = False, factor: Optional[torch.Tensor] = None):
    """Per-token symmetric INT8: ``x [..., L, d] -> (x8 int8 [..., L, d], s fp32 [..., L])``.

    ``smooth`` (fp32 ``[..., d]``, e.g. ``k_smooth_mean(k)``; a non-finite channel counts as 0) is subtracted
    first. ``s = amax/127 * scale`` (fold the softmax scale and log2(e) into Q's scale here); rows of zeros
    give codes 0 and s = 0. A row holding a NaN/Inf ("poisoned") gives codes 0 and s = NaN: the attention
    loop turns exactly the rows that see it into NaN.

    ``rotate`` (quant.py's fused rotation, ``rotate_qk``): the rows become ``x . diag(factor) . H`` first
    (``factor`` fp32 ``[..., d]``: the smoothing factors s for Q, 1/s for K; none for plain "hadamard") via
    :func:`fwht_rows` with ``1/sqrt(n)`` folded into ``scale``, and ``smooth`` is the unrotated mean, rotated
    the same way (the rotated keys' mean).
    """
    xf = x.float()
    if rotate:
        n = rotation_block(x.shape[-1])
        f = None if factor is None else factor.float().reshape(*xf.shape[:-2], 1, xf.shape[-1])
        xf = fwht_rows(xf if f is None else xf * f)
        scale = float(scale) / math.sqrt(n)
    if smooth is not None:
        m = _finite_or_zero(smooth.float()).reshape(*xf.shape[:-2], 1, xf.shape[-1])
        if rotate:
            m = fwht_rows(m if f is None else m * f)
        xf = xf - m
    bad = ~torch.isfinite(xf).all(dim=-1)
    xf = xf.masked_fill(bad[..., None], 0.0)
    amax = xf.abs().amax(dim=-1)
    x8 = _symmetric_int8(xf, amax, -1)
    s = (_div127(amax) * scale).masked_fill(bad, math.nan)
    return x8.contiguous(), s.contiguous()


def _poison_tokens(poison: Optional[torch.Tensor], bad: torch.Tensor) -> None:
    """Set the key scales ``poison [b, H, >= L]`` to NaN in place where ``bad [b, H, L]`` (a non-finite V token)."""
    if poison is not None:
        L = bad.shape[-1]
        poison[..., :L] = poison[..., :L].masked_fill(bad, math.nan)


def quantize_v_blocks(v: torch.Tensor, block: int = DEFAULT_BLOCK_N, *, poison: Optional[torch.Tensor] = None):
    """Per-block, per-channel symmetric INT8 of V, stored transposed.

    v: ``[b, H, L, d]`` -> ``v8t int8 [b, H, d, Lpad]`` (tokens contiguous; Lpad = L rounded up to
    ``block``; padded tokens are 0) and ``sv fp32 [b, H, Lpad // block, d]`` (amax over the block / 127).
    A token holding a NaN/Inf is coded 0, left out of the scales, and marked NaN in ``poison`` (the key
    scales sk ``[b, H, >= L]``, in place) if given.
    """
    b, h, L, d = v.shape
    nblk = max(1, -(-L // block))
    lpad = nblk * block
    vf = torch.zeros(b, h, lpad, d, dtype=torch.float32, device=v.device)
    vf[:, :, :L] = v.float()
    bad = ~torch.isfinite(vf).all(dim=-1)
    vf = vf.masked_fill(bad[..., None], 0.0)
    _poison_tokens(poison, bad[..., :L])
    vb = vf.view(b, h, nblk, block, d)
    amax = vb.abs().amax(dim=3)  # [b, h, nblk, d]
    v8 = _symmetric_int8(vb, amax, 3)
    v8t = v8.view(b, h, lpad, d).transpose(-1, -2).contiguous()
    sv = _div127(amax).contiguous()
    return v8t, sv


def quantize_v_channels(v: torch.Tensor, block: int = DEFAULT_BLOCK_N, *, poison: Optional[torch.Tensor] = None):
    """Per-channel symmetric INT8 of V over the whole sequence (one scale per b, head, channel), transposed.

    v: ``[b, H, L, d]`` -> ``v8t int8 [b, H, d, Lpad]`` (Lpad = L rounded up to ``block``, the kernel's
    KV tile; padded tokens 0) and ``sv fp32 [b, H, 1, d]`` (amax over all tokens / 127). Non-finite
    tokens and ``poison`` as in ``quantize_v_blocks``.
    """
    b, h, L, d = v.shape
    nblk = max(1, -(-L // block))
    lpad = nblk * block
    vf = torch.zeros(b, h, lpad, d, dtype=torch.float32, device=v.device)
    vf[:, :, :L] = v.float()
    bad = ~torch.isfinite(vf).all(dim=-1)
    vf = vf.masked_fill(bad[..., None], 0.0)
    _poison_tokens(poison, bad[..., :L])
    amax = vf.abs().amax(dim=2)  # [b, h, d]
    v8 = _symmetric_int8(vf, amax, 2)
    return v8.transpose(-1, -2).contiguous(), _div127(amax).unsqueeze(2).contiguous()


# ------------------------------------------------------------------------------------ int8 attention
def int8_flash_attention(q8, sq, k8, sk, v8t, sv, *, causal=True, window=None, softcap=None, key_valid=None,
                         softmax="exact", sas_threshold=6.0, Lk=None, out_dtype=torch.bfloat16,
                         p_scale=DEFAULT_P_SCALE, out=None, block_n=None, int_to_float="magic"):
    """Reference of the INT8 flash-attention loop on quantized operands (same blocking as the kernel).

    q8 ``[b, Hq, Lq, d]`` int8, sq ``[b, Hq, Lq]`` (base-2 logit scale folded in), k8 ``[b, Hk, Lk, d]``,
    sk ``[b, Hk, Lk]``, v8t ``[b, Hk, d, Lpad]``, sv ``[b, Hk, nblk, d]``: per block (``quantize_v_blocks``,
    the loop block is then ``Lpad // nblk``) or, with nblk == 1, per channel (``quantize_v_channels``; the
    loop block is ``block_n``, default DEFAULT_BLOCK_N). Returns ``o [b, Lq, Hq, d]`` in ``out_dtype``
    (written into ``out`` if given). See ``turbo_attention`` for the mask arguments. ``int_to_float``: the
    kernel's conversion of the int32 dots (``INT_TO_FLOAT_MODES``, ``i32_scaled``).

    Per KV block, fp32 state (m running max, c reference point, l, acc kept relative to 2^c; masked
    scores -inf; ``safe(x)`` = 0 where x == -inf)::

        t = i32_scaled((q8 . k8)_int32, sk);  S2 = t * max(sq, SQ_MIN)  [softcap on S2]
        m_new = max(m, bmax),  bmax = rowmax S2
        c_new = m_new (static) | max(bmax, m_new - P_BLOCK_GAP) (block)
        r = exp2(c - safe(c_new));  p = exp2(fma(t, sq, -safe(c_new))) (or sas_exp2; block+sas: also 0
        where m_new - S2 > threshold);  p8 = quantize_p(p)
        l = l r + sum(p8);  acc = fma(acc, r, i32_scaled((p8 . v8)_int32, sv_block))

    and ``o = acc / l`` (0 where l == 0). With a 16-bit ``v8t`` (V itself, ``[b, Hk, Lpad, d]``: the Gluon prefill's
    P.V on 16-bit operands, ``sv`` unused) P is p rounded to V's type and ``l = l r + sum(p)``, ``acc = acc r +
    P . V`` in fp32, the loop block ``block_n`` defaulting to the kernel's (``PV_HALF_BLOCK_N`` by head dim, else
    DEFAULT_BLOCK_N). A NaN scale (a non-finite token, see ``quantize_per_token``) keeps
    NaN through every max here: a NaN sk makes the rows that do not mask that key NaN, a NaN sq (l starts at
    NaN) its row. "static" is INT-FlashAttention's P scale 1/127 relative to the
    running max (c = m: r is the usual alpha); "block" quantizes each block relative to its own max (all 127
    codes used by every block), and since acc is kept relative to c no per-block weight is needed: the
    kernel's update is one FMA per accumulator element. l sums exactly the p8 that multiply V (summing the
    unrounded 127 p instead was measured: it biases o towards 0 by the mass of the codes rounded to 0,
    N(0,1)+2 V at L 1k: MRE 0.34 % -> 1.07 %).
    """
    if softmax not in SOFTMAX_MODES:
        raise ValueError(f"softmax={softmax!r} must be one of {SOFTMAX_MODES}")
    if p_scale not in P_SCALE_MODES:
        raise ValueError(f"p_scale={p_scale!r} must be one of {P_SCALE_MODES}")
    if int_to_float not in INT_TO_FLOAT_MODES:
        raise ValueError(f"int_to_float={int_to_float!r} must be one of {INT_TO_FLOAT_MODES}")
    b, hq, lq, d = q8.shape
    hk = k8.shape[1]
    g = hq // hk
    if Lk is None:
        Lk = k8.shape[2]
    half = v8t.dtype in PV_HALF_DTYPES  # P.V on V itself ``[b, Hk, Lpad, d]``, P in its type
    lpad = v8t.shape[2] if half else v8t.shape[-1]
    nblk = 1 if half else sv.shape[2]
    if half:  # the Gluon kernel's block for its head dim unless given
        block = PV_HALF_BLOCK_N.get(q8.shape[3], DEFAULT_BLOCK_N) if block_n is None else int(block_n)
        svr = None
    elif nblk > 1:
        block = lpad // nblk
        svr = sv.float().repeat_interleave(g, dim=1)  # [b, hq, nblk, d]
    else:
        block = DEFAULT_BLOCK_N if block_n is None else int(block_n)
        svr = sv.float().repeat_interleave(g, dim=1).expand(b, hq, -(-lpad // block), d)
    dev = q8.device
    thr2 = float(sas_threshold) * LOG2E

    # integer dots in floating point, exact: every partial sum is an integer of magnitude below
    # 256 * 127^2 < 2^24 (d <= 256, block <= 1024), so fp32 is exact on CUDA unless TF32 is on; fp64 else.
    idt = torch.float32 if (dev.type == "cuda" and not torch.backends.cuda.matmul.allow_tf32
                            and d <= 256 and block <= 1024) else torch.float64
    qf = q8.to(idt)
    kf = k8[:, :, :Lk].to(idt).repeat_interleave(g, dim=1)  # [b, hq, Lk, d]
    if half:
        vf = v8t.float().repeat_interleave(g, dim=1)  # [b, hq, Lpad, d]
    else:
        vf = v8t.to(idt).transpose(-1, -2).repeat_interleave(g, dim=1)  # [b, hq, Lpad, d]
    skr = sk[:, :, :Lk].float().repeat_interleave(g, dim=1)  # [b, hq, Lk]
    sqf = sq.float().clamp_min(SQ_MIN)  # keeps NaN (a poisoned query row)
    pos = torch.arange(lq, device=dev) + (Lk - lq)  # absolute position of each query row
    kv = None if key_valid is None else key_valid.to(device=dev, dtype=torch.bool)

    m = torch.full((b, hq, lq), -math.inf, dtype=torch.float32, device=dev)
    c = torch.full((b, hq, lq), -math.inf, dtype=torch.float32, device=dev)
    l = torch.where(torch.isnan(sqf), sqf, torch.zeros_like(sqf))  # a NaN query row stays NaN, keys or not
    acc = torch.zeros((b, hq, lq, d), dtype=torch.float32, device=dev)
    ninf = torch.tensor(-math.inf, dtype=torch.float32, device=dev)
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    for start in range(0, Lk, block):
        end = min(start + block, Lk)
        j = torch.arange(start, end, device=dev)
        s_int = (qf @ kf[:, :, start:end].transpose(-1, -2)).to(torch.float32)
        t = i32_scaled(s_int, skr[:, :, None, start:end], int_to_float)
        s2 = t * sqf[..., None]
        if softcap is not None:
            s2 = t = _tanh_softcap_base2(s2, float(softcap))
        mask = _position_mask(pos, j, causal, window).expand(b, hq, lq, end - start)
        if kv is not None:
            mask = mask & kv[:, None, None, start:end]
        s2 = torch.where(mask, s2, ninf)
        t = torch.where(mask, t, ninf)
        bmax = s2.amax(dim=-1)
        m_new = torch.maximum(m, bmax)
        c_new = m_new if p_scale == "static" else torch.maximum(bmax, m_new - P_BLOCK_GAP)
        c_safe = torch.where(c_new == -math.inf, zero, c_new)
        r = torch.exp2(c - c_safe)
        x = t - c_safe[..., None] if softcap is not None else fma(t, sqf[..., None], -c_safe[..., None])
        if softmax == "exact":
            p = torch.exp2(x)
        else:
            if p_scale == "block":  # threshold relative to the row max: m_new - S2 > thr2
                m_safe = torch.where(m_new == -math.inf, zero, m_new)
                p = sas_exp2(x, (thr2 - (m_safe - c_safe))[..., None])
            else:
                p = sas_exp2(x, thr2)
        if half:  # the products of the rounded P and V exact in fp32; l sums the unrounded p
            pv = p.to(v8t.dtype).float() @ vf[:, :, start:end]
            l = l * r + p.sum(dim=-1)
            acc = acc * r[..., None] + pv
        else:
            p8 = quantize_p(p)  # integer-valued fp32 in [0, 127]
            pv = (p8.to(idt) @ vf[:, :, start:end]).to(torch.float32)
            l = l * r + p8.sum(dim=-1)
            acc = fma(acc, r[..., None], i32_scaled(pv, svr[:, :, start // block][:, :, None, :], int_to_float))
        m, c = m_new, c_new
    o = torch.where(l[..., None] != 0, acc / torch.where(l != 0, l, torch.ones_like(l))[..., None],
                    torch.zeros_like(acc))
    o = o.transpose(1, 2).to(out_dtype)
    if out is not None:
        out.copy_(o)
        return out
    return o.contiguous()


def turbo_attention(q, k, v, *, scale=None, causal=True, window=None, softcap=None, key_valid=None,
                    softmax="exact", sas_threshold=6.0, smooth_k=True, out=None, p_scale=DEFAULT_P_SCALE,
                    block_n=None, v_scale=DEFAULT_V_SCALE, k_mean=None, rotate_qk=False, qk_smooth=None,
                    pv_dtype=None):
    """INT8 attention, plain PyTorch: the same math as ``turbo_attn_hf.kernels.prefill.turbo_attention``.

    q ``[b, Hq, Lq, d]``, k, v ``[b, Hk, Lk, d]`` (bf16/fp16/fp32), Hq % Hk == 0, Lq <= Lk.
    Returns ``o [b, Lq, Hq, d]`` in q's dtype.
      scale: softmax scale (natural-log units), default d**-0.5.
      causal: query i sits at absolute position Lk - Lq + i (bottom-right); attends key j iff j <= pos_i.
      window: sliding window W (HF semantics): also require pos_i - j < W. None = no window.
      softcap: Gemma-2 logit softcap, s = softcap * tanh(s / softcap), before masking.
      key_valid: bool ``[b, Lk]``, False = padded key. Rows with no valid key return zeros.
      softmax: "exact" (exp2) or "sas" (TurboAttention sparse activated softmax, ``sas_threshold`` in
        natural-log units below the row max). smooth_k: subtract K's channel mean (forced off with softcap);
        k_mean: that mean if the caller has it (default: ``k_smooth_mean(k)``).
      p_scale: "static" or "block" (see ``int8_flash_attention``). block_n: KV block (tokens), None:
        ``default_block_n(d)``.
      v_scale: "block" (per block_n tokens and channel) or "channel" (per channel over the sequence).
      rotate_qk: Hadamard-rotate Q and K inside their quantization (``rotate_qk="hadamard"``); with qk_smooth
        (``rotation.smooth_scales`` factors ``s [b, Hk, d]``, "smooth_hadamard") Q by ``diag(s)`` and K by
        ``diag(1/s)`` first. q, k and k_mean stay unrotated (see ``quantize_per_token``).
      pv_dtype: None (INT8 P.V) or the 16-bit type of the Gluon kernel's P.V on V itself (``prefill.pv_dtype``):
        V rounded to it, its non-finite tokens zeroed and flagged in sk, P rounded to it, I2F conversions, P's
        reference point per ``PV_HALF_BLOCK_N`` keys where that names the head dim.
    Non-finite inputs: NaN rows exactly where ``nonfinite_rows`` says (a bad token is quantized as zeros with a
    NaN scale, kept out of every statistic; K's mean is not finite in a channel -> that channel unsmoothed).
    """
    _check_inputs_ref(q, k, v, key_valid)
    if v_scale not in V_SCALE_MODES:
        raise ValueError(f"v_scale={v_scale!r} must be one of {V_SCALE_MODES}")
    if qk_smooth is not None and not rotate_qk:
        raise ValueError("qk_smooth (the smooth_hadamard factors) needs rotate_qk=True")
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else float(scale)
    use_smooth = smooth_k and softcap is None
    fq = fk = None
    if qk_smooth is not None:  # Q head h uses KV head h // g; 1/s correctly rounded (the kernel's div_rn)
        sf = qk_smooth.to(device=k.device, dtype=torch.float32)
        fq, fk = sf.repeat_interleave(q.shape[1] // k.shape[1], dim=1), torch.full_like(sf, 1.0) / sf
    q8, sq = quantize_per_token(q, scale=scale * LOG2E, rotate=rotate_qk, factor=fq)
    mean = (k_smooth_mean(k) if k_mean is None else k_mean) if use_smooth else None
    k8, sk = quantize_per_token(k, smooth=mean, rotate=rotate_qk, factor=fk)
    if block_n is None:
        block_n = default_block_n(d)
    loop_n = block_n
    if pv_dtype is not None:  # ``quant.v_operand_half``: V padded to whole blocks, a bad token zeroed and flagged
        bad = ~torch.isfinite(v).all(-1)
        _poison_tokens(sk, bad)
        v8t = torch.nn.functional.pad(torch.where(bad[..., None], 0.0, v.float()).to(pv_dtype),
                                      (0, 0, 0, -v.shape[2] % block_n))
        sv, loop_n = None, PV_HALF_BLOCK_N.get(d, block_n)
    else:
        v8t, sv = (quantize_v_blocks if v_scale == "block" else quantize_v_channels)(v, block_n, poison=sk)
    return int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=causal, window=window, softcap=softcap,
                                key_valid=key_valid, softmax=softmax, sas_threshold=sas_threshold,
                                Lk=k.shape[2], out_dtype=q.dtype, p_scale=p_scale, out=out, block_n=loop_n,
                                int_to_float="magic" if pv_dtype is None else "exact")


def _check_inputs_ref(q, k, v, key_valid) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [b, H, L, d]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    b, hq, lq, d = q.shape
    _, hk, lk, dk = k.shape
    if k.shape[0] != b or dk != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree in batch or head_dim")
    _check_head_dim(d)
    if hq % hk != 0:
        raise ValueError(f"query heads {hq} are not a multiple of key/value heads {hk}")
    if lq > lk:
        raise ValueError(f"q_len {lq} > kv_len {lk}: queries must be the last Lq of the Lk positions")
    if key_valid is not None and tuple(key_valid.shape) != (b, lk):
        raise ValueError(f"key_valid must be bool [b, Lk] = {(b, lk)}; got {tuple(key_valid.shape)}")


def _position_mask(pos: torch.Tensor, j: torch.Tensor, causal: bool, window) -> torch.Tensor:
    """``[len(pos), len(j)]`` bool: the query at absolute position ``pos[i]`` attends key ``j[c]`` (causal,
    HF sliding window ``pos - j < window``)."""
    mask = torch.ones(pos.numel(), j.numel(), dtype=torch.bool, device=pos.device)
    if causal:
        mask &= j[None, :] <= pos[:, None]
    if window is not None:
        mask &= (pos[:, None] - j[None, :]) < window
    return mask


def nonfinite_rows(q, k, v, *, causal=True, window=None, key_valid=None) -> torch.Tensor:
    """Which output rows ``[b, Lq, Hq]`` (bool) the prefill returns non-finite: those whose query holds a
    NaN/Inf, and those that attend (by the causal / window / key_valid mask) a key whose K or V holds one.

    SDPA's math backend (and the GPU backends) give a NaN/Inf query row a NaN row. For a bad key they give
    NaN at least in these rows, but differ beyond them: with an additive or boolean mask, NaN + (-inf) = NaN
    spreads a NaN key to masked rows too, and a NaN V token reaches masked rows through 0 * NaN in P.V
    (tests/kernels/test_reference.py measures it); an Inf key whose score is -inf drops out of a row there
    and leaves it finite, where this rule (the quantized key cannot tell the sign) makes it NaN.
    """
    b, hq, lq, _ = q.shape
    hk, lk = k.shape[1], k.shape[2]
    dev = q.device
    bad_q = ~torch.isfinite(q).all(-1)  # [b, Hq, Lq]
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [b, Hk, Lk]
    mask = _position_mask(torch.arange(lq, device=dev) + (lk - lq), torch.arange(lk, device=dev), causal, window)
    mask = mask.expand(b, lq, lk)
    if key_valid is not None:
        mask = mask & key_valid.to(device=dev, dtype=torch.bool)[:, None, :]
    sees = (mask[:, None].float() @ bad_kv[:, :, :, None].float())[..., 0] > 0  # [b, Hk, Lq]
    bad = bad_q | sees.repeat_interleave(hq // hk, dim=1)
    return bad.transpose(1, 2).contiguous()


# ------------------------------------------------------------------------------------- fp64 attention
def attention_fp64(q, k, v, *, scale=None, causal=True, window=None, softcap=None, key_valid=None):
    """Exact attention in float64: ``o [b, Lq, Hq, d]`` fp64 (same mask semantics as turbo_attention).

    Works head group by head group so that the [Lq, Lk] score matrix stays below ~1 GiB.
    """
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    g = hq // hk
    scale = d ** -0.5 if scale is None else float(scale)
    dev = q.device
    mask = _position_mask(torch.arange(lq, device=dev) + (lk - lq), torch.arange(lk, device=dev), causal, window)
    out = torch.empty(b, lq, hq, d, dtype=torch.float64, device=dev)
    chunk = max(1, min(hq, (1 << 27) // max(1, lq * lk)))
    for ib in range(b):
        mb = mask if key_valid is None else mask & key_valid[ib].to(dev, torch.bool)[None, :]
        for h0 in range(0, hq, chunk):
            hs = torch.arange(h0, min(hq, h0 + chunk), device=dev)
            qh = q[ib, hs].double()
            kh = k[ib, hs // g].double()
            vh = v[ib, hs // g].double()
            s = (qh @ kh.transpose(-1, -2)) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~mb, -math.inf)
            mx = s.amax(dim=-1, keepdim=True)
            mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
            p = torch.exp(s - mx)
            den = p.sum(dim=-1, keepdim=True)
            o = (p @ vh) / torch.where(den > 0, den, torch.ones_like(den))
            out[ib, :, h0:h0 + len(hs)] = o.transpose(0, 1)
    return out


# ===== KV cache: progressive packing and decode =====
# Owned by the TurboCache work (kernels/pack.py, kernels/decode.py, turbo_attn_hf/cache.py); plain-PyTorch
# twins of the packed-cache math. Format, rounding and layout are documented in kernels/pack.py.


def kv_finite_mean_ref(k: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """The K mean with non-finite keys left out, where ``mean`` (``k_smooth_mean``) is not finite:
    ``fl32(sum(finite k) / count(finite k))`` per channel with the sum in fp64 (0 for a channel with none), as
    ``k_smooth_mean`` computes it for a channel without one; the fused store (``store._finish_head``) computes this
    for every channel, bit for bit."""
    fin = torch.isfinite(k)
    s = torch.where(fin, k, torch.zeros((), dtype=k.dtype, device=k.device)).sum(dim=2, dtype=torch.float64)
    n = fin.sum(dim=2).double()
    alt = torch.where(n > 0, s / n.clamp_min(1.0), torch.zeros_like(s)).float()
    return torch.where(torch.isfinite(mean), mean, alt)


def rope_pair_amax_ref(k: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """``k [b, H, L, d]`` -> fp32 ``[b, H, rope_dims]``: per channel j < rope_dims the max over tokens of the norm
    of its RoPE pair (rotate_half: j and j ± rope_dims/2), ``sqrt(max(k_j² + k_p²))`` in fp32 over the pairs where
    that sum is finite (0 where none is). RoPE turns a pair by a position-dependent angle and keeps its norm, so
    this covers the pair at any later position."""
    half = rope_dims // 2
    kr = k[..., :rope_dims].float()
    n2 = kr[..., :half] * kr[..., :half] + kr[..., half:] * kr[..., half:]
    n2 = torch.where(torch.isfinite(n2), n2, torch.zeros((), device=k.device)).amax(dim=2)
    n = n2.double().sqrt().float()  # = IEEE fp32 sqrt (the kernels' sqrt_rn); torch's CPU fp32 sqrt is not
    return torch.cat([n, n], dim=-1)


def rope_rotate_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding of q ``[b, Hq, L, d]`` and k ``[b, Hk, L, d]`` with cos / sin ``[b or 1, L, d]``, as HF's
    ``apply_rotary_pos_emb`` computes it: ``x * cos + cat(-x2, x1) * sin``, each op rounded to the tensors' dtype
    (``rope.rope_rotate_half``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q), rotate(k)


def rotate_keys_ref(k: torch.Tensor, qk_smooth: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The stored basis of a rotated cache (``rotate_qk``) as the store kernels compute it (``hadamard._rotate_keys``):
    ``k [b, H, L, d]`` -> fp32 ``fwht_rows(k · diag(1/s)) · fl32(1/sqrt(n))``, kept in fp32 (no rounding to
    k's dtype: the kernels code from the fp32 values). ``qk_smooth``: ``rotation.smooth_scales`` ``s [b, H, d]`` or
    None (plain hadamard)."""
    x = k.float()
    if qk_smooth is not None:
        x = x * (torch.ones_like(qk_smooth, dtype=torch.float32) / qk_smooth.float())[:, :, None, :]
    return fwht_rows(x) * _rot_scale(k.shape[-1])


def rotate_mean_ref(mean: torch.Tensor, qk_smooth: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The raw keys' mean ``[b, H, d]`` in the stored basis: ``fwht_rows(mean · diag(1/s)) · fl32(1/sqrt(n))``, fp32
    (``store._finish_head``, bit for bit)."""
    m = mean.float()
    if qk_smooth is not None:
        m = m * (torch.ones_like(qk_smooth, dtype=torch.float32) / qk_smooth.float())
    return fwht_rows(m) * _rot_scale(m.shape[-1])


def _rot_scale(d: int) -> torch.Tensor:
    """fp32 ``1/sqrt(n)`` of head dim d's Hadamard block (``rotation.rot_scale``)."""
    return torch.tensor(1.0 / math.sqrt(rotation_block(d)), dtype=torch.float32)


def kv_universal_scales_ref(k: torch.Tensor, v: torch.Tensor, smooth_k: bool = True, headroom: float = 1.0,
                            rope_dims: int = 0, rotate: bool = False, qk_smooth: Optional[torch.Tensor] = None):
    """FlashQ step 1 scales, fixed at the first prefill: ``k, v [b, H, L, d]`` ->
    ``(k_mean [b, H, d] or None, k_scale [b, H, d], v_scale [b, H, d])`` fp32, scale = amax * headroom / 127
    (K after subtracting its channel mean). A zero channel gets scale 1 (codes 0). Non-finite elements are
    left out of the mean and the amax (``kv_finite_mean_ref``; a channel with none finite gets scale 1): one
    bad token must not set every token's scale. ``rope_dims > 0`` (``k_scale_range: rope_pair``): K's first
    ``rope_dims`` channels take ``rope_pair_amax_ref`` and mean 0 (the mean of a slowly turning pair is not
    stationary); the mean is None when every channel is rotated. ``rotate`` (``store.kv_stats(rotate=True)``): the
    stored basis' scales, i.e. those of ``rotate_keys_ref(k, qk_smooth)`` around ``rotate_mean_ref`` of the raw keys'
    (finite) mean, which is the mean returned."""
    if rotate:
        if rope_dims:
            raise ValueError("rope_dims does not apply to rotated keys")
        mean = kv_finite_mean_ref(k, k_smooth_mean(k)) if smooth_k else None
        k = rotate_keys_ref(k, qk_smooth)
        mean = None if mean is None else rotate_mean_ref(mean, qk_smooth)
    else:
        mean = k_smooth_mean(k) if smooth_k and rope_dims < k.shape[-1] else None
        if mean is not None:
            mean = kv_finite_mean_ref(k, mean)
    kf, vf = k.float(), v.float()
    if mean is not None:
        mean[..., :rope_dims] = 0.0
        kf = kf - mean[:, :, None, :]
    zero = torch.zeros((), device=k.device)
    ka = torch.where(torch.isfinite(k), kf.abs(), zero).amax(dim=2)
    if rope_dims:
        ka[..., :rope_dims] = rope_pair_amax_ref(k, rope_dims)
    ks = ka * (headroom / 127.0)
    vs = torch.where(torch.isfinite(v), vf.abs(), zero).amax(dim=2) * (headroom / 127.0)
    return mean, torch.where(ks > 0, ks, torch.ones_like(ks)), torch.where(vs > 0, vs, torch.ones_like(vs))


def quantize_int8_universal_ref(x: torch.Tensor, scale: torch.Tensor, mean: Optional[torch.Tensor] = None):
    """``x [b, H, T, d]`` -> int8 ``clamp(round_half_away((x - mean) / scale), -127, 127)`` (outliers clamp);
    a non-finite element gives code 0."""
    xf = x.float()
    fin = torch.isfinite(xf)
    if mean is not None:
        xf = xf - mean[:, :, None, :]
    q = _round_half_away(xf / scale[:, :, None, :]).clamp_(-127, 127)
    return torch.where(fin, q, torch.zeros((), device=q.device)).to(torch.int8)


def pack_blocks_ref(x8: torch.Tensor, bits: int, axis: int):
    """TurboAttention eq. 7 on block tiles ``x8 [N, R, C]`` int8; ``axis`` (of the tile) is reduced for each
    group's min/max: 0 = one group per column (K tiles ``[BS, d]``: per channel; V tiles ``[d, BS]``: per
    token), 1 = one per row.

    Returns ``packed [N, R, C*bits//8] uint8`` (interleaved: byte j holds codes PB*j + p in bits
    [bits*p, bits*p + bits)), ``scale_int [N, NCH] int8``, ``zero [N, NCH] int8``.
    """
    qmax = (1 << bits) - 1
    pb = 8 // bits
    x = x8.to(torch.int32)
    dim = axis + 1
    mn = x.amin(dim=dim, keepdim=True)
    mx = x.amax(dim=dim, keepdim=True)
    sc = torch.clamp(torch.div(mx - mn + qmax - 1, qmax, rounding_mode="floor"), min=1)
    code = torch.clamp(torch.div(2 * (x - mn) + sc, 2 * sc, rounding_mode="floor"), max=qmax)
    # never past 127 when restored (code * sc + mn): rounded down instead, so the restore needs no clamp
    code = torch.minimum(code, torch.div(127 - mn, sc, rounding_mode="floor"))
    N, R, C = x.shape
    code = code.view(N, R, C // pb, pb)
    shifts = torch.arange(pb, device=x.device, dtype=torch.int32) * bits
    packed = (code << shifts).sum(-1).to(torch.uint8)
    return packed, sc.squeeze(dim).to(torch.int8), mn.squeeze(dim).to(torch.int8)


def unpack_codes_ref(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed bytes ``[..., C * bits // 8]`` uint8 -> codes ``[..., C]`` int32 (interleaved layout)."""
    pb = 8 // bits
    shifts = torch.arange(pb, device=p.device, dtype=torch.int32) * bits
    code = (p.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return code.reshape(*p.shape[:-1], p.shape[-1] * pb)


def unpack_blocks_ref(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int, axis: int):
    """Inverse of ``pack_blocks_ref``: INT8 ``code * scale_int + zero`` ``[N, R, C]`` (within [-127, 127] by
    construction; the clamp is a no-op guard)."""
    code = unpack_codes_ref(p, bits)
    dim = axis + 1
    x = code * s.to(torch.int32).unsqueeze(dim) + z.to(torch.int32).unsqueeze(dim)
    return x.clamp_(-127, 127).to(torch.int8)


def prepare_query_ref(q, k_scale, k_mean, scale, softcap, rotate=False, qk_smooth=None):
    """Twin of the decode kernel's query prologue: q' = q * s_k (per channel), per-row INT8 ``q8``, ``sq`` with
    scale*log2e folded in, and with softcap the smoothing correction ``qb = scale*log2e * q.mean_k``.

    ``rotate`` (K stored rotated, ``rotation.rotate``): q first becomes ``(q · diag(qk_smooth)) · H±1`` in fp32
    (``qk_smooth [b, HK, d]`` or None; query head h uses KV head h // g) by :func:`fwht_rows` (the kernel's
    butterfly), and ``1/sqrt(n)`` goes into ``sq`` and ``qb``'s scale instead."""
    g = q.shape[1] // k_scale.shape[1]
    qf = q.float()
    qscale = scale * LOG2E
    if rotate:
        n = rotation_block(qf.shape[-1])
        if qk_smooth is not None:
            qf = qf * qk_smooth.float().repeat_interleave(g, dim=1)[:, :, None, :]
        qf = fwht_rows(qf)
        qscale = scale * LOG2E / math.sqrt(n)  # as the kernel's host computes it
    qs = qf * k_scale.repeat_interleave(g, dim=1)[:, :, None, :]
    amax = qs.abs().amax(-1)
    q8 = _symmetric_int8(qs, amax, -1)
    sq = (amax / 127.0) * qscale
    qb = None
    if softcap and k_mean is not None:
        qb = (qf * k_mean.repeat_interleave(g, dim=1)[:, :, None, :]).sum(-1) * qscale
    return q8, sq, qb


def _group_tiles_ref(grp, k_tail, v_tail, n_tail, bs, n_sink=0):
    """Yield ``(positions [n], k8 [b, H, n, d], v [b, H, n, d], vs [b, H, n], vz [b, H, n], kz)`` per tile of
    one bit group (packed blocks, then the INT8 buffer in tiles of ``bs`` slots: sinks, recent window + tail):
    K restored to INT8, V as codes with its per-token integer scale/zero (INT8 tiles: the INT8 values,
    scale 1, zero 0), ``kz [b, H, d]`` K's integer zero of a 4/2-bit K block (None for INT8 K)."""
    heads = grp.heads.long().to(k_tail.device)
    k_bits = getattr(grp, "k_bits", grp.bits)
    for t in range(grp.n_blocks):
        k, v = grp.k[:, :, t], grp.v[:, :, t]
        b, h = k.shape[:2]
        if k_bits == 8:
            k8, kz = k, None
        else:
            k8 = unpack_blocks_ref(k.reshape(b * h, *k.shape[2:]), grp.k_scale[:, :, t].reshape(b * h, -1),
                                   grp.k_zero[:, :, t].reshape(b * h, -1), k_bits, 0).view(b, h, bs, -1)
            kz = grp.k_zero[:, :, t]
        if grp.bits == 8:
            vc = v.transpose(-1, -2)
            vs = torch.ones(b, h, bs, device=k.device)
            vz = torch.zeros(b, h, bs, device=k.device)
        else:
            vc = unpack_codes_ref(v, grp.bits).transpose(-1, -2)
            vs, vz = grp.v_scale[:, :, t].float(), grp.v_zero[:, :, t].float()
        yield torch.arange(n_sink + t * bs, n_sink + (t + 1) * bs, device=k.device), k8, vc, vs, vz, kz
    for s0 in range(0, n_tail, bs):
        s1 = min(s0 + bs, n_tail)
        k8 = k_tail[:, heads, s0:s1]
        b, h, n = k8.shape[:3]
        slot = torch.arange(s0, s1, device=k8.device)
        pos = torch.where(slot < n_sink, slot, slot + grp.n_blocks * bs)
        yield (pos, k8, v_tail[:, heads, :, s0:s1].transpose(-1, -2),
               torch.ones(b, h, n, device=k8.device), torch.zeros(b, h, n, device=k8.device), None)


def fold_logits_ref(s_int, zq, sq, qb, softcap):
    """Base-2 logits of a folded packed tile as the decode kernel forms them (``decode._fold_scores``):
    ``fma(f, a, c)`` with f = float(q8·k8 - zq) (the folded integer score: Σ_c code·q8·s_k), a = sq and
    c = sq·zq (``zq [.., R, 1] = Σ_c q8·z_k``), so the zero term and the running max ride in one FMA; with softcap
    f = cap(fma(f, sq, c) + qb), a = 1, c = 0. s_int, zq fp64 holding integers; returns (f, a [.., R], c [.., R])."""
    f = (s_int - zq).to(torch.float32)
    c = zq[..., 0].to(torch.float32) * sq
    if not softcap:
        return f, sq, c
    f = fma(f, sq[..., None], c[..., None])
    if qb is not None:
        f = f + qb[..., None]
    return _tanh_softcap_base2(f, float(softcap)), torch.ones_like(sq), torch.zeros_like(sq)


def pv_tile_ref(p: torch.Tensor, vc: torch.Tensor, vs: torch.Tensor, vz: torch.Tensor) -> torch.Tensor:
    """P·V of one decode tile with V = code * scale_t + zero_t per token (twin of the kernel's P·V step,
    ``decode._p_scale`` / ``_p_codes``):
    ``p [.., R, n]`` fp32, ``vc [.., n, d]`` codes (or INT8 values with scale 1, zero 0), ``vs, vz [.., n]``.
    The token scale rides in the probabilities, quantized per row of the tile relative to their max:
    ``w = p * s_t``, ``w8 = round(127 w / max w)``, ``P·V = (w8 · code) * (max w / 127) + Σ_t p z_t``.
    (A static 1/127 scale rounds every key far below the running max to 0; measured on SmolLM2 with the
    int8 preset, decode-path KL vs fp32 5.3e-3 static vs 2.8e-3 per tile.)"""
    w = p * vs[..., None, :]
    wmax = w.amax(-1)
    ok = wmax > W_MIN  # a tile of only negligible weights adds 0 (W_MIN: 127 / max w would overflow)
    inv = torch.where(ok, torch.full_like(wmax, 127.0) / torch.where(ok, wmax, torch.ones_like(wmax)),
                      torch.zeros_like(wmax))
    w8 = torch.floor(fma(w, inv[..., None], 0.5))
    pc = (w8.to(torch.float64) @ vc.to(torch.float64)).to(torch.float32)
    zs = (p * vz[..., None, :]).sum(-1)
    return fma(pc, _div127(wmax)[..., None], zs[..., None])


def folds_packed_tiles(bits: int, head_dim: int, block: int, fold: bool = True, k_bits: Optional[int] = None) -> bool:
    """Whether the decode kernel folds the integer scale/zero of packed tiles (``fold_logits_ref``): 2/4-bit heads
    whose folded 8-bit dots reduce over >= 32 (packed K bytes per row and half a block); else it restores INT8
    tiles (same integers, logits formed as for INT8 tiles). ``k_bits``: K's width when not ``bits`` (8: INT8 K)."""
    bd = 1 << (head_dim - 1).bit_length()
    return fold and bits != 8 and bd // (8 // (k_bits or bits)) >= 32 and block >= 64


def fold_unmasked_blocks(kv_len: int, lq: int, n_sink: int, block: int, *, causal: bool, window, key_valid: bool,
                         softcap) -> float:
    """Packed blocks ``[0, n)`` that every query of a chunk sees completely: the decode kernel runs them without
    per-score masks, in a loop of their own (the same numbers: their masks are all true). Block t holds positions
    ``n_sink + t·block ..``; the chunk's first query sits at ``kv_len - lq``. A window, key_valid or softcap
    (whose logits are masked after the cap) mask every block: 0. Not causal: every block (inf)."""
    if window or key_valid or softcap:
        return 0
    if not causal:
        return math.inf
    return max(kv_len - lq - n_sink + 1, 0) // block


def turbo_decode_ref(q, groups, k_tail, v_tail, n_tail, k_scale, v_scale, k_mean=None, *, scale=None,
                     causal=True, window=None, softcap=None, key_valid=None, n_sink=0, softmax="exact",
                     sas_threshold=6.0, n_splits=1, fold=True, rotate=False, qk_smooth=None):
    """Twin of ``decode.turbo_decode_attention`` (same arguments; ``groups`` are ``PackedKV``-like objects
    with ``bits, heads, k, v, k_scale, k_zero, v_scale, v_zero, n_blocks``; ``rotate``, ``qk_smooth``: the query
    is rotated by ``prepare_query_ref``), same tile order and split:
    the ``n_tiles`` tiles (packed blocks, then the INT8 buffer's tiles) are cut into shares of ``ceil(n_tiles / n_splits)``
    (``n_splits``: an int, or a dict bits -> int per bit group); with a sliding window the tiles no query
    of the chunk can see are skipped first (``decode.first_visible_tile``);
    each share runs the online softmax from scratch, one tile per step; shares merge by the rescale
    ``m = max m_s, l = Σ l_s 2^(m_s - m), acc = Σ acc_s 2^(m_s - m)``. Per tile (fp32 state)::

        s2 = (q8 . k8)_int * sq  [+ qb, softcap]; masked -> -inf; m_new = max(m, rowmax s2)
        p = exp2(s2 - m_safe) (or sas_exp2);  alpha = exp2(m - m_safe)
        l = l * alpha + Σ p;  acc = acc * alpha + pv_tile_ref(p, v codes, s_t, z_t)

    Folded packed tiles (``folds_packed_tiles``; ``fold`` selects the kernel's variant) form the same logits as
    ``fma(f, a, c)`` (``fold_logits_ref``): m_new from ``fma(rowmax f, a, c)``, p = exp2(fma(f, a, c - m_safe)).
    sq is floored at ``SQ_MIN`` (an all-zero query row: its scores are 0 either way).

    and ``o = acc / l * s_v`` (0 where l == 0). Returns ``[b, Lq, HQ, d]`` in q's dtype.
    """
    b, hq, lq, d = q.shape
    hk = k_tail.shape[1]
    bs = groups[0].k.shape[3]
    g = hq // hk
    dev = q.device
    scale = d ** -0.5 if scale is None else float(scale)
    thr2 = float(sas_threshold) * LOG2E
    n_blocks = groups[0].n_blocks
    kv_len = n_blocks * bs + n_tail
    q8, sq, qb = prepare_query_ref(q, k_scale, k_mean, scale, softcap, rotate, qk_smooth)
    sq = sq.clamp_min(SQ_MIN)  # > 0 for an all-zero row too (its scores are 0 either way)
    pos = torch.arange(lq, device=dev) + (kv_len - lq)
    kv = None if key_valid is None else key_valid.to(device=dev, dtype=torch.bool)
    out = torch.zeros(b, lq, hq, d, dtype=torch.float32, device=dev)
    ninf = torch.tensor(-math.inf, dtype=torch.float32, device=dev)
    n_tiles = n_blocks + -(-n_tail // bs)
    # packed blocks wholly before the window are skipped (the INT8 buffer's tiles never are)
    t0 = min(max(0, (kv_len - lq - int(window) + 1) // bs - n_sink // bs), n_blocks) if window else 0
    for grp in groups:
        heads = grp.heads.long().to(dev)
        if len(heads) == 0:
            continue
        S = n_splits.get(grp.bits, 1) if isinstance(n_splits, dict) else n_splits
        S = max(1, min(int(S), max(n_tiles - t0, 1)))
        tps = -(-max(n_tiles - t0, 1) // S)
        qh = (heads[:, None] * g + torch.arange(g, device=dev)[None, :]).reshape(-1)  # [H*g] query heads
        h = len(heads)
        qg = q8[:, qh].to(torch.float64).view(b, h, g * lq, d)
        sqg = sq[:, qh].reshape(b, h, g * lq)
        qbg = None if qb is None else qb[:, qh].reshape(b, h, g * lq)
        rpos = pos.repeat(g)  # row r = head_in_group * lq + i
        tiles = list(_group_tiles_ref(grp, k_tail, v_tail, n_tail, bs, n_sink))[t0:]
        parts = []
        for s0 in range(0, len(tiles), tps):
            m = torch.full((b, h, g * lq), -math.inf, dtype=torch.float32, device=dev)
            l = torch.zeros_like(m)
            acc = torch.zeros(b, h, g * lq, d, dtype=torch.float32, device=dev)
            share = tiles[s0:s0 + tps]
            n_packed = max(0, min(len(share), grp.n_blocks - t0 - s0))  # the share's packed tiles come first
            folded = folds_packed_tiles(grp.bits, d, bs, fold, getattr(grp, "k_bits", grp.bits))
            for i_tile, (j, k8, vc, vs, vz, kz) in enumerate(share):  # one online-softmax step per tile
                fold_step = folded and i_tile < n_packed
                n = k8.shape[2]
                mask = torch.ones(g * lq, n, dtype=torch.bool, device=dev)
                if causal:
                    mask &= j[None, :] <= rpos[:, None]
                if window:
                    mask &= j[None, :] > rpos[:, None] - window
                mask = mask.expand(b, h, g * lq, n)
                if kv is not None:
                    mask = mask & kv[:, None, None, j]
                s_int = qg @ k8.to(torch.float64).transpose(-1, -2)
                if fold_step:
                    zq = torch.zeros_like(s_int[..., :1]) if kz is None else qg @ kz.to(torch.float64)[..., None]
                    f, a, c = fold_logits_ref(s_int, zq, sqg, qbg, softcap)
                else:
                    f = s_int.to(torch.float32) * sqg[..., None]
                    if softcap:
                        if qbg is not None:
                            f = f + qbg[..., None]
                        f = _tanh_softcap_base2(f, float(softcap))
                    a, c = torch.ones_like(sqg), torch.zeros_like(sqg)
                f = torch.where(mask, f, ninf)
                m_new = torch.maximum(m, fma(f.amax(-1), a, c))
                m_safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
                alpha = torch.exp2(m - m_safe)
                x = fma(f, a[..., None], (c - m_safe)[..., None])  # INT8 tiles: a = 1, c = 0, exactly f - m
                p = torch.exp2(x) if softmax == "exact" else sas_exp2(x, thr2)
                l = fma(l, alpha, p.sum(-1))
                acc = fma(acc, alpha[..., None], pv_tile_ref(p, vc, vs, vz))
                m = m_new
            parts.append((m, l, acc))
        if len(parts) == 1:
            m, l, acc = parts[0]
        else:  # global max first, then weighted sums (the kernel sums chunks of shares: fp32 order differs)
            m = torch.stack([p_[0] for p_ in parts]).amax(0)
            mz = torch.where(m == -math.inf, torch.zeros_like(m), m)
            l = torch.zeros_like(parts[0][1])
            acc = torch.zeros_like(parts[0][2])
            for ms, ls, accs in parts:
                w = torch.exp2(ms - mz)
                l = l + ls * w
                acc = acc + accs * w[..., None]
        o = torch.where(l[..., None] > 0, acc / torch.where(l > 0, l, torch.ones_like(l))[..., None],
                        torch.zeros_like(acc))
        o = o * v_scale.float()[:, heads][:, :, None, :]
        out[:, :, qh] = o.view(b, h, g, lq, d).permute(0, 3, 1, 2, 4).reshape(b, lq, h * g, d)
    return out.to(q.dtype)


class _GroupRef:
    """Minimal PackedKV stand-in for the reference (no triton import here)."""

    def __init__(self, bits, heads, k, v, k_scale=None, k_zero=None, v_scale=None, v_zero=None, n_blocks=0,
                 k_bits=None):
        self.bits, self.heads, self.k, self.v, self.k_bits = bits, heads, k, v, k_bits or bits
        self.k_scale, self.k_zero, self.v_scale, self.v_zero, self.n_blocks = k_scale, k_zero, v_scale, v_zero, n_blocks


def int8_buffer_layout(L: int, bs: int, sink_blocks: int = 0, recent_blocks: int = 0) -> tuple[int, list]:
    """Where a TurboCache keeps ``L`` tokens: ``(n_blocks, INT8 buffer token ranges)``. The first
    ``sink_blocks·bs`` tokens stay INT8; after them, recent tokens stay INT8 until ``recent_blocks + 1``
    full blocks wait, then the oldest block is packed (so packing token by token or all at once agree)."""
    n_sink = sink_blocks * bs
    if L <= n_sink:
        return 0, [(0, L)]
    r = L - n_sink
    nb = (r - recent_blocks * bs) // bs if r >= (recent_blocks + 1) * bs else 0
    return nb, [(0, n_sink), (n_sink + nb * bs, L)]


def build_packed_cache_ref(k, v, n_prefill, head_bits, block_size, smooth_k=True, headroom=1.0, sink_blocks=0,
                           recent_blocks=0, rope_dims=0, rotate=False, qk_smooth=None, int8_k=False):
    """The packed state a TurboCache holds after storing ``k, v [b, Hk, L, d]`` (scales fixed by the first
    ``n_prefill`` tokens): ``(groups, k_tail [b,Hk,C,d], v_tail [b,Hk,d,C], n_tail, k_scale, v_scale, k_mean)``
    with ``C = (sink_blocks + recent_blocks + 1)·BS`` INT8 slots — the arguments of ``turbo_decode_ref``
    (with ``n_sink = sink_blocks·BS``; blocks are independent, so packing all at once equals packing them one
    by one as the cache does). ``rotate``: a rotated layer (``rotate_qk``), K stored as
    ``rotate_keys_ref(k, qk_smooth)`` (scales and mean: ``kv_universal_scales_ref(rotate=True)``). ``int8_k``: packed
    groups keep K's INT8 codes (``PackedKV.k_bits`` 8; ``TurboConfig.packed_k_bits``)."""
    b, hk, L, d = k.shape
    bs = block_size
    mean, ks, vs = kv_universal_scales_ref(k[:, :, :n_prefill], v[:, :, :n_prefill], smooth_k, headroom, rope_dims,
                                           rotate, qk_smooth)
    k8 = quantize_int8_universal_ref(rotate_keys_ref(k, qk_smooth) if rotate else k, ks, mean)
    v8 = quantize_int8_universal_ref(v, vs)
    nb, ranges = int8_buffer_layout(L, bs, sink_blocks, recent_blocks)
    p0 = sink_blocks * bs if nb else 0  # first packed token
    groups = []
    for bits in (8, 4, 2):
        heads = [i for i, hb in enumerate(head_bits) if hb == bits]
        if not heads:
            continue
        hi = torch.tensor(heads, dtype=torch.long, device=k.device)
        h = len(heads)
        kb = k8[:, hi, p0:p0 + nb * bs].reshape(b, h, nb, bs, d)
        vb = v8[:, hi, p0:p0 + nb * bs].reshape(b, h, nb, bs, d).transpose(-1, -2)
        if bits == 8:
            groups.append(_GroupRef(8, hi.int(), kb, vb, n_blocks=nb))
            continue
        vp, vsc, vz = pack_blocks_ref(vb.reshape(-1, d, bs), bits, 0)  # V: per token
        vp, vsc, vz = vp.view(b, h, nb, *vp.shape[1:]), vsc.view(b, h, nb, bs), vz.view(b, h, nb, bs)
        if int8_k:
            groups.append(_GroupRef(bits, hi.int(), kb, vp, None, None, vsc, vz, n_blocks=nb, k_bits=8))
            continue
        kp, ksc, kz = pack_blocks_ref(kb.reshape(-1, bs, d), bits, 0)
        groups.append(_GroupRef(bits, hi.int(), kp.view(b, h, nb, *kp.shape[1:]), vp, ksc.view(b, h, nb, d),
                                kz.view(b, h, nb, d), vsc, vz, n_blocks=nb))
    cap = (sink_blocks + recent_blocks + 1) * bs
    k_tail = torch.zeros(b, hk, cap, d, dtype=torch.int8, device=k.device)
    v_tail = torch.zeros(b, hk, d, cap, dtype=torch.int8, device=k.device)
    nt = 0
    for t0, t1 in ranges:
        k_tail[:, :, nt:nt + t1 - t0] = k8[:, :, t0:t1]
        v_tail[:, :, :, nt:nt + t1 - t0] = v8[:, :, t0:t1].transpose(-1, -2)
        nt += t1 - t0
    return groups, k_tail, v_tail, nt, ks, vs, mean
