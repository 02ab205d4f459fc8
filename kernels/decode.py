"""Decode attention over the packed KV cache: a query chunk against INT4/INT2/INT8 blocks + the INT8 tail.

What it implements:
- TurboAttention (Kang et al., 2024) §3.1 eq. 8 / §3.3: packed INT4/INT2 blocks are turned back into INT8
  in registers by integer arithmetic (``code * scale_int + zero``), then INT8 x INT8 -> INT32 dots run
  (INT-FlashAttention) for Q·Kᵀ and P·V; the INT8 tail buffer (< BS tokens, universal scale) is read in
  the same pass. §4 SAS (sparse activated softmax) as an option.
- P quantized per row of each tile relative to the tile's own max (not INT-FlashAttention's static
  1/127, which rounds every key more than ~5.5 nats below the running max to 0): ``w8 = round(127 w / max w)``
  with ``w = p`` for INT8 tiles and ``w = p·s_t`` for packed V (its per-token scale rides in P, its zero in
  ``Σ_t p·z_t``); ``P·V = (w8·code)·max w/127 + Σ p·z``, and ``l = Σ p`` in fp32. About halves the decode-path
  KL vs the static scale on SmolLM2 (PERF_NOTES: decode round 2, decode launch defaults).
- FlashAttention-3's K-major rule for 8-bit dots: K tiles are ``[tokens, D]`` (D contiguous), V tiles
  ``[D, tokens]`` (tokens contiguous), so both dots read their reduction axis contiguously.
- GQA packing: the G query heads of one KV head and the chunk's Lq queries form the M rows of one
  program (row ``r = head_in_group * Lq + query``), so K/V tiles are read once per KV head.
- Sliding window: tiles that no query of the chunk can see are not visited (``first_visible_tile``).
- Lean Attention's split of the context over the GPU: the tiles of each (batch, KV head, M tile) are cut
  into equal contiguous shares so that the grid is about ``waves x #SMs`` programs, at most one resident
  wave (``RESIDENT_PER_SM``); both bit groups of ``mixed`` share the launch; partial ``(m, l, O)``
  triples merge by the associative rescale. One launch by default: every share writes its partial and
  bumps an arrival counter, and the share that arrives last merges the tile (no spin-waiting); a second
  merge kernel is the measured alternative (``merge="kernel"``). With one share the output is written
  directly. (Split-K per (batch, head); no cross-(batch, head) shares.)
- Speed (Hopper, decode is bandwidth-bound): packed heads are never restored to INT8 tiles. The restore
  ``x8 = code·s + z`` is exact and linear (pack.py), so K's per-channel ``s``/``z`` fold into the query and
  V's per-token ones into P and the output, and the 4/2-bit codes go straight from the packed bytes (one
  mask per 4 bytes, inline PTX) into the INT8 MMAs. The GQA query rows (4 at GQA 32/8) sit on the MMA N
  side ("swap AB"), so the per-block softmax and rescale work is not padded to 16 rows. Measurements: ``eval/PERF_NOTES.md``.

Query preparation (in the kernel's prologue; twin ``reference.prepare_query_ref``): K's universal
per-channel scale is folded into the query,
``q' = q · s_k`` (per channel), then per-row symmetric INT8 ``q8`` with scale ``sq`` (softmax scale and
log2(e) folded in), so ``s = sq · Σ q8·k8`` is in log2 units. K smoothing (subtracting the prompt's channel
mean μ) leaves softmax unchanged; with logit softcapping the exact correction ``scale·log2e · q·μ`` is
added to every logit of the row before the cap, so smoothing stays valid there too.
Rounding: float -> int8 rounds half away from zero, as in ``reference.py``.
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .device import current_cuda_device, sm_count
from .hadamard import _factor_inverse, _rotate_keys, hadamard_rows
from .interpreter import interpreting
from .launch import LeanLaunch
from .pack import (PackedKV, _bad_rows, _dequant_tile, _quantize_universal, _universal_scales, _unpack_tile,
                   keeps_int8_k)
from .quant import check_qk_smooth
from .reference import SQ_MIN, W_MIN
from .rotation import rotate_constexprs
from .softmax import sas_exp2

__all__ = ["turbo_decode_attention", "decode_entry", "decode_storage", "plan_splits", "group_splits",
           "launch_pairs", "first_visible_tile", "stores_in_launch"]


_INTERPRET = interpreting()
LOG2E = 1.4426950408889634
#: programs per SM that the split plan aims for (Lean Attention's grid sized to the SM count): with 1 warp and
#: 2 stages, best or within 6 % of best for every preset (PERF_NOTES: decode launch defaults).
DEFAULT_WAVES = 6.0
#: programs one SM holds at once with the default launch (1 warp at 255 registers: 65536 / (256 * 32)); a plan past
#: ``RESIDENT_PER_SM x #SMs`` runs a second, mostly idle wave, so the default is capped there (PERF_NOTES: same).
RESIDENT_PER_SM = 8
#: the default plan fills the resident wave (more warps to hide the load -> MMA -> softmax chain) only when every
#: share keeps this many tiles: shorter shares add more merge work than they gain (PERF_NOTES: same).
FILL_MIN_TILES = 16
#: pipeline stages of a launch with a 2-bit group (``mixed``): a third stage keeps one block's load in flight
#: during the compute and still fits 8 programs per SM; int4 / INT8 launches keep 2 (PERF_NOTES: same).
INT2_STAGES = 3
#: the largest default M tile (query rows: G x Lq are the N side of the MMAs)
MAX_BLOCK_M = 64
LN2 = 0.6931471805599453
_SQ_MIN = tl.constexpr(SQ_MIN)
_W_MIN = tl.constexpr(W_MIN)


# ----------------------------------------------------------------------------------------- Triton
@triton.jit
def _codes(b_p, SHIFT: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed bytes (uint8, any shape) -> int8 codes ``(byte >> SHIFT) & (2**BITS - 1)``, same shape.

    USE_ASM (GPU): four bytes per 32-bit register, one ``and`` (+ one ``shr``) per four codes, and the codes
    come out already packed four to a register as the int8 mma operands want them. Else plain Triton ops
    (the interpreter has no inline PTX)."""
    if USE_ASM:
        if BITS == 4:
            if SHIFT == 0:
                b_c = tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [b_p], dtype=tl.int8,
                                                is_pure=True, pack=4)
            else:
                b_c = tl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }",
                                                "=r,r", [b_p], dtype=tl.int8, is_pure=True, pack=4)
        else:
            if SHIFT == 0:
                b_c = tl.inline_asm_elementwise("and.b32 $0, $1, 0x03030303;", "=r,r", [b_p], dtype=tl.int8,
                                                is_pure=True, pack=4)
            elif SHIFT == 2:
                b_c = tl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 2; and.b32 $0, t, 0x03030303; }",
                                                "=r,r", [b_p], dtype=tl.int8, is_pure=True, pack=4)
            elif SHIFT == 4:
                b_c = tl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x03030303; }",
                                                "=r,r", [b_p], dtype=tl.int8, is_pure=True, pack=4)
            else:
                b_c = tl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 6; and.b32 $0, t, 0x03030303; }",
                                                "=r,r", [b_p], dtype=tl.int8, is_pure=True, pack=4)
    else:
        b_c = ((b_p >> SHIFT) & ((1 << BITS) - 1)).to(tl.int8)
    return b_c


