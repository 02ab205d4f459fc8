"""Progressive KV-cache packing: INT8 -> per-block INT4/INT2, K per channel, V per token (TurboAttention "FlashQ").

TurboAttention (Kang et al., 2024) §3.1, eq. 7-8: a KV cache already quantized to INT8 with a per-channel
"universal" scale (step 1, :func:`quantize_int8`) is re-quantized, one block of ``BS`` tokens at a time,
asymmetrically, in integer arithmetic (step 2, :func:`pack_blocks`), per group ``g`` = a channel of K (min/max
over the block's tokens) or a token of V (min/max over its channels)::

    zero      = min over the group's INT8 codes
    scale_int = max(1, ceil((max - min) / (2**bits - 1)))
    code      = min(round((x8 - zero) / scale_int), 2**bits - 1, (127 - zero) // scale_int)
                (round half up, integers only)

and restored to INT8 by ``x8' = code * scale_int + zero`` (:func:`_unpack_tile`). The third bound of the code
keeps ``x8'`` within [-127, 127] without a clamp (rounding up near 127 could overshoot by up to scale_int / 2;
such a code is rounded down instead, an error below one step, only in groups whose range reaches 127). So the
restore is exactly linear in the code, which the decode kernel uses: it never restores INT8 tiles but folds
K's ``scale_int``/``zero`` into the query and V's into the probabilities and the output (``decode.py``).
bits=8 heads keep the INT8 codes unchanged. ``k_bits=8`` groups (q/k-norm families, issue 23) keep K's INT8 codes
and pack only V: K's 4 bits carried most of Gemma-3's int4 loss (decode KL 5.49x -> 3.49x the bf16 floor).

Why V per token (KIVI's choice; the paper's text says channel-wise): measured on SmolLM2-135M-Instruct (CPU,
reference math, decode-path teacher-forced KL vs fp32 over 3 GSM8K texts, int4 everywhere, P scale per
tile): V per channel 2.85e-2, V per token 1.72e-2 nats; with K kept at 8 bits, 4-bit V per token costs
4.8e-3. K stays per channel (its outlier channels are what per-channel groups absorb).

DESIGN.md puts pack/unpack in ``quant.py``; we split it out (one job per file: ``quant.py`` quantizes
attention operands for prefill, this module owns the packed cache *format*).

Format (one bit-width group of KV heads of one layer, ``b`` batch, ``H`` heads of the group, ``NB`` block
capacity, ``BS`` block size, ``D`` head dim, ``PB = 8 // bits`` codes per byte):

  k       ``[b, H, NB, BS, D // PB]``  uint8   K packed along ``D`` (tile ``[tokens, D]``, ``D`` contiguous)
  v       ``[b, H, NB, D, BS // PB]``  uint8   V transposed, packed along tokens (tile ``[D, tokens]``)
  k_scale, k_zero  ``[b, H, NB, D]``   int8    per block and channel (absent for bits=8 and k_bits=8)
  v_sz    ``[b, H, NB, 2, BS]``      int8    per token: scale row, then zero row (absent for bits=8);
                                              ``v_scale`` / ``v_zero`` are its views ``[b, H, NB, BS]``

Blocks are contiguous (block-major), so a block tile is one contiguous load and the buffers grow by
appending along ``NB``. A block's V scales and zeros are one 2·BS-byte row, so the decode kernel reads them
in one load of 4 bytes per thread, which Triton's pipeliner prefetches with the codes (two separate
BS-byte rows are 2-byte loads, too narrow for cp.async: the decode loop then waited on them every block).
For bits=8 ``k``/``v`` are int8 with ``PB = 1``; for ``k_bits=8`` ``k`` is (``[b, H, NB, BS, D]`` int8).

Byte layout ("interleaved"): byte ``j`` of a row holds codes ``PB*j + p`` in bits ``[bits*p, bits*p + bits)``,
``p = 0..PB-1``. Unpacking a row of bytes in registers is a few shifts/masks and ``tl.join`` + ``tl.reshape``
(no gathers); the same layout serves K (packed along channels) and V (packed along tokens).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from .arena import carve, lazy_view
from .interpreter import use_triton
from .quant import _multiple, _tile_rows, _to_int8_half_away, _vec

__all__ = ["PackedKV", "quantize_int8", "pack_blocks", "unpack_blocks", "kv_bytes_per_token", "keeps_int8_k"]


# ----------------------------------------------------------------------------------------- Triton
@triton.jit
def _unpack_tile(b_p, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr):
    """[R, C*BITS//8] packed bytes (any int dtype) -> [R, C] int32 codes, interleaved layout."""
    b_p = b_p.to(tl.int32) & 255
    if BITS == 4:
        b_c = tl.reshape(tl.join(b_p & 15, b_p >> 4), (R, C))
    elif BITS == 2:
        b_c = tl.reshape(
            tl.join(tl.join(b_p & 3, (b_p >> 4) & 3), tl.join((b_p >> 2) & 3, b_p >> 6)), (R, C)
        )
    else:
        b_c = b_p
    return b_c


@triton.jit
def _dequant_tile(b_c, b_scale, b_zero, AXIS: tl.constexpr):
    """codes [R, C] -> INT8 values: code * scale + zero (within [-127, 127] by construction; the clamp is
    kept as a guard); channels along rows (AXIS=1) or columns (AXIS=0), i.e. scale/zero are [C] for AXIS=0
    and [R] for AXIS=1."""
    if AXIS == 0:
        b_x = b_c * b_scale[None, :] + b_zero[None, :]
    else:
        b_x = b_c * b_scale[:, None] + b_zero[:, None]
    return tl.minimum(tl.maximum(b_x, -127), 127).to(tl.int8)


@triton.jit
def _pack_tile(b_x, m_x, BR: tl.constexpr, BC: tl.constexpr, BITS: tl.constexpr, AXIS: tl.constexpr):
    """Eq. 7 on one tile: ``b_x [BR, BC]`` int32 INT8 codes (``m_x``: the real entries; padded ones are kept out
    of the min/max) -> ``(packed [BR, BC*BITS//8] int32 bytes, scale_int, zero)``, one group per column (AXIS=0,
    scale/zero ``[BC]``) or per row (AXIS=1, ``[BR]``). Shared by ``_pack_kernel`` and the fused store
    (``store._store_kv_kernel``): one copy of the rounding."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    PB: tl.constexpr = 8 // BITS
    BCB: tl.constexpr = BC // PB
    b_min = tl.min(tl.where(m_x, b_x, 127), axis=AXIS)
    b_max = tl.max(tl.where(m_x, b_x, -127), axis=AXIS)
    b_scale = tl.maximum((b_max - b_min + QMAX - 1) // QMAX, 1)
    if AXIS == 0:
        b_n = b_x - b_min[None, :]
        b_sc = b_scale[None, :]
        b_top = ((127 - b_min) // b_scale)[None, :]
    else:
        b_n = b_x - b_min[:, None]
        b_sc = b_scale[:, None]
        b_top = ((127 - b_min) // b_scale)[:, None]
    # round half up of b_n / b_sc (b_n >= 0), in integers; never past 127 when restored (no clamp needed)
    b_c = tl.minimum(tl.minimum((2 * b_n + b_sc) // (2 * b_sc), QMAX), b_top)
    if BITS == 4:
        b_c0, b_c1 = tl.split(tl.reshape(b_c, (BR, BCB, 2)))
        b_p = b_c0 | (b_c1 << 4)
    else:
        b_a, b_b = tl.split(tl.reshape(b_c, (BR, BCB, 2, 2)))
        b_c0, b_c2 = tl.split(b_a)
        b_c1, b_c3 = tl.split(b_b)
        b_p = b_c0 | (b_c1 << 2) | (b_c2 << 4) | (b_c3 << 6)
    return b_p, b_scale, b_min


@triton.jit
def _pack_kernel(
    x, p, s, z,
    stride_x0, stride_x1, stride_x2, stride_xr, stride_xc,
    stride_p0, stride_p1, stride_p2, stride_pr,
    stride_s0, stride_s1, stride_s2, stride_z0, stride_z1, stride_z2,
    R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    BITS: tl.constexpr, AXIS: tl.constexpr,
):
    """grid (N2, N1, N0): block tile ``[i0, i1, i2]`` of x ``[N0, N1, N2, R, C]`` int8 (any strides) -> its
    packed ``[R, C*BITS//8]`` uint8 bytes in p (rows ``stride_pr`` apart) + scale/zero per group in s, z.

    AXIS=0: the groups are columns (K tile [tokens, D]: per channel; V tile [D, tokens]: per token);
    AXIS=1: the groups are rows. BR/BC are R/C rounded up to powers of two (head dims 80, 96); padded
    entries are kept out of the min/max.
    """
    i_2, i_1, i_0 = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    PB: tl.constexpr = 8 // BITS
    CB: tl.constexpr = C // PB
    BCB: tl.constexpr = BC // PB
    o_r = tl.arange(0, BR)
    o_c = tl.arange(0, BC)
    m_x = (o_r[:, None] < R) & (o_c[None, :] < C)
    b_x = tl.load(x + i_0 * stride_x0 + i_1 * stride_x1 + i_2 * stride_x2 + o_r[:, None] * stride_xr
                  + o_c[None, :] * stride_xc, mask=m_x, other=0).to(tl.int32)
    b_p, b_scale, b_min = _pack_tile(b_x, m_x, BR, BC, BITS, AXIS)
    o_cb = tl.arange(0, BCB)
    tl.store(p + i_0 * stride_p0 + i_1 * stride_p1 + i_2 * stride_p2 + o_r[:, None] * stride_pr + o_cb[None, :],
             b_p.to(tl.uint8), mask=(o_r[:, None] < R) & (o_cb[None, :] < CB))
    NCH: tl.constexpr = C if AXIS == 0 else R
    BCH: tl.constexpr = BC if AXIS == 0 else BR
    o_ch = tl.arange(0, BCH)
    tl.store(s + i_0 * stride_s0 + i_1 * stride_s1 + i_2 * stride_s2 + o_ch, b_scale.to(tl.int8), mask=o_ch < NCH)
    tl.store(z + i_0 * stride_z0 + i_1 * stride_z1 + i_2 * stride_z2 + o_ch, b_min.to(tl.int8), mask=o_ch < NCH)


@triton.jit
def _unpack_kernel(
    p, s, z, x,
    R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    BITS: tl.constexpr, AXIS: tl.constexpr,
):
    """Inverse of _pack_kernel (up to the quantization): packed [R, C*BITS//8] -> INT8 [R, C]."""
    i_n = tl.program_id(0).to(tl.int64)
    CB: tl.constexpr = C * BITS // 8
    BCB: tl.constexpr = BC * BITS // 8
    NCH: tl.constexpr = C if AXIS == 0 else R
    BCH: tl.constexpr = BC if AXIS == 0 else BR
    o_r = tl.arange(0, BR)
    o_c = tl.arange(0, BC)
    o_cb = tl.arange(0, BCB)
    o_ch = tl.arange(0, BCH)
    b_p = tl.load(p + i_n * (R * CB) + o_r[:, None] * CB + o_cb[None, :],
                  mask=(o_r[:, None] < R) & (o_cb[None, :] < CB), other=0)
    b_s = tl.load(s + i_n * NCH + o_ch, mask=o_ch < NCH, other=0).to(tl.int32)
    b_z = tl.load(z + i_n * NCH + o_ch, mask=o_ch < NCH, other=0).to(tl.int32)
    b_x = _dequant_tile(_unpack_tile(b_p, BR, BC, BITS), b_s, b_z, AXIS)
    tl.store(x + i_n * (R * C) + o_r[:, None] * C + o_c[None, :], b_x,
             mask=(o_r[:, None] < R) & (o_c[None, :] < C))


@triton.jit
def _quantize_universal(b_x, b_scale, b_mean, HAS_MEAN: tl.constexpr):
    """INT8 codes of a tile ``b_x [R, D]`` (any float dtype) with the universal per-channel ``b_scale`` (and
    ``b_mean``) ``[D]`` fp32: ``clamp(round_half_away((x - mean) / scale), ±127)``, the division correctly
    rounded (``div_rn``, as torch divides): the bits of ``reference.quantize_int8_universal_ref``. The
    quotient is clamped to ±128 first (the same codes) and a NaN made 0, so that the float -> int32 conversion
    never goes out of range (the GPU's saturates, the interpreter's wraps); a non-finite input (inf, NaN) gives
    code 0 (one bad element must not become ±127 in every later dot product). Shared by
    ``_quantize_int8_kernel`` and the decode-step store (``store._store_tokens_kernel``)."""
    b_x = b_x.to(tl.float32)
    b_fin = tl.abs(b_x) < float("inf")  # a non-finite input is stored as code 0 (and counted by the store)
    if HAS_MEAN:
        b_x = b_x - b_mean[None, :]
    b_q = tl.math.div_rn(b_x, b_scale[None, :])
    b_q = tl.clamp(tl.where(b_fin & (b_q == b_q), b_q, 0.0), -128.0, 128.0)
    return _to_int8_half_away(b_q, 1.0)  # inv 1.0: x * 1.0 is exact


@triton.jit
def _finite(b_x):
    """Elements that are neither inf nor NaN (NaN compares false)."""
    return tl.abs(b_x.to(tl.float32)) < float("inf")


@triton.jit
def _bad_rows(b_k, b_v, m):
    """Number of rows (token vectors) of the [R, D] tiles ``b_k``, ``b_v`` (``m``: the real entries) with a
    non-finite element in K or V (int32 scalar)."""
    b_bad = m & ((_finite(b_k) == 0) | (_finite(b_v) == 0))
    return tl.sum(tl.max(b_bad.to(tl.int32), 1), 0)


@triton.jit
def _universal_scales(sk, mk, sv, o_s, m_d, HAS_MEAN: tl.constexpr):
    """A (row, head)'s universal K scale, K mean (the K scale when there is none) and V scale at offsets ``o_s``."""
    b_sk = tl.load(sk + o_s, mask=m_d, other=1.0)
    b_sv = tl.load(sv + o_s, mask=m_d, other=1.0)
    b_mk = b_sk
    if HAS_MEAN:
        b_mk = tl.load(mk + o_s, mask=m_d, other=0.0)
    return b_sk, b_mk, b_sv


@triton.jit(do_not_specialize=["T", "stride_xb", "stride_xh", "stride_xt"])
def _quantize_int8_kernel(
    x, s, m, x8, T, H,
    stride_xb, stride_xh, stride_xt, stride_xd,
    HAS_MEAN: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, VEC: tl.constexpr,
):
    """grid (cdiv(T, BT) * b * H,): ``BT`` tokens of one (batch, head) of x ``[b, H, T, D]`` (any strides; those
    over b, H, T multiples of VEC) -> x8 ``[b, H, T, D]`` int8 (contiguous); s, m ``[b, H, D]`` fp32 contiguous."""
    n_t = tl.cdiv(T, BT)
    i_t, i_bh = tl.program_id(0) % n_t, tl.program_id(0) // n_t  # 1-D grid: b * H may pass 65535
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    stride_xb, stride_xh, stride_xt = _multiple(stride_xb, VEC), _multiple(stride_xh, VEC), _multiple(stride_xt, VEC)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_x = (o_t < T)[:, None] & m_d[None, :]
    o_s = i_bh.to(tl.int64) * D + o_d
    b_s = tl.load(s + o_s, mask=m_d, other=1.0)
    b_m = b_s
    if HAS_MEAN:
        b_m = tl.load(m + o_s, mask=m_d, other=0.0)
    b_x = tl.load(x + i_b * stride_xb + i_h * stride_xh + o_t[:, None].to(tl.int64) * stride_xt
                  + o_d[None, :] * stride_xd, mask=m_x, other=0.0)
    o_x8 = (i_bh.to(tl.int64) * T + o_t[:, None]) * D + o_d[None, :]
    tl.store(x8 + o_x8, _quantize_universal(b_x, b_s, b_m, HAS_MEAN=HAS_MEAN), mask=m_x)


# ----------------------------------------------------------------------------------------- public
def quantize_int8(x: torch.Tensor, scale: torch.Tensor, mean: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FlashQ step 1 with a fixed ("universal") per-channel scale; outliers clamp to +-127.

    Args:
        x: ``[b, H, T, D]`` float keys or values (any strides).
        scale: ``[b, H, D]`` fp32 per-channel scale (amax / 127 of the first prefill).
        mean: optional ``[b, H, D]`` fp32 channel mean subtracted first (K smoothing).
    Returns:
        ``[b, H, T, D]`` int8 (contiguous) ``clamp(round((x - mean) / scale), -127, 127)``, rounding half away
        from zero. CUDA (or the interpreter): one Triton pass, x read once and the codes written once; CPU
        tensors without ``TRITON_INTERPRET=1`` take the PyTorch twin ``reference.quantize_int8_universal_ref``
        (the same bits: tests/kernels/test_pack.py).
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [b, H, T, D]; got shape {tuple(x.shape)}")
    for name, t in (("scale", scale), ("mean", mean)):
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 (the universal scales' dtype), got {t.dtype}")
    if not use_triton(x.device):
        from .reference import quantize_int8_universal_ref

        return quantize_int8_universal_ref(x, scale, mean)
    b, H, T, D = x.shape
    x8 = torch.empty(b, H, T, D, dtype=torch.int8, device=x.device)
    if x8.numel():
        s = scale.reshape(b, H, D).contiguous()
        m = s if mean is None else mean.reshape(b, H, D).contiguous()
        bt = _tile_rows(D)
        _quantize_int8_kernel[(triton.cdiv(T, bt) * b * H,)](
            x, s, m, x8, T, H, *x.stride(), HAS_MEAN=mean is not None, D=D, BD=triton.next_power_of_2(D), BT=bt,
            VEC=_vec(x), num_warps=4, enable_fp_fusion=False,
        )
    return x8


def _check_blocks(x8: torch.Tensor, bits: int) -> None:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits={bits} is not supported; choose 2, 4 or 8")
    if x8.dtype != torch.int8 or not 3 <= x8.dim() <= 5:
        raise ValueError(f"expected int8 block tiles [*lead, R, C] (1 to 3 leading dims), got {x8.dtype} "
                         f"{tuple(x8.shape)}")
    if x8.shape[-1] % (8 // bits):
        raise ValueError(f"the packed axis ({x8.shape[-1]}) must be a multiple of {8 // bits} for {bits}-bit codes")


def _lead_strides(t: torch.Tensor, n_lead: int) -> list:
    """Strides of the ``n_lead`` leading dims of ``t``, padded in front with 0 to three dims (the kernel's)."""
    return [0] * (3 - n_lead) + list(t.stride()[:n_lead])


def pack_blocks(x8: torch.Tensor, bits: int, axis: int, out: Optional[tuple] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack block tiles of INT8 codes to ``bits`` (2 or 4) along their last axis.

    Args:
        x8: ``[*lead, R, C]`` int8 with 1 to 3 leading dims, any strides (``PackedKV.append`` hands over
            ``[b, H, n, BS, D]`` views of the quantized prompt: no copy). K tiles: ``[..., BS, D]``, V tiles:
            ``[..., D, BS]`` (transposed), both with ``axis=0`` (groups = columns: K per channel, V per token).
        bits: 2 or 4.
        axis: the axis reduced for each group's min/max (0: one group per column, 1: per row).
        out: optional ``(packed, scale_int, zero)`` of the returned shapes and dtypes to write into: any
            strides over ``lead``, last dim contiguous (``PackedKV.append`` passes slices of its buffers).
    Returns:
        ``packed [*lead, R, C*bits//8] uint8``, ``scale_int [*lead, NCH] int8``, ``zero [*lead, NCH] int8``
        with ``NCH = C if axis == 0 else R`` (the tensors of ``out`` when given).

    CPU tensors without ``TRITON_INTERPRET=1`` take the PyTorch twin (``reference.pack_blocks_ref``).
    """
    _check_blocks(x8, bits)
    if bits == 8:
        raise ValueError("bits=8 blocks are stored unpacked; pack_blocks takes bits 2 or 4")
    *lead, R, C = x8.shape
    nch = C if axis == 0 else R
    shapes = ((*lead, R, C * bits // 8), (*lead, nch), (*lead, nch))
    dtypes = (torch.uint8, torch.int8, torch.int8)
    if out is not None:
        for name, t, shape, dt in zip(("packed", "scale_int", "zero"), out, shapes, dtypes):
            if tuple(t.shape) != shape or t.dtype != dt or t.stride(-1) != 1:
                raise ValueError(f"out {name} must be {dt} {shape} with its last dim contiguous; got {t.dtype} "
                                 f"{tuple(t.shape)} strides {t.stride()}")
    if not use_triton(x8.device):
        from .reference import pack_blocks_ref

        res = [r.view(shape) for r, shape in zip(pack_blocks_ref(x8.reshape(-1, R, C), bits, axis), shapes)]
        if out is None:
            return tuple(res)
        for o, r in zip(out, res):
            o.copy_(r)
        return out
    p, s, z = out if out is not None else (torch.empty(sh, dtype=dt, device=x8.device)
                                           for sh, dt in zip(shapes, dtypes))
    n0, n1, n2 = [1] * (3 - len(lead)) + lead
    if max(n0, n1) > 65535:
        raise ValueError(f"leading dims {tuple(lead)}: all but the last must be <= 65535 (grid y/z); merge them")
    if p.numel():
        k = len(lead)
        _pack_kernel[(n2, n1, n0)](
            x8, p, s, z, *_lead_strides(x8, k), *x8.stride()[-2:], *_lead_strides(p, k), p.stride(-2),
            *_lead_strides(s, k), *_lead_strides(z, k), R=R, C=C, BR=triton.next_power_of_2(R),
            BC=triton.next_power_of_2(C), BITS=bits, AXIS=axis,
        )
    return p, s, z


def unpack_blocks(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    """Inverse of :func:`pack_blocks`: ``[N, R, C*bits//8]`` uint8 -> ``[N, R, C]`` int8 (dequantized codes)."""
    if not use_triton(p.device):
        from .reference import unpack_blocks_ref

        return unpack_blocks_ref(p, s, z, bits, axis)
    N, R, CB = p.shape
    C = CB * 8 // bits
    x = torch.empty(N, R, C, dtype=torch.int8, device=p.device)
    if N:
        _unpack_kernel[(N,)](p.contiguous(), s.contiguous(), z.contiguous(), x, R=R, C=C,
                             BR=triton.next_power_of_2(R), BC=triton.next_power_of_2(C), BITS=bits, AXIS=axis)
    return x


def kv_bytes_per_token(head_dim: int, bits: int, block_size: int, k_bits: Optional[int] = None) -> float:
    """Bytes per token and KV head of a full packed block, K and V together, scales/zeros included (``k_bits``:
    K's bits when they differ from V's ``bits``)."""
    k_bits = k_bits or bits
    data = head_dim * (bits + k_bits) / 8
    # int8 scale_int + zero: K per block and channel, V per token
    meta = (0 if k_bits == 8 else 2 * head_dim / block_size) + (0 if bits == 8 else 2)
    return data + meta


def keeps_int8_k(groups) -> bool:
    """Whether a layer's packed (2/4-bit) groups keep K's INT8 codes (``PackedKV.k_bits`` 8): one constexpr of the
    store and decode launches. ValueError when its packed groups disagree."""
    widths = {g.k_bits == 8 for g in groups if g.bits != 8}
    if len(widths) > 1:
        raise ValueError("a layer's packed groups must all keep INT8 K (k_bits=8) or none; got "
                         f"{[(g.bits, g.k_bits) for g in groups]}")
    return widths == {True}


# ----------------------------------------------------------------------------------------- storage
def _torch_alloc(device) -> Callable:
    """``alloc(name, shape, dtype)`` for ``PackedKV``: a new ``torch.empty`` on ``device``."""
    return lambda name, shape, dtype: torch.empty(shape, dtype=dtype, device=device)


#: the least a packed group grows by (blocks) when a store needs room (``PackedKV.reserve``)
GROW_MIN_BLOCKS = 4


class PackedKV:
    """Packed full blocks of one bit-width group of KV heads of one layer (format in the module doc); ``bits`` is
    V's width and, unless ``k_bits`` says 8 (K blocks kept INT8), K's.

    ``heads`` ``[H]`` int32 holds the layer's KV-head index of each slot; ``n_blocks`` full blocks are
    valid out of the allocated capacity ``k.shape[2]``, which grows by a quarter (``reserve``). V's per-token
    scales and zeros live in ``v_sz``; separate ``v_scale``/``v_zero`` passed to the constructor are stacked into it.
    """

    TENSORS = ("k", "v", "k_scale", "k_zero", "v_sz")

    def __getattr__(self, name: str):
        return lazy_view(self, name)  # a group a replayed first prefill made: its views on first use

    def __init__(self, bits: int, heads: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_scale: Optional[torch.Tensor] = None, k_zero: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None, v_zero: Optional[torch.Tensor] = None, n_blocks: int = 0,
                 v_sz: Optional[torch.Tensor] = None, k_bits: Optional[int] = None):
        if v_sz is None and v_scale is not None:
            v_sz = torch.stack((v_scale, v_zero), 3)
        self.bits, self.heads, self.k, self.v = bits, heads, k, v
        self.k_bits = k_bits or bits
        self.k_scale, self.k_zero, self.v_sz, self.n_blocks = k_scale, k_zero, v_sz, n_blocks
        self.flat: Optional[torch.Tensor] = None  # the byte buffer the tensors are views of (empty / reserve)

    def __repr__(self) -> str:
        return (f"PackedKV(bits={self.bits}, k_bits={self.k_bits}, heads={self.heads.tolist()}, "
                f"n_blocks={self.n_blocks}, "
                f"capacity={self.capacity}, k={tuple(self.k.shape)})")

    @property
    def v_scale(self) -> Optional[torch.Tensor]:
        """``[b, H, NB, BS]`` int8 per-token V scales (a view of ``v_sz``)."""
        return None if self.v_sz is None else self.v_sz[:, :, :, 0]

    @property
    def v_zero(self) -> Optional[torch.Tensor]:
        """``[b, H, NB, BS]`` int8 per-token V zeros (a view of ``v_sz``)."""
        return None if self.v_sz is None else self.v_sz[:, :, :, 1]

    @classmethod
    def empty(cls, bits: int, heads: torch.Tensor, batch: int, head_dim: int, block_size: int,
              device, capacity: int = 1, alloc: Optional[Callable] = None, one_buffer: bool = True,
              k_bits: Optional[int] = None) -> "PackedKV":
        """No blocks, room for ``capacity``; every tensor is a view of one byte buffer (``arena.carve``; separate
        tensors with ``one_buffer=False``), made by ``alloc(name, shape, dtype)`` (default ``torch.empty`` on
        ``device``)."""
        if heads.dtype != torch.int32 or heads.device != (device if isinstance(device, torch.device)
                                                            else torch.device(device)):
            heads = heads.to(device=device, dtype=torch.int32)
        g = cls(bits=bits, heads=heads, k=None, v=None, k_bits=k_bits)
        g._carve(batch, heads.shape[0], capacity, block_size, head_dim, alloc or _torch_alloc(device), one_buffer)
        return g

    def _specs(self, batch: int, H: int, capacity: int, BS: int, D: int) -> tuple:
        def dt(bits: int):
            return torch.int8 if bits == 8 else torch.uint8

        specs = (("k", (batch, H, capacity, BS, D * self.k_bits // 8), dt(self.k_bits)),
                 ("v", (batch, H, capacity, D, BS * self.bits // 8), dt(self.bits)))
        meta = (("k_scale", (D,)), ("k_zero", (D,))) if self.k_bits != 8 else ()
        meta += (("v_sz", (2, BS)),) if self.bits != 8 else ()
        return specs + tuple((name, (batch, H, capacity, *shape), torch.int8) for name, shape in meta)

    def _carve(self, batch: int, H: int, capacity: int, BS: int, D: int, alloc: Optional[Callable] = None,
               one_buffer: Optional[bool] = None) -> None:
        """(Re)make the tensors for ``capacity`` blocks: one buffer unless ``one_buffer`` is False (None: as now)."""
        if one_buffer is None:
            one_buffer = self.k is None or self.flat is not None
        alloc = alloc or _torch_alloc(self.k.device)
        views = carve(self._specs(batch, H, capacity, BS, D), alloc, one_buffer)
        self.flat = views.pop("flat")
        for name, t in views.items():
            setattr(self, name, t)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def head_dim(self) -> int:
        return self.k.shape[4] * 8 // self.k_bits

    def _tensors(self):
        return [(n, getattr(self, n)) for n in self.TENSORS if getattr(self, n) is not None]

    def reserve(self, n_blocks: int) -> None:
        """Grow the capacity to hold ``n_blocks``, by a quarter (at least ``GROW_MIN_BLOCKS``): one new buffer, the
        valid blocks copied once. Not doubling: after a 32k prompt (stored at its exact size) the first packed decode
        block would double the packed memory; a quarter keeps the copies amortised O(1) per block."""
        if n_blocks <= self.capacity:
            return
        cap = max(n_blocks, self.capacity + max(self.capacity // 4, GROW_MIN_BLOCKS))
        old = self._tensors()
        b, H, _, BS = self.k.shape[:4]
        D = self.head_dim
        self._carve(b, H, cap, BS, D)
        for name, t in old:
            getattr(self, name)[:, :, : self.n_blocks] = t[:, :, : self.n_blocks]

    def append(self, k8: torch.Tensor, v8: torch.Tensor) -> None:
        """Append full blocks of INT8 codes (never re-quantizes stored blocks).

        Args:
            k8: ``[b, H, n*BS, D]`` int8 keys of this group's heads (universal scale, smoothed).
            v8: ``[b, H, n*BS, D]`` int8 values.
        """
        b, H, T, D = k8.shape
        BS = self.k.shape[3]
        n = T // BS
        if n == 0:
            return
        self.reserve(self.n_blocks + n)
        sl = slice(self.n_blocks, self.n_blocks + n)
        kb = k8.reshape(b, H, n, BS, D)  # views (k8/v8: token slices of [b, H, T, D] codes)
        vb = v8.reshape(b, H, n, BS, D).transpose(-1, -2)  # [b, H, n, D, BS]
        # strided views in, buffer slices out: no copy of the codes on the way
        if self.k_bits == 8:
            self.k[:, :, sl] = kb
        else:
            pack_blocks(kb, self.k_bits, 0, out=(self.k[:, :, sl], self.k_scale[:, :, sl], self.k_zero[:, :, sl]))
        if self.bits == 8:
            self.v[:, :, sl] = vb
        else:
            pack_blocks(vb, self.bits, 0, out=(self.v[:, :, sl], self.v_scale[:, :, sl], self.v_zero[:, :, sl]))
        self.n_blocks += n

    def unpack_block(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``i`` back to INT8: ``(k8 [b, H, BS, D], v8 [b, H, BS, D])`` (used by ``crop``)."""
        k, v = self.k[:, :, i], self.v[:, :, i]
        b, H = k.shape[:2]
        if self.k_bits == 8:
            k8 = k.clone()
        else:
            k8 = unpack_blocks(k.reshape(b * H, *k.shape[2:]), self.k_scale[:, :, i].reshape(b * H, -1),
                               self.k_zero[:, :, i].reshape(b * H, -1), self.k_bits, axis=0).view(b, H, k.shape[2], -1)
        if self.bits == 8:
            return k8, v.transpose(-1, -2).clone()
        v8 = unpack_blocks(v.reshape(b * H, *v.shape[2:]), self.v_scale[:, :, i].reshape(b * H, -1),
                           self.v_zero[:, :, i].reshape(b * H, -1), self.bits, axis=0)
        return k8, v8.view(b, H, *v8.shape[1:]).transpose(-1, -2)

    def truncate(self, n_blocks: int) -> None:
        self.n_blocks = min(self.n_blocks, n_blocks)

    def index_batch(self, idx: torch.Tensor) -> None:
        """Keep/reorder/repeat batch rows: ``t = t[idx]`` for every buffer (beam search, batch select)."""
        old = self._tensors()
        idx = idx.to(self.k.device)
        b, H, cap, BS = self.k.shape[:4]
        D = self.head_dim
        self._carve(idx.numel(), H, cap, BS, D)
        for name, t in old:
            torch.index_select(t, 0, idx, out=getattr(self, name))

    def used_bytes(self) -> int:
        """Bytes of the ``n_blocks`` valid blocks (data + scales/zeros)."""
        return sum(t[:, :, : self.n_blocks].numel() * t.element_size() for _, t in self._tensors())

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self._tensors())
