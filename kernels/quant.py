"""Fused INT8 quantization of the prefill attention operands (bf16/fp16 -> int8 + fp32 scales).

INT-FlashAttention (Chen et al., 2024, §3): per-token symmetric INT8 for Q and K; V with a scale that
factors out of P.V (here per block of BLOCK_N tokens and per channel). SageAttention (Zhang et al., 2024,
§3.2): K is first centred by its per-channel mean over the tokens (softmax-invariant, removes the channel
outliers of K). FlashAttention-3 (Shah et al., 2024, §3.3): 8-bit wgmma wants both operands K-major, so
V is written transposed, ``[d, tokens]``, tokens contiguous.

Each kernel reads its bf16/fp16 input once (any strides: HF hands over transposed views) and writes the
int8 codes and fp32 scales once. The K mean is ``reference.k_smooth_mean`` bit for bit (an exact fp64 sum shared
with the reference and the cache's store, so all quantize against the same mean): the prefill reads K once for it
in ``_k_sum_kernel`` (fp64 sums of token splits) and the Q+K pass finishes it (torch's reduction cast all of K to
fp64 first, 3-4x the Q+K pass's time). K and V
stay two passes: a fused K+V pass measured no faster on the H100 once the passes load 16 bytes (0.96-1.00x,
eval/results/bench_quant_h100.json). The prefill launches Q's and K's passes as one (``_quant_qk_kernel``: Q's
programs, then K's, each the same row helper; ``quantize_qk``): one launch fewer per layer, the same bits. V stays
its own launch after K's: it flags poisoned keys in K's scales, which K's pass writes. With ``rotate_qk`` (issue 23
item 5) that pass also Hadamard-rotates Q and K (``ROTATE``; ``hadamard.hadamard_rows``, fp32 butterflies in registers)
instead of a separate fp32 matmul writing rotated copies (eval/PERF_NOTES.md, issue 23).

Loads: the batch / head / token strides stay out of the specialization key (they change with L), so the
compiler knows nothing of their divisibility and loads every bf16 element alone (2-byte ``ld.global.b16``
in the sm_90 PTX). The launchers pass VEC = elements per 16 bytes when all those strides are multiples of it
(``_vec``; HF's layouts always are), and the kernels write each stride as ``s // VEC * VEC``: 16-byte loads.

Rounding: ``trunc(x * (127 / amax) + copysign(0.5, .))`` (half away from zero), ``127 / amax`` and
``amax / 127`` correctly rounded (``div_rn``), FMA contraction off: bit-exact with ``reference.py``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .device import sm_count
from .hadamard import hadamard_rows
from .interpreter import interpreting
from .launch import lean
from .reference import (DEFAULT_BLOCK_N, PV_HALF_DTYPES, _finite_token_amax,  # noqa: F401  (k_smooth_mean re-exported)
                        k_smooth_mean)
from .rotation import rotation_block

__all__ = ["quantize_per_token", "quantize_qk", "quantize_v_blocks", "quantize_v_channels", "v_operand_half",
           "k_smooth_mean", "k_mean", "interpreting"]




def _check_device(x: torch.Tensor, what: str) -> None:
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{what} is on {x.device}, but the Triton kernels need CUDA tensors; set TRITON_INTERPRET=1 "
            "before importing triton to run them on the CPU, or use "
            "turbo_attn_hf.kernels.reference.turbo_attention"
        )


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _to_int8_half_away(x, inv):
    """int8 codes of fp32 ``x`` scaled by ``inv`` (broadcast): trunc(x*inv + copysign(0.5)), clamped."""
    xs = x * inv
    r = tl.where(xs >= 0, xs + 0.5, xs - 0.5)
    return tl.minimum(tl.maximum(r.to(tl.int32), -127), 127).to(tl.int8)


@triton.jit
def _to_int8_half_away_lim(x, inv, lim):
    """``_to_int8_half_away`` clamped to [-lim, lim] (broadcast): lim 0 codes a poisoned token 0 whatever
    x * inv is (NaN: 0 on the GPU, INT_MIN in the interpreter), at no cost per element."""
    xs = x * inv
    r = tl.where(xs >= 0, xs + 0.5, xs - 0.5)
    return tl.minimum(tl.maximum(r.to(tl.int32), -lim), lim).to(tl.int8)


@triton.jit
def _max_nan(a, b):
    """max that keeps NaN (maximumf; tl.max's maxnumf drops it on the GPU): an amax that is not finite flags a
    token (or block) holding a NaN/Inf, at the cost of the plain amax."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _poisoned_rows(x, axis: tl.constexpr):
    """True for each token (slice along ``axis``) of ``x`` holding a NaN or an Inf. Such a token is quantized
    as zeros, out of every scale statistic, and flagged by a NaN scale: NaN-dropping max reductions and the
    float -> int cast would otherwise turn it into finite numbers (GPU) or spread it (per-block scales)."""
    return tl.min((tl.abs(x) < float("inf")).to(tl.int32), axis) == 0


@triton.jit
def _finite_or_zero(x):
    """``x`` where finite, else 0: K's channel mean over the prompt is not finite when one key is not; that
    channel is then left unsmoothed (softmax-invariant either way) rather than poisoning every key."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def _multiple(x, VEC: tl.constexpr):
    """``x`` (a stride the launcher found to be a multiple of VEC) written so that the compiler knows it: strides
    kept out of the specialization key carry no divisibility, and loads through them stay 2-byte scalar."""
    return x // VEC * VEC


@triton.jit
def _quant_token_rows(p_x, p_x8, p_s, b_mean, b_f, scale, o_t, L, stride_xl, stride_xd,
                      HAS_SMOOTH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                      ROTATE: tl.constexpr, ROT_N: tl.constexpr):
    """Per-token INT8 of the rows ``o_t`` ([BT], masked at L) of one head: ``p_x`` its rows (any strides),
    ``p_x8`` its ``[L, D]`` codes (contiguous), ``p_s`` its ``[L]`` scales; ``b_mean`` [BD] subtracted first.
    ROTATE: the rows become ``x . diag(b_f) . H+-1`` first (``rotation.rotate`` without its 1/sqrt(n), which the
    caller folds into ``scale``; ``b_mean`` is then the rotated mean)."""
    o_d = tl.arange(0, BD)
    m_t = o_t < L
    m_x = m_t[:, None] & (o_d < D)[None, :]
    b_x = tl.load(p_x + o_t[:, None].to(tl.int64) * stride_xl + o_d[None, :] * stride_xd,
                  mask=m_x, other=0.0).to(tl.float32)
    if ROTATE:  # in the pass that reads the rows anyway: no rotated copy of Q/K is written and read back
        b_x = hadamard_rows(b_x * b_f[None, :], ROT_N)
    if HAS_SMOOTH:
        b_x = tl.where(m_x, b_x - b_mean[None, :], 0.0)
    # a NaN-keeping amax is NaN/Inf exactly for a poisoned token: its scale is NaN and its codes are clamped
    # to [0, 0] (per-row work only; the finite path costs what it did before the non-finite handling)
    b_amax = tl.reduce(tl.abs(b_x), 1, _max_nan)
    b_bad = ~(b_amax < float("inf"))
    b_amax = tl.where(b_bad, 0.0, b_amax)
    b_safe = tl.where(b_amax > 0, b_amax, 1.0)
    b_inv = tl.where(b_amax > 0, tl.math.div_rn(tl.full([BT], 127.0, tl.float32), b_safe), 0.0)
    b_x8 = _to_int8_half_away_lim(b_x, b_inv[:, None], tl.where(b_bad, 0, 127)[:, None])
    tl.store(p_x8 + o_t[:, None].to(tl.int64) * D + o_d[None, :], b_x8, mask=m_x)
    b_s = tl.math.div_rn(b_amax, tl.full([BT], 127.0, tl.float32)) * scale
    tl.store(p_s + o_t, tl.where(b_bad, float("nan"), b_s), mask=m_t)


@triton.jit
def _quant_v_block(p_x, p_amax, p_v8t, p_sv, p_poison, i_n, L, stride_xl, stride_xd, stride_vd,
                   HAS_AMAX: tl.constexpr, POISON: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                   BN: tl.constexpr, MMA_ORDER: tl.constexpr, HALF: tl.constexpr = False):
    """INT8 of V block ``i_n`` (BN tokens) of one head, per channel, written transposed: ``p_x`` its rows
    (any strides), ``p_v8t`` its ``[D, Lpad]`` codes (row stride ``stride_vd``; tokens >= L written as 0),
    ``p_sv`` its ``[Lpad // BN, D]`` scales; with HAS_AMAX the channel amax ``p_amax`` [D] over the whole
    sequence is used instead and block 0 writes the one row of scales. A token with a NaN/Inf is coded 0,
    kept out of the block's scales, and (POISON) flagged as NaN in the key scales ``p_poison`` [L]. MMA_ORDER: each
    32 tokens' columns in the Gluon prefill's P.V operand order (``prefill_hopper.mma_key_order``: token
    16h + 8e + 2c + b at column 16h + 4c + 2e + b). HALF: no codes: the block's rows of V itself in ``p_v8t``'s
    16-bit type (``[Lpad, D]``, row stride ``stride_vd``), a poisoned token's row and tokens >= L written as 0, no
    scales (the Gluon prefill's 16-bit P.V operand: a masked p is 0, and 0 times a non-finite value is NaN)."""
    o_t = i_n * BN + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_x = (o_t < L)[:, None] & m_d[None, :]
    b_x = tl.load(p_x + o_t[:, None].to(tl.int64) * stride_xl + o_d[None, :] * stride_xd,
                  mask=m_x, other=0.0).to(tl.float32)
    # a NaN-keeping amax over the token is NaN/Inf exactly for a poisoned token: it stays out of the channel
    # amax (one select), its codes are clamped to [0, 0] (free) and (POISON) its key scale is set to NaN
    b_ax = tl.abs(b_x)
    b_bad = ~(tl.reduce(b_ax, 1, _max_nan) < float("inf"))  # [BN]
    if POISON:  # the key's scale carries the flag: exactly the score columns the kernel does not mask
        tl.store(p_poison + o_t, tl.full([BN], float("nan"), tl.float32), mask=b_bad)
    if HALF:
        tl.store(p_v8t + o_t[:, None].to(tl.int64) * stride_vd + o_d[None, :],
                 tl.where(b_bad[:, None], 0.0, b_x).to(p_v8t.dtype.element_ty), mask=m_d[None, :])
    else:
        _quant_v_codes(b_x, b_ax, b_bad, p_amax, p_v8t, p_sv, i_n, o_t, o_d, m_d, stride_vd, HAS_AMAX=HAS_AMAX, D=D,
                       BN=BN, BD=BD, MMA_ORDER=MMA_ORDER)


@triton.jit
def _quant_v_codes(b_x, b_ax, b_bad, p_amax, p_v8t, p_sv, i_n, o_t, o_d, m_d, stride_vd, HAS_AMAX: tl.constexpr,
                   D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, MMA_ORDER: tl.constexpr):
    """``_quant_v_block``'s INT8 codes of the block ``b_x`` (``b_ax`` = |b_x|, ``b_bad`` its poisoned tokens),
    transposed, and their scales."""
    if HAS_AMAX:
        b_amax = tl.load(p_amax + o_d, mask=m_d, other=0.0)
    else:
        b_amax = tl.max(tl.where(b_bad[:, None], 0.0, b_ax), 0)  # [BD]
    b_safe = tl.where(b_amax > 0, b_amax, 1.0)
    b_inv = tl.where(b_amax > 0, tl.math.div_rn(tl.full([BD], 127.0, tl.float32), b_safe), 0.0)
    b_v8t = tl.trans(_to_int8_half_away_lim(b_x, b_inv[None, :], tl.where(b_bad, 0, 127)[:, None]))  # [BD, BN]
    if MMA_ORDER:  # permuted in registers, so the store stays contiguous (16-byte stores, not byte scatter)
        b_v8t = tl.reshape(tl.permute(tl.reshape(b_v8t, [BD, BN // 32, 2, 2, 4, 2]), [0, 1, 2, 4, 3, 5]), [BD, BN])
    tl.store(p_v8t + o_d[:, None].to(tl.int64) * stride_vd + o_t[None, :], b_v8t, mask=m_d[:, None])
    b_sv = tl.math.div_rn(b_amax, tl.full([BD], 127.0, tl.float32))
    if HAS_AMAX:
        tl.store(p_sv + o_d, b_sv, mask=m_d & (i_n == 0))
    else:
        tl.store(p_sv + i_n * D + o_d, b_sv, mask=m_d)


@triton.jit(do_not_specialize=["L", "CH", "stride_xb", "stride_xh", "stride_xl"])
def _k_sum_kernel(X, PART, L, H, NS, CH, stride_xb, stride_xh, stride_xl, stride_xd,
                  D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, VEC: tl.constexpr):
    """grid (b * H * NS,): ``PART [b * H, NS, D]`` fp64, split s the channel sums of the tokens [s CH, (s + 1) CH) of
    X [b, H, L, D] (b, H, L strides multiples of VEC). fp64 sums of 16-bit keys are exact, so the mean the Q+K pass
    finishes from them is ``reference.k_smooth_mean`` bit for bit, whatever the split."""
    pid = tl.program_id(0)
    i_s, i_bh = pid % NS, pid // NS
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    p_x = X + i_b * _multiple(stride_xb, VEC) + i_h * _multiple(stride_xh, VEC)
    sl = _multiple(stride_xl, VEC)
    o_d = tl.arange(0, BD)
    lo = i_s * CH
    hi = tl.minimum(lo + CH, L)
    acc = tl.zeros([BT, BD], dtype=tl.float64)
    for t0 in range(lo, hi, BT):
        o_t = t0 + tl.arange(0, BT)
        m = (o_t < hi)[:, None] & (o_d < D)[None, :]
        acc += tl.load(p_x + o_t[:, None].to(tl.int64) * sl + o_d[None, :] * stride_xd, mask=m,
                       other=0.0).to(tl.float64)
    tl.store(PART + (i_bh.to(tl.int64) * NS + i_s) * D + o_d, tl.sum(acc, 0), mask=o_d < D)


@triton.jit(do_not_specialize=["L", "stride_xb", "stride_xh", "stride_xl", "stride_sb", "stride_sh"])
def _quant_tokens_kernel(
    X, MEAN, X8, S, scale, L, H,
    stride_xb, stride_xh, stride_xl, stride_xd,
    stride_mb, stride_mh,
    stride_ob, stride_oh,
    stride_sb, stride_sh,
    HAS_SMOOTH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, VEC: tl.constexpr,
):
    """grid (cdiv(L, BT) * b * H,). X [b, H, L, D] any strides (b, H, L ones multiples of VEC) -> X8 [b, H, L, D]
    contiguous, S [b, H, L]."""
    n_t = tl.cdiv(L, BT)
    i_t, i_bh = tl.program_id(0) % n_t, tl.program_id(0) // n_t  # 1-D grid: b * H may pass 65535
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    stride_xb, stride_xh, stride_xl = _multiple(stride_xb, VEC), _multiple(stride_xh, VEC), _multiple(stride_xl, VEC)
    b_mean = tl.zeros([BD], dtype=tl.float32)
    if HAS_SMOOTH:
        o_d = tl.arange(0, BD)
        b_mean = _finite_or_zero(tl.load(MEAN + i_b * stride_mb + i_h * stride_mh + o_d, mask=o_d < D, other=0.0))
    _quant_token_rows(X + i_b * stride_xb + i_h * stride_xh, X8 + i_b * stride_ob + i_h * stride_oh,
                      S + i_b * stride_sb + i_h * stride_sh, b_mean, b_mean, scale, i_t * BT + tl.arange(0, BT), L,
                      stride_xl, stride_xd, HAS_SMOOTH=HAS_SMOOTH, D=D, BD=BD, BT=BT, ROTATE=False, ROT_N=16)


@triton.jit(do_not_specialize=["L", "stride_xb", "stride_xh", "stride_xl", "stride_pb", "stride_ph"])
def _quant_v_kernel(
    X, AMAX, V8T, SV, POISON_S, L, H,
    stride_xb, stride_xh, stride_xl, stride_xd,
    stride_vb, stride_vh, stride_vd,
    stride_sb, stride_sh,
    stride_pb, stride_ph,
    HAS_AMAX: tl.constexpr, POISON: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    VEC: tl.constexpr, MMA_ORDER: tl.constexpr = False, HALF: tl.constexpr = False,
):
    """grid (Lpad // BN * b * H,). X [b, H, L, D] (b, H, L strides multiples of VEC) -> V8T [b, H, D, Lpad]
    (tokens contiguous; tokens >= L are 0), SV [b, H, Lpad // BN, D] = amax over the block's tokens / 127 per
    channel; with HAS_AMAX the per-channel AMAX [b, H, D] (contiguous) over the whole sequence is used instead
    and the first block writes SV [b, H, 1, D]. POISON: POISON_S [b, H, L] (last stride 1) is set to NaN at
    tokens holding a NaN/Inf. HALF: V8T is V itself [b, H, Lpad, D] in 16 bits (``_quant_v_block``), SV unused."""
    n_blk = tl.maximum(tl.cdiv(L, BN), 1)
    i_n, i_bh = tl.program_id(0) % n_blk, tl.program_id(0) // n_blk
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    stride_xb, stride_xh, stride_xl = _multiple(stride_xb, VEC), _multiple(stride_xh, VEC), _multiple(stride_xl, VEC)
    _quant_v_block(X + i_b * stride_xb + i_h * stride_xh, AMAX + i_bh.to(tl.int64) * D,
                   V8T + i_b * stride_vb + i_h * stride_vh, SV + i_b * stride_sb + i_h * stride_sh,
                   POISON_S + i_b * stride_pb + i_h * stride_ph, i_n, L, stride_xl, stride_xd, stride_vd,
                   HAS_AMAX=HAS_AMAX, POISON=POISON, D=D, BD=BD, BN=BN, MMA_ORDER=MMA_ORDER, HALF=HALF)


@triton.jit(do_not_specialize=["NQ", "LQ", "LK", "stride_qb", "stride_qh", "stride_ql", "stride_kb", "stride_kh",
                               "stride_kl", "stride_sqb", "stride_sqh", "stride_skb", "stride_skh"])
def _quant_qk_kernel(
    Q, K, MEAN, SMF, Q8, K8, SQ, SK, q_scale, k_scale, NQ, LQ, LK, HQ, HK, N_PARTS,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_mb, stride_mh,
    stride_fb, stride_fh,
    stride_q8b, stride_q8h, stride_k8b, stride_k8h,
    stride_sqb, stride_sqh, stride_skb, stride_skh,
    HAS_SMOOTH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, VEC_Q: tl.constexpr,
    VEC_K: tl.constexpr, ROTATE: tl.constexpr, ROT_N: tl.constexpr, HAS_FACTOR: tl.constexpr,
    MEAN_PARTS: tl.constexpr = False,
):
    """The prefill's two per-token operands in one launch: grid (NQ + cdiv(LK, BT) * b * HK,), NQ = cdiv(LQ, BT)
    * b * HQ. Programs < NQ are ``_quant_tokens_kernel``'s for Q (scale ``q_scale``, no mean), the others its
    programs for K (scale ``k_scale``, MEAN subtracted with HAS_SMOOTH): the same row helper, the same bits.
    ROTATE (``rotate_qk``): Q rows -> ``q . diag(s) . H+-1``, K rows -> ``k . diag(1/s) . H+-1`` with HAS_FACTOR (SMF
    = s [b, HK, D], contiguous channels; Q head h uses KV head h // (HQ // HK)), else ``x . H+-1``; the scales carry
    the 1/sqrt(ROT_N) (the launcher's), MEAN is rotated here. MEAN_PARTS: MEAN holds ``_k_sum_kernel``'s N_PARTS fp64
    partial sums per (b, KV head) (batch / head strides stride_mb / stride_mh, D apart), finished here into the mean
    ``fl32(sum / LK)`` (``reference.k_smooth_mean``); else MEAN is the fp32 mean."""
    pid = tl.program_id(0)
    o_d = tl.arange(0, BD)
    b_f = tl.full([BD], 1.0, tl.float32)
    if pid < NQ:
        n_t = tl.cdiv(LQ, BT)
        i_t, i_bh = pid % n_t, pid // n_t
        i_b, i_h = (i_bh // HQ).to(tl.int64), (i_bh % HQ).to(tl.int64)
        sb, sh, sl = _multiple(stride_qb, VEC_Q), _multiple(stride_qh, VEC_Q), _multiple(stride_ql, VEC_Q)
        if HAS_FACTOR:
            b_f = tl.load(SMF + i_b * stride_fb + (i_h // (HQ // HK)) * stride_fh + o_d, mask=o_d < D, other=1.0)
        _quant_token_rows(Q + i_b * sb + i_h * sh, Q8 + i_b * stride_q8b + i_h * stride_q8h,
                          SQ + i_b * stride_sqb + i_h * stride_sqh, tl.zeros([BD], dtype=tl.float32), b_f, q_scale,
                          i_t * BT + tl.arange(0, BT), LQ, sl, stride_qd, HAS_SMOOTH=False, D=D, BD=BD, BT=BT,
                          ROTATE=ROTATE, ROT_N=ROT_N)
    else:
        n_t = tl.cdiv(LK, BT)
        i_t, i_bh = (pid - NQ) % n_t, (pid - NQ) // n_t
        i_b, i_h = (i_bh // HK).to(tl.int64), (i_bh % HK).to(tl.int64)
        sb, sh, sl = _multiple(stride_kb, VEC_K), _multiple(stride_kh, VEC_K), _multiple(stride_kl, VEC_K)
        if HAS_FACTOR:  # 1/s correctly rounded (reference: ones / s)
            b_f = tl.math.div_rn(tl.full([BD], 1.0, tl.float32),
                                 tl.load(SMF + i_b * stride_fb + i_h * stride_fh + o_d, mask=o_d < D, other=1.0))
        b_mean = tl.zeros([BD], dtype=tl.float32)
        if HAS_SMOOTH:
            if MEAN_PARTS:
                b_sum = tl.zeros([BD], dtype=tl.float64)
                for i_p in range(N_PARTS):
                    b_sum += tl.load(MEAN + i_b * stride_mb + i_h * stride_mh + i_p * D + o_d, mask=o_d < D,
                                     other=0.0)
                b_mean = _finite_or_zero((b_sum / LK.to(tl.float64)).to(tl.float32))  # div.rn.f64
            else:
                b_mean = _finite_or_zero(tl.load(MEAN + i_b * stride_mb + i_h * stride_mh + o_d, mask=o_d < D,
                                                 other=0.0))
            if ROTATE:  # the rotated keys' mean is mean(k) . diag(1/s) . H+-1 (linear): no second read of K
                b_mean = tl.reshape(hadamard_rows(tl.reshape(b_mean * b_f, [1, BD]), ROT_N), [BD])
        _quant_token_rows(K + i_b * sb + i_h * sh, K8 + i_b * stride_k8b + i_h * stride_k8h,
                          SK + i_b * stride_skb + i_h * stride_skh, b_mean, b_f, k_scale,
                          i_t * BT + tl.arange(0, BT), LK, sl, stride_kd, HAS_SMOOTH=HAS_SMOOTH, D=D, BD=BD, BT=BT,
                          ROTATE=ROTATE, ROT_N=ROT_N)


# ---------------------------------------------------------------------------------------- launchers
def _as_4d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"expected a tensor [..., L, d]; got shape {tuple(x.shape)}")
    while x.dim() < 4:
        x = x.unsqueeze(0)
    if x.dim() > 4:
        x = x.reshape(-1, *x.shape[-3:])
    return x


def _vec(*xs: torch.Tensor) -> int:
    """Elements in 16 bytes if every stride over the ``[b, H, L]`` dims of ``xs`` (those of size > 1: the
    others only multiply 0) is a multiple of it, else 1: the kernels' VEC, which lets 16-byte loads through."""
    vec = 16 // max(x.element_size() for x in xs)
    ok = all(st % vec == 0 for x in xs for n, st in zip(x.shape[:-1], x.stride()[:-1]) if n > 1)
    return vec if ok else 1


def _tile_rows(d: int) -> int:
    if interpreting():
        return 32
    return 64 if d <= 128 else 32


def _qk_tile(d: int, rotate: bool) -> tuple[int, int]:
    """(rows a tile, warps) of the Q+K pass. Rotated: one warp over 2048 channels' worth of rows (16 at head_dim
    128, 8 at 256), so the butterfly changes layout with shuffles only; on 4 warps it paid a barrier and a
    shared-memory trip per stage, 1.8-3.7x the time (H200, eval/results/rotation_launch_sweep_h200.json)."""
    if rotate and not interpreting():
        return max(8, 2048 // _pow2(d)), 1
    return _tile_rows(d), 4


def _mean_arg(smooth: Optional[torch.Tensor], unused: torch.Tensor, b: int, h: int, d: int):
    """(pointer, batch stride, head stride) of the fp32 ``[b, h, d]`` mean to subtract, or of ``unused``."""
    if smooth is None:
        return unused, 0, 0
    m = smooth.to(device=unused.device, dtype=torch.float32).reshape(b, h, d)
    if m.stride(-1) != 1:
        m = m.contiguous()
    return m, m.stride(0), m.stride(1)


def _poison_arg(poison: Optional[torch.Tensor], unused: torch.Tensor, b: int, h: int, L: int):
    """(tensor, batch stride, head stride) of the fp32 ``[b, h, >= L]`` key scales that V marks, or of ``unused``."""
    if poison is None:
        return unused, 0, 0
    if (poison.dtype != torch.float32 or poison.dim() != 3 or tuple(poison.shape[:2]) != (b, h)
            or poison.shape[2] < L or poison.device != unused.device or (L > 1 and poison.stride(2) != 1)):
        raise ValueError(f"poison must be fp32 [b, H, >= L] = [{b}, {h}, >= {L}] on {unused.device} with a "
                         f"contiguous last dimension (the key scales sk); got {tuple(poison.shape)} "
                         f"{poison.dtype} on {poison.device}")
    return poison, poison.stride(0), poison.stride(1)


def _pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1): plain Python (``triton.next_power_of_2`` / ``triton.cdiv`` are
    constexpr-function wrappers costing microseconds per host call)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def _tokens_spec(x4: torch.Tensor, scale: float, smb: int, smh: int, has_smooth: bool):
    """(grid, scalars, kwargs) of ``_quant_tokens_kernel`` on ``x4 [b, h, L, d]`` into contiguous codes/scales."""
    b, h, L, d = x4.shape
    bt = _tile_rows(d)
    grid = (-(-L // bt) * b * h,)
    scalars = (float(scale), L, h, *x4.stride(), smb, smh, h * L * d, L * d, h * L, L)
    kw = dict(HAS_SMOOTH=has_smooth, D=d, BD=_pow2(d), BT=bt, VEC=_vec(x4), num_warps=4, enable_fp_fusion=False)
    return grid, scalars, kw


def _qk_spec(q4: torch.Tensor, k4: torch.Tensor, q_scale: float, k_scale: float, smb: int, smh: int,
             has_smooth: bool, rotate: bool = False, has_factor: bool = False, mean_parts: int = 0,
             sk_row: Optional[int] = None):
    """(grid, scalars, kwargs) of ``_quant_qk_kernel``: Q ``[b, HQ, LQ, d]`` and K ``[b, HK, LK, d]`` (same b, d);
    ``rotate``: Hadamard-rotate both in the pass (``has_factor``: with the smoothing factors, fp32 ``[b, HK, d]``
    contiguous); ``mean_parts``: the mean is finished from that many fp64 partial sums (``_k_sum_spec``); ``sk_row``:
    K's scales a head apart in ``sk`` (default LK)."""
    b, hq, lq, d = q4.shape
    hk, lk = k4.shape[1], k4.shape[2]
    bt, warps = _qk_tile(d, rotate)
    nq = -(-lq // bt) * b * hq
    grid = (nq + -(-lk // bt) * b * hk,)
    n = rotation_block(d) if rotate else 16
    if rotate:  # H+-1 = sqrt(n) H: 1/sqrt(n) goes into each row's scale (exact for n = 16, 64, 256)
        q_scale, k_scale = float(q_scale) / math.sqrt(n), float(k_scale) / math.sqrt(n)
    sfb, sfh = (hk * d, d) if has_factor else (0, 0)
    scalars = (float(q_scale), float(k_scale), nq, lq, lk, hq, hk, max(mean_parts, 1), *q4.stride(), *k4.stride(),
               smb, smh, sfb, sfh,
               hq * lq * d, lq * d, hk * lk * d, lk * d, hq * lq, lq, hk * (sk_row or lk), sk_row or lk)
    kw = dict(HAS_SMOOTH=has_smooth, D=d, BD=_pow2(d), BT=bt, VEC_Q=_vec(q4), VEC_K=_vec(k4), ROTATE=rotate,
              ROT_N=n,
              HAS_FACTOR=rotate and has_factor, MEAN_PARTS=mean_parts > 0, num_warps=warps, enable_fp_fusion=False)
    return grid, scalars, kw


def _k_sum_spec(k4: torch.Tensor, programs: Optional[int] = None):
    """(grid, scalars, kwargs, splits) of ``_k_sum_kernel`` on K ``[b, H, L, d]``: each (b, head)'s tokens in as many
    splits (of whole tiles, at least 4 a split) as give about ``programs`` programs in all (default: two an SM of
    K's device)."""
    b, h, L, d = k4.shape
    programs = programs or 2 * sm_count(k4.device)
    bd = _pow2(d)
    bt = 16 if interpreting() else max(8, 8192 // bd)
    tiles = max(1, -(-L // bt))
    want = max(1, min(-(-tiles // 4), -(-programs // max(b * h, 1))))
    ch = -(-tiles // want) * bt
    ns = max(1, -(-L // ch))
    kw = dict(D=d, BD=bd, BT=bt, VEC=_vec(k4), num_warps=8, enable_fp_fusion=False)
    return (b * h * ns,), (L, h, ns, ch, *k4.stride()), kw, ns


def _v_spec(v: torch.Tensor, block: int, spb: int, sph: int, has_amax: bool, poison: bool,
            mma_order: bool = False, half: bool = False):
    """(grid, scalars, kwargs) of ``_quant_v_kernel`` on ``v [b, h, L, d]`` into contiguous ``v8t [b, h, d, Lpad]``
    and ``sv [b, h, nblk, d]`` (``nblk`` 1 with ``has_amax``); ``mma_order``: v8t's tokens in the Gluon prefill's
    operand order (block a multiple of 32); ``half``: into V itself, contiguous ``[b, h, Lpad, d]`` in v's dtype."""
    b, h, L, d = v.shape
    nblk = max(1, -(-L // block))
    lpad = nblk * block
    ns = 1 if has_amax else nblk
    grid = (nblk * b * h,)
    scalars = (L, h, *v.stride(), h * d * lpad, d * lpad, d if half else lpad, h * ns * d, ns * d, spb, sph)
    kw = dict(HAS_AMAX=has_amax, POISON=poison, D=d, BD=_pow2(d), BN=block, VEC=_vec(v), MMA_ORDER=bool(mma_order),
              HALF=bool(half), num_warps=4, enable_fp_fusion=False)
    return grid, scalars, kw


def _check_tokens_input(x: torch.Tensor, name: str) -> None:
    _check_device(x, name)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_per_token takes fp16/bf16/fp32, got {x.dtype}")


def quantize_per_token(x: torch.Tensor, *, scale: float = 1.0, smooth: Optional[torch.Tensor] = None):
    """Per-token symmetric INT8 (one fused Triton pass).

    x: ``[..., L, d]`` fp16/bf16/fp32, any strides. smooth: optional fp32 ``[..., d]`` subtracted first
    (K's channel mean, ``k_smooth_mean``; a non-finite channel of it counts as 0). Returns
    ``x8 int8 [..., L, d]`` (contiguous) and ``s fp32 [..., L]`` with ``s = amax / 127 * scale`` (0 for an
    all-zero row, whose codes are 0). A row holding a NaN/Inf gets codes 0 and ``s = NaN``.
    """
    _check_tokens_input(x, "x")
    lead, (L, d) = x.shape[:-2], x.shape[-2:]
    x4 = _as_4d(x)
    b, h = x4.shape[0], x4.shape[1]
    x8 = torch.empty(b, h, L, d, dtype=torch.int8, device=x.device)
    s = torch.empty(b, h, L, dtype=torch.float32, device=x.device)
    m, smb, smh = _mean_arg(smooth, s, b, h, d)
    if L > 0 and b * h > 0:
        grid, scalars, kw = _tokens_spec(x4, scale, smb, smh, smooth is not None)
        lean(_quant_tokens_kernel)[grid](x4, m, x8, s, *scalars, **kw)
    return x8.reshape(*lead, L, d), s.reshape(*lead, L)


def _k_sums(k4: torch.Tensor):
    """(``[b * H * splits * d]`` fp64 channel sums of K's token splits, splits): ``_k_sum_kernel``'s launch."""
    grid, scalars, kw, ns = _k_sum_spec(k4)
    part = torch.empty(grid[0] * k4.shape[3], dtype=torch.float64, device=k4.device)
    if k4.shape[2] > 0 and grid[0] > 0:
        lean(_k_sum_kernel)[grid](k4, part, *scalars, **kw)
    return part, ns


def k_mean(k: torch.Tensor) -> torch.Tensor:
    """``reference.k_smooth_mean(k)`` (fp32 ``[..., d]``, K ``[..., L, d]`` fp16/bf16/fp32, any strides) from one read
    of K (``_k_sum_kernel``) instead of torch's fp64 cast and reduction: bit for bit for 16-bit keys (exact fp64
    sums); fp32 keys' fp64 sums may round differently in another order."""
    _check_tokens_input(k, "k")
    lead, (L, d) = k.shape[:-2], k.shape[-2:]
    k4 = _as_4d(k)
    b, h = k4.shape[0], k4.shape[1]
    part, ns = _k_sums(k4)
    return (part.view(b, h, ns, d).sum(2) / L).float().reshape(*lead, d)


def quantize_qk(q: torch.Tensor, k: torch.Tensor, *, q_scale: float = 1.0,
                smooth: Optional[torch.Tensor] | str = None, rotate: bool = False,
                qk_smooth: Optional[torch.Tensor] = None):
    """``quantize_per_token(q, scale=q_scale)`` and ``quantize_per_token(k, smooth=smooth)`` in one launch, bit for
    bit: q ``[b, HQ, LQ, d]``, k ``[b, HK, LK, d]`` (same b and d; fp16/bf16/fp32, any strides, on one device).
    Returns ``(q8, sq, k8, sk)``. ``smooth="k"``: K's own mean (``k_smooth_mean(k)``), its fp64 sums taken by
    ``_k_sum_kernel`` and finished by the pass (``turbo_attention`` without a ``k_mean``).

    ``rotate`` (``rotate_qk``, issue 23): Q and K are Hadamard-rotated in the same pass, ``qk_smooth`` (the
    ``rotation.smooth_scales`` factors ``s [b, HK, d]``) applied first, Q by ``s``, K by ``1/s``; ``smooth`` stays
    the unrotated keys' mean. Twin: ``reference.quantize_per_token(..., rotate=True, factor=...)``."""
    _check_tokens_input(q, "q")
    _check_tokens_input(k, "k")
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.device != k.device:
        raise ValueError(f"q {tuple(q.shape)} on {q.device} and k {tuple(k.shape)} on {k.device} must be 4-D with the "
                         "same batch size and head_dim, on one device")
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    q8 = torch.empty(b, hq, lq, d, dtype=torch.int8, device=q.device)
    sq = torch.empty(b, hq, lq, dtype=torch.float32, device=q.device)
    k8 = torch.empty(b, hk, lk, d, dtype=torch.int8, device=q.device)
    sk = torch.empty(b, hk, lk, dtype=torch.float32, device=q.device)
    if isinstance(smooth, str) and smooth != "k":
        raise ValueError(f"smooth={smooth!r}: a fp32 [b, HK, d] mean, 'k' (K's own) or None")
    check_qk_smooth(qk_smooth, rotate, k)
    f = factor_arg(qk_smooth, sk)
    if b * (hq * lq + hk * lk) > 0:
        parts = 0
        if isinstance(smooth, str):
            m, parts = _k_sums(k)
            smb, smh = hk * parts * d, parts * d
        else:
            m, smb, smh = _mean_arg(smooth, sk, b, hk, d)
        grid, scalars, kw = _qk_spec(q, k, q_scale, 1.0, smb, smh, smooth is not None, rotate, qk_smooth is not None,
                                     parts)
        lean(_quant_qk_kernel)[grid](q, k, m, f, q8, k8, sq, sk, *scalars, **kw)
    return q8, sq, k8, sk


def check_qk_smooth(qk_smooth: Optional[torch.Tensor], rotate: bool, k: torch.Tensor) -> None:
    """The smooth_hadamard factors' checks (``quantize_qk``, ``prefill.turbo_attention``): ValueError unless None or
    a ``[b, Hk, d]`` tensor on K's device with ``rotate`` on; a head dim without a Hadamard block: RotationError."""
    if rotate:
        rotation_block(k.shape[-1])
    if qk_smooth is None:
        return
    b, hk, _, d = k.shape
    if not rotate:
        raise ValueError("qk_smooth (the smooth_hadamard factors) needs rotate_qk=True")
    if not isinstance(qk_smooth, torch.Tensor) or tuple(qk_smooth.shape) != (b, hk, d) or qk_smooth.device != k.device:
        raise ValueError(f"qk_smooth must be a [b, Hk, d] = [{b}, {hk}, {d}] tensor on {k.device}; got "
                         f"{tuple(qk_smooth.shape) if isinstance(qk_smooth, torch.Tensor) else type(qk_smooth).__name__}")


def factor_arg(qk_smooth: Optional[torch.Tensor], unused: torch.Tensor) -> torch.Tensor:
    """The kernel's SMF: the checked factors as fp32 ``[b, hk, d]`` contiguous, or ``unused``."""
    return unused if qk_smooth is None else qk_smooth.to(torch.float32).contiguous()


def _check_v(v: torch.Tensor, block: int) -> None:
    _check_device(v, "v")
    if v.dim() != 4:
        raise ValueError(f"v must be [b, H, L, d]; got shape {tuple(v.shape)}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 16")


def quantize_v_blocks(v: torch.Tensor, block: int = DEFAULT_BLOCK_N, *, poison: Optional[torch.Tensor] = None,
                      mma_order: bool = False):
    """Per-block (``block`` tokens), per-channel symmetric INT8 of V, written transposed (one Triton pass).

    v: ``[b, H, L, d]`` fp16/bf16/fp32, any strides. Returns ``v8t int8 [b, H, d, Lpad]`` (tokens
    contiguous, Lpad = L rounded up to ``block``, padded tokens 0) and ``sv fp32 [b, H, Lpad // block, d]``.
    A token holding a NaN/Inf is coded 0 and left out of the scales; ``poison`` (the key scales ``sk``,
    fp32 ``[b, H, >= L]``) is set to NaN at those tokens, in place, so that the attention rows which see
    them come out NaN (without ``poison`` the flag is dropped). ``mma_order``: each 32 tokens' columns in the Gluon
    prefill's operand order (``prefill_hopper.mma_key_order``; ``launch_ws(..., v8t_in_mma_order=True)``).
    """
    _check_v(v, block)
    if mma_order and block % 32:
        raise ValueError(f"mma_order needs a block of a multiple of 32 tokens; got {block}")
    b, h, L, d = v.shape
    nblk = max(1, -(-L // block))
    v8t = torch.empty(b, h, d, nblk * block, dtype=torch.int8, device=v.device)
    sv = torch.empty(b, h, nblk, d, dtype=torch.float32, device=v.device)
    ps, spb, sph = _poison_arg(poison, sv, b, h, L)
    if b * h > 0:
        grid, scalars, kw = _v_spec(v, block, spb, sph, False, poison is not None, mma_order)
        lean(_quant_v_kernel)[grid](v, sv, v8t, sv, ps, *scalars, **kw)
    return v8t, sv


def v_operand_half(v: torch.Tensor, block: int = DEFAULT_BLOCK_N, *, poison: Optional[torch.Tensor] = None):
    """V itself as the Gluon prefill's 16-bit P.V operand (one Triton pass): ``[b, H, Lpad, d]`` contiguous in v's
    dtype (fp16/bf16; Lpad = L rounded up to ``block``), tokens >= L zero, and a token holding a NaN/Inf zeroed and
    flagged in ``poison`` (the key scales ``sk``) as ``quantize_v_blocks`` does. v: ``[b, H, L, d]``, any strides."""
    _check_v(v, block)
    if v.dtype not in PV_HALF_DTYPES:
        raise ValueError(f"v_operand_half takes fp16/bf16 V, got {v.dtype}")
    b, h, L, d = v.shape
    out = torch.empty(b, h, max(1, -(-L // block)) * block, d, dtype=v.dtype, device=v.device)
    dummy = torch.empty(1, dtype=torch.float32, device=v.device)
    ps, spb, sph = _poison_arg(poison, dummy, b, h, L)
    if b * h > 0:
        grid, scalars, kw = _v_spec(v, block, spb, sph, False, poison is not None, half=True)
        lean(_quant_v_kernel)[grid](v, dummy, out, dummy, ps, *scalars, **kw)
    return out


def quantize_v_channels(v: torch.Tensor, block: int = DEFAULT_BLOCK_N, *, poison: Optional[torch.Tensor] = None):
    """Per-channel symmetric INT8 of V over the whole sequence (INT-FlashAttention's V scale), transposed.

    v: ``[b, H, L, d]`` fp16/bf16/fp32, any strides. Returns ``v8t int8 [b, H, d, Lpad]`` (Lpad = L rounded
    up to ``block``, the kernel's KV tile; padded tokens 0) and ``sv fp32 [b, H, 1, d]`` = amax / 127.
    The channel amax (torch reductions) skips tokens holding a NaN/Inf, then the Triton pass of
    ``quantize_v_blocks`` (non-finite tokens and ``poison`` as there).
    """
    _check_v(v, block)
    b, h, L, d = v.shape
    nblk = max(1, -(-L // block))
    v8t = torch.empty(b, h, d, nblk * block, dtype=torch.int8, device=v.device)
    sv = torch.empty(b, h, 1, d, dtype=torch.float32, device=v.device)
    ps, spb, sph = _poison_arg(poison, sv, b, h, L)
    if b * h > 0:
        amax = _v_channel_amax(v)
        grid, scalars, kw = _v_spec(v, block, spb, sph, True, poison is not None)
        lean(_quant_v_kernel)[grid](v, amax, v8t, sv, ps, *scalars, **kw)
    return v8t, sv


def _v_channel_amax(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``[b, H, d]`` contiguous: the finite tokens' channel amax (zeros for L = 0)."""
    b, h, L, d = v.shape
    return (_finite_token_amax(v) if L > 0 else torch.zeros(b, h, d, dtype=torch.float32, device=v.device)).contiguous()