@triton.jit
def _channel_parts(b_x, BITS: tl.constexpr):
    """[R, C] -> the PB = 8 // BITS channel parts [R, C // PB] matching the packed K bytes (byte j holds the
    codes of channels PB·j + p); int4 returns parts 0, 1, 0, 1 (the last two unused)."""
    R: tl.constexpr = b_x.shape[0]
    C: tl.constexpr = b_x.shape[1]
    if BITS == 4:
        b_x0, b_x1 = tl.split(tl.reshape(b_x, (R, C // 2, 2)))
        b_x2 = b_x0
        b_x3 = b_x1
    else:  # reshape index (j, a, c) = channel 4j + 2a + c; split takes c, then a
        b_xa, b_xb = tl.split(tl.reshape(b_x, (R, C // 4, 2, 2)))
        b_x0, b_x2 = tl.split(b_xa)
        b_x1, b_x3 = tl.split(b_xb)
    return b_x0, b_x1, b_x2, b_x3


@triton.jit
def _token_parts(b_x, BITS: tl.constexpr):
    """[BS] per-token values of a block -> its two token parts [BS // 2] (the V codes of packed byte columns
    0 / 1): int4 tokens 2r + h; int2 tokens 4(r // 2) + 2h + r % 2."""
    BS: tl.constexpr = b_x.shape[0]
    if BITS == 4:
        b_x0, b_x1 = tl.split(tl.reshape(b_x, (BS // 2, 2)))
    else:  # reshape index (j, h, c) = token 4j + 2h + c; part h holds r = 2j + c
        b_x0, b_x1 = tl.split(tl.permute(tl.reshape(b_x, (BS // 4, 2, 2)), (0, 2, 1)))
        b_x0 = tl.reshape(b_x0, (BS // 2,))
        b_x1 = tl.reshape(b_x1, (BS // 2,))
    return b_x0, b_x1


@triton.jit
def _a_split(b_qp, b_ksp):
    """A = q8·scale_int of one channel part ([BM, BDK] int32, |A| < 2^15) as one INT8 dot operand
    ``[BDK, 2·BM]``: A = 128·hi + lo (lo in [0, 127]) with lo and hi of row r in columns 2r and 2r + 1, so one
    MMA (whose N side of 8 a 4-row GQA group would only half fill) yields both partial sums."""
    BM: tl.constexpr = b_qp.shape[0]
    BDK: tl.constexpr = b_qp.shape[1]
    b_a = (b_qp * b_ksp)[:, None, :]
    o_h = tl.arange(0, 2)[None, :, None]
    b_lh = tl.where(o_h == 0, b_a & 127, b_a >> 7)  # [BM, 2, BDK]; channels stay the fastest axis (ldmatrix)
    return tl.trans(tl.reshape(b_lh, (2 * BM, BDK)).to(tl.int8))


@triton.jit
def _qk_half(b_kp, b_a0, b_a1, b_a2, b_a3, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """Folded integer scores Σ_c code[t, c]·(q8·s_k)[c] of one token part, transposed: packed K rows
    b_kp [N, BDK] (byte j: channels PB·j + p) against the split query parts (``_a_split``) -> [N, BM] int32."""
    N: tl.constexpr = b_kp.shape[0]
    BM: tl.constexpr = b_a0.shape[1] // 2
    b_s = tl.dot(_codes(b_kp, 0, BITS, USE_ASM), b_a0, out_dtype=tl.int32)
    b_s = tl.dot(_codes(b_kp, BITS, BITS, USE_ASM), b_a1, acc=b_s, out_dtype=tl.int32)
    if BITS == 2:
        b_s = tl.dot(_codes(b_kp, 4, 2, USE_ASM), b_a2, acc=b_s, out_dtype=tl.int32)
        b_s = tl.dot(_codes(b_kp, 6, 2, USE_ASM), b_a3, acc=b_s, out_dtype=tl.int32)
    b_lo, b_hi = tl.split(tl.reshape(b_s, (N, BM, 2)))
    return b_lo + b_hi * 128


@triton.jit
def _masked_scores(
    b_s, b_qb, o_key, m_key, o_pos, window, softcap,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """Scores ``b_s [N keys, BM rows]`` (fp32) -> -inf where masked (``m_key`` [N] false, or the key invisible to
    the row); with softcap the base-2 logits ``s`` first become ``cap(s + qb)``."""
    if HAS_SOFTCAP:  # base-2 logits: softcap * tanh(s / softcap), tanh via exp2 (reference formula)
        b_s = b_s + b_qb[None, :]
        b_s = (1.0 - 2.0 / (tl.exp2(b_s * (2.0 / softcap)) + 1.0)) * (softcap * 1.4426950408889634)
    m_s = m_key[:, None]
    if IS_CAUSAL:
        m_s = m_s & (o_key[:, None] <= o_pos[None, :])
    if HAS_WINDOW:
        m_s = m_s & (o_key[:, None] > o_pos[None, :] - window)
    return tl.where(m_s, b_s, float("-inf"))


@triton.jit
def _probs(b_x, sas_thr, USE_SAS: tl.constexpr):
    """p = exp2(x) for the base-2 logits less the running max, x <= 0 (exact exp2 or SAS)."""
    if USE_SAS:
        b_p = sas_exp2(b_x, sas_thr)
    else:
        b_p = tl.exp2(b_x)
    return b_p


@triton.jit
def _running_max(b_m, b_tmax):
    """Online-softmax bookkeeping: (new running max, its finite stand-in, rescale alpha = exp2(m - m_new))."""
    b_mn = tl.maximum(b_m, b_tmax)
    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    return b_mn, b_ms, tl.exp2(b_m - b_ms)


@triton.jit
def _p_scale(b_wmax):
    """Per-row P scale of one tile (twin: reference.pv_tile_ref): (127 / max w, 0 where max w <= W_MIN: such a tile
    adds nothing, and 127 / a subnormal max w would be inf, 0 · inf NaN) and the factor max w / 127 that brings the
    integer P·V back."""
    b_ok = b_wmax > _W_MIN
    b_inv = tl.where(b_ok, tl.math.div_rn(tl.full(b_wmax.shape, 127.0, tl.float32), tl.where(b_ok, b_wmax, 1.0)),
                     0.0)
    return b_inv, tl.math.div_rn(b_wmax, tl.full(b_wmax.shape, 127.0, tl.float32))


@triton.jit
def _p_codes(b_w, b_inv):
    """w8 = round(127 w / max w) as int8 [N, BM] (w >= 0; b_inv from ``_p_scale``)."""
    return tl.math.fma(b_w, b_inv[None, :], tl.full(b_w.shape, 0.5, tl.float32)).to(tl.int8)


@triton.jit
def _pad_k(b_x):
    """[R, K] int8 -> [R, 2K] with zeros interleaved (column 2i = column i, 2i + 1 = 0): widens the reduction
    axis of an 8-bit tl.dot, which Triton's NVIDIA backend needs to be >= 32 (padding both operands alike
    leaves the dot unchanged)."""
    R: tl.constexpr = b_x.shape[0]
    K: tl.constexpr = b_x.shape[1]
    return tl.reshape(tl.join(b_x, tl.zeros([R, K], dtype=b_x.dtype)), (R, 2 * K))


@triton.jit
def _int8_tile(
    b_acc, b_m, b_l, b_qt, b_sq, b_qb, b_k, b_v, b_vs, b_vz, o_key, m_key, o_pos, window, softcap, sas_thr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, USE_SAS: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    """One online-softmax step over an INT8 K tile, transposed: s [BS, BM] = k8 [BS, BD] · q8ᵀ [BD, BM];
    accᵀ [BD, BM] += P·V with b_v [BD, BS] INT8 values, or (PER_TOKEN) codes whose per-token integer
    scale/zero b_vs/b_vz [BS] (fp32) ride in P: w = p·s_t quantized per row, + Σ_t p·z_t."""
    b_si = tl.dot(b_k, b_qt, out_dtype=tl.int32)
    b_s = _masked_scores(b_si.to(tl.float32) * b_sq[None, :], b_qb, o_key, m_key, o_pos, window, softcap, IS_CAUSAL,
                         HAS_WINDOW, HAS_SOFTCAP)
    b_mn, b_ms, b_alpha = _running_max(b_m, tl.max(b_s, 0))
    b_p = _probs(b_s - b_ms[None, :], sas_thr, USE_SAS)
    if PER_TOKEN:
        b_w = b_p * b_vs[:, None]
    else:
        b_w = b_p
    b_inv, b_f = _p_scale(tl.max(b_w, 0))
    b_w8 = _p_codes(b_w, b_inv)
    if b_v.shape[1] < 32:  # block 16: the P·V reduction over BS keys is padded to 32 (8-bit dots need K >= 32)
        b_pc = tl.dot(_pad_k(b_v), tl.trans(_pad_k(tl.trans(b_w8))), out_dtype=tl.int32)
    else:
        b_pc = tl.dot(b_v, b_w8, out_dtype=tl.int32)
    if PER_TOKEN:
        b_zs = tl.sum(b_p * b_vz[:, None], 0)
    else:
        b_zs = tl.zeros_like(b_f)
    b_pv = tl.math.fma(b_pc.to(tl.float32), b_f[None, :], b_zs[None, :])
    b_l = tl.math.fma(b_l, b_alpha, tl.sum(b_p, 0))
    b_acc = tl.math.fma(b_acc, b_alpha[None, :], b_pv)
    return b_acc, b_mn, b_l


@triton.jit
def _fold_scores(
    t, p_kb, ks, kz, kvalid, o_sbase, o_kvrow, o_d, m_d, o_dk, m_dk, o_t0, o_t1, b_q32, b_qt, b_q0, b_q1, b_q2, b_q3,
    b_sq, b_qb, o_pos, n_sink, window, softcap,
    BS: tl.constexpr, D: tl.constexpr, DK: tl.constexpr, BITS: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KVALID: tl.constexpr, MASKED: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """Packed block ``t`` (folded K·Qᵀ, no INT8 tile restored) as ``(f0, f1, a, c)``: its base-2 logits are
    ``fma(f, a, c)`` per token part ``f [BS // 2, BM]`` and row (twin: ``reference.fold_logits_ref``).
    Without softcap f = float(Σ_c code·(q8·s_k)[c]), a = sq, c = sq·Σ_c q8·z_k: the zero term and the later
    ``- m`` ride in one FMA per score, and the block's row max is ``fma(max f, sq, c)`` (sq > 0). With softcap f
    is the capped logit itself (a = 1, c = 0). f = -inf where masked (MASKED: causal / window / key_valid; a
    block every row sees needs none). ``BITS`` is K's width here: 8 (``PackedKV.k_bits``) reads INT8 K rows of the
    token parts, f = float(q8·k8), c = 0."""
    BM: tl.constexpr = b_q32.shape[0]
    if BITS == 8:
        p_kt = p_kb + t * (BS * D) + o_d[None, :]
        b_k0 = tl.load(p_kt + o_t0[:, None] * D, mask=m_d[None, :], other=0)
        b_k1 = tl.load(p_kt + o_t1[:, None] * D, mask=m_d[None, :], other=0)
        b_f0 = tl.dot(b_k0, b_qt, out_dtype=tl.int32).to(tl.float32)
        b_f1 = tl.dot(b_k1, b_qt, out_dtype=tl.int32).to(tl.float32)
        b_c = tl.zeros([BM], dtype=tl.float32)
    else:
        o_sc = o_sbase + t * D + o_d
        b_ks0, b_ks1, b_ks2, b_ks3 = _channel_parts(tl.load(ks + o_sc, mask=m_d, other=0).to(tl.int32)[None, :],
                                                    BITS)
        b_kz = tl.load(kz + o_sc, mask=m_d, other=0).to(tl.int32)
        b_zq = tl.sum(b_q32 * b_kz[None, :], 1).to(tl.float32)  # Σ_c q8·z_k [BM], exact (< 2^24)
        b_a0 = _a_split(b_q0, b_ks0)
        b_a1 = _a_split(b_q1, b_ks1)
        if BITS == 2:
            b_a2 = _a_split(b_q2, b_ks2)
            b_a3 = _a_split(b_q3, b_ks3)
        else:
            b_a2 = b_a0
            b_a3 = b_a1
        p_kt = p_kb + t * (BS * DK) + o_dk[None, :]
        b_kp0 = tl.load(p_kt + o_t0[:, None] * DK, mask=m_dk[None, :], other=0)
        b_kp1 = tl.load(p_kt + o_t1[:, None] * DK, mask=m_dk[None, :], other=0)
        b_f0 = _qk_half(b_kp0, b_a0, b_a1, b_a2, b_a3, BITS, USE_ASM).to(tl.float32)
        b_f1 = _qk_half(b_kp1, b_a0, b_a1, b_a2, b_a3, BITS, USE_ASM).to(tl.float32)
        b_c = b_zq * b_sq
    if MASKED or HAS_SOFTCAP:
        o_key0 = n_sink + t * BS + o_t0
        o_key1 = n_sink + t * BS + o_t1
        if HAS_KVALID:
            m_key0 = tl.load(kvalid + o_kvrow + o_key0) != 0
            m_key1 = tl.load(kvalid + o_kvrow + o_key1) != 0
        else:
            m_key0 = o_t0 < BS
            m_key1 = m_key0
        if HAS_SOFTCAP:  # the cap is not linear: f becomes the logit itself
            b_f0 = tl.math.fma(b_f0, b_sq[None, :], b_c[None, :])
            b_f1 = tl.math.fma(b_f1, b_sq[None, :], b_c[None, :])
        b_f0 = _masked_scores(b_f0, b_qb, o_key0, m_key0, o_pos, window, softcap, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP)
        b_f1 = _masked_scores(b_f1, b_qb, o_key1, m_key1, o_pos, window, softcap, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP)
    if HAS_SOFTCAP:
        b_a = tl.full([BM], 1.0, tl.float32)
        b_c = tl.zeros([BM], dtype=tl.float32)
    else:
        b_a = b_sq
    return b_f0, b_f1, b_a, b_c


@triton.jit
def _v_scale_zero(vsz, o_vsbase, t, BS: tl.constexpr):
    """Block ``t``'s per-token V scales and zeros ``([BS], [BS])`` fp32 from its one 2·BS-byte row (pack.py):
    a single load of 4 bytes per thread, which the pipeliner prefetches (two BS-byte loads are too narrow)."""
    b_sz = tl.load(vsz + o_vsbase + t * (2 * BS) + tl.arange(0, 2 * BS)).to(tl.float32)
    return tl.split(tl.permute(tl.reshape(b_sz, (2, BS)), (1, 0)))


@triton.jit
def _fold_pv(t, b_p0, b_p1, p_vb, vsz, o_vsbase, o_d, m_d, o_sb,
             BS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """P·V of packed block ``t`` from its two token parts' probabilities ``[BS // 2, BM]``, transposed:
    (``Σ_t code·w8 · max w / 127`` [BD, BM], ``p·z_t`` [BS // 2, BM] to be summed over tokens). V's per-token
    scale rides in P (w = p·s_t, quantized per row of the block, twin ``reference.pv_tile_ref``)."""
    BD: tl.constexpr = o_d.shape[0]
    BSB: tl.constexpr = o_sb.shape[0]
    b_vs, b_vz = _v_scale_zero(vsz, o_vsbase, t, BS)
    b_vs0, b_vs1 = _token_parts(b_vs, BITS)
    b_vz0, b_vz1 = _token_parts(b_vz, BITS)
    b_w0 = b_p0 * b_vs0[:, None]
    b_w1 = b_p1 * b_vs1[:, None]
    b_inv, b_f = _p_scale(tl.max(tl.maximum(b_w0, b_w1), 0))
    b_vp = tl.load(p_vb + t * (D * BSB) + o_d[:, None] * BSB + o_sb[None, :], mask=m_d[:, None], other=0)
    if BITS == 4:
        b_vc0 = _codes(b_vp, 0, 4, USE_ASM)
        b_vc1 = _codes(b_vp, 4, 4, USE_ASM)
    else:
        b_vc0 = tl.reshape(tl.join(_codes(b_vp, 0, 2, USE_ASM), _codes(b_vp, 2, 2, USE_ASM)), (BD, BS // 2))
        b_vc1 = tl.reshape(tl.join(_codes(b_vp, 4, 2, USE_ASM), _codes(b_vp, 6, 2, USE_ASM)), (BD, BS // 2))
    b_pc = tl.dot(b_vc0, _p_codes(b_w0, b_inv), out_dtype=tl.int32)
    b_pc = tl.dot(b_vc1, _p_codes(b_w1, b_inv), acc=b_pc, out_dtype=tl.int32)
    return b_pc.to(tl.float32) * b_f[None, :], b_p0 * b_vz0[:, None] + b_p1 * b_vz1[:, None]


@triton.jit
def _fold_step(
    b_acc, b_m, b_l, t, p_kb, ks, kz, kvalid, o_sbase, o_kvrow, o_d, m_d, o_dk, m_dk, o_t0, o_t1,
    b_q32, b_qt, b_q0, b_q1, b_q2, b_q3, b_sq, b_qb, o_pos, n_sink, window, softcap, sas_thr, p_vb, vsz, o_vsbase,
    o_sb, BS: tl.constexpr, D: tl.constexpr, DK: tl.constexpr, BITS: tl.constexpr, KBITS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KVALID: tl.constexpr, MASKED: tl.constexpr,
    USE_SAS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """One online-softmax step over packed block t, folded (no INT8 tile restored); V in ``BITS``, K in ``KBITS``."""
    b_f0, b_f1, b_a, b_c = _fold_scores(
        t, p_kb, ks, kz, kvalid, o_sbase, o_kvrow, o_d, m_d, o_dk, m_dk, o_t0, o_t1, b_q32, b_qt, b_q0, b_q1, b_q2,
        b_q3, b_sq, b_qb, o_pos, n_sink, window, softcap, BS, D, DK, KBITS, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
        HAS_KVALID, MASKED, USE_ASM)
    # row max of fma(f, a, c) = fma(row max f, a, c): a > 0 and rounding is monotone
    b_m, b_ms, b_alpha = _running_max(b_m, tl.math.fma(tl.max(tl.maximum(b_f0, b_f1), 0), b_a, b_c))
    b_cm = (b_c - b_ms)[None, :]
    b_p0 = _probs(tl.math.fma(b_f0, b_a[None, :], b_cm), sas_thr, USE_SAS)
    b_p1 = _probs(tl.math.fma(b_f1, b_a[None, :], b_cm), sas_thr, USE_SAS)
    b_pv, b_z = _fold_pv(t, b_p0, b_p1, p_vb, vsz, o_vsbase, o_d, m_d, o_sb, BS, D, BITS, USE_ASM)
    b_l = tl.math.fma(b_l, b_alpha, tl.sum(b_p0 + b_p1, 0))
    b_acc = tl.math.fma(b_acc, b_alpha[None, :], b_pv + tl.sum(b_z, 0)[None, :])
    return b_acc, b_m, b_l


@triton.jit
def _slot_rows(i_s, i_bh, n_bh, n_mp, o_r):
    """Rows of the partials workspace (``po`` / ``pml``, ``[slots, items, n_mp]`` rows) of slot ``i_s``, work item
    ``i_bh``, M rows ``o_r``: the one layout the shares' partials, the group merges and the rotated query's round trip
    share (``i_s``, ``o_r`` broadcast)."""
    return (i_s.to(tl.int64) * n_bh + i_bh) * n_mp + o_r


@triton.jit
def _store_new_token(b_k, b_v, b_sk, b_mk, b_sv, nf, kt, vt, o_kvh, slot, tail_cap, o_d, m_d, D: tl.constexpr,
                     HAS_MEAN: tl.constexpr, COUNT: tl.constexpr):
    """One (row, KV head)'s new token -> INT8 buffer slot ``slot``, as ``store._store_tokens_kernel`` writes it
    (``pack._quantize_universal``: the same bits): ``b_k``, ``b_v [1, BD]`` its K (in the stored basis: rotated by
    the caller with ROTATE) and V, ``b_sk``, ``b_mk``, ``b_sv`` the (row, head)'s universal scales."""
    if COUNT:
        tl.atomic_add(nf, _bad_rows(b_k, b_v, m_d[None, :]))
    b_k8 = _quantize_universal(b_k, b_sk, b_mk, HAS_MEAN=HAS_MEAN)
    b_v8 = _quantize_universal(b_v, b_sv, b_sv, HAS_MEAN=False)
    tl.store(kt + o_kvh * tail_cap + slot * D + o_d[None, :], b_k8, mask=m_d[None, :])
    tl.store(vt + o_kvh * tail_cap + o_d[None, :] * tail_cap + slot, b_v8, mask=m_d[None, :])  # V transposed


@triton.jit
def _decode_program(
    i_s, i_m, i_bh, i_b, i_h,
    q, sk, mk, heads, kp, ks, kz, vp, vsz, kt, vt, sv, qsm, kvalid, o, po, pml, cnt, kn, vn, nf,
    n_blocks, n_tail, n_sink, tail_cap, Lq, kv_len, kv_row, T0, TPS, S, S_MAX, N_M, N_BH, window, softcap, sas_thr,
    qscale, stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_sb, stride_sh, stride_vb, stride_vh, stride_vsb, stride_vsh,
    stride_nkb, stride_nkh, stride_nvb, stride_nvh,
    HK,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
    BITS: tl.constexpr, K8: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_KVALID: tl.constexpr, USE_SAS: tl.constexpr,
    SPLIT: tl.constexpr, FUSED_MERGE: tl.constexpr, FOLD: tl.constexpr, USE_ASM: tl.constexpr, SC: tl.constexpr,
    ROTATE: tl.constexpr, ROT_N: tl.constexpr, HAS_FACTOR: tl.constexpr, ROT_C: tl.constexpr, STORE: tl.constexpr,
    COUNT: tl.constexpr,
):
    """One program of ``_decode_kernel``: share ``i_s`` of M tile ``i_m`` of KV head ``heads[i_h]`` of batch row
    ``i_b`` in one bit group; ``i_bh`` is the (batch, head) work item of the launch (partials, counters).

    q [b, HQ, Lq, D] (any float dtype, strides given, D contiguous); sk/mk/sv [b, HK, D] fp32 (K scale,
    K mean, V scale); ROTATE: K is stored rotated (``rotation.rotate``), the query is rotated here, first scaled
    per channel by qsm [b, HK, D] fp32 (HAS_FACTOR: K -> Q smoothing factors; 1/sqrt(ROT_N) is in qscale);
    packed blocks as in pack.py; kt [b, HK, C, D], vt [b, HK, D, C] the INT8 buffer
    (C = tail_cap slots, n_tail valid): slots < n_sink hold positions 0.. (attention sinks), the others
    positions from n_sink + n_blocks·BS on (the recent window + tail); packed block t holds positions
    n_sink + t·BS ..;
    kvalid [b, kv_row] int8 (``kv_row >= kv_len``: a static cache's mask spans its capacity); o [b, Lq, HQ, D];
    po [S, items, n_m*BM, BD] and pml [S, items, n_m*BM, 2] fp32
    partials over the launch's (batch, head) items (SPLIT, and ROTATE: a program's slot first holds its rotated
    query, fp32 [BM, BD]; rows >= M of a partial are not written); cnt [items*n_m]
    int32 arrival counters, zero between
    calls (FUSED_MERGE: the last share of a tile to finish merges it and resets its counter).
    Strides stay specialised (multiples of 16 -> 16-byte vector loads).
    STORE (an eager decode step, one token, one M tile): the step's new token kn / vn ``[b, HK, 1, D]`` (strides
    given) is not in the buffer yet; the program whose share holds its slot ``n_tail - 1`` quantizes it with the
    universal scales and writes it in the prologue, before its first tile (``store.store_int8_tokens``' math;
    COUNT: non-finite vectors added to ``nf``; ROTATE: its K rotated first, as the store kernel rotates it), then
    reads the tile as usual — the store's own launch saved. In the prologue the store's loads overlap the query's
    (after the packed loop the kernel ran 3-4 % longer at Gemma-3's heads, eval/PERF_NOTES.md session 42).

    Orientation ("swap AB"): the M = G·Lq query rows (4 for GQA 32/8 at one token) are the N side of the
    MMAs (scores ``[keys, rows]``, ``accᵀ [D, rows]``), keys and channels the 16-row M side, so the
    per-block elementwise work is not inflated to 16 padded query rows.

    FOLD (packed heads): no INT8 tile is ever restored. With x8 = code·s + z (pack.py, exact, no clamp):
    K·Qᵀ = Σ_c code[t, c]·(q8·s_k)[c] + Σ_c q8[c]·z_k[c]  (A = q8·s_k split into two int8 dots), and
    (P·V)ᵀ = Σ_t code[c, t]·(p·s_v)[t] + Σ_t p[t]·z_v[t] (p·s_v quantized per row, ``_p_scale``,
    ``_p_codes``); the codes come straight out of the packed bytes (byte j holds codes PB·j + p), so the
    channel axis of K is cut into PB interleaved parts and each block into two token parts matching V's byte
    layout. The integer scores
    equal those of the restored tiles exactly; the restoring variant (``fold=False``, and narrow dots)
    restores K only and takes V's codes the same way, so both variants compute the same numbers.
    K8 (``PackedKV.k_bits`` 8): packed blocks hold INT8 K (no scale/zero) and ``BITS``-bit V.
    """
    tl.static_assert(BITS == 2 or BITS == 4 or BITS == 8)
    i_hk = tl.load(heads + i_h).to(tl.int64)
    i_b64 = i_b.to(tl.int64)
    HQ = HK * G
    M = G * Lq
    KBITS: tl.constexpr = 8 if K8 else BITS
    PB: tl.constexpr = 8 // KBITS
    BDK: tl.constexpr = BD // PB  # packed bytes per K row (padded)
    DK: tl.constexpr = D // PB
    BSB: tl.constexpr = BS * BITS // 8  # packed bytes per V row
    # Triton's NVIDIA backend needs K >= 32 for an 8-bit tl.dot: the folded dots reduce over BDK packed K
    # bytes (Q·Kᵀ) and BS // 2 tokens (P·V), so narrow shapes (head_dim 64 at 2 bits: BDK = 16) take the
    # restoring loop instead (same integers).
    DO_FOLD: tl.constexpr = FOLD and BITS != 8 and BDK >= 32 and BS >= 64

    o_r = i_m * BM + tl.arange(0, BM)
    m_r = o_r < M
    o_qi = o_r % Lq
    o_qh = i_hk * G + o_r // Lq
    o_pos = kv_len - Lq + o_qi
    o_d = tl.arange(0, BD)
    if D == BD:  # a constant-true mask folds away and keeps loads vectorised
        m_d = tl.full([BD], 1, tl.int1)
    else:
        m_d = o_d < D
    o_n = tl.arange(0, BS)
    o_kvh = (i_b64 * HK + i_hk) * D

    n_tiles = n_blocks + tl.cdiv(n_tail, BS)  # packed blocks, then the INT8 buffer's tiles
    t_lo = T0 + i_s * TPS  # T0: first tile any query of the chunk can see (sliding window)
    t_hi = t_lo + TPS
    if t_hi > n_tiles:
        t_hi = n_tiles
    t_i8 = t_lo  # first INT8 buffer tile of this share
    if t_i8 < n_blocks:
        t_i8 = n_blocks
    if STORE:  # the share holding the new token's slot stores it, in the prologue (no other share reads that tile)
        t_new = n_blocks + (n_tail - 1) // BS
        storer = (t_new >= t_i8) & (t_new < t_hi)
        # its loads issued first (masked off in the other shares), so their latency overlaps the query's: below the
        # query's round-trip store the compiler cannot move them up (eval/PERF_NOTES.md session 43)
        m_st = m_d & storer
        b_kn = tl.load(kn + i_b64 * stride_nkb + i_hk * stride_nkh + o_d, mask=m_st, other=0.0)[None, :]
        b_vn = tl.load(vn + i_b64 * stride_nvb + i_hk * stride_nvh + o_d, mask=m_st, other=0.0)[None, :]
        b_usk, b_umk, b_usv = _universal_scales(sk, mk, sv, o_kvh + o_d, m_st, HAS_MEAN)

    # ---- query: fold K's per-channel scale in, per-row symmetric INT8 (round half away), as prepare_query_ref
    p_q = q + i_b64 * stride_qb + o_qh[:, None].to(tl.int64) * stride_qh + o_qi[:, None] * stride_ql + o_d[None, :]
    b_qf = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    # K's channel scales read beside the query: with ROTATE the barrier below would otherwise hold this load back
    b_sk = tl.load(sk + o_kvh + o_d, mask=m_d, other=0.0)
    if ROTATE:  # into K's stored basis, (q · diag(s)) · H±1 in fp32 (padded channels are 0 and form whole blocks)
        if HAS_FACTOR:  # K -> Q smoothing factors, loaded once for the query and a stored token's 1/s
            b_qsm = tl.load(qsm + o_kvh + o_d, mask=m_d, other=1.0)
            b_qf = b_qf * b_qsm[None, :]
        b_qf = hadamard_rows(b_qf, ROT_N)
        # back through this program's own partials slot (written again only after the loop): reloaded, the query
        # has the layout of the plain path's load, so nothing after the prologue compiles differently (in the
        # butterfly's final layout the rotated launch ran 10-12.5 % slower at head_dim 256; a butterfly of warp
        # shuffles that keeps the load's layout cost more than this round trip, eval/PERF_NOTES.md session 43)
        p_rt = po + _slot_rows(i_s, i_bh, N_BH, N_M * BM, o_r)[:, None] * BD + o_d[None, :]
        tl.store(p_rt, b_qf)
    if STORE:
        if storer:
            b_f = tl.full([BD], 1.0, tl.float32)  # K's 1/s, from the factors the query loaded
            if ROTATE and HAS_FACTOR:
                b_f = _factor_inverse(b_qsm, USE_ASM)
            _store_new_token(_rotate_keys(b_kn, b_f, ROTATE, ROT_N, ROT_C, USE_ASM), b_vn, b_usk, b_umk, b_usv, nf, kt,
                             vt, o_kvh, n_tail - 1, tail_cap, o_d, m_d, D, HAS_MEAN, COUNT)
            if not ROTATE:
                tl.debug_barrier()  # every thread's stores before any thread reads the tile
    if ROTATE:
        tl.debug_barrier()  # the rotated query's (and a stored token's) stores before any thread reads them
        b_qf = tl.load(p_rt)
    b_qs = b_qf * b_sk[None, :]
    b_amax = tl.max(tl.abs(b_qs), 1)
    b_inv = tl.where(b_amax > 0, tl.math.div_rn(tl.full([BM], 127.0, tl.float32), tl.where(b_amax > 0, b_amax, 1.0)),
                     0.0)
    b_x = b_qs * b_inv[:, None]
    b_x = tl.where(b_x >= 0, b_x + 0.5, b_x - 0.5).to(tl.int32)
    b_q32 = tl.minimum(tl.maximum(b_x, -127), 127)
    b_qt = tl.trans(b_q32.to(tl.int8))  # [BD, BM]
    # > 0 even for an all-zero row (its q8 and scores are 0): folded logits are fma(f, sq, c) with f = -inf masked
    b_sq = tl.maximum(tl.math.div_rn(b_amax, tl.full([BM], 127.0, tl.float32)) * qscale, _SQ_MIN)
    if HAS_SOFTCAP and HAS_MEAN:  # smoothing correction qscale * q.mean_k (both rotated with ROTATE), before the cap
        b_mk = tl.load(mk + o_kvh + o_d, mask=m_d, other=0.0)
        b_qb = tl.sum(b_qf * b_mk[None, :], 1) * qscale
    else:
        b_qb = tl.zeros([BM], dtype=tl.float32)
    if DO_FOLD and KBITS != 8:  # query channel parts p (channels PB·j + p: the K codes of packed byte j)
        b_q0, b_q1, b_q2, b_q3 = _channel_parts(b_q32, KBITS)
    else:  # unused
        b_q0 = b_q32
        b_q1 = b_q32
        b_q2 = b_q32
        b_q3 = b_q32

    b_acc = tl.zeros([BD, BM], dtype=tl.float32)  # accᵀ
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)

    t_hp = t_hi  # end of this share's packed tiles
    if t_hp > n_blocks:
        t_hp = n_blocks
    p_kb = kp + i_b64 * stride_kb + i_h * stride_kh
    p_vb = vp + i_b64 * stride_vb + i_h * stride_vh
    o_sbase = i_b64 * stride_sb + i_h * stride_sh  # K scale/zero [.., NB, D]
    o_vsbase = i_b64 * stride_vsb + i_h * stride_vsh  # V scales, zeros [.., NB, 2, BS] (per token)
    o_dk = tl.arange(0, BDK)
    o_sb = tl.arange(0, BSB)
    if D == BD:
        m_dk = tl.full([BDK], 1, tl.int1)
    else:
        m_dk = o_dk < DK
    # token parts h = 0, 1 of a block (FOLD): int4 tokens 2r + h; int2 tokens 4(r // 2) + 2h + r % 2
    o_r2 = tl.arange(0, BS // 2)
    if BITS == 4:
        o_t0 = 2 * o_r2
        o_t1 = o_t0 + 1
    else:
        o_t0 = 4 * (o_r2 // 2) + o_r2 % 2
        o_t1 = o_t0 + 2
    # ---- packed blocks
    if DO_FOLD:
        # One block per step. Blocks that every row of the chunk sees completely (all of them at Lq = 1) run
        # without per-score masks (reference.fold_unmasked_blocks), the rest, if any, in a second loop with them.
        # (Two blocks per step with one running max for both measured 13 % slower for `mixed` at batch 8 and no
        # faster for int4: eval/PERF_NOTES.md, decode round 7.)
        o_kvrow = i_b64 * kv_row
        if HAS_WINDOW or HAS_KVALID or HAS_SOFTCAP:
            t_u = t_lo
        elif IS_CAUSAL:
            t_u = tl.minimum(tl.maximum(tl.maximum(kv_len - Lq - n_sink + 1, 0) // BS, t_lo), t_hp)
        else:
            t_u = t_hp
        for seg in tl.static_range(2):  # 0: [t_lo, t_u) without per-score masks, 1: [t_u, t_hp) with them
            if seg == 0:
                t_a = t_lo
                t_z = t_u
            else:
                t_a = t_u
                t_z = t_hp
            for t in range(t_a, t_z):
                b_acc, b_m, b_l = _fold_step(
                    b_acc, b_m, b_l, t, p_kb, ks, kz, kvalid, o_sbase, o_kvrow, o_d, m_d, o_dk, m_dk, o_t0, o_t1,
                    b_q32, b_qt, b_q0, b_q1, b_q2, b_q3, b_sq, b_qb, o_pos, n_sink, window, softcap, sas_thr, p_vb,
                    vsz, o_vsbase, o_sb, BS, D, DK, BITS, KBITS, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_KVALID,
                    seg == 1, USE_SAS, USE_ASM)
    else:
        for t in range(t_lo, t_hp):
            o_key = n_sink + t * BS + o_n
            m_key = o_n < BS
            if HAS_KVALID:
                m_key = tl.load(kvalid + i_b64 * kv_row + o_key) != 0
            if BITS == 8:
                b_k = tl.load(p_kb + t * (BS * D) + o_n[:, None] * D + o_d[None, :], mask=m_d[None, :], other=0)
                b_v = tl.load(p_vb + t * (D * BS) + o_d[:, None] * BS + o_n[None, :], mask=m_d[:, None], other=0)
                b_acc, b_m, b_l = _int8_tile(b_acc, b_m, b_l, b_qt, b_sq, b_qb, b_k, b_v, b_sq, b_sq, o_key, m_key,
                                             o_pos, window, softcap, sas_thr, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                             USE_SAS, False)
            else:  # restore INT8 tiles in registers (the first version; kept to measure against)
                if KBITS == 8:
                    b_k = tl.load(p_kb + t * (BS * D) + o_n[:, None] * D + o_d[None, :], mask=m_d[None, :], other=0)
                else:
                    b_kp = tl.load(p_kb + t * (BS * DK) + o_n[:, None] * DK + o_dk[None, :], mask=m_dk[None, :],
                                   other=0)
                    o_sc = o_sbase + t * D + o_d
                    b_k = _dequant_tile(_unpack_tile(b_kp, BS, BD, KBITS),
                                        tl.load(ks + o_sc, mask=m_d, other=0).to(tl.int32),
                                        tl.load(kz + o_sc, mask=m_d, other=0).to(tl.int32), 0)
                b_vp = tl.load(p_vb + t * (D * BSB) + o_d[:, None] * BSB + o_sb[None, :], mask=m_d[:, None], other=0)
                b_vc = _unpack_tile(b_vp, BD, BS, BITS).to(tl.int8)  # V stays codes: its scale rides in P
                b_vs, b_vz = _v_scale_zero(vsz, o_vsbase, t, BS)
                b_acc, b_m, b_l = _int8_tile(b_acc, b_m, b_l, b_qt, b_sq, b_qb, b_k, b_vc,
                                             b_vs, b_vz,
                                             o_key, m_key, o_pos, window, softcap, sas_thr, IS_CAUSAL, HAS_WINDOW,
                                             HAS_SOFTCAP, USE_SAS, True)
    # ---- INT8 buffer (sink tiles, then the recent window + tail). All BS slots of a tile are read (stale
    # slots hold finite int8); slots at or past n_tail are masked in the scores, so their p8 is 0.
    for t in tl.range(t_i8, t_hi, num_stages=1):  # a tile or two per share: not worth pipeline buffers
        o_slot = (t - n_blocks) * BS + o_n
        b_k = tl.load(kt + (o_kvh * tail_cap + o_slot[:, None] * D + o_d[None, :]), mask=m_d[None, :], other=0)
        b_v = tl.load(vt + (o_kvh * tail_cap + o_d[:, None] * tail_cap + o_slot[None, :]), mask=m_d[:, None],
                      other=0)
        o_key = tl.where(o_slot < n_sink, o_slot, o_slot + n_blocks * BS)
        m_key = o_slot < n_tail
        if HAS_KVALID:
            m_key = m_key & (tl.load(kvalid + i_b64 * kv_row + o_key, mask=m_key, other=0) != 0)
        b_acc, b_m, b_l = _int8_tile(b_acc, b_m, b_l, b_qt, b_sq, b_qb, b_k, b_v, b_sq, b_sq, o_key, m_key, o_pos,
                                     window, softcap, sas_thr, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_SAS, False)

    p_ot = o + ((i_b64 * Lq + o_qi) * HQ + o_qh)[None, :] * D + o_d[:, None]  # [BD, BM]
    if SPLIT:
        n_bh = N_BH
        n_mp = N_M * BM
        o_p = _slot_rows(i_s, i_bh, n_bh, n_mp, o_r)
        tl.store(po + o_p[None, :] * BD + o_d[:, None], b_acc, mask=m_r[None, :])
        tl.store(pml + o_p * 2, b_m, mask=m_r)
        tl.store(pml + o_p * 2 + 1, b_l, mask=m_r)
        if FUSED_MERGE:
            # Arrival counts (no waiting), two levels: shares come in groups of SC; the last share of a group to
            # finish merges the group's partials (one chunk of loads). With one group that is the tile's result;
            # else the group's (acc, m, l) goes to slot S + group and the last group merger merges those. The
            # serial chain of L2 round trips is ~2 + cdiv(S, SC) / SC instead of ~S / SC (batch 1: ~100 shares).
            # A barrier orders every thread's stores before the program's (gpu-scope, acq_rel) atomic.
            tl.debug_barrier()
            NG = tl.cdiv(S, SC)  # S: this group's shares; counters are laid out for the launch's largest, S_MAX
            i_g = i_s // SC
            g_lo = i_g * SC
            p_cnt = cnt + (i_bh * N_M + i_m) * (tl.cdiv(S_MAX, SC) + 1)
            o_rm = tl.where(m_r, o_r, 0)
            n_done = tl.atomic_add(p_cnt + i_g, 1, sem="acq_rel", scope="gpu")
            if n_done == tl.minimum(S - g_lo, SC) - 1:
                tl.atomic_xchg(p_cnt + i_g, 0, sem="relaxed", scope="gpu")  # ready for the next call
                b_acc2, b_m2, b_l2 = _merge_partials(po, pml, i_bh, n_bh, n_mp, o_rm, o_d, g_lo,
                                                     tl.minimum(g_lo + SC, S), BM, BD, SC)
                if NG > 1:
                    o_g = _slot_rows(S + i_g, i_bh, n_bh, n_mp, o_r)
                    tl.store(po + o_g[:, None] * BD + o_d[None, :], b_acc2, mask=m_r[:, None])
                    tl.store(pml + o_g * 2, b_m2, mask=m_r)
                    tl.store(pml + o_g * 2 + 1, b_l2, mask=m_r)
                    tl.debug_barrier()
                    n_grp = tl.atomic_add(p_cnt + NG, 1, sem="acq_rel", scope="gpu")
                    if n_grp == NG - 1:
                        tl.atomic_xchg(p_cnt + NG, 0, sem="relaxed", scope="gpu")
                        b_acc2, b_m2, b_l2 = _merge_partials(po, pml, i_bh, n_bh, n_mp, o_rm, o_d, S, S + NG,
                                                             BM, BD, SC)
                        _store_merged(o, sv, b_acc2, b_l2, o_kvh, i_b64, Lq, HQ, o_qi, o_qh, o_d, m_r, m_d, D)
                else:
                    _store_merged(o, sv, b_acc2, b_l2, o_kvh, i_b64, Lq, HQ, o_qi, o_qh, o_d, m_r, m_d, D)
    else:
        b_sv = tl.load(sv + o_kvh + o_d, mask=m_d, other=0.0)
        b_o = tl.where(b_l[None, :] > 0, b_acc / tl.where(b_l > 0, b_l, 1.0)[None, :], 0.0) * b_sv[:, None]
        tl.store(p_ot, b_o.to(o.dtype.element_ty), mask=m_d[:, None] & m_r[None, :])


@triton.jit
def _work_item(i_bh, n_items, H0, H1):
    """Work item ``i_bh`` of a launch over two bit groups -> (in group 1, batch row, head index in its group):
    items ``[0, b·H0)`` are group 0's (batch, head) pairs, the rest group 1's."""
    n0 = (n_items // (H0 + H1)) * H0  # b·H0
    in_g1 = i_bh >= n0
    j = tl.where(in_g1, i_bh - n0, i_bh)
    h = tl.where(in_g1, tl.maximum(H1, 1), H0)
    return in_g1, j // h, j % h


@triton.jit(do_not_specialize=["n_blocks", "n_tail", "n_sink", "Lq", "kv_len", "kv_row", "T0", "TPS0", "TPS1", "S0",
                              "S1", "window"])
def _decode_kernel(
    q, sk, mk, kt, vt, sv, qsm, kvalid, o, po, pml, cnt, lens, kn, vn, nf,
    heads0, kp0, ks0, kz0, vp0, vsz0, heads1, kp1, ks1, kz1, vp1, vsz1,
    n_blocks, n_tail, n_sink, tail_cap, Lq, kv_len, kv_row, T0, TPS0, TPS1, S0, S1, N_M, B, window, softcap, sas_thr,
    qscale,
    stride_qb, stride_qh, stride_ql,
    stride_kb0, stride_kh0, stride_sb0, stride_sh0, stride_vb0, stride_vh0, stride_vsb0, stride_vsh0,
    stride_kb1, stride_kh1, stride_sb1, stride_sh1, stride_vb1, stride_vh1, stride_vsb1, stride_vsh1,
    stride_nkb, stride_nkh, stride_nvb, stride_nvh,
    H0, H1, HK,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
    BITS0: tl.constexpr, BITS1: tl.constexpr, TWO_GROUPS: tl.constexpr, K8: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_KVALID: tl.constexpr, USE_SAS: tl.constexpr, SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr, FOLD: tl.constexpr, USE_ASM: tl.constexpr, SC: tl.constexpr, LENS: tl.constexpr,
    ROTATE: tl.constexpr, ROT_N: tl.constexpr, HAS_FACTOR: tl.constexpr, ROT_C: tl.constexpr, STORE: tl.constexpr,
    COUNT: tl.constexpr,
):
    """grid = (n_items0 * S0 + n_items1 * S1,): one launch for up to two bit groups (e.g. the INT4 and the INT2
    heads of ``mixed``), so a step pays one launch and the split plan fills the GPU once for all heads. Work items
    (batch, head, M tile) ``[0, b·H0·N_M)`` are group 0's, the rest group 1's (TWO_GROUPS only); group g cuts each
    of its items into S_g shares of TPS_g tiles, and the grid holds exactly the programs of both (a grid with
    idle programs ran 18-33 % slower: eval/PERF_NOTES.md, decode #25). Each group has its packed tensors, strides
    and ``BITS`` (both branches are compiled into the one kernel: registers are the larger of the two). The
    program itself is ``_decode_program``.

    LENS (a static cache decoded inside a CUDA graph): ``n_blocks``, ``n_tail`` are read from ``lens`` [2] int32
    on the device and the launch's host values of them, ``kv_len``, ``T0`` and ``TPS*`` are ignored: each item's
    visible tiles are cut into the launch's fixed S0 / S1 shares here (Lean Attention's stream-K shares computed
    on the device); shares past the last tile are empty and still write their (m = -inf, l = 0) partial."""
    if LENS:
        n_blocks = tl.load(lens)
        n_tail = tl.load(lens + 1)
        kv_len = n_blocks * BS + n_tail
        T0 = 0
        if HAS_WINDOW:  # first_visible_tile, in packed-block units (the sink tiles are always visited)
            T0 = tl.minimum(tl.maximum((kv_len - Lq - window + 1) // BS - n_sink // BS, 0), n_blocks)
        n_vis = n_blocks + tl.cdiv(n_tail, BS) - T0
        TPS0 = tl.maximum(tl.cdiv(n_vis, S0), 1)
        TPS1 = tl.maximum(tl.cdiv(n_vis, S1), 1)
    pid = tl.program_id(0)
    NB0 = B * H0  # group 0's (batch, head) items
    NBH = B * (H0 + H1)
    p0 = NB0 * N_M * S0  # group 0's programs
    in1 = pid >= p0
    q_ = tl.where(in1, pid - p0, pid)
    s_g = tl.where(in1, S1, S0)
    i_s = q_ % s_g
    i_w = q_ // s_g + tl.where(in1, NB0 * N_M, 0)  # work item = i_bh * N_M + i_m
    i_bh = i_w // N_M
    i_m = i_w % N_M
    g1, i_b, i_h = _work_item(i_bh, NBH, H0, H1)
    if TWO_GROUPS:
        in_g1 = g1
    else:
        in_g1 = False  # constexpr: the group-1 branch is not compiled
    if in_g1:
        _decode_program(
            i_s, i_m, i_bh, i_b, i_h,
            q, sk, mk, heads1, kp1, ks1, kz1, vp1, vsz1, kt, vt, sv, qsm, kvalid, o, po, pml, cnt, kn, vn, nf,
            n_blocks, n_tail, n_sink, tail_cap, Lq, kv_len, kv_row, T0, TPS1, S1, tl.maximum(S0, S1), N_M, NBH, window,
            softcap, sas_thr, qscale,
            stride_qb, stride_qh, stride_ql,
            stride_kb1, stride_kh1, stride_sb1, stride_sh1, stride_vb1, stride_vh1, stride_vsb1, stride_vsh1,
            stride_nkb, stride_nkh, stride_nvb, stride_nvh, HK,
            G, D, BD, BS, BM, BITS1, K8, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_MEAN, HAS_KVALID, USE_SAS, SPLIT,
            FUSED_MERGE, FOLD, USE_ASM, SC, ROTATE, ROT_N, HAS_FACTOR, ROT_C, STORE, COUNT)
    else:
        _decode_program(
            i_s, i_m, i_bh, i_b, i_h,
            q, sk, mk, heads0, kp0, ks0, kz0, vp0, vsz0, kt, vt, sv, qsm, kvalid, o, po, pml, cnt, kn, vn, nf,
            n_blocks, n_tail, n_sink, tail_cap, Lq, kv_len, kv_row, T0, TPS0, S0, tl.maximum(S0, S1), N_M, NBH, window,
            softcap, sas_thr, qscale,
            stride_qb, stride_qh, stride_ql,
            stride_kb0, stride_kh0, stride_sb0, stride_sh0, stride_vb0, stride_vh0, stride_vsb0, stride_vsh0,
            stride_nkb, stride_nkh, stride_nvb, stride_nvh, HK,
            G, D, BD, BS, BM, BITS0, K8, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_MEAN, HAS_KVALID, USE_SAS, SPLIT,
            FUSED_MERGE, FOLD, USE_ASM, SC, ROTATE, ROT_N, HAS_FACTOR, ROT_C, STORE, COUNT)


@triton.jit
def _store_merged(o, sv, b_acc, b_l, o_kvh, i_b64, Lq, HQ, o_qi, o_qh, o_d, m_r, m_d, D: tl.constexpr):
    """o = acc / l · s_v (0 for a row without any visible key) of a merged tile ``acc [BM, BD]``."""
    b_sv = tl.load(sv + o_kvh + o_d, mask=m_d, other=0.0)
    b_o = tl.where(b_l[:, None] > 0, b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None], 0.0) * b_sv[None, :]
    p_o = o + ((i_b64 * Lq + o_qi) * HQ + o_qh)[:, None] * D + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])


@triton.jit
def _merge_partials(po, pml, i_bh, n_bh, n_mp, o_r, o_d, s_lo, s_hi, BM: tl.constexpr, BD: tl.constexpr,
                    SC: tl.constexpr):
    """Merge the partials (m, l, acc) of shares ``[s_lo, s_hi)`` of one tile: M = max_s m_s,
    l = Σ_s l_s·2^(m_s - M), acc = Σ_s acc_s·2^(m_s - M), SC shares per step (independent loads in flight;
    L2 reads: the partials were written by other programs)."""
    b_mx = tl.full([BM], float("-inf"), dtype=tl.float32)
    for s0 in range(s_lo, s_hi, 64):
        o_s = s0 + tl.arange(0, 64)
        o_p = _slot_rows(o_s[:, None], i_bh, n_bh, n_mp, o_r[None, :])
        b_ms = tl.load(pml + o_p * 2, mask=(o_s < s_hi)[:, None], other=float("-inf"), cache_modifier=".cg")
        b_mx = tl.maximum(b_mx, tl.max(b_ms, 0))
    b_mz = tl.where(b_mx == float("-inf"), 0.0, b_mx)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    for s0 in range(s_lo, s_hi, SC):
        o_s = s0 + tl.arange(0, SC)
        m_s = (o_s < s_hi)[:, None]
        o_p = _slot_rows(o_s[:, None], i_bh, n_bh, n_mp, o_r[None, :])  # [SC, BM]
        b_ms = tl.load(pml + o_p * 2, mask=m_s, other=float("-inf"), cache_modifier=".cg")
        b_ls = tl.load(pml + o_p * 2 + 1, mask=m_s, other=0.0, cache_modifier=".cg")
        b_as = tl.load(po + o_p[:, :, None] * BD + o_d[None, None, :], mask=m_s[:, :, None], other=0.0,
                       cache_modifier=".cg")
        b_w = tl.exp2(b_ms - b_mz[None, :])  # 0 for empty / missing shares
        b_l += tl.sum(b_ls * b_w, 0)
        b_acc += tl.sum(b_as * b_w[:, :, None], 0)
    return b_acc, b_mx, b_l


@triton.jit(do_not_specialize=["Lq", "S"])
def _merge_kernel(
    po, pml, heads0, heads1, sv, o, Lq, S, H0, H1, HK,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, SC: tl.constexpr,
):
    """grid = (n_m_tiles, b * (H0 + H1)): merge S partial (m, l, acc) by the associative rescale, write o
    (work items as in ``_decode_kernel``: group 0's (batch, head) pairs, then group 1's)."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    in_g1, i_b, i_h = _work_item(i_bh, tl.num_programs(1), H0, H1)
    i_hk = tl.load(tl.where(in_g1, heads1, heads0) + i_h).to(tl.int64)
    i_b64 = i_b.to(tl.int64)
    HQ = HK * G
    M = G * Lq
    o_r = i_m * BM + tl.arange(0, BM)
    m_r = o_r < M
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_acc, b_m, b_l = _merge_partials(po, pml, i_bh, tl.num_programs(1), tl.num_programs(0) * BM,
                                      tl.where(m_r, o_r, 0), o_d, 0, S, BM, BD, SC)
    _store_merged(o, sv, b_acc, b_l, (i_b64 * HK + i_hk) * D, i_b64, Lq, HQ, o_r % Lq, i_hk * G + o_r // Lq, o_d,
                  m_r, m_d, D)


# ----------------------------------------------------------------------------------------- launcher
_DECODE = LeanLaunch(_decode_kernel)  # the decode step's launch without Triton's per-call binder


def _stages(*bits: int) -> int:
    """Default pipeline stages of a launch over groups of these bit widths (``INT2_STAGES``: see there)."""
    return INT2_STAGES if 2 in bits and 8 not in bits else 2


def stores_in_launch(lq: int, hq: int, hk: int) -> bool:
    """Whether a decode call may take ``store=`` (the step's new token written by the launch): one query token whose
    ``hq // hk`` rows fit one M tile of the default ``block_m``."""
    return lq == 1 and hq <= MAX_BLOCK_M * hk


def first_visible_tile(kv_len: int, lq: int, window: Optional[int], block: int) -> int:
    """First tile (block) that a query of the chunk can see: with a sliding window ``w`` the first query
    (position ``kv_len - lq``) sees keys from ``kv_len - lq - w + 1`` on; earlier tiles are skipped."""
    if not window:
        return 0
    return max(0, (kv_len - lq - int(window) + 1) // block)


def plan_splits(n_tiles: int, work_units: int, device: torch.device, waves: Optional[float] = None,
                n_splits: Optional[int] = None, min_tiles: int = 4) -> tuple[int, int]:
    """Shares of the context per (batch, head, M tile): ``(n_splits, tiles_per_split)``.

    About ``waves x #SMs`` programs in all (Lean Attention; ``waves`` default :data:`DEFAULT_WAVES`), shares
    of at least ``min_tiles`` tiles (a share pays a prologue and a partial write), never an empty share.
    Without an explicit ``waves`` the plan never exceeds one resident wave (``RESIDENT_PER_SM x #SMs``
    programs) and fills it when every share keeps at least ``FILL_MIN_TILES`` tiles.
    An explicit ``n_splits`` is only capped by ``n_tiles``. On CPU (interpreter) 4 "SMs" are assumed so
    tests exercise the split + merge path.
    """
    sms = sm_count(device)
    return _plan(n_tiles, work_units, sms, waves, n_splits, min_tiles)


@functools.lru_cache(maxsize=4096)
def _plan(n_tiles: int, work_units: int, sms: int, waves: Optional[float], n_splits: Optional[int],
          min_tiles: int) -> tuple[int, int]:
    """The plan of :func:`plan_splits` (cached: the same few shapes recur every decode step)."""
    if n_tiles <= 0:
        return 1, 1
    if n_splits is None:
        w = DEFAULT_WAVES if waves is None else waves
        n_splits = math.ceil(w * sms / max(work_units, 1))
        if waves is None:  # the default launch: within one resident wave; filled when the shares stay long
            fill = max(1, RESIDENT_PER_SM * sms // max(work_units, 1))
            n_splits = fill if n_tiles // fill >= FILL_MIN_TILES else min(n_splits, fill)
        n_splits = max(1, min(n_splits, n_tiles // max(min_tiles, 1)))
    n_splits = max(1, min(int(n_splits), n_tiles))
    tps = math.ceil(n_tiles / n_splits)
    return math.ceil(n_tiles / tps), tps


def spare_slot_shares(S: int, n0: int, n1: int, bits0: int, bits1: int, sms: int) -> Optional[tuple[int, int]]:
    """Share counts per bit group for a launch over two groups whose plan fills the resident wave with S shares
    per item (``RESIDENT_PER_SM x #SMs`` slots, ``n0 + n1`` items): the slots left over go to the wider group
    (more bytes per tile: its shares end last) as one more share per item, when they cover all its items.
    ``mixed`` at 32k batch 8: 16 + 16 shares (1024 programs) -> 17 for the INT4 heads (1056): 104.0-104.8 ->
    102.7-102.9 us eager (eval/PERF_NOTES.md, decode #26). None: one plan for both."""
    slots = RESIDENT_PER_SM * sms
    if S != slots // (n0 + n1) or bits0 == bits1:  # not the filled plan: leave it
        return None
    if bits0 > bits1:
        return (S + 1, S) if slots - S * (n0 + n1) >= n0 else None
    return (S, S + 1) if slots - S * (n0 + n1) >= n1 else None


@functools.lru_cache(maxsize=4096)
def _pair_plan(n_tiles: int, n0: int, n1: int, bits0: int, bits1: int, sms: int, waves: Optional[float],
               n_splits, min_tiles: int, fused: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((S0, tps0), (S1, tps1))``: the shares of a launch over one or two bit groups with ``n0`` / ``n1`` work
    items. ``n_splits``: None (the default plan), an int for all, or ``((bits, S), ...)`` per bit group (as
    ``reference.turbo_decode_ref`` takes them). The default plan is one for both groups, except that a filled
    plan's spare slots go to the wider group (``spare_slot_shares``, fused merge only)."""
    if isinstance(n_splits, tuple):
        per = dict(n_splits)
        return tuple(_plan(n_tiles, n0 + n1, sms, None, per.get(bits, 1), 1) for bits in (bits0, bits1))
    plan = _plan(n_tiles, n0 + n1, sms, waves, n_splits, min_tiles)
    spare = None
    if n1 and waves is None and n_splits is None and fused:
        spare = spare_slot_shares(plan[0], n0, n1, bits0, bits1, sms)
    if spare is None:
        return plan, plan
    return tuple(_plan(n_tiles, n0 + n1, sms, None, S, 1) for S in spare)


def launch_pairs(groups: Sequence[PackedKV]) -> list:
    """The bit groups that share one launch: consecutive pairs of the non-empty groups (``mixed``: its
    INT4 and INT2 heads in one launch; a third bit width would take a second launch)."""
    live = [g_ for g_ in groups if len(g_.heads) > 0]
    return [live[i:i + 2] for i in range(0, len(live), 2)]


def group_splits(n_tiles: int, groups: Sequence[PackedKV], b: int, n_m: int, device: torch.device,
                 waves: Optional[float] = None, n_splits: Optional[int] = None, min_tiles: int = 4) -> dict:
    """``{bits: n_splits}`` as the launcher plans them with the fused merge (one plan per launch, over all heads
    of its groups, ``_pair_plan``): what ``reference.turbo_decode_ref`` needs to reproduce the kernel's shares."""
    sms = sm_count(device)
    out = {}
    for pair in launch_pairs(groups):
        g0, g1 = pair[0], pair[-1]
        n0 = b * n_m * len(g0.heads)
        n1 = b * n_m * len(g1.heads) if len(pair) == 2 else 0
        plans = _pair_plan(n_tiles, n0, n1, g0.bits, g1.bits, sms, waves, n_splits, min_tiles, True)
        for g_, (S, _) in zip((g0, g1), plans):
            out[g_.bits] = S
    return out


def _pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); plain Python (triton.next_power_of_2 is a slow JIT wrapper)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


@functools.lru_cache(maxsize=1024)
def _merge_chunk(S: int, BM: int, BD: int, num_warps: int) -> int:
    """Shares merged per step: up to 128 fp32 registers per thread for the [SC, BM, BD] partial tile (the
    merge runs after the main loop, whose live registers dominate: ptxas reports 245 registers for the
    default launch with SC 2, 4 or 8 alike); fewer steps = fewer serial L2 round trips at small batch."""
    sc = max(1, (4096 * num_warps) // (BM * BD))
    return min(16, sc, _pow2(S))


_WORKSPACE: dict = {}


def _workspace(device: torch.device, n_acc: int, n_ml: int, n_cnt: int):
    """Partials (fp32 ``acc``, ``(m, l)``) and zeroed arrival counters, cached per device and grown on
    demand: no allocation on the decode hot path. The counters are back at zero after every call (the
    merging program resets its own); calls on one device must not run concurrently on two streams."""
    key = (device.type, device.index)
    ws = _WORKSPACE.get(key)
    if ws is None or ws[0].numel() < n_acc or ws[1].numel() < n_ml or ws[2].numel() < n_cnt:
        old = (0, 0, 0) if ws is None else tuple(t.numel() for t in ws)
        ws = (torch.empty(max(n_acc, old[0]), dtype=torch.float32, device=device),
              torch.empty(max(n_ml, old[1]), dtype=torch.float32, device=device),
              torch.zeros(max(n_cnt, old[2]), dtype=torch.int32, device=device))
        _WORKSPACE[key] = ws
    return ws


def turbo_decode_attention(
    q: torch.Tensor,
    groups: Sequence[PackedKV],
    k_tail: torch.Tensor,
    v_tail: torch.Tensor,
    n_tail: int,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_mean: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    key_valid: Optional[torch.Tensor] = None,
    n_sink: int = 0,
    softmax: str = "exact",
    sas_threshold: float = 6.0,
    n_splits: Optional[int] = None,
    waves: Optional[float] = None,
    min_tiles: int = 4,
    block_m: Optional[int] = None,
    num_warps: int = 1,
    num_stages: Optional[int] = None,
    max_registers: Optional[int] = None,
    merge: str = "fused",
    fold: bool = True,
    lens: Optional[torch.Tensor] = None,
    rotate: bool = False,
    qk_smooth: Optional[torch.Tensor] = None,
    store: Optional[tuple] = None,
) -> torch.Tensor:
    """Attention of a query chunk over a packed KV cache (all of ``groups``' blocks, then the tail).

    Args:
        q: ``[b, HQ, Lq, D]`` bf16/fp16/fp32 queries (RoPE applied); query ``i`` sits at position
            ``kv_len - Lq + i`` where ``kv_len = n_blocks * BS + n_tail`` (the new tokens are stored already).
        groups: one :class:`~.pack.PackedKV` per bit width; together their ``heads`` cover ``0..HK-1``
            once; all hold the same ``n_blocks``.
        k_tail: ``[b, HK, C, D]`` int8; v_tail: ``[b, HK, D, C]`` int8 (transposed): the INT8 buffer of
            ``C`` slots (a multiple of the block size), ``n_tail`` of them valid. Its first ``n_sink`` slots
            hold positions ``0..n_sink-1`` (attention sinks kept INT8), the rest positions from
            ``n_sink + n_blocks * BS`` on (recent window + tail); packed block ``t`` holds positions
            ``n_sink + t * BS ..``. ``n_sink`` is a multiple of the block size (0: the plain layout, a tail
            of ``< BS`` tokens after the blocks).
        k_scale, v_scale: ``[b, HK, D]`` fp32 universal INT8 scales; k_mean: ``[b, HK, D]`` fp32 or None.
        scale: softmax scale (default ``D**-0.5``). causal: mask keys after each query's position.
        window: sliding window (key ``j`` visible from position ``i`` iff ``i - j < window``).
        softcap: logit softcapping ``softcap * tanh(s / softcap)``. key_valid: ``[b, kv_len]`` bool.
        softmax: ``"exact"`` or ``"sas"``; sas_threshold in natural-log units.
        n_splits / waves / min_tiles / block_m / num_warps / num_stages: launch overrides (tests, tuning);
            ``n_splits`` an int for every group or ``{bits: n}`` per bit group (as the reference takes it;
            different counts within a launch need ``merge="fused"``);
            ``num_stages`` None: ``INT2_STAGES`` for a launch with a 2-bit group and no INT8 one, else 2;
            by default the context is cut into shares for about ``DEFAULT_WAVES x #SMs`` programs (up to
            ``RESIDENT_PER_SM x #SMs`` when the shares keep ``FILL_MIN_TILES`` tiles), see :func:`plan_splits`.
        max_registers: cap on registers per thread (ptxas ``maxnreg``; GPU only): more programs per SM at the
            price of spills (a tuning knob, measured in ``eval/experiments/decode_sweep.py``).
        merge: ``"fused"`` (the last share of a tile to finish merges the partials: one launch) or
            ``"kernel"`` (a second small merge kernel).
        fold: packed heads fold ``scale_int``/``zero`` into the query and the output instead of restoring
            INT8 tiles (same integers; ``False`` = the restoring variant, kept for measurements). Where a folded
            8-bit dot would reduce over fewer than 32 (packed K bytes < 32, e.g. head_dim 64 at 2 bits, or
            block < 64) the restoring loop runs regardless (Triton's NVIDIA backend rejects K < 32).
        lens: ``[2]`` int32 on the device, ``(n_blocks, n_tail)``: the lengths are read by the kernel, not from
            ``groups``/``n_tail`` (a static cache inside a CUDA graph: no host int changes between steps). The
            split plan is made for the groups' capacity, so the launch is the same every step; ``key_valid``
            may then be wider than ``kv_len`` (``[b, >= kv_len]``, e.g. a static cache's capacity).
        rotate: K (and ``k_scale``, ``k_mean``) are stored Hadamard-rotated (``rotation.rotate``, ``rotate_qk``);
            ``q`` is passed unrotated and rotated in the kernel's prologue, ``(q · diag(qk_smooth)) · H``
            (query head h uses KV head h // g), instead of a separate op per step.
        qk_smooth: ``[b, HK, D]`` fp32 K -> Q smoothing factors (``rotation.smooth_scales``; "smooth_hadamard"),
            None for plain "hadamard"; needs ``rotate``.
        store: ``(k, v, nonfinite or None)``, an eager decode step's new token ``[b, HK, 1, D]`` that is counted in
            ``n_tail`` but not written yet: the kernel writes it to slot ``n_tail - 1`` as ``store.store_int8_tokens``
            would (one launch for the step's store and attention; with ``rotate`` its K rotated as the store
            kernel rotates it). Needs ``Lq == 1``, one M tile (``G <= 64``) and no ``lens``.
    Returns:
        ``[b, Lq, HQ, D]`` in ``q.dtype``.
    """
    # the static part of the call (validation, sizes, storage arguments): decode_entry, reused across steps
    if isinstance(n_splits, dict):
        n_splits = tuple(sorted((int(k), int(v)) for k, v in n_splits.items()))
    stor = decode_storage(k_tail, v_tail, k_scale, v_scale, k_mean, qk_smooth, groups)
    st = decode_entry(q, groups, stor, key_valid is None, lens is None, scale=scale, causal=causal, window=window,
                      softcap=softcap, n_sink=n_sink, softmax=softmax, sas_threshold=sas_threshold,
                      n_splits=n_splits, waves=waves, min_tiles=min_tiles, block_m=block_m, num_warps=num_warps,
                      num_stages=num_stages, max_registers=max_registers, merge=merge, fold=fold, rotate=rotate)
    if lens is not None:
        if store is not None:
            raise ValueError("store= takes host lengths; a launch with lens stores through store_step")
        return st.run_lens(q, groups, stor, lens, key_valid)
    return st.run(q, groups, stor, n_tail, key_valid, store)


def decode_entry(q: torch.Tensor, groups: Sequence[PackedKV], stor: tuple, no_key_valid: bool, host_lens: bool,
                 *, scale=None, causal=True, window=None, softcap=None, n_sink=0, softmax="exact",
                 sas_threshold=6.0, n_splits=None, waves=None, min_tiles=4, block_m=None, num_warps=1,
                 num_stages=None, max_registers=None, merge="fused", fold=True, rotate=False,
                 rebind_only=False) -> Optional["_DecodeStatic"]:
    """The static part of a :func:`turbo_decode_attention` call (its options as there; ``stor`` from
    :func:`decode_storage`; ``no_key_valid``: the call passes no ``key_valid``; ``host_lens``: the lengths come from
    the host, not ``lens``): made once per (storage tensor objects, query layout, options) and kept process-wide.
    ``rebind_only``: None where the entry would be new (no layout seen before): the caller only wants the cheap
    rebinding, ahead of the call (``q`` may then be any tensor of the call's query layout).

    Consecutive decode steps of a layer pass the same buffers, and rebuilding the entry cost ~60 us of Python per
    call (eval/PERF_NOTES.md, decode round 6). Buffers replaced (capacity growth, beam reorder) are new objects,
    hence a new entry; entries hold weak references only (``alive``)."""
    key = (tuple(map(id, stor)), tuple((g_.bits, g_.k_bits) for g_ in groups), q.shape, q.dtype, q.stride(),
           q.device, scale, causal, window, softcap, no_key_valid, n_sink, softmax, sas_threshold, n_splits, waves,
           min_tiles, block_m, num_warps, num_stages, max_registers, merge, fold, host_lens, rotate)
    st = _STATIC.get(key)
    if st is None or not st.alive(stor):
        # a new cache of a layout seen before (every generate() makes one): the entry of that layout, rebound
        lay_key = (tuple(map(_layout, stor)),) + key[1:]
        proto = _LAYOUTS.get(lay_key)
        if proto is not None:
            st = proto.rebound(stor)
        elif rebind_only:
            return None
        else:
            st = _DecodeStatic(q, groups, stor, scale=scale, causal=causal, window=window, softcap=softcap,
                               n_sink=n_sink, softmax=softmax, sas_threshold=sas_threshold, n_splits=n_splits,
                               waves=waves, min_tiles=min_tiles, block_m=block_m, num_warps=num_warps,
                               num_stages=num_stages, max_registers=max_registers, merge=merge, fold=fold,
                               rotate=rotate)
        if st.cacheable:
            if len(_STATIC) >= _STATIC_MAX:
                _STATIC.clear()
                _LAYOUTS.clear()
            _STATIC[key] = _LAYOUTS[lay_key] = st
    return st


def _layout(t: Optional[torch.Tensor]):
    """What a decode entry and its compiled launches depend on in one storage tensor besides its address: shape,
    strides, dtype, device and the address's 16-byte alignment (a launch is specialised on it)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15 == 0  # get_device: no torch.device made


def decode_storage(k_tail, v_tail, k_scale, v_scale, k_mean, qk_smooth, groups: Sequence[PackedKV]) -> tuple:
    """The storage tensors of a decode call, in the order a decode entry holds them (``stor``)."""
    stor = (k_tail, v_tail, k_scale, v_scale, k_mean, qk_smooth)
    for g_ in groups:
        stor += (g_.heads, g_.k, g_.v, g_.k_scale, g_.k_zero, g_.v_sz)
    return stor


def _none_ref():
    return None


_KVALID: list = [None, -1, None]  # (weakref to the last key_valid, its version, its int8 copy)


def _kvalid_int8(key_valid: torch.Tensor) -> torch.Tensor:
    """``key_valid`` as contiguous int8 for the kernel. Every layer of a forward passes the same mask tensor (the
    model builds it once per forward): it is converted once, reused while it is the same object at the same
    version (an in-place change bumps ``_version``; a new mask is a new object)."""
    try:
        version = key_valid._version
    except RuntimeError:  # an inference-mode tensor has no version counter: convert every call
        return key_valid.to(torch.int8).contiguous()
    ref, ver, out = _KVALID
    if ref is not None and ref() is key_valid and ver == version:
        return out
    out = key_valid.to(torch.int8).contiguous()
    _KVALID[:] = [weakref.ref(key_valid), version, out]
    return out


class _StepLaunch:
    """What ``_DecodeStatic.run_step`` replays: a launch with host lengths (with or without the step's token), the
    facts it was specialised and planned on (``_step_facts``) and its argument tuple's fixed parts."""

    __slots__ = ("facts", "lean", "launch", "sizes", "ws_key", "ws", "cuda", "kv_ptr", "ln_ptr", "no_token", "head",
                 "groups", "tail")

    def __init__(self, facts, hit, grid, device, sizes, kv_ptr, ln_ptr, tps0, tps1, S0, S1, n_m, b, nstr):
        _, compiled, ptrs = hit
        self.facts, self.lean, self.launch, self.sizes = facts, _DECODE, LeanLaunch.bind(compiled, (grid,)), sizes
        self.cuda, self.ws_key = device.type == "cuda", (device.type, device.index)
        self.kv_ptr, self.ln_ptr = kv_ptr, ln_ptr
        self.no_token = (ln_ptr, ln_ptr, ln_ptr)  # STORE off: sv takes the new token's slots (never read)
        self.ws = self.workspace(device)
        self.head, self.groups = ptrs[0], ptrs[1]
        self.tail = (tps0, tps1, S0, S1, n_m, b) + ptrs[2] + nstr + ptrs[3]

    def rebased(self, head: tuple, groups: tuple) -> "_StepLaunch":
        """This launch over other storage of the same layout: ``head`` / ``groups`` its tensors' addresses (``run``'s
        order); the facts, plan and compiled launch are the layout's."""
        rec = object.__new__(_StepLaunch)
        for name in _StepLaunch.__slots__:
            setattr(rec, name, getattr(self, name))
        rec.head, rec.groups, rec.kv_ptr, rec.ln_ptr = head, groups, head[2], head[4]  # k_tail and sv stand in
        rec.no_token = (head[4],) * 3
        if rec.sizes is None:  # no workspace: the new sv takes its slots
            rec.ws = rec.workspace(None)
        return rec

    def workspace(self, device) -> tuple:
        """(a weak reference to the workspace's partials, its three addresses): weak, so a record does not keep a
        regrown workspace's old buffers alive; without one (``sizes`` None) sv takes the slots."""
        if self.sizes is None:
            return (_none_ref, self.ln_ptr, self.ln_ptr, self.ln_ptr)
        ws = _workspace(device, *self.sizes)
        return (weakref.ref(ws[0]),) + tuple(map(_data_ptr, ws))


_data_ptr = torch.Tensor.data_ptr
_STATIC: dict = {}
#: the entries by storage layout (``_layout`` of each tensor in place of its identity): a new cache's first decode
#: step rebinds one (``_DecodeStatic.rebound``) instead of planning and specialising its launches again (once per
#: generate() and layer: 146 -> 89 us of that step's host on the CPU, launches stubbed; eval/PERF_NOTES.md session 36)
_LAYOUTS: dict = {}
_NO_STRIDES = (0, 0, 0, 0)  # the new token's strides without STORE (never read)
_N_HEAD = 6  # the leading storage tensors of ``stor`` (k_tail .. qk_smooth); the bit groups' follow
_STATIC_MAX = 512  # layers x (bit layouts, options) of a process; cleared when full (rebuilt on demand)


class _DecodeStatic:
    """The part of a ``turbo_decode_attention`` call that depends only on the storage tensors, the query's
    layout and the options; ``run`` adds what changes every step (query, ``n_blocks``, ``n_tail``, the
    split plan, the output). ``stor`` = (k_tail, v_tail, k_scale, v_scale, k_mean, qk_smooth, then per group heads,
    k, v, k_scale, k_zero, v_sz): the entry keeps weak references to them and indices into ``stor``,
    never the tensors (a dropped cache frees its memory). Inputs that would need a converted copy (scales not
    fp32-contiguous, a non-contiguous INT8 buffer) make an entry for that call only (``cacheable`` false): a
    cached copy could go stale. Assumed, as of any buffer a kernel keeps using: a storage tensor object is not
    re-pointed or re-shaped in place (``Tensor.set_``, ``resize_``) between calls; the cache replaces its
    buffers by new tensors (capacity growth, beam reorder), which is a new entry; contents may change freely."""

    def __init__(self, q, groups, stor, *, scale, causal, window, softcap, n_sink, softmax, sas_threshold,
                 n_splits, waves, min_tiles, block_m, num_warps, num_stages, max_registers, merge, fold, rotate):
        k_tail, v_tail, k_scale, v_scale, k_mean, qk_smooth = stor[:_N_HEAD]
        if q.dim() != 4:
            raise ValueError(f"q must be [b, HQ, Lq, D], got shape {tuple(q.shape)}")
        b, HQ, Lq, D = q.shape
        HK = k_tail.shape[1]
        if HQ % HK:
            raise ValueError(f"{HQ} query heads are not a multiple of {HK} KV heads")
        if merge not in ("fused", "kernel"):
            raise ValueError(f"merge={merge!r} must be 'fused' or 'kernel'")
        if softmax not in ("exact", "sas"):
            raise ValueError(f"softmax={softmax!r} must be 'exact' or 'sas'")
        if not groups:
            raise ValueError("groups is empty: pass at least one PackedKV (possibly with 0 blocks)")
        BS = groups[0].block_size
        C = k_tail.shape[2]
        if C % BS or tuple(v_tail.shape[2:]) != (D, C):
            raise ValueError(f"INT8 buffers k_tail {tuple(k_tail.shape)} / v_tail {tuple(v_tail.shape)} must be "
                             f"[b, HK, C, {D}] / [b, HK, {D}, C] with C a multiple of the block size {BS}")
        if n_sink % BS or not 0 <= n_sink <= C:
            raise ValueError(f"n_sink={n_sink} must be a multiple of {BS} in [0, {C}], all held once blocks are packed")
        self.refs = tuple(_none_ref if t is None else weakref.ref(t) for t in stor)
        G = HQ // HK
        scale = D ** -0.5 if scale is None else float(scale)
        check_qk_smooth(qk_smooth, rotate, k_tail)  # [b, HK, C, D]: factors [b, HK, D] with rotate on
        # RotationError (a ValueError) for a head dim without a rotation block
        rot = rotate_constexprs(D, rotate, qk_smooth is not None)
        rot_n = rot["ROT_N"] if rotate else 1
        self.q_copy = q.stride(-1) != 1
        qs = q.stride() if not self.q_copy else (HQ * Lq * D, Lq * D, D, 1)
        self.o_shape, self.device, self.rotate = (b, Lq, HQ, D), q.device, bool(rotate)
        self.b, self.Lq, self.BS, self.C, self.n_sink, self.window = b, Lq, BS, C, n_sink, window
        BD = _pow2(D)
        M = G * Lq
        BM = block_m or min(MAX_BLOCK_M, max(4, _pow2(M)))  # query rows are the N side of the MMAs
        self.BM, self.BD, self.n_m, self.G = BM, BD, -(-M // BM), G
        conv = [k_tail.contiguous(), v_tail.contiguous(), k_scale.float().contiguous(), v_scale.float().contiguous(),
                k_mean.float().contiguous() if k_mean is not None else None,
                qk_smooth.float().contiguous() if qk_smooth is not None else None]
        self.cacheable = all(c is t for c, t in zip(conv, stor[:_N_HEAD]))
        self.conv = None if self.cacheable else tuple(conv)  # this call's converted inputs (not cached)
        # sk, mk, k_tail, v_tail, sv, qsm (an absent mk / qsm: sk stands in, never read)
        self.head = operator.itemgetter(2, 4 if k_mean is not None else 2, 0, 1, 3, 5 if qk_smooth is not None else 2)
        use_asm = q.device.type == "cuda" and not _INTERPRET
        reg_cap = {"maxnreg": int(max_registers)} if max_registers and use_asm else {}
        self.sms = sm_count(q.device)  # CPU (interpreter): 4 "SMs", so tests exercise the split + merge path
        self.plan_opts = (waves, n_splits, min_tiles)
        self.merge, self.num_warps = merge, num_warps
        # qscale: the rotation's 1/sqrt(n) rides in the row scale (the query's INT8 codes do not depend on it)
        self.scalars = (int(window or 0), float(softcap or 1.0), float(sas_threshold * LOG2E),
                        float(scale * LOG2E / math.sqrt(rot_n)), qs[0], qs[1], qs[2])
        # one launch per pair of bit groups (mixed: its INT4 and INT2 heads together), split plan over the pair
        self.pairs = []
        for pair in launch_pairs(groups):
            g0, g1 = pair[0], pair[-1]
            H0, H1 = g0.heads.shape[0], (g1.heads.shape[0] if len(pair) == 2 else 0)
            ga, gs = [], []
            for grp in (g0, g1):
                # the group's tensors in ``stor``: heads, k, v, k_scale, k_zero, v_sz from i0 on; the kernel
                # takes heads, k, k_scale, k_zero, v, v_sz (INT8 groups: k stands in for the scales and zeros
                # they do not have)
                i0 = _N_HEAD + 6 * next(i for i, g_ in enumerate(groups) if g_ is grp)
                heads, k, v, ks, kz, vsz = range(i0, i0 + 6)
                if grp.k_bits == 8:
                    ks = kz = k
                    sst = (0, 0)
                else:
                    sst = (grp.k_scale.stride(0), grp.k_scale.stride(1))
                if grp.bits == 8:
                    vsz = k
                    vst = (0, 0)
                else:
                    if grp.v_sz.stride()[2:] != (2 * BS, BS, 1):
                        raise ValueError(f"v_sz must hold each block's scales and zeros as one contiguous [2, {BS}] "
                                         f"row (pack.py format); got strides {grp.v_sz.stride()}")
                    vst = (grp.v_sz.stride(0), grp.v_sz.stride(1))
                ga += [heads, k, ks, kz, v, vsz]
                gs += [grp.k.stride(0), grp.k.stride(1), *sst, grp.v.stride(0), grp.v.stride(1), *vst]
            const = dict(G=G, D=D, BD=BD, BS=BS, BM=BM, BITS0=g0.bits, BITS1=g1.bits, TWO_GROUPS=H1 > 0,
                         K8=keeps_int8_k(groups),
                         IS_CAUSAL=bool(causal), HAS_WINDOW=bool(window), HAS_SOFTCAP=bool(softcap),
                         HAS_MEAN=k_mean is not None, **rot)
            opts = dict(USE_SAS=softmax == "sas", FOLD=bool(fold), USE_ASM=use_asm)
            n_work = b * (H0 + H1) * self.n_m
            self.pairs.append((n_work, operator.itemgetter(*ga), tuple(gs) + (H0, H1, HK), const, opts, dict(
                num_warps=num_warps, num_stages=num_stages or _stages(g0.bits, g1.bits), **reg_cap),
                (ga[0], ga[6], H0, H1, HK, G, D)))
        # (pair, split, fused, sc, has kvalid, alignments, device) -> (the launch's keyword arguments, the
        # compiled kernel that ran with them or None, (the storage tensors' addresses, the trailing scalars))
        self.launches = {}
        self.plans = {}  # (pair, visible tiles) -> _step_plan
        self.step = None  # the last launch with host lengths, for ``run_step`` to replay (``_StepLaunch``)
        self.first = None  # the first one recorded: what a rebound entry's first step replays (``rebound``)

    def rebound(self, stor) -> "_DecodeStatic":
        """This entry for other storage tensors of the same layout (``_layout``: shapes, strides, dtypes, devices,
        alignments): everything derived from the layout is shared, the launches keep their compiled kernels with
        the new tensors' addresses, and the step it replays is this entry's first recorded step on them: a new cache's
        first decode step is usually the last cache's first one again (the same prompt length), and replays."""
        st = object.__new__(_DecodeStatic)  # a shallow copy without copy.copy's __reduce_ex__ round trip (6x faster)
        st.__dict__.update(self.__dict__)
        st.refs = tuple(_none_ref if t is None else weakref.ref(t) for t in stor)
        head = tuple(t.data_ptr() for t in self.head(stor))
        pairs = [tuple(t.data_ptr() for t in pair[1](stor)) for pair in self.pairs]
        st.launches = {kk: (kw, ran, ptrs if ptrs is None else (head, pairs[kk[0]]) + ptrs[2:])
                       for kk, (kw, ran, ptrs) in self.launches.items()}
        st.step = st.first = None if self.first is None else self.first.rebased(head, pairs[0])
        return st

    def alive(self, stor) -> bool:
        """The entry's storage tensors are the objects passed now (ids of dead objects can be reused)."""
        return len(stor) == len(self.refs) and all(map(operator.is_, map(operator.call, self.refs), stor))

    def _step_plan(self, i_p, n_tiles):
        """What a launch of pair ``i_p`` over ``n_tiles`` visible tiles needs from the plan (host ints only):
        ``(S0, tps0, S1, tps1, S, split, fused, sc, workspace sizes or None, grid size)``, memoised per entry
        (the same value changes once per block of decode steps)."""
        memo = self.plans.get((i_p, n_tiles))
        if memo is not None:
            return memo
        n_work, _, gs, const = self.pairs[i_p][:4]
        n0 = self.b * gs[-3] * self.n_m  # group 0's work items (gs ends with H0, H1, HK)
        waves, n_splits, min_tiles = self.plan_opts
        (S0, tps0), (S1, tps1) = _pair_plan(n_tiles, n0, n_work - n0, const["BITS0"], const["BITS1"],
                                            self.sms, waves, n_splits, min_tiles, self.merge == "fused")
        S = max(S0, S1)
        split = S > 1
        fused = split and self.merge == "fused"
        if S0 != S1 and not fused:
            raise ValueError(f"share counts per bit group {S0} != {S1} need merge='fused' (the merge kernel takes "
                             f"one count for all)")
        sc = _merge_chunk(S, self.BM, self.BD, self.num_warps)
        sizes = None
        if not split and self.rotate:  # the rotated query's round trip (one slot per program)
            sizes = (n_work * self.BM * self.BD, 1, 1)
        if split:
            # partials of the S shares (+ one per group of SC shares for the fused two-level merge), counters
            n_grp = -(-S // sc)
            slots = S + (n_grp if fused and n_grp > 1 else 0)
            sizes = (slots * n_work * self.BM * self.BD, slots * n_work * self.BM * 2, n_work * (n_grp + 1))
        memo = self.plans[(i_p, n_tiles)] = (S0, tps0, S1, tps1, S, split, fused, sc, sizes,
                                             n0 * S0 + (n_work - n0) * S1)
        return memo

    def run(self, q, groups, stor, n_tail, key_valid, store=None):
        n_blocks = groups[0].n_blocks
        for g_ in groups:
            if g_.n_blocks != n_blocks:
                raise ValueError(f"bit groups hold different block counts {[g_.n_blocks for g_ in groups]}")
        BS, C, n_sink, Lq = self.BS, self.C, self.n_sink, self.Lq
        if not 0 <= n_tail <= C:
            raise ValueError(f"n_tail={n_tail} must lie in [0, {C}] (the INT8 buffer's slots)")
        if n_blocks and n_tail < n_sink:
            raise ValueError(f"n_tail={n_tail} < n_sink={n_sink}: the sink slots must all be held once blocks are packed")
        kv_len = n_blocks * BS + n_tail
        if Lq > kv_len:
            raise ValueError(f"query chunk of {Lq} tokens exceeds the {kv_len} stored tokens (store first)")
        if key_valid is not None and tuple(key_valid.shape) != (self.b, kv_len):
            raise ValueError(f"key_valid must be [b, kv_len] = {(self.b, kv_len)}, got {tuple(key_valid.shape)}")
        n_tiles = n_blocks + -(-n_tail // BS)
        t0 = 0
        if self.window:
            t0 = min(max(first_visible_tile(kv_len, Lq, self.window, BS) - n_sink // BS, 0), n_blocks)
        if store is not None:
            store = self._new_token(store, n_tail)
        return self._launch(q, stor, key_valid, None, (n_blocks, n_tail, kv_len, kv_len, t0), n_tiles - t0, store)

    def run_step(self, q, groups, stor, n_tail, key_valid, k=None, v=None, nf=None):
        """``run(q, groups, stor, n_tail, key_valid, store)`` (``store`` = ``(k, v, nf)``, or None without ``k``) for a
        step like the last launch ``run`` made (``self.step``): the same tile plan and the same facts of the query,
        mask and new token. Only addresses and lengths are new, so the launch is one argument tuple and the C
        launcher: no plan, key or facts rebuilt (the eager step's host time, issue 18). Returns None where it does
        not apply; ``run`` then does everything. The caller has checked ``alive(stor)`` (the addresses kept are the
        storage's)."""
        rec = self.step
        if rec is None or rec.lean is not _DECODE or LeanLaunch.hooks_active():
            return None
        BS, Lq = self.BS, self.Lq
        n_blocks = groups[0].n_blocks
        for g_ in groups:
            if g_.n_blocks != n_blocks:
                return None
        kv_len = n_blocks * BS + n_tail
        t0 = 0
        if self.window:
            t0 = min(max(first_visible_tile(kv_len, Lq, self.window, BS) - self.n_sink // BS, 0), n_blocks)
        kv_ptr = rec.kv_ptr
        if key_valid is not None:
            if tuple(key_valid.shape) != (self.b, kv_len):
                return None
            kv_ptr = _kvalid_int8(key_valid).data_ptr()
        if self.q_copy:  # as ``_launch``: the strides the entry passes are a contiguous query's
            q = q.contiguous()
        q_ptr = q.data_ptr()
        new = rec.no_token
        if k is not None:
            new = (k.data_ptr(), v.data_ptr(), nf.data_ptr() if nf is not None else rec.ln_ptr)
        if (self._step_facts(n_blocks, n_tail, t0, q_ptr | kv_ptr | new[0] | new[1] | new[2], key_valid is None, k, v,
                             nf, current_cuda_device() if rec.cuda else -1) != rec.facts
                or not 0 <= n_tail <= self.C or Lq > kv_len or (n_blocks and n_tail < self.n_sink)):
            return None
        o = torch.empty(self.o_shape, dtype=q.dtype, device=self.device)
        ws = rec.ws
        if rec.sizes is not None and (_WORKSPACE.get(rec.ws_key) or (None,))[0] is not ws[0]():
            rec.ws = ws = rec.workspace(self.device)  # regrown (or dropped) since: another call's sizes
        LeanLaunch.fire(rec.launch, (q_ptr, *rec.head, kv_ptr, o.data_ptr(), *ws[1:], rec.ln_ptr, *new, *rec.groups,
                                     n_blocks, n_tail, self.n_sink, self.C, Lq, kv_len, kv_len, t0) + rec.tail)
        return o

    def _step_facts(self, n_blocks, n_tail, t0, ptrs, no_key_valid, k, v, nf, cur) -> tuple:
        """What a launch with host lengths was specialised and planned on, for ``run_step`` to compare: blocks, tiles,
        visible tiles (the plan), every pointer's 16-byte alignment (``ptrs``: their OR), the mask's presence, the
        new token's counter, shapes, strides and dtypes (None without one), the current device."""
        n_tiles = n_blocks + -(-n_tail // self.BS)
        tok = None if k is None else (nf is None, k.shape, v.shape, k.stride(), v.stride(), k.dtype, v.dtype)
        return n_blocks, n_tiles, n_tiles - t0, ptrs & 15 == 0, no_key_valid, tok, cur

    def _new_token(self, store, n_tail):
        """``store = (k, v, nonfinite)`` checked for the launch -> (k, v, nonfinite, its facts, its strides)."""
        k, v, nf = store
        shape = (self.b, self.o_shape[2] // self.G, 1, self.o_shape[3])
        if not stores_in_launch(self.Lq, self.G, 1) or self.n_m != 1 or n_tail < 1:
            raise ValueError(f"store= needs one query token, one M tile and n_tail >= 1 (got Lq {self.Lq}, "
                             f"{self.n_m} M tiles, n_tail {n_tail})")
        if k.shape != shape or v.shape != shape:
            raise ValueError(f"store= K/V must be {shape}, got {tuple(k.shape)} / {tuple(v.shape)}")
        ks, vs = k.stride(), v.stride()
        if ks[3] != 1:
            k = k.contiguous()
            ks = k.stride()
        if vs[3] != 1:
            v = v.contiguous()
            vs = v.stride()
        strides = (ks[0], ks[1], vs[0], vs[1])
        facts = (k.dtype, v.dtype, nf is not None, k.data_ptr() & 15 == 0, v.data_ptr() & 15 == 0,
                 nf is None or nf.data_ptr() & 15 == 0, strides)
        return k, v, nf, facts, strides

    def run_lens(self, q, groups, stor, lens, key_valid):
        """``run`` with the lengths on the device (``lens``): the same launches every step, planned for the groups'
        capacity; nothing here reads a length (CUDA-graph safe)."""
        if lens.dtype != torch.int32 or lens.numel() < 2 or lens.device != self.device:
            raise ValueError(f"lens must be int32 [2] (n_blocks, n_tail) on {self.device}, got {lens.dtype} "
                             f"{tuple(lens.shape)} on {lens.device}")
        kv_row = 0
        if key_valid is not None:
            if key_valid.dim() != 2 or key_valid.shape[0] != self.b:
                raise ValueError(f"key_valid must be [b={self.b}, >= kv_len], got {tuple(key_valid.shape)}")
            kv_row = key_valid.shape[1]
        cap_tiles = groups[0].capacity + self.C // self.BS
        return self._launch(q, stor, key_valid, lens, (0, 0, 0, kv_row, 0), cap_tiles)

    def _launch(self, q, stor, key_valid, lens, lengths, n_plan, store=None):
        """The launches of one call: ``lengths`` = (n_blocks, n_tail, kv_len, kvalid row length, t0) (host values;
        ignored by a LENS launch), ``n_plan`` the visible tiles the split plan is made for; ``store``: the new
        token's (k, v, nonfinite, facts, strides) from ``_new_token`` or None."""
        if self.conv is not None:
            stor = self.conv + stor[_N_HEAD:]
        n_blocks, n_tail, kv_len, kv_row, t0 = lengths
        C, n_sink, Lq = self.C, self.n_sink, self.Lq
        if key_valid is None:
            kvalid = None
        elif lens is not None:  # no cached copy: it would outlive a CUDA-graph capture (a bool mask is read as int8)
            kvalid = key_valid.view(torch.int8) if key_valid.dtype == torch.bool and key_valid.is_contiguous() \
                else key_valid.to(torch.int8).contiguous()
        else:
            kvalid = _kvalid_int8(key_valid)
        if self.q_copy:
            q = q.contiguous()
        o = torch.empty(self.o_shape, dtype=q.dtype, device=self.device)
        head = self.head(stor)
        sv = head[4]
        ln = lens if lens is not None else sv
        cur = current_cuda_device() if self.device.type == "cuda" else -1
        kv = kvalid if kvalid is not None else head[2]
        # the launch's specialisation facts beyond the entry's: the query's and key_valid's 16-byte alignment
        # (o and the workspace are fresh allocations; the integers that change are not specialised)
        q_ptr, kv_ptr = q.data_ptr(), kv.data_ptr()
        if store is None:
            kn = vn = nf = sv  # never read (STORE off)
            nstr, sfacts = _NO_STRIDES, None
            sv_ptr = sv.data_ptr()
            new_ptrs = (sv_ptr, sv_ptr, sv_ptr)
        else:
            kn, vn, nf, sfacts, nstr = store
            if nf is None:
                nf = sv
            new_ptrs = (kn.data_ptr(), vn.data_ptr(), nf.data_ptr())
        facts = (kvalid is not None, q_ptr & 15 == 0, kv_ptr & 15 == 0, cur, lens is not None, sfacts)
        lean = isinstance(_DECODE, LeanLaunch) and not LeanLaunch.hooks_active()
        for i_p, pair in enumerate(self.pairs):
            S0, tps0, S1, tps1, S, split, fused, sc, sizes, grid = self._step_plan(i_p, n_plan)
            if sizes is not None:
                po, pml, cnt = _workspace(self.device, *sizes)
            else:
                po = pml = cnt = sv
            # a compiled kernel is loaded per device; Triton launches on the current one
            kk = (i_p, split, fused, sc) + facts
            hit = self.launches.get(kk)
            if hit is not None and hit[1] is not None and lean:
                _, compiled, ptrs = hit  # the entry's storage tensors' addresses (same objects: ``alive``)
                LeanLaunch.relaunch(compiled, (grid,), (
                    q_ptr, *ptrs[0], kv_ptr, o.data_ptr(), po.data_ptr(), pml.data_ptr(), cnt.data_ptr(),
                    ln.data_ptr(), *new_ptrs, *ptrs[1], n_blocks, n_tail, n_sink, C, Lq, kv_len, kv_row, t0, tps0,
                    tps1, S0, S1, self.n_m, self.b) + ptrs[2] + nstr + ptrs[3])
            else:
                n_work, ga, gs, const, opts, launch, merge_args = pair
                kw = hit[0] if hit is not None else dict(
                    const, HAS_KVALID=kvalid is not None, **opts, SPLIT=split, FUSED_MERGE=fused, SC=sc,
                    LENS=lens is not None, STORE=store is not None, COUNT=store is not None and store[2] is not None,
                    **launch)
                ga_t = ga(stor)
                ran = _DECODE[(grid,)](q, *head, kv, o, po, pml, cnt, ln, kn, vn, nf, *ga_t, n_blocks, n_tail, n_sink,
                                       C, Lq, kv_len, kv_row, t0, tps0, tps1, S0, S1, self.n_m, self.b, *self.scalars,
                                       *gs[:-3], *nstr, *gs[-3:], **kw)
                if self.cacheable and isinstance(_DECODE, LeanLaunch) and ran is not None:  # relaunch from now on
                    ptrs = (tuple(t.data_ptr() for t in head), tuple(t.data_ptr() for t in ga_t),
                            self.scalars + gs[:-3], gs[-3:])
                    self.launches[kk] = hit = (kw, ran, ptrs)
                elif hit is None:
                    self.launches[kk] = (kw, None, None)
            ptrs_or = q_ptr | kv_ptr | new_ptrs[0] | new_ptrs[1] | new_ptrs[2]
            # one launch with host lengths, every pointer 16-byte aligned (the one alignment fact ``run_step`` checks):
            # ``run_step`` replays it
            if lens is None and len(self.pairs) == 1 and hit is not None and hit[1] is not None and \
                    (fused or not split) and not ptrs_or & 15:
                k_new = (kn, vn, store[2]) if store is not None else (None, None, None)
                self.step = _StepLaunch(
                    self._step_facts(n_blocks, n_tail, t0, ptrs_or, kvalid is None, *k_new, cur),
                    hit, grid, self.device, sizes, head[2].data_ptr(), sv.data_ptr(), tps0, tps1, S0, S1, self.n_m,
                    self.b, nstr)
                if self.first is None:
                    self.first = self.step
            if split and not fused:
                if lens is not None:
                    raise ValueError("merge='kernel' takes host lengths; a launch with lens needs merge='fused'")
                h0, h1, H0, H1, HK, G, D = pair[6]
                _merge_kernel[(self.n_m, pair[0] // self.n_m)](
                    po, pml, stor[h0], stor[h1], sv, o, Lq, S, H0, H1, HK, G=G, D=D, BD=self.BD, BM=self.BM,
                    SC=_merge_chunk(S, self.BM, self.BD, 4), num_warps=4)
        return o
