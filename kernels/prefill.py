"""INT8 flash-attention forward (prefill): causal / GQA / sliding window / softcap / padding mask.

What it implements:
- INT-FlashAttention (Chen et al., 2024, Alg. 1): Q.K^T and P.V both as INT8 x INT8 -> INT32 tensor-core
  dots inside one FlashAttention-2 online-softmax loop; Q, K per-token symmetric INT8 scales, V a
  per-(block, channel) scale that factors out of P.V, P an INT8 code of the probabilities.
- P scale (``p_scale``): "static" is INT-FlashAttention's ``p8 = round(127 exp2(S2 - m_running))``;
  "block" (default) quantizes each block relative to its own row max, ``p8 = round(127 exp2(S2 - bmax))``
  (the weight exp2(bmax - m) rides in the accumulator's reference point, see below). Measured on CPU with
  the reference (d 128, L 1k-4k, vs fp64; tests/kernels/test_reference.py keeps a small version of it):
  FA3's outlier test (N(0,1) + N(0,100) Bernoulli(0.001)) gives RMSE 2.3e-2 - 3.7e-2 with "static" (a row
  dominated by a few keys rounds every other weight to 0) and 4.4e-3 - 6.2e-3 with "block" at block_n 64,
  5.2e-3 - 7.6e-3 at block_n 128 (FA3-FP8: 9.1e-3); N(0,1) MRE (mean |o - ref| / mean |ref|) 2.1-3.0 %
  static, 1.5 % block (1.8 % at block_n 128); U(-0.5, 0.5) 0.5 % all.
- V scale (``v_scale``): per block of block_n tokens and channel (default) or per channel over the whole
  sequence ("channel", INT-FlashAttention's; 1 % faster, N(0,1) MRE 1.57 -> 1.64 %, FA3 RMSE +20-30 %).
- TurboAttention (Kang et al., 2024) §4: SAS softmax as an option (``softmax="sas"``, kernels/softmax.py);
  the rescale factor alpha = exp2(m_old - m_new) stays exact.
- FlashAttention-3 (Shah et al., 2024) §3.3: 8-bit wgmma needs both operands K-major: K tiles are loaded
  as ``[d, tokens]`` views of ``k8 [tokens, d]`` (d contiguous), V tiles as ``[d, tokens]`` blocks of the
  transposed ``v8t [d, Lpad]`` (tokens contiguous) and ``tl.trans``-ed, so both dots read their reduction
  axis contiguously.
- Hopper's conversion unit runs 16 results/clock/SM, as slow as MUFU.EX2, so int32 -> fp32 of the dot
  results and fp32 -> int8 of P use the magic number C = 1.5 * 2^23: bits(x + bits(C)) is the float C + x,
  so ``float(x) * s = fma(C + x, s, -C s)`` (``_i32_scaled``: the K and V scales ride in the same FMA), and
  p8 = round(127 p) is the low byte of bits(fma(p, 127, C)) (exact while |x| < 2^22: ``tl.static_assert``).
- Non-finite inputs (``reference.nonfinite_rows``): the quantizers code a token holding a NaN/Inf as zeros,
  outside every scale statistic, and flag it by a NaN scale (sq for a query; sk for a key, also when only its
  V is bad; a non-finite channel of K's mean is not subtracted). The loop's masks are ``where`` selects (a
  masked NaN score becomes -inf) and, in masked blocks (and with key_valid), its row max keeps NaN, so a NaN
  score reaches m, c, r and makes l and acc NaN in exactly the rows that see the key; a NaN sq starts l at NaN.
  Unmasked blocks are seen by every row of the program: they keep the plain max, and one scan of their sk
  after the loop (``_keys_nan``) adds NaN to l when one is poisoned. No extra work per element.
- The epilogue per KV block is one FMA per accumulator element: acc and l are kept relative to a per-row
  reference point c (the running max for "static", max(block max, running max - 32) for "block"), so the
  block-P weight and the online-softmax rescale are one factor r = exp2(c_old - c_new)
  (``reference.int8_flash_attention`` has the derivation and the overflow bound).

Layout of the work: a 1-D grid of cdiv(Lq, BLOCK_M) * b * Hq programs, the row blocks of one head
next to each other (its K/V stay in L2), heaviest causal row blocks first; the KV head of
query head h is h // (Hq // Hk) (GQA/MQA without repeating K/V). Each program runs up to three loops over
KV blocks: [lo, full_lo) with masks (window edge), [full_lo, full_hi) without (only the key-padding mask
if any), [full_hi, hi) with masks (causal diagonal and the Lk tail). Blocks after the causal diagonal and
before the window are never visited. The output is written as ``[b, Lq, Hq, d]``.

Speed (H200, FA3 protocol: 16k tokens, hidden 2048, bf16 in/out, quantization included; FLOPs 4 b h L^2 d,
halved causal; eval/PERF_NOTES.md, eval/results/prefill_sweep_h200.json): d128 with the default block_n
128, L 4k / 8k / 16k: 427 / 473 / 500 TFLOP/s full, 336 / 417 / 492 causal, i.e. 1.19-1.38x / 1.09-1.50x
SDPA-flash (FA2) and 0.60-0.78x SDPA-cuDNN; the kernel alone 500-536. The loop is ALU-bound, not
MUFU-bound (SAS's polynomial is 27 % slower than ex2 here); block_n 128 halves the per-token epilogue and
loop overhead (1.32-1.38x over 64) for N(0,1) MRE 1.6 -> 1.8 % and FA3 outlier RMSE ~5e-3 -> 6-7.6e-3.

Tiers (FLA style): ``_int8_attn_fwd_kernel`` (``@triton.jit``) -> ``_attn_spec`` (grid, strides, tiles) ->
``int8_flash_attention`` (quantized operands) / ``turbo_attention`` (bf16/fp16 in, bf16/fp16 out).

Host path (time to first token, issue 19): ``turbo_attention`` is three launches — Q+K quantization (one launch,
``quant._quant_qk_kernel``), V quantization, the INT8 kernel (plus K's channel sums, ``quant._k_sum_kernel``, when
the caller has no K mean). Its
checks, tiles, strides and constexprs are worked out once per key (shapes, strides, dtypes, devices, options:
``_AttnPlan``); a repeated call (every layer of a prefill) allocates the outputs and relaunches the compiled
kernels without Triton's per-call binder (``LeanLaunch.launch_memo``; the Gluon kernel:
``prefill_hopper.WsLaunch``). CPU, launches stubbed
(``eval/experiments/host_step.py --components``): ~150-260 -> ~22-40 us a call (eval/PERF_NOTES.md).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from . import prefill_hopper
from .device import current_cuda_device
from .launch import LeanLaunch, lean
from .quant import (_check_device, _k_sum_kernel, _k_sum_spec, _mean_arg, _pow2, _qk_spec, _quant_qk_kernel,
                    _quant_v_kernel, _v_channel_amax, _v_spec, check_qk_smooth, factor_arg, interpreting,
                    quantize_per_token, quantize_v_blocks, quantize_v_channels)
from .reference import (
    DEFAULT_BLOCK_N,
    DEFAULT_P_SCALE,
    DEFAULT_V_SCALE,
    LOG2E,
    MAGIC,
    MAGIC_BITS,
    P_BLOCK_GAP,
    P_SCALE_MODES,
    SOFTMAX_MODES,
    SQ_MIN,
    SUPPORTED_HEAD_DIMS,
    V_SCALE_MODES,
    default_block_n,
    psum_bias,
)
from .softmax import sas_exp2

__all__ = [
    "turbo_attention",
    "int8_flash_attention",
    "quantize_per_token",
    "quantize_v_blocks",
    "quantize_v_channels",
    "sas_exp2",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

_MAGIC = tl.constexpr(MAGIC)
_MAGIC_BITS = tl.constexpr(MAGIC_BITS)
_TWO_POW_22 = tl.constexpr(4194304)
_P_BLOCK_GAP = tl.constexpr(P_BLOCK_GAP)
_SQ_MIN = tl.constexpr(SQ_MIN)

# Tiles per (BLOCK_D, causal, BLOCK_N): (BLOCK_M, num_warps, num_stages); no autotuning at call time, sequence
# lengths stay out of the key. BLOCK_M 64 with 4 warps (one warpgroup, two programs per SM) won at d <= 128;
# 8 warps at d 256 (4 spill). The sweeps: PERF_NOTES "Prefill tile table".
_GPU_CONFIGS = {
    (64, False, 128): (128, 4, 3),
    (64, True, 128): (64, 4, 3),
    (64, False, 64): (128, 4, 3),
    (64, True, 64): (128, 4, 3),
    (128, False, 128): (64, 4, 3),
    (128, True, 128): (64, 4, 3),
    (128, False, 64): (64, 4, 3),
    (128, True, 64): (64, 4, 3),
    (256, False, 128): (64, 8, 2),
    (256, True, 128): (64, 8, 2),
    (256, False, 64): (64, 8, 2),
    (256, True, 64): (64, 8, 2),
}
_INTERPRET_CONFIG = (32, 1, 1)
_GPU_BLOCK_N = (32, 64, 128)
_INTERPRET_BLOCK_N = (16, 32, 64, 128)
#: which INT8 kernel runs the attention (``TURBO_PREFILL_KERNEL``): "portable" (``_int8_attn_fwd_kernel``, every
#: GPU), "hopper" (the Gluon kernel of ``prefill_hopper`` on sm_90 where it takes the call, the portable one
#: elsewhere) or "auto" (default: "hopper", the faster of the two wherever both run: 1.01-1.20x the portable kernel
#: on an H200 at head_dim 64 and 128, L 4k-16k, PERF_NOTES session 45)
PREFILL_KERNELS = ("auto", "portable", "hopper")
_KERNEL = [os.environ.get("TURBO_PREFILL_KERNEL", "auto")]


# ------------------------------------------------------------------------------------------ kernel
@triton.jit
def _i32_to_f32(x):
    """float(x) for int32 |x| < 2^22, exact, by an integer add and a float add (no I2F instruction)."""
    return (x + _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC


@triton.jit
def _i32_scaled(x, s, s_magic):
    """float(x) * s for int32 |x| < 2^22: bits(x + bits(C)) is the float C + x, so one integer add and one
    FMA, ``(C + x) * s - C s``, with ``s_magic = C * s`` precomputed per row/column (error <= ulp(C s) / 2,
    i.e. half a unit of x times s: far below the INT8 step)."""
    return tl.math.fma((x + _MAGIC_BITS).to(tl.float32, bitcast=True), s, -s_magic)


@triton.jit
def _max_nan(a, b):
    """max that keeps NaN (maximumf; tl.max's maxnumf drops it on the GPU, the interpreter keeps it): a NaN
    score, from a poisoned key or query, must reach the row's running max. Same instruction cost."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block_mask(o_n, o_pos, p_kvbase, Lk, window, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_KEY_VALID: tl.constexpr):
    """[BM, BN] True where query row ``o_pos`` may see key ``o_n`` (a masked block)."""
    m_n = o_n < Lk
    m_s = m_n[None, :]
    if IS_CAUSAL:
        m_s = m_s & (o_n[None, :] <= o_pos[:, None])
    if HAS_WINDOW:
        m_s = m_s & ((o_pos[:, None] - o_n[None, :]) < window)
    if HAS_KEY_VALID:
        b_kv = tl.load(p_kvbase + o_n, mask=m_n, other=0)
        m_s = m_s & (b_kv != 0)[None, :]
    return m_s


@triton.jit
def _masked_keys_nan(p_skbase, p_kvbase, lo, hi, o_pos, Lk, window, IS_CAUSAL: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per row: 0.0, or NaN when the row sees a key with a NaN scale among the masked blocks [lo, hi)."""
    b_f = tl.zeros(o_pos.shape, dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        b_z = tl.load(p_skbase + o_n, mask=o_n < Lk, other=0.0) * 0.0  # sk finite -> 0, NaN -> NaN
        m_s = _block_mask(o_n, o_pos, p_kvbase, Lk, window, IS_CAUSAL, HAS_WINDOW, False)
        b_f += tl.sum(tl.where(m_s, b_z[None, :], 0.0), 1)
    return b_f


@triton.jit
def _keys_nan(p_skbase, lo, hi, SCAN: tl.constexpr):
    """0.0, or NaN when a key scale sk in [lo, hi) is NaN (a poisoned key): one read of sk, 4 bytes a key."""
    b_z = tl.zeros([SCAN], dtype=tl.float32)
    for s in range(lo, hi, SCAN):
        o_s = s + tl.arange(0, SCAN)
        b_z += tl.load(p_skbase + o_s, mask=o_s < hi, other=0.0) * 0.0  # sk finite -> 0, NaN -> NaN
    return tl.sum(b_z, 0)


@triton.jit
def _first_nan_key(p_skbase, lo, hi, SCAN: tl.constexpr):
    """Smallest key index in [lo, hi) whose scale sk is NaN (a poisoned key), else hi: one read of sk,
    4 bytes a key, outside the loop."""
    b_first = tl.zeros([SCAN], dtype=tl.int32) + hi
    for s in range(lo, hi, SCAN):
        o_s = s + tl.arange(0, SCAN)
        b_sk = tl.load(p_skbase + o_s, mask=o_s < hi, other=0.0)
        b_first = tl.minimum(b_first, tl.where(b_sk != b_sk, o_s, hi))
    return tl.min(b_first, 0)


@triton.jit
def _load_k(p_kbase, p_skbase, start_n, o_n0, o_d, m_d, stride_kn, Lk, MASKED: tl.constexpr,
            EVEN_D: tl.constexpr):
    """K tile [BD, BN] (a K-major view of k8 [BN, d]) and its scales sk [BN] at key offset start_n."""
    o_n = start_n + o_n0
    p_k = p_kbase + o_n[None, :] * stride_kn + o_d[:, None]
    if MASKED:
        m_n = o_n < Lk
        b_k = tl.load(p_k, mask=m_d[:, None] & m_n[None, :], other=0)
        b_sk = tl.load(p_skbase + o_n, mask=m_n, other=0.0)
    else:
        if EVEN_D:
            b_k = tl.load(p_k)
        else:
            b_k = tl.load(p_k, mask=m_d[:, None], other=0)
        b_sk = tl.load(p_skbase + o_n)
    return b_k, b_sk


@triton.jit
def _attn_update(
    acc, l_i, m_i, c_i, b_qk, b_sk, b_sq, start_n, o_n0, o_pos, o_d, m_d,
    p_vbase, p_svbase, p_kvbase, stride_vd, stride_svn,
    Lk, window, softcap_in, softcap_out, thr2,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr, USE_SAS: tl.constexpr, BLOCK_P_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, PSUM_BIAS: tl.constexpr,
):
    """One KV block after its Q.K^T dot ``b_qk`` (int32 [BM, BN]): masks, online softmax, P.V.

    State: m_i running row max, c_i the reference point acc and l are kept relative to (2^c_i), see
    ``reference.int8_flash_attention``. Per accumulator element and block: one integer add + two FMAs.
    """
    o_n = start_n + o_n0
    # t = (q8 . k8)_int32 * sk; the base-2 logits are S2 = t * sq (softmax scale and log2 e are in sq)
    b_t = _i32_scaled(b_qk, b_sk[None, :], (b_sk * _MAGIC)[None, :])
    if HAS_SOFTCAP:  # softcap * tanh(S2 ln2 / softcap) * log2 e, tanh(z) = 1 - 2 / (e^(2z) + 1)
        b_t = b_t * b_sq[:, None]
        b_t = (1.0 - 2.0 / (tl.exp2(b_t * softcap_in) + 1.0)) * softcap_out
    if MASKED:
        b_t = tl.where(_block_mask(o_n, o_pos, p_kvbase, Lk, window, IS_CAUSAL, HAS_WINDOW, HAS_KEY_VALID),
                       b_t, float("-inf"))
    elif HAS_KEY_VALID:
        b_kv = tl.load(p_kvbase + o_n)
        b_t = tl.where((b_kv != 0)[None, :], b_t, float("-inf"))
    # online softmax, base 2, relative to c (-inf -> 0 so that exp2 gives 0, not NaN). A NaN score (a key
    # with a NaN scale, not masked: where() above made masked ones -inf) makes m, c, r, hence l and acc, NaN.
    # Unmasked blocks without key_valid keep the plain (NaN-dropping) max: every row sees every key there, so
    # the kernel flags those rows after the loop from sk alone (_keys_nan); a NaN-keeping max in that loop
    # perturbs its register allocation (d256: +10% instructions).
    if HAS_SOFTCAP:
        b_bmax = tl.max(b_t, 1)
    else:
        b_bmax = tl.max(b_t, 1) * b_sq  # sq > 0: rowmax(t sq) = rowmax(t) sq, exactly
    if MASKED or HAS_KEY_VALID:
        m_new = _max_nan(m_i, b_bmax)
    else:
        m_new = tl.maximum(m_i, b_bmax)
    if BLOCK_P_SCALE:
        c_new = tl.maximum(b_bmax, m_new - _P_BLOCK_GAP)
    else:
        c_new = m_new
    c_safe = tl.where(c_new == float("-inf"), 0.0, c_new)
    b_r = tl.math.exp2(c_i - c_safe)
    if HAS_SOFTCAP:
        b_x = b_t - c_safe[:, None]
    else:
        b_x = tl.math.fma(b_t, b_sq[:, None], -c_safe[:, None])
    if USE_SAS:
        if BLOCK_P_SCALE:  # SAS threshold relative to the row max: m_new - S2 > thr2, i.e. c - S2 > thr2 - (m - c)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            b_p = sas_exp2(b_x, (thr2 - (m_safe - c_safe))[:, None])
        else:
            b_p = sas_exp2(b_x, thr2)
    else:
        b_p = tl.math.exp2(b_x)
    # p8 = round(127 p) = bits(127 p + C) - bits(C): its low byte (bits(C)'s is 0, p8 <= 127); the row
    # sum of p8 = sum(bits) - BLOCK_N bits(C), int32 adds wrapping mod 2^32 (PSUM_BIAS: reference.psum_bias)
    b_pbits = tl.math.fma(b_p, 127.0, _MAGIC).to(tl.int32, bitcast=True)
    b_pi = b_pbits.to(tl.int8)
    l_i = l_i * b_r + (tl.sum(b_pbits, 1) - PSUM_BIAS).to(tl.float32)
    if HAS_KEY_VALID:  # x is -inf where masked, NaN at an unmasked poisoned key: its row sum is NaN
        b_xsum = tl.sum(b_x, 1)
        l_i = tl.where(b_xsum == b_xsum, l_i, b_xsum)
    elif MASKED and not IS_CAUSAL and not HAS_WINDOW:  # the tail block: every row sees its keys < Lk (sk 0 past)
        l_i = l_i + tl.sum(b_sk * 0.0, 0)
    p_v = p_vbase + o_d[:, None] * stride_vd + o_n[None, :]  # [BD, BN] of v8t: tokens contiguous
    if EVEN_D:
        b_vt = tl.load(p_v)
    else:
        b_vt = tl.load(p_v, mask=m_d[:, None], other=0)
    b_sv = tl.load(p_svbase + (start_n // BLOCK_N) * stride_svn + o_d, mask=m_d, other=0.0)
    # chained int8 dot: P (from the first dot) x V, V as a K-major [BN, BD] view of the [BD, BN] tile
    b_pv = _i32_scaled(tl.dot(b_pi, tl.trans(b_vt)), b_sv[None, :], (b_sv * _MAGIC)[None, :])
    acc = tl.math.fma(acc, b_r[:, None], b_pv)
    return acc, l_i, m_new, c_new


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, c_i, b_q, b_sq, o_pos, o_d, m_d,
    p_kbase, p_skbase, p_vbase, p_svbase, p_kvbase,
    stride_kn, stride_vd, stride_svn,
    lo, hi, Lk, window, softcap_in, softcap_out, thr2,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr, USE_SAS: tl.constexpr, BLOCK_P_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, PSUM_BIAS: tl.constexpr,
):
    """KV blocks [lo, hi) (lo a multiple of BLOCK_N) of one row block; MASKED adds the position masks."""
    o_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        b_k, b_sk = _load_k(p_kbase, p_skbase, start_n, o_n0, o_d, m_d, stride_kn, Lk, MASKED, EVEN_D)
        acc, l_i, m_i, c_i = _attn_update(
            acc, l_i, m_i, c_i, tl.dot(b_q, b_k), b_sk, b_sq, start_n, o_n0, o_pos, o_d, m_d,
            p_vbase, p_svbase, p_kvbase, stride_vd, stride_svn, Lk, window, softcap_in, softcap_out,
            thr2, MASKED, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_KEY_VALID, USE_SAS, BLOCK_P_SCALE,
            BLOCK_N, EVEN_D, PSUM_BIAS)
    return acc, l_i, m_i, c_i


@triton.jit(do_not_specialize=["Lq", "Lk", "stride_sqb", "stride_sqh", "stride_skb", "stride_skh",
                               "stride_kvb"])
def _int8_attn_fwd_kernel(
    Q8, SQ, K8, SK, VT, SV, KV, O,
    Lq, Lk, HQ, G, window, softcap_in, softcap_out, thr2,
    stride_qb, stride_qh, stride_qm,
    stride_sqb, stride_sqh,
    stride_kb, stride_kh, stride_kn,
    stride_skb, stride_skh,
    stride_vb, stride_vh, stride_vd,
    stride_svb, stride_svh, stride_svn,
    stride_kvb,
    stride_ob, stride_om, stride_oh,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr, USE_SAS: tl.constexpr, BLOCK_P_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    PSUM_BIAS: tl.constexpr,
):
    """grid (cdiv(Lq, BLOCK_M) * b * HQ,): row blocks of one head are neighbours (K/V stay in L2).

    Q8 [b, HQ, Lq, D] int8, SQ [b, HQ, Lq] fp32; K8 [b, HK, Lk, D] int8, SK [b, HK, Lk] fp32;
    VT [b, HK, D, Lpad] int8 (Lpad a multiple of BLOCK_N), SV [b, HK, Lpad / BLOCK_N, D] fp32;
    KV [b, Lk] uint8 key validity (HAS_KEY_VALID); O [b, Lq, HQ, D] (last stride 1). G = HQ // HK.
    """
    tl.static_assert(BLOCK_D * 127 * 127 < _TWO_POW_22)  # |q8 . k8| < 2^22: exact _i32_to_f32
    tl.static_assert(BLOCK_N * 127 * 127 < _TWO_POW_22)  # |p8 . v8| < 2^22
    tl.static_assert(HEAD_DIM <= BLOCK_D)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    n_m = tl.cdiv(Lq, BLOCK_M)
    i_m = n_m - 1 - tl.program_id(0) % n_m  # longest (causal) row blocks first
    i_bh = tl.program_id(0) // n_m  # 1-D grid: b * HQ may pass the 65535 limit of grid axis 1
    i_b, i_hq = i_bh // HQ, i_bh % HQ
    i_hk = i_hq // G
    i_b64, i_hq64, i_hk64 = i_b.to(tl.int64), i_hq.to(tl.int64), i_hk.to(tl.int64)

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m, m_d = o_m < Lq, o_d < HEAD_DIM
    o_pos = o_m + (Lk - Lq)  # absolute query positions (bottom-right aligned)

    p_q = Q8 + i_b64 * stride_qb + i_hq64 * stride_qh + o_m[:, None] * stride_qm + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0)
    b_sq = tl.load(SQ + i_b64 * stride_sqb + i_hq64 * stride_sqh + o_m, mask=m_m, other=0.0)
    l_i = tl.where(b_sq == b_sq, 0.0, b_sq)  # a NaN query scale (poisoned row) starts l at NaN: row stays NaN
    b_sq = _max_nan(b_sq, _SQ_MIN)  # an all-zero query row has sq = 0: keep -inf * sq = -inf
    p_kbase = K8 + i_b64 * stride_kb + i_hk64 * stride_kh
    p_skbase = SK + i_b64 * stride_skb + i_hk64 * stride_skh
    p_vbase = VT + i_b64 * stride_vb + i_hk64 * stride_vh
    p_svbase = SV + i_b64 * stride_svb + i_hk64 * stride_svh
    p_kvbase = KV + i_b64 * stride_kvb

    # KV block ranges: [lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi) masked
    pos_min = i_m * BLOCK_M + (Lk - Lq)
    pos_max = pos_min + (BLOCK_M - 1)
    lo = 0
    hi = Lk
    if IS_CAUSAL:
        hi = tl.minimum(hi, pos_max + 1)
    full_lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pos_min - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(pos_max - window + 1, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = Lk // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        full_hi = tl.minimum(full_hi, (pos_min + 1) // BLOCK_N * BLOCK_N)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    c_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Rows that will see a poisoned key start l at NaN (the loop's max drops NaN); with key_valid the loop
    # flags them itself. Without a window a row sees every key < min(its position + 1, Lk) of [lo, hi).
    if not HAS_KEY_VALID:
        if HAS_WINDOW:  # unmasked blocks: every row; masked ones: per row and key
            bad = _first_nan_key(p_skbase, full_lo, full_hi, 1024) < full_hi
            b_f = tl.where(bad, float("nan"), 0.0) + _masked_keys_nan(
                p_skbase, p_kvbase, lo, full_lo, o_pos, Lk, window, IS_CAUSAL, HAS_WINDOW, BLOCK_N)
            b_f += _masked_keys_nan(p_skbase, p_kvbase, full_hi, hi, o_pos, Lk, window, IS_CAUSAL, HAS_WINDOW,
                                    BLOCK_N)
        elif IS_CAUSAL:
            first = _first_nan_key(p_skbase, lo, tl.minimum(hi, Lk), 1024)
            b_f = tl.where(first <= o_pos, float("nan"), 0.0)  # first <= o_pos < min(hi, Lk) for real rows
        else:  # every row sees every key; the masked tail block [full_hi, Lk) flags itself in the loop
            b_f = _keys_nan(p_skbase, full_lo, full_hi, 1024)
        l_i = l_i + b_f
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_WINDOW:
        acc, l_i, m_i, c_i = _attn_fwd_inner(
            acc, l_i, m_i, c_i, b_q, b_sq, o_pos, o_d, m_d, p_kbase, p_skbase, p_vbase, p_svbase, p_kvbase,
            stride_kn, stride_vd, stride_svn, lo, full_lo, Lk, window, softcap_in, softcap_out, thr2,
            True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_KEY_VALID, USE_SAS, BLOCK_P_SCALE, BLOCK_N, EVEN_D,
            PSUM_BIAS)
    acc, l_i, m_i, c_i = _attn_fwd_inner(
        acc, l_i, m_i, c_i, b_q, b_sq, o_pos, o_d, m_d, p_kbase, p_skbase, p_vbase, p_svbase, p_kvbase,
        stride_kn, stride_vd, stride_svn, full_lo, full_hi, Lk, window, softcap_in, softcap_out, thr2,
        False, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_KEY_VALID, USE_SAS, BLOCK_P_SCALE, BLOCK_N, EVEN_D,
        PSUM_BIAS)
    acc, l_i, m_i, c_i = _attn_fwd_inner(
        acc, l_i, m_i, c_i, b_q, b_sq, o_pos, o_d, m_d, p_kbase, p_skbase, p_vbase, p_svbase, p_kvbase,
        stride_kn, stride_vd, stride_svn, full_hi, hi, Lk, window, softcap_in, softcap_out, thr2,
        True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_KEY_VALID, USE_SAS, BLOCK_P_SCALE, BLOCK_N, EVEN_D,
        PSUM_BIAS)

    # epilogue: o = acc / l, 0 for rows without any valid key (l == 0 exactly); l NaN gives a NaN row
    has_key = l_i != 0
    b_o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    b_o = tl.where(has_key[:, None], b_o, 0.0)
    p_o = O + i_b64 * stride_ob + i_hq64 * stride_oh + o_m[:, None].to(tl.int64) * stride_om + o_d[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


# ---------------------------------------------------------------------------------------- launcher
def _pick_config(head_dim: int, causal: bool, block_n: int):
    """(BLOCK_M, num_warps, num_stages) from the table (GPU) or small tiles (interpreter); a block_n without
    an entry (32) takes the block_n 64 entry."""
    if interpreting():
        return _INTERPRET_CONFIG
    bd = triton.next_power_of_2(head_dim)
    return _GPU_CONFIGS.get((bd, bool(causal), block_n), _GPU_CONFIGS[(bd, bool(causal), 64)])


def _attn_spec(q8, sq, k8, sk, v8t, sv, out, stride_kvb, *, causal, window, softcap, has_key_valid, use_sas, thr2,
               block_p, Lk, block_n, config=None):
    """(grid, scalars, kwargs) of ``_int8_attn_fwd_kernel`` on these operands (the 8 tensors come first)."""
    b, hq, lq, d = q8.shape
    hk = k8.shape[1]
    stride_svn = sv.stride(2) if sv.shape[2] > 1 else 0  # per-channel V scale: the same row every block
    block_m, num_warps, num_stages = config if config is not None else _pick_config(d, causal, block_n)
    has_window = window is not None
    has_softcap = softcap is not None
    grid = (-(-lq // block_m) * b * hq,)
    scalars = (
        lq, Lk, hq, hq // hk,
        int(window) if has_window else 0,
        2.0 / float(softcap) if has_softcap else 0.0,
        float(softcap) * LOG2E if has_softcap else 0.0,
        float(thr2),
        q8.stride(0), q8.stride(1), q8.stride(2),
        sq.stride(0), sq.stride(1),
        k8.stride(0), k8.stride(1), k8.stride(2),
        sk.stride(0), sk.stride(1),
        v8t.stride(0), v8t.stride(1), v8t.stride(2),
        sv.stride(0), sv.stride(1), stride_svn,
        stride_kvb,
        out.stride(0), out.stride(1), out.stride(2),
    )
    kw = dict(
        IS_CAUSAL=bool(causal), HAS_WINDOW=has_window, HAS_SOFTCAP=has_softcap,
        HAS_KEY_VALID=bool(has_key_valid), USE_SAS=bool(use_sas), BLOCK_P_SCALE=bool(block_p),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_pow2(d), HEAD_DIM=d,
        PSUM_BIAS=psum_bias(block_n),
        num_warps=num_warps, num_stages=num_stages,
    )
    return grid, scalars, kw


def _key_valid_arg(key_valid, unused):
    """(uint8 [b, Lk] view of the padding mask, its batch stride), or (``unused``, 0) without one."""
    if key_valid is None:
        return unused, 0  # unused pointer
    kv = key_valid.to(torch.bool).contiguous().view(torch.uint8)
    return kv, kv.stride(0)


def kernel_choice() -> str:
    """The prefill kernel in use (``TURBO_PREFILL_KERNEL``, or :func:`chosen_kernel`), checked."""
    if _KERNEL[0] not in PREFILL_KERNELS:
        raise ValueError(f"TURBO_PREFILL_KERNEL={_KERNEL[0]!r} must be one of {PREFILL_KERNELS}")
    return _KERNEL[0]


@contextlib.contextmanager
def chosen_kernel(name: str):
    """``turbo_attention`` on the prefill kernel ``name`` inside the block (the choice is part of its plans' key, so
    plans of both kernels coexist)."""
    old, _KERNEL[0] = _KERNEL[0], name
    try:
        kernel_choice()
        yield
    finally:
        _KERNEL[0] = old


def hopper_takes(device, d, block_n, *, window, softcap, key_valid, softmax, p_scale, pv_half=False) -> str:
    """'' when the Gluon Hopper kernel runs this call, else why not (a phrase for a log line or an error);
    ``pv_half``: its P.V would run on 16-bit V (``pv_dtype``), which head_dim 256 needs."""
    if interpreting() or device.type != "cuda":
        return "not a CUDA device"
    if not prefill_hopper.gluon_available():
        return f"Triton {triton.__version__} is not one the Gluon kernel was tested with {prefill_hopper.TESTED_TRITON}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "not an sm_90 GPU"
    if not prefill_hopper.supports(d=d, block_n=block_n, window=window, softcap=softcap,
                                   has_key_valid=key_valid is not None, use_sas=softmax == "sas",
                                   block_p=p_scale == "block", pv_half=pv_half):
        return ("its options (head_dim 64/128, or 256 with 16-bit V and per-block V scales; block_n 128, no window, "
                "softcap, padding mask or SAS, block P scale)")
    return ""


def gluon_runs(device, d, block_n=None, *, window=None, softcap=None, key_valid=None, softmax="exact",
               p_scale=DEFAULT_P_SCALE, pv_half=False) -> bool:
    """``turbo_attention`` with these options runs the Gluon Hopper kernel (the kernel choice allows it and
    :func:`hopper_takes` the call; ``block_n`` None: ``turbo_attention``'s default; ``pv_half``: V is 16-bit with
    per-block scales, so P.V would run on it)."""
    return kernel_choice() != "portable" and not hopper_takes(
        device, d, default_block_n(d) if block_n is None else block_n, window=window, softcap=softcap,
        key_valid=key_valid, softmax=softmax, p_scale=p_scale, pv_half=pv_half)


def pv_dtype(device, v_dtype, d, block_n=None, *, window=None, softcap=None, key_valid=None, softmax="exact",
             p_scale=DEFAULT_P_SCALE, v_scale=DEFAULT_V_SCALE):
    """The type ``turbo_attention`` runs P.V in for V of ``v_dtype`` and these options: V's own 16-bit type where the
    Gluon kernel runs the call with V's per-block scales (P.V on V itself: faster there and about half the INT8 P.V's
    error, PERF_NOTES session 47), else None (INT8 P.V; per-channel V scales are INT-FlashAttention's INT8 choice).
    ``reference.turbo_attention(..., pv_dtype=...)`` is the twin of either."""
    half = v_dtype in prefill_hopper.PV_HALF_DTYPES and v_scale == "block" and gluon_runs(
        device, d, block_n, window=window, softcap=softcap, key_valid=key_valid, softmax=softmax, p_scale=p_scale,
        pv_half=True)
    return v_dtype if half else None


def _launch(q8, sq, k8, sk, v8t, sv, out, *, causal, window, softcap, key_valid, use_sas, thr2, block_p,
            Lk, block_n, config=None, hopper=False):
    if hopper:
        return prefill_hopper.launch_ws(q8, sq, k8, sk, v8t, sv, out, causal=causal, Lk=Lk)
    kv, stride_kvb = _key_valid_arg(key_valid, sq)
    grid, scalars, kw = _attn_spec(q8, sq, k8, sk, v8t, sv, out, stride_kvb, causal=causal, window=window,
                                   softcap=softcap, has_key_valid=key_valid is not None, use_sas=use_sas, thr2=thr2,
                                   block_p=block_p, Lk=Lk, block_n=block_n, config=config)
    lean(_int8_attn_fwd_kernel)[grid](q8, sq, k8, sk, v8t, sv, kv, out, *scalars, **kw)
    return out


# ----------------------------------------------------------------------------------- public: checks
def _check_head_dim(d: int) -> None:
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {d} is not supported by turbo_int8 (supported: {SUPPORTED_HEAD_DIMS}); "
            "load the model with attn_implementation='sdpa'"
        )


def _check_options(causal, window, softcap, softmax, p_scale, sas_threshold) -> None:
    if softmax not in SOFTMAX_MODES:
        raise ValueError(f"softmax={softmax!r} must be one of {SOFTMAX_MODES}")
    if p_scale not in P_SCALE_MODES:
        raise ValueError(f"p_scale={p_scale!r} must be one of {P_SCALE_MODES}")
    if window is not None and (int(window) != window or window < 1):
        raise ValueError(f"window={window!r} must be a positive integer (sliding window size) or None")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap!r} must be > 0 or None")
    if softmax == "sas" and not sas_threshold > 0:
        raise ValueError(f"sas_threshold={sas_threshold!r} must be > 0")


def _check_key_valid(key_valid, b, lk, device) -> None:
    if key_valid is None:
        return
    if tuple(key_valid.shape) != (b, lk):
        raise ValueError(f"key_valid must be [b, Lk] = {(b, lk)} (True = real token); got {tuple(key_valid.shape)}")
    if key_valid.dtype != torch.bool:
        raise ValueError(f"key_valid must be a bool tensor; got {key_valid.dtype}")
    if key_valid.device != device:
        raise ValueError(f"key_valid is on {key_valid.device}, the attention inputs on {device}")


def _check_out(out, shape, dtype, device):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be {tuple(shape)} {dtype} on {device}; got {tuple(out.shape)} {out.dtype} "
                         f"on {out.device}")
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dimension")
    return out


# ---------------------------------------------------------------------------------- public: kernels
def int8_flash_attention(q8, sq, k8, sk, v8t, sv, *, causal=True, window=None, softcap=None, key_valid=None,
                         softmax="exact", sas_threshold=6.0, Lk=None, out_dtype=torch.bfloat16,
                         p_scale=DEFAULT_P_SCALE, out=None, block_n=None, _config=None, _kernel=None):
    """The INT8 flash-attention kernel alone, on quantized operands (for kernel-only benchmarks).

    q8: ``[b, Hq, Lq, d]`` int8, sq: ``[b, Hq, Lq]`` fp32 with the softmax scale and log2(e) folded in
    (``quantize_per_token(q, scale=scale * log2 e)``); k8: ``[b, Hk, Lk, d]`` int8, sk: ``[b, Hk, Lk]``;
    v8t: ``[b, Hk, d, Lpad]`` int8 with either sv ``[b, Hk, Lpad // block, d]`` (``quantize_v_blocks``: the
    KV block of the loop is the V block) or sv ``[b, Hk, 1, d]`` (``quantize_v_channels``: the KV block is
    ``block_n``, default 64, which must divide Lpad). Lk: number of real keys (default k8.shape[2]).
    Returns ``o [b, Lq, Hq, d]`` in ``out_dtype`` (written into ``out`` if given). Other arguments: see
    ``turbo_attention``. ``_config=(BLOCK_M, num_warps, num_stages)`` overrides the tile table; ``_kernel``
    ("auto" / "portable" / "hopper") overrides ``TURBO_PREFILL_KERNEL``, and "hopper" raises where that kernel cannot
    run.
    """
    _check_device(q8, "q8")
    for name, t, dt in (("q8", q8, torch.int8), ("k8", k8, torch.int8), ("v8t", v8t, torch.int8),
                        ("sq", sq, torch.float32), ("sk", sk, torch.float32), ("sv", sv, torch.float32)):
        if t.dtype != dt:
            raise ValueError(f"{name} must be {dt}; got {t.dtype}")
        if t.device != q8.device:
            raise ValueError(f"{name} is on {t.device}, q8 on {q8.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be one of {SUPPORTED_DTYPES}; got {out_dtype}")
    if q8.dim() != 4 or k8.dim() != 4 or v8t.dim() != 4:
        raise ValueError("q8, k8, v8t must be 4-D")
    b, hq, lq, d = q8.shape
    _, hk, lk_k, _ = k8.shape
    Lk = lk_k if Lk is None else int(Lk)
    _check_head_dim(d)
    if k8.shape[0] != b or k8.shape[3] != d or tuple(v8t.shape[:3]) != (b, hk, d):
        raise ValueError(f"shapes disagree: q8 {tuple(q8.shape)}, k8 {tuple(k8.shape)}, v8t {tuple(v8t.shape)}")
    if hq % hk != 0:
        raise ValueError(f"query heads {hq} are not a multiple of key/value heads {hk}")
    if not 0 < Lk <= lk_k or Lk > v8t.shape[-1]:
        raise ValueError(f"Lk={Lk} must be in [1, {min(lk_k, v8t.shape[-1])}]")
    if lq > Lk:
        raise ValueError(f"q_len {lq} > kv_len {Lk}: queries must be the last Lq of the Lk positions")
    if tuple(sq.shape) != (b, hq, lq) or tuple(sk.shape[:2]) != (b, hk) or sk.shape[2] < Lk:
        raise ValueError(f"scale shapes disagree: sq {tuple(sq.shape)}, sk {tuple(sk.shape)}")
    nblk = sv.shape[2] if sv.dim() == 4 else 0
    if sv.dim() != 4 or tuple(sv.shape) != (b, hk, nblk, d) or nblk == 0 or v8t.shape[-1] % nblk:
        raise ValueError(f"sv {tuple(sv.shape)} does not match v8t {tuple(v8t.shape)}")
    if nblk > 1:
        if block_n is not None and block_n != v8t.shape[-1] // nblk:
            raise ValueError(f"block_n={block_n} disagrees with the V blocks of sv {tuple(sv.shape)} "
                             f"({v8t.shape[-1] // nblk} tokens); leave block_n=None")
        block_n = v8t.shape[-1] // nblk
    else:
        block_n = DEFAULT_BLOCK_N if block_n is None else int(block_n)
        if v8t.shape[-1] % block_n:
            raise ValueError(f"block_n={block_n} must divide v8t's padded length {v8t.shape[-1]} "
                             "(quantize_v_channels(v, block_n) pads to it)")
    allowed = _INTERPRET_BLOCK_N if interpreting() else _GPU_BLOCK_N
    if block_n not in allowed:
        raise ValueError(f"V block {block_n} is not supported (supported: {allowed})")
    _check_options(causal, window, softcap, softmax, p_scale, sas_threshold)
    _check_key_valid(key_valid, b, Lk, q8.device)
    out = _check_out(out, (b, lq, hq, d), out_dtype, q8.device)
    choice = kernel_choice() if _kernel is None else _kernel
    why = hopper_takes(q8.device, d, block_n, window=window, softcap=softcap, key_valid=key_valid, softmax=softmax,
                       p_scale=p_scale) if choice != "portable" else "not chosen"
    if _kernel == "hopper" and why:
        raise ValueError(f"the Hopper prefill kernel cannot run this call: {why}; use _kernel='portable'")
    if lq == 0 or b * hq == 0:
        return out
    return _launch(q8, sq, k8, sk, v8t, sv, out, causal=causal, window=window, softcap=softcap,
                   key_valid=key_valid, use_sas=softmax == "sas", thr2=float(sas_threshold) * LOG2E,
                   block_p=p_scale == "block", Lk=Lk, block_n=block_n, config=_config, hopper=not why)


def turbo_attention(q, k, v, *, scale=None, causal=True, window=None, softcap=None, key_valid=None,
                    softmax="exact", sas_threshold=6.0, smooth_k=True, out=None, p_scale=DEFAULT_P_SCALE,
                    block_n=None, v_scale=DEFAULT_V_SCALE, k_mean=None, rotate_qk=False, qk_smooth=None):
    """INT8 flash attention from bf16/fp16 Q, K, V: fused quantization + the INT8 kernel.

    q: ``[b, Hq, Lq, d]``, k, v: ``[b, Hk, Lk, d]``, fp16 or bf16 (any strides), Hq % Hk == 0, Lq <= Lk,
    d in (64, 80, 96, 128, 256). Returns ``o [b, Lq, Hq, d]`` in q's dtype (written into ``out`` if given).
      scale: softmax scale (natural-log units), default d**-0.5.
      causal: query i sits at absolute position Lk - Lq + i (bottom-right); attends key j iff j <= pos_i.
      window: sliding window W (HF semantics): also require pos_i - j < W. None = no window.
      softcap: Gemma-2 logit softcap, s = softcap * tanh(s / softcap) on natural-unit scores, before masking.
      key_valid: bool ``[b, Lk]`` padding mask (False = padded key) or None. Rows with no valid key
        return zeros.
      softmax: "exact" (exp2) or "sas" (TurboAttention's sparse activated softmax: weights more than
        ``sas_threshold`` natural-log units below the row max are dropped, the rest use FMA-only exp).
      smooth_k: subtract K's per-channel mean before quantizing (SageAttention); forced off with softcap
        (the mean only commutes with softmax, not with tanh).
      k_mean: that mean (fp32 ``[b, Hk, d]``) when the caller has it already (TurboCache computes it for its
        scales): K is then reduced once per prefill, not twice. Any finite vector leaves softmax unchanged.
      p_scale: "block" (default) or "static" quantization of P, see the module docstring.
      block_n: KV tile (tokens), also the V quantization block with v_scale="block"; None (default):
        ``default_block_n(d)`` = 128.
      v_scale: "block" (V scale per block_n tokens and channel, default) or "channel" (one scale per
        channel over the sequence, INT-FlashAttention's choice).
      rotate_qk: Hadamard-rotate Q and K (``TurboConfig.rotate_qk``, kernels/rotation.py) inside their quantization
        pass, not as a separate matmul; qk_smooth: the ``smooth_hadamard`` factors ``s [b, Hk, d]``
        (``rotation.smooth_scales``), Q times s and K times 1/s before the rotation. Pass unrotated q, k, k_mean.
    Non-finite inputs: a query row holding a NaN/Inf gives a NaN output row; a key token whose K or V holds
    one gives NaN in exactly the rows that attend it (``reference.nonfinite_rows``); every other row stays
    finite and as accurate as without it.
    The plain-PyTorch twin is ``turbo_attn_hf.kernels.reference.turbo_attention`` (same arguments).
    """
    try:  # everything the checks and the launches read; a repeated call (every layer of a prefill) skips both
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
               v.dtype, v.device, scale, causal, window, softcap, softmax, sas_threshold, smooth_k, p_scale, block_n,
               v_scale, bool(rotate_qk), _KERNEL[0],
               None if qk_smooth is None else (qk_smooth.shape, qk_smooth.stride(), qk_smooth.dtype, qk_smooth.device),
               None if key_valid is None else (key_valid.shape, key_valid.stride(), key_valid.dtype, key_valid.device),
               None if out is None else (out.shape, out.stride(), out.dtype, out.device),
               None if k_mean is None else (k_mean.shape, k_mean.stride(), k_mean.dtype, k_mean.device))
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the checks say what is wrong
        key = plan = None
    if plan is None:
        block_n = _check_attention_args(q, k, v, causal, window, softcap, key_valid, softmax, sas_threshold,
                                        p_scale, block_n, v_scale, out)
        check_qk_smooth(qk_smooth, bool(rotate_qk), k)
        b, hq, lq, d = q.shape
        if lq == 0 or b * hq == 0:
            return _check_out(out, (b, lq, hq, d), q.dtype, q.device)
        plan = _AttnPlan(q, k, v, key_valid, out, k_mean, scale=scale, causal=causal, window=window, softcap=softcap,
                         softmax=softmax, sas_threshold=sas_threshold, smooth_k=smooth_k, p_scale=p_scale,
                         block_n=block_n, v_scale=v_scale, rotate_qk=bool(rotate_qk), has_factor=qk_smooth is not None)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    elif not plan.cuda:
        _check_device(q, "q")  # CPU tensors: only under the interpreter (checked each call: it can be switched)
    return plan.run(q, k, v, key_valid, out, k_mean, qk_smooth)


def _check_attention_args(q, k, v, causal, window, softcap, key_valid, softmax, sas_threshold, p_scale, block_n,
                          v_scale, out) -> int:
    """``turbo_attention``'s input checks (raise ValueError); returns the KV tile ``block_n``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [b, H, L, d]; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} is {t.dtype}; turbo_attention takes {SUPPORTED_DTYPES} (use "
                             "turbo_attn_hf.kernels.reference.turbo_attention for float32)")
        _check_device(t, name)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    b, hq, lq, d = q.shape
    _, hk, lk, dk = k.shape
    if k.shape[0] != b or dk != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree in batch size or head_dim")
    _check_head_dim(d)
    if hq % hk != 0:
        raise ValueError(f"query heads {hq} are not a multiple of key/value heads {hk}")
    if lq > lk:
        raise ValueError(f"q_len {lq} > kv_len {lk}: queries must be the last Lq of the Lk positions")
    if block_n is None:
        block_n = default_block_n(d)
    allowed = _INTERPRET_BLOCK_N if interpreting() else _GPU_BLOCK_N
    if block_n not in allowed:
        raise ValueError(f"block_n={block_n} is not supported (supported: {allowed})")
    _check_options(causal, window, softcap, softmax, p_scale, sas_threshold)
    if v_scale not in V_SCALE_MODES:
        raise ValueError(f"v_scale={v_scale!r} must be one of {V_SCALE_MODES}")
    _check_key_valid(key_valid, b, lk, q.device)
    if out is not None:
        _check_out(out, (b, lq, hq, d), q.dtype, q.device)
    return block_n


#: turbo_attention's plans by key (shapes, strides, dtypes, devices, options); cleared when full (a long-running
#: process with many prompt lengths re-plans, ~100 us a plan)
_PLANS: dict = {}
_MAX_PLANS = 256


class _AttnPlan:
    """``turbo_attention`` for one key: output shapes, the three launches (Q+K quantization, V quantization, the
    INT8 kernel) with their grids, scalar arguments and constexprs, and each launch's compiled kernel per current
    device, relaunched without Triton's binder while every pointer is 16-byte aligned (``LeanLaunch.launch_memo``)."""

    __slots__ = ("cuda", "device", "dtype", "shapes", "smooth", "mean_stride", "mean_direct", "channel", "block_n",
                 "kv_arg", "qk", "v", "attn", "memo", "hopper", "ksum", "ws", "v_op")

    def __init__(self, q, k, v, key_valid, out, k_mean, *, scale, causal, window, softcap, softmax, sas_threshold,
                 smooth_k, p_scale, block_n, v_scale, rotate_qk=False, has_factor=False):
        b, hq, lq, d = q.shape
        hk, lk = k.shape[1], k.shape[2]
        dev = q.device
        self.cuda, self.device, self.dtype = dev.type == "cuda", dev, q.dtype
        self.smooth = smooth_k and softcap is None
        self.channel = v_scale != "block"
        self.block_n = block_n
        nblk = max(1, -(-lk // block_n))
        self.hopper = gluon_runs(dev, d, block_n, window=window, softcap=softcap, key_valid=key_valid, softmax=softmax,
                                 p_scale=p_scale, pv_half=v.dtype in prefill_hopper.PV_HALF_DTYPES and not self.channel)
        sk_row = -(-lk // 4) * 4 if self.hopper else lk  # the Gluon kernel's 1-D TMA copies start 16-byte aligned
        # P.V on V itself in the Gluon kernel (16-bit, padded, non-finite tokens zeroed by the V pass): ``pv_dtype``
        half = pv_dtype(dev, v.dtype, d, block_n, window=window, softcap=softcap, key_valid=key_valid,
                        softmax=softmax, p_scale=p_scale, v_scale=v_scale) is not None
        self.v_op = v.dtype if half else torch.int8
        self.shapes = ((b, hq, lq, d), (b, hq, lq), (b, hk, lk, d), (b, hk, sk_row),
                       (b, hk, nblk * block_n, d) if half else (b, hk, d, nblk * block_n),
                       (b, hk, 1 if self.channel or half else nblk, d), (b, lq, hq, d))
        meta = [torch.empty(sh, dtype=dt, device="meta") for sh, dt in zip(
            self.shapes, (torch.int8, torch.float32, torch.int8, torch.float32, self.v_op, torch.float32, q.dtype))]
        q8, sq, k8, sk, v8t, sv, o = meta
        # the mean is passed contiguous (plan strides); a given one that already is fp32 [b, hk, d] on this device
        # and contiguous (TurboCache's) is passed as it is, any other is converted (``_mean_arg``) each call
        self.mean_stride = (hk * d, d, 1)
        smb, smh = (hk * d, d) if self.smooth else (0, 0)
        self.mean_direct = (k_mean is not None and k_mean.dtype == torch.float32 and k_mean.device == dev
                            and tuple(k_mean.shape) == (b, hk, d) and k_mean.stride() == self.mean_stride)
        # without a given mean: K's fp64 channel sums in splits, finished into the mean by the Q+K pass (the torch
        # reduction cast K to fp64 first: 3-4x the Q+K pass's time, PERF_NOTES session 46)
        self.ksum, parts = None, 0
        if self.smooth and k_mean is None:
            *self.ksum, parts = _k_sum_spec(k)
            smb, smh = hk * parts * d, parts * d
        scale = d ** -0.5 if scale is None else float(scale)
        self.qk = _qk_spec(q, k, scale * LOG2E, 1.0, smb, smh, self.smooth, rotate_qk, has_factor, parts, sk_row)
        # poison: sk [b, hk, sk_row], contiguous; the Gluon kernel takes V's INT8 keys in its operand order
        self.v = _v_spec(v, block_n, hk * sk_row, sk_row, self.channel, True, mma_order=self.hopper and not half,
                         half=half)
        kv, stride_kvb = _key_valid_arg(key_valid, q)
        self.kv_arg = key_valid is not None
        self.attn = self.ws = None
        if self.hopper:
            self.ws = prefill_hopper.WsLaunch(q8, sq, k8, sk, v8t, sv, out if out is not None else o, causal=causal,
                                              Lk=lk)
        else:
            self.attn = _attn_spec(q8, sq, k8, sk, v8t, sv, out if out is not None else o, stride_kvb, causal=causal,
                                   window=window, softcap=softcap, has_key_valid=key_valid is not None,
                                   use_sas=softmax == "sas", thr2=float(sas_threshold) * LOG2E,
                                   block_p=p_scale == "block", Lk=lk, block_n=block_n)
        self.memo = ({}, {}, {}, {})

    def run(self, q, k, v, key_valid, out, k_mean, qk_smooth=None):
        dev = self.device
        s_q8, s_sq, s_k8, s_sk, s_v8t, s_sv, s_o = self.shapes
        q8 = torch.empty(s_q8, dtype=torch.int8, device=dev)
        sq = torch.empty(s_sq, dtype=torch.float32, device=dev)
        k8 = torch.empty(s_k8, dtype=torch.int8, device=dev)
        sk = torch.empty(s_sk, dtype=torch.float32, device=dev)
        v8t = torch.empty(s_v8t, dtype=self.v_op, device=dev)
        sv = torch.empty(s_sv, dtype=torch.float32, device=dev)
        if out is None:
            out = torch.empty(s_o, dtype=self.dtype, device=dev)
        m = sk  # unused pointer without smoothing
        hooks = LeanLaunch.hooks_active()
        dev_key = current_cuda_device() if self.cuda else -1  # the rest of the key is the plan's
        memo_qk, memo_v, memo_attn, memo_sum = self.memo
        if self.smooth:
            if self.ksum is not None:
                grid, scalars, kw = self.ksum
                m = torch.empty(grid[0] * s_q8[3], dtype=torch.float64, device=dev)
                lean(_k_sum_kernel).launch_memo(memo_sum, dev_key, grid, (k, m), scalars, kw, hooks)
            elif self.mean_direct:
                m = k_mean
            else:
                m = _mean_arg(k_mean, q, s_sk[0], s_sk[1], s_q8[3])[0].contiguous()
        kv = _key_valid_arg(key_valid, q)[0] if self.kv_arg else sq
        f = factor_arg(qk_smooth, sk)
        grid, scalars, kw = self.qk
        lean(_quant_qk_kernel).launch_memo(memo_qk, dev_key, grid, (q, k, m, f, q8, k8, sq, sk), scalars, kw, hooks)
        grid, scalars, kw = self.v
        amax = _v_channel_amax(v) if self.channel else sv  # after K's pass: V marks poisoned keys in sk
        lean(_quant_v_kernel).launch_memo(memo_v, dev_key, grid, (v, amax, v8t, sv, sk), scalars, kw, hooks)
        if self.ws is not None:
            return self.ws(q8, sq, k8, sk, v8t, sv, out)
        grid, scalars, kw = self.attn
        lean(_int8_attn_fwd_kernel).launch_memo(memo_attn, dev_key, grid, (q8, sq, k8, sk, v8t, sv, kv, out),
                                                scalars, kw, hooks)
        return out
