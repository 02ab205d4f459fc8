"""Decode-step store: quantize new K/V tokens to INT8 and write them into the cache's INT8 buffer, one launch.

A decode step stores 1 (or a few) tokens per layer. Done with PyTorch ops (``pack.quantize_int8`` for K and
V, then two slice copies into the buffers) that is ~22 kernel launches per layer, and the step is bound by
their host cost (eval/PERF_NOTES.md, "Decode step on the host"). This kernel does the same arithmetic
(``pack._quantize_universal``, shared with ``quantize_int8``'s kernel; twin: ``reference.quantize_int8_universal_ref``)
and the two writes in one launch:

    k8 = clamp(round_half_away((k - mean) / s_k), ±127)  -> k_tail[b, h, slot + t, :]
    v8 = clamp(round_half_away(v / s_v), ±127)           -> v_tail[b, h, :, slot + t]   (V transposed)

The first prefill's store and every store that packs a block (issue 19: it was ~60-110 small PyTorch launches
per layer with host syncs for mixed's head choice) are two more kernels here, none with a host sync:

* ``_stats_kernel`` (grid: chunks of blocks x (b, h)): per chunk and channel the min/max of K and V over the
  finite elements, the calibration's per-block gaps (``calibrate.prompt_head_priority``), the finite K sum and
  count (the K mean, inf/NaN left out) and the number of token vectors with a non-finite element. The
  last chunk of a (b, h) to finish (an arrival counter) turns that head's partials into its universal scales
  (``_finish_head``: the fp32 formula of ``TurboLayer._fix_scales``, bit for bit); the last head to finish writes
  the non-finite count and, for ``head_select: prompt``, ranks the heads (gap x std) and writes each bit group's
  ``heads`` map on the device (``_finish_layer``);
* ``_store_kv_kernel`` (grid: blocks to pack + 1, b*H): quantizes the tokens with the universal scales, packs
  each full block straight into its group's storage (INT8/INT4/INT2 by the group's constexpr bits) and writes
  sink / recent / tail tokens into the INT8 buffer (``reference.int8_buffer_layout``).

With K smoothing the stats kernel also sums the finite keys in fp64 and the head finisher writes the mean: exact for
16-bit keys, so bit for bit ``reference.k_smooth_mean`` (the prefill's and the reference's) in any summation order.
First prefill = stats + store = 2 launches per layer; the first stores a forward queued (``turbo_attn_hf.
first_prefill``) take those two launches once for all queued layers (``LAYERS``: grid axis 2, every pointer moved by
a per-layer table, ``_at_layer``).

``rotate_qk`` (issue 23): a rotated layer passes its keys unrotated with ``rotate=True`` (and the smooth_hadamard
factors): each kernel rotates the K rows it loads (``_rotate_keys``: x 1/s, the in-register butterfly
``hadamard.hadamard_rows``, x fp32 1/sqrt(n)) before any statistic, code or pack, so no rotated copy of K
is written and read back; ``kv_stats`` also returns the raw mean's rotation (the finisher), the mean the
stores subtract. Twin: ``reference.rotate_keys_ref`` / ``rotate_mean_ref``. ``rotate=False`` compiles today's code.

Host path (issue 19): ``kv_stats`` keeps its grids, scalars and constexprs per key (shapes, strides, dtypes, options)
and ``store_kv`` its constexprs per specialisation; both relaunch the compiled kernels without Triton's binder
(``LeanLaunch.launch_memo``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .decode import _pow2
from .device import current_cuda_device, sm_count
from .hadamard import _key_factor, _rotate_keys, hadamard_rows
from .interpreter import interpreting
from .launch import LeanLaunch, lean
from .pack import _bad_rows, _finite, _pack_tile, _quantize_universal, _universal_scales, keeps_int8_k
from .quant import _multiple, _vec, check_qk_smooth, factor_arg
from .rotation import rotate_constexprs

__all__ = ["store_int8_tokens", "kv_stats", "store_kv", "STATS_CHUNK_BLOCKS", "StatsLaunch", "StoreKVLaunch",
           "check_store_kv", "stats_launch", "stats_workspace", "stats_workspace_steps", "store_kv_launch",
           "LAYER_ROW_STATS", "LAYER_ROW_STORE"]


@triton.jit(do_not_specialize=["slot", "T"])
def _store_tokens_kernel(
    k, v, sk, mk, sv, kt, vt, flag, smf, slot, T,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    H, C,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HAS_MEAN: tl.constexpr, COUNT: tl.constexpr,
    ROTATE: tl.constexpr, ROT_N: tl.constexpr, HAS_FACTOR: tl.constexpr,
    ROT_C: tl.constexpr,
):
    """grid = (b * H,): tokens ``[0, T)`` of k/v ``[b, H, T, D]`` -> buffer slots ``slot + t``;
    sk/mk/sv ``[b, H, D]`` fp32; kt ``[b, H, C, D]``, vt ``[b, H, D, C]`` int8. ROTATE: K rows rotated first
    (``_rotate_keys``; smf ``[b, H, D]`` fp32 factors with HAS_FACTOR)."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m = (o_t[:, None] < T) & (o_d[None, :] < D)
    b_sk, b_mk, b_sv = _universal_scales(sk, mk, sv, i_bh.to(tl.int64) * D + o_d, o_d < D, HAS_MEAN)
    b_k = tl.load(k + i_b.to(tl.int64) * stride_kb + i_h * stride_kh + o_t[:, None] * stride_kt + o_d[None, :],
                  mask=m, other=0.0)
    if ROTATE:
        b_f = _key_factor(smf, i_bh.to(tl.int64) * D + o_d, o_d < D, BD, HAS_FACTOR)
        b_k = _rotate_keys(b_k, b_f, ROTATE, ROT_N, ROT_C)
    b_v = tl.load(v + i_b.to(tl.int64) * stride_vb + i_h * stride_vh + o_t[:, None] * stride_vt + o_d[None, :],
                  mask=m, other=0.0)
    # pack.quantize_int8's tile math (one helper: the same bits)
    b_k8 = _quantize_universal(b_k, b_sk, b_mk, HAS_MEAN=HAS_MEAN)
    b_v8 = _quantize_universal(b_v, b_sv, b_sv, HAS_MEAN=False)
    if COUNT:
        tl.atomic_add(flag, _bad_rows(b_k, b_v, m))
    o_buf = i_bh.to(tl.int64) * C * D  # the same for [C, D] and [D, C]
    tl.store(kt + o_buf + (slot + o_t[:, None]) * D + o_d[None, :], b_k8, mask=m)
    tl.store(vt + o_buf + o_d[None, :] * C + (slot + o_t[:, None]), b_v8, mask=m)


_STORE = LeanLaunch(_store_tokens_kernel)  # one launch per layer and decode step: skip the binder


def store_int8_tokens(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, k_mean: Optional[torch.Tensor],
                      v_scale: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, slot: int,
                      nonfinite: Optional[torch.Tensor] = None, rotate: bool = False,
                      qk_smooth: Optional[torch.Tensor] = None) -> None:
    """Quantize ``k, v [b, H, T, D]`` (last dim contiguous) with the universal scales and write them to
    ``k_tail[:, :, slot:slot+T]`` / ``v_tail[:, :, :, slot:slot+T]`` (contiguous ``[b, H, C, D]`` /
    ``[b, H, D, C]`` int8, ``slot + T <= C``). Scales/mean: contiguous ``[b, H, D]`` fp32. ``nonfinite``: an
    int32 counter that gets the number of stored (row, head, token) vectors with an inf/NaN in K or V.
    ``rotate`` (``rotate_qk``): ``k`` is the caller's unrotated K; the kernel stores ``rotate_keys_ref(k, qk_smooth)``
    (factors ``s [b, H, D]`` or None), so ``k_scale`` / ``k_mean`` are the rotated basis' (``kv_stats``' third
    output)."""
    b, H, T, D = k.shape
    C = k_tail.shape[2]
    if slot + T > C:
        raise ValueError(f"{T} tokens at slot {slot} overflow the INT8 buffer of {C} slots")
    check_qk_smooth(qk_smooth, rotate, k)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    tensors = (k, v, k_scale, k_mean if k_mean is not None else k_scale, v_scale, k_tail, v_tail,
               nonfinite if nonfinite is not None else k_tail, factor_arg(qk_smooth, k_scale))
    strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    # every fact Triton specialises on but the pointers' alignment (launch_memo checks that): a decode step's store
    # (every layer, every step) relaunches without the per-argument facts of LeanLaunch.launch
    key = (tuple(t.dtype for t in tensors), k.device, b, H, T, D, C, strides, rotate, qk_smooth is None,
           k_mean is None, nonfinite is None)
    kw = _STORE_KW.get(key)
    if kw is None:
        if len(_STORE_KW) >= 256:
            _STORE_KW.clear()
            _STORE_MEMO.clear()
        kw = _STORE_KW[key] = dict(D=D, BD=_pow2(D), BT=_pow2(T), HAS_MEAN=k_mean is not None,
                                   COUNT=nonfinite is not None,
                                   **rotate_constexprs(k.shape[-1], rotate, qk_smooth is not None),
                                   num_warps=4,
                                   **_no_fma(rotate))
    dev_key = current_cuda_device() if k.is_cuda else -1
    _STORE.launch_memo(_STORE_MEMO, (key, dev_key), (b * H,), tensors, (int(slot), T, *strides, H, C), kw,
                       LeanLaunch.hooks_active())


#: store_int8_tokens' constexprs and compiled kernels by call key
_STORE_KW: dict = {}
_STORE_MEMO: dict = {}


def _no_fma(rotate: bool) -> dict:
    """A rotating store kernel rounds ``y * ROT_C`` (and ``x * 1/s``) before the next add (the twin's order; the finish
    kernel's rotated mean before ``max - mean``): no FMA contraction there; the unrotated kernels keep their compile
    options. (An FMA there moved k_scale by 1 ulp on the H100.)"""
    return dict(enable_fp_fusion=False) if rotate else {}


# ============================================================================ first prefill: stats -> scales
#: the most blocks per program of ``_stats_kernel`` on the GPU (a chunk of 8 x 64 tokens: 512 programs at 32k, 8
#: heads); fewer while that leaves SMs idle (``stats_chunk_blocks``); the interpreter takes whole sequences per
#: program (its cost is per operation, not per element)
STATS_CHUNK_BLOCKS = 8
N_PART = 7  # rows of a stats partial: K min, K max, V min, V max, K gap sum, V gap sum, finite K count (the finite
#: K sum is fp64, ``psum``: exact for 16-bit keys, so the mean does not depend on the order of the sums)


#: int64 entries per layer of a batched launch's table (``tbl``): the kernel's pointer arguments before ``tbl``,
#: rounded up to even (each launch's rows then start 16-byte aligned in one table)
LAYER_ROW_STATS = 14
LAYER_ROW_STORE = 28
_LAYER_ROW_STATS = tl.constexpr(LAYER_ROW_STATS)
_LAYER_ROW_STORE = tl.constexpr(LAYER_ROW_STORE)


@triton.jit
def _at_layer(p, row, j):
    """``p`` moved to the program's layer: ``row[j]`` elements (``turbo_attn_hf.first_prefill`` launches a forward's
    queued first stores on grid axis 2). The host checks every entry is a multiple of 16 bytes; written so that the
    compiler knows it and the pointer keeps its 16-byte alignment (vector loads)."""
    n: tl.constexpr = 128 // p.dtype.element_ty.primitive_bitwidth
    return p + tl.load(row + j) // n * n


@triton.jit
def _group_at_layer(h, gk, gv, gks, gkz, gvsz, row, j):
    """A bit group's six pointers of ``_store_kv_kernel`` moved to the program's layer (``_at_layer``)."""
    return (_at_layer(h, row, j), _at_layer(gk, row, j + 1), _at_layer(gv, row, j + 2), _at_layer(gks, row, j + 3),
            _at_layer(gkz, row, j + 4), _at_layer(gvsz, row, j + 5))


@triton.jit(do_not_specialize=["T", "NC", "stride_kb", "stride_kh", "stride_kt", "stride_vb", "stride_vh",
                               "stride_vt"])
def _stats_kernel(
    k, v, part, psum, cnt, arrive, mean, ks, vs, flag, heads_hi, heads_lo, mrot, smf, tbl, T, NC, B, H, hs, n_gap,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, NSUB: tl.constexpr, VEC: tl.constexpr, ROT: tl.constexpr,
    ROTATE: tl.constexpr, ROT_N: tl.constexpr, HAS_FACTOR: tl.constexpr,
    ROT_C: tl.constexpr, BC: tl.constexpr, HP: tl.constexpr, N2: tl.constexpr,
    HAS_MEAN: tl.constexpr, SELECT: tl.constexpr, MEAN_IN: tl.constexpr, LAYERS: tl.constexpr = False,
):
    """grid (NC, b*H), with LAYERS (NC, b*H, layers): every pointer moved to the program's layer (``_at_layer``,
    ``tbl``). Tokens ``[i_c*NSUB*BS, (i_c+1)*NSUB*BS)`` of (b, h) of k, v ``[b, H, T, D]`` (last dim
    contiguous) -> ``part[b*H, NC, N_PART, BD]`` fp32, ``psum[b*H, NC, BD]`` fp64 (the finite keys' sum),
    ``cnt[b*H, NC]`` int32 (non-finite token vectors); the last
    chunk of a (b, h) to arrive (``arrive[b*H + 1]`` int32 counters, zero before and after the launch) finishes its
    scales (``_finish_head``), the last of those the layer's count and head choice (``_finish_layer``).
    Non-finite elements are left out of every statistic. Gaps follow ``calibrate._block_gaps``: per block of BS
    tokens max - min per channel, full blocks only; a sequence shorter than one block is one block. Channels
    ``< ROT`` (RoPE pairs j, j ± ROT/2) put the min/max of the pair's squared norm in the K min/max rows.
    ROTATE: K's min/max and gaps are those of the rotated rows (``_rotate_keys``, factors smf ``[b*H, D]`` with
    HAS_FACTOR), its finite sum/count stay the raw keys' (the raw mean, ``_finish_head``)."""
    if LAYERS:
        row = tbl + tl.program_id(2).to(tl.int64) * _LAYER_ROW_STATS
        k, v, part, psum = _at_layer(k, row, 0), _at_layer(v, row, 1), _at_layer(part, row, 2), _at_layer(psum, row, 3)
        cnt, arrive, mean, ks = _at_layer(cnt, row, 4), _at_layer(arrive, row, 5), _at_layer(mean, row, 6), \
            _at_layer(ks, row, 7)
        vs, flag, heads_hi = _at_layer(vs, row, 8), _at_layer(flag, row, 9), _at_layer(heads_hi, row, 10)
        heads_lo, mrot, smf = _at_layer(heads_lo, row, 11), _at_layer(mrot, row, 12), _at_layer(smf, row, 13)
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    # strides out of the specialization key, multiples of VEC (the launcher checks): 16-byte loads of K/V rows
    stride_kb, stride_kh, stride_kt = _multiple(stride_kb, VEC), _multiple(stride_kh, VEC), _multiple(stride_kt, VEC)
    stride_vb, stride_vh, stride_vt = _multiple(stride_vb, VEC), _multiple(stride_vh, VEC), _multiple(stride_vt, VEC)
    o_d = tl.arange(0, BD)
    o_r = tl.arange(0, BS)
    m_d = o_d < D
    o_p = tl.where(o_d < ROT // 2, o_d + ROT // 2, tl.where(o_d < ROT, o_d - ROT // 2, o_d))  # RoPE partner
    inf = float("inf")
    b_kmin, b_kmax, b_vmin, b_vmax, b_ksum, b_kn = _empty_stats(BD)
    b_kgap = tl.zeros([BD], tl.float32)
    b_vgap = tl.zeros([BD], tl.float32)
    n_bad = tl.sum(tl.zeros([BS], tl.int32), 0)
    p_k = k + i_b * stride_kb + i_h * stride_kh
    p_v = v + i_b * stride_vb + i_h * stride_vh
    n_full = T // BS
    b_f = _key_factor(smf, i_bh.to(tl.int64) * D + o_d, m_d, BD, HAS_FACTOR and ROTATE)
    for j in range(NSUB):
        t0 = (i_c * NSUB + j) * BS
        o_t = (t0 + o_r).to(tl.int64)
        m = (o_t < T)[:, None] & m_d[None, :]
        b_k = tl.load(p_k + o_t[:, None] * stride_kt + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_v = tl.load(p_v + o_t[:, None] * stride_vt + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        f_k = m & _finite(b_k)
        f_v = m & _finite(b_v)
        b_ksum += tl.sum(tl.where(f_k, b_k, 0.0).to(tl.float64), 0)  # raw keys: the raw mean (exact sum)
        b_kn += tl.sum(f_k.to(tl.float32), 0)
        if ROTATE:  # a key's non-finite element spreads over its Hadamard block: those channels drop out
            b_k = _rotate_keys(b_k, b_f, ROTATE, ROT_N, ROT_C)
            f_k = m & _finite(b_k)
        k_lo = tl.min(tl.where(f_k, b_k, inf), 0)
        k_hi = tl.max(tl.where(f_k, b_k, -inf), 0)
        v_lo = tl.min(tl.where(f_v, b_v, inf), 0)
        v_hi = tl.max(tl.where(f_v, b_v, -inf), 0)
        if ROT > 0:  # squares of 16-bit values are exact in fp32; no FMA (the launch): fp32 K rounds as torch
            b_kp = tl.load(p_k + o_t[:, None] * stride_kt + o_p[None, :], mask=m, other=0.0).to(tl.float32)
            b_n2 = b_k * b_k + b_kp * b_kp
            f_n2 = m & _finite(b_n2)
            n_lo = tl.min(tl.where(f_n2, b_n2, inf), 0)
            n_hi = tl.max(tl.where(f_n2, b_n2, -inf), 0)
            b_kmin = tl.minimum(b_kmin, tl.where(o_d < ROT, n_lo, k_lo))
            b_kmax = tl.maximum(b_kmax, tl.where(o_d < ROT, n_hi, k_hi))
        else:
            b_kmin, b_kmax = tl.minimum(b_kmin, k_lo), tl.maximum(b_kmax, k_hi)
        b_vmin, b_vmax = tl.minimum(b_vmin, v_lo), tl.maximum(b_vmax, v_hi)
        counted = (t0 + BS <= T) | ((n_full == 0) & (t0 == 0))
        b_kgap += tl.where(counted & (k_hi >= k_lo), k_hi - k_lo, 0.0)  # a channel with no finite value: 0
        b_vgap += tl.where(counted & (v_hi >= v_lo), v_hi - v_lo, 0.0)
        n_bad += tl.sum(tl.max((m & ((f_k == 0) | (f_v == 0))).to(tl.int32), 1), 0)
    p_p = part + (i_bh.to(tl.int64) * NC + i_c) * (7 * BD) + o_d
    tl.store(p_p, b_kmin)
    tl.store(p_p + BD, b_kmax)
    tl.store(p_p + 2 * BD, b_vmin)
    tl.store(p_p + 3 * BD, b_vmax)
    tl.store(p_p + 4 * BD, b_kgap)
    tl.store(p_p + 5 * BD, b_vgap)
    tl.store(p_p + 6 * BD, b_kn)
    tl.store(psum + (i_bh.to(tl.int64) * NC + i_c) * BD + o_d, b_ksum)
    tl.store(cnt + i_bh.to(tl.int64) * NC + i_c, n_bad)
    # arrival counts, no waiting (decode.py's split merge): a barrier orders every thread's stores before the
    # program's gpu-scope acq_rel atomic; the finishers read the partials from L2 (.cg)
    tl.debug_barrier()
    if tl.atomic_add(arrive + i_bh, 1, sem="acq_rel", scope="gpu") == NC - 1:
        tl.atomic_xchg(arrive + i_bh, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        _finish_head(i_bh, part, psum, mean, ks, vs, mrot, smf, NC, hs, D, BD, BC, HAS_MEAN, MEAN_IN, ROT, ROTATE, ROT_N,
                     HAS_FACTOR, ROT_C, SELECT)
        tl.debug_barrier()
        if tl.atomic_add(arrive + B * H, 1, sem="acq_rel", scope="gpu") == B * H - 1:
            tl.atomic_xchg(arrive + B * H, 0, sem="relaxed", scope="gpu")
            _finish_layer(part, cnt, flag, heads_hi, heads_lo, NC, B, H, n_gap, D, BD, HP, N2, SELECT)


@triton.jit
def _empty_stats(BD: tl.constexpr):
    """Channel accumulators before any token: K min, K max, V min, V max (+-inf), finite K sum (fp64: exact for
    16-bit keys) and count (0)."""
    inf = float("inf")
    return (tl.full([BD], inf, tl.float32), tl.full([BD], -inf, tl.float32), tl.full([BD], inf, tl.float32),
            tl.full([BD], -inf, tl.float32), tl.zeros([BD], tl.float64), tl.zeros([BD], tl.float32))


@triton.jit
def _head_prio(b_g, m_d, D: tl.constexpr):
    """``calibrate.head_priority`` of channel gaps ``b_g [HP, BD]``: mean_c x std_c (population) per row."""
    b_mu = tl.sum(tl.where(m_d[None, :], b_g, 0.0), 1) / D
    b_dev = tl.where(m_d[None, :], b_g - b_mu[:, None], 0.0)
    return b_mu * tl.sqrt_rn(tl.sum(b_dev * b_dev, 1) / D)


@triton.jit
def _finish_head(pid, part, psum, mean, ks, vs, mrot, smf, NC, hs, D: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr,
                 HAS_MEAN: tl.constexpr, MEAN_IN: tl.constexpr, ROT: tl.constexpr, ROTATE: tl.constexpr, ROT_N: tl.constexpr,
                 HAS_FACTOR: tl.constexpr, ROT_C: tl.constexpr, GAPS: tl.constexpr):
    """(b, h) ``pid``'s NC chunk partials -> the K mean (HAS_MEAN: finite sum / count, written to ``mean``),
    k_scale, v_scale ``[B*H, D]`` = amax * hs (K: max(k_max - mean, mean - k_min)), 1 where not > 0. Channels
    ``< ROT`` hold the squared RoPE-pair norm's min/max (``_stats_kernel``): amax = sqrt of its max, mean 0
    (``reference.kv_universal_scales_ref``). ROTATE: the partials' K min/max are the rotated keys'; the fixed raw
    mean stays in ``mean`` and its rotation ``(mean . diag(1/s) . H+-1) * ROT_C`` (fp32 products, exact; fp32
    sums) goes to ``mrot`` ``[B*H, D]``, the mean the K scale is taken around (and the store's). GAPS: the chunks' K
    and V gap sums, summed, replace chunk 0's (``_finish_layer`` reads one row per head, in parallel per head here)."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    inf = float("inf")
    o_c = tl.arange(0, BC)
    b_kmin, b_kmax, b_vmin, b_vmax, b_ksum, b_kn = _empty_stats(BD)
    b_kgap = tl.zeros([BD], tl.float32)
    b_vgap = tl.zeros([BD], tl.float32)
    for c0 in range(0, NC, BC):
        m = ((c0 + o_c) < NC)[:, None] & (o_d < BD)[None, :]
        p_p = part + (pid.to(tl.int64) * NC + c0 + o_c[:, None]) * (7 * BD) + o_d[None, :]
        b_kmin = tl.minimum(b_kmin, tl.min(tl.load(p_p, mask=m, other=inf, cache_modifier=".cg"), 0))
        b_kmax = tl.maximum(b_kmax, tl.max(tl.load(p_p + BD, mask=m, other=-inf, cache_modifier=".cg"), 0))
        b_vmin = tl.minimum(b_vmin, tl.min(tl.load(p_p + 2 * BD, mask=m, other=inf, cache_modifier=".cg"), 0))
        b_vmax = tl.maximum(b_vmax, tl.max(tl.load(p_p + 3 * BD, mask=m, other=-inf, cache_modifier=".cg"), 0))
        b_kn += tl.sum(tl.load(p_p + 6 * BD, mask=m, other=0.0, cache_modifier=".cg"), 0)
        if GAPS:
            b_kgap += tl.sum(tl.load(p_p + 4 * BD, mask=m, other=0.0, cache_modifier=".cg"), 0)
            b_vgap += tl.sum(tl.load(p_p + 5 * BD, mask=m, other=0.0, cache_modifier=".cg"), 0)
        b_ksum += tl.sum(tl.load(psum + (pid.to(tl.int64) * NC + c0 + o_c[:, None]) * BD + o_d[None, :], mask=m,
                                 other=0.0, cache_modifier=".cg"), 0)
    if GAPS:
        p_g = part + pid.to(tl.int64) * NC * (7 * BD) + o_d
        tl.store(p_g + 4 * BD, b_kgap)
        tl.store(p_g + 5 * BD, b_vgap)
    o_s = pid.to(tl.int64) * D + o_d
    if HAS_MEAN:  # reference.kv_finite_mean_ref: fp64 sum / count, rounded once to fp32 (0 without a finite key)
        b_mu = tl.where(b_kn > 0, (b_ksum / tl.maximum(b_kn, 1.0).to(tl.float64)).to(tl.float32), 0.0)
        if MEAN_IN:  # the caller's mean, where finite
            b_in = tl.load(mean + o_s, mask=m_d, other=0.0)
            b_mu = tl.where(_finite(b_in), b_in, b_mu)
        tl.store(mean + o_s, b_mu, mask=m_d)
        if ROTATE:  # once per (b, h): the store kernels take the mean in the stored basis
            b_f = _key_factor(smf, o_s, m_d, BD, HAS_FACTOR)
            b_mu = tl.reshape(hadamard_rows(tl.reshape(b_mu * b_f, [1, BD]), ROT_N), [BD]) * ROT_C
            tl.store(mrot + o_s, b_mu, mask=m_d)
        b_mu = tl.where(o_d < ROT, 0.0, b_mu)
        b_ka = tl.maximum(b_kmax - b_mu, b_mu - b_kmin)
    else:
        b_ka = tl.maximum(b_kmax, -b_kmin)
    if ROT > 0:
        b_ka = tl.where(o_d < ROT, tl.sqrt_rn(b_ka), b_ka)
    b_ks = b_ka * hs
    b_vs = tl.maximum(b_vmax, -b_vmin) * hs
    tl.store(ks + o_s, tl.where(b_ks > 0, b_ks, 1.0), mask=m_d)
    tl.store(vs + o_s, tl.where(b_vs > 0, b_vs, 1.0), mask=m_d)


@triton.jit
def _finish_layer(part, cnt, flag, heads_hi, heads_lo, NC, B, H, n_gap, D: tl.constexpr, BD: tl.constexpr,
                  HP: tl.constexpr, N2: tl.constexpr, SELECT: tl.constexpr):
    """``flag`` = the layer's non-finite token vectors; with SELECT the ``N2`` lowest-priority heads (gap x std of K
    and V, each over its mean over the heads; stable ties) -> ``heads_lo`` (ascending), the others -> ``heads_hi``."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    inf = float("inf")
    o_n = tl.arange(0, 1024)
    n_bad = tl.sum(tl.zeros([1024], tl.int32), 0)
    for i0 in range(0, B * H * NC, 1024):
        n_bad += tl.sum(tl.load(cnt + i0 + o_n, mask=(i0 + o_n) < B * H * NC, other=0, cache_modifier=".cg"), 0)
    tl.store(flag, n_bad)
    if SELECT:
        o_h = tl.arange(0, HP)
        m_h = o_h < H
        b_gk = tl.zeros([HP, BD], tl.float32)
        b_gv = tl.zeros([HP, BD], tl.float32)
        # each head's finisher summed its chunks' gaps into chunk 0 (``_finish_head``, GAPS): one [HP, BD] tile per
        # batch row here (tiles of every chunk here made the stats launch 66 us a layer, not < 19, at 1 x 1k on an H100)
        for i_b in range(0, B):
            p_p = part + ((i_b * H + o_h[:, None]).to(tl.int64) * NC) * (7 * BD) + o_d[None, :]
            b_gk += tl.load(p_p + 4 * BD, mask=m_h[:, None], other=0.0, cache_modifier=".cg")
            b_gv += tl.load(p_p + 5 * BD, mask=m_h[:, None], other=0.0, cache_modifier=".cg")
        b_n = tl.zeros([HP, BD], tl.float32) + n_gap
        b_pk = _head_prio(tl.math.div_rn(b_gk, b_n), m_d, D)
        b_pv = _head_prio(tl.math.div_rn(b_gv, b_n), m_d, D)
        b_pk = b_pk / tl.maximum(tl.sum(tl.where(m_h, b_pk, 0.0), 0) / H, 1e-30)
        b_pv = b_pv / tl.maximum(tl.sum(tl.where(m_h, b_pv, 0.0), 0) / H, 1e-30)
        b_pr = tl.where(m_h, b_pk + b_pv, inf)
        # stable ascending rank: heads before h in argsort(prio, stable=True)
        p_a, p_b = b_pr[:, None], b_pr[None, :]
        before = (p_b < p_a) | ((p_b == p_a) & (o_h[None, :] < o_h[:, None]))
        rank = tl.sum((before & m_h[None, :]).to(tl.int32), 1)
        lo = rank < N2
        same = (lo[:, None] == lo[None, :]) & (o_h[None, :] < o_h[:, None]) & m_h[None, :]
        slot = tl.sum(same.to(tl.int32), 1)
        tl.store(heads_lo + slot, o_h, mask=m_h & lo)
        tl.store(heads_hi + slot, o_h, mask=m_h & (lo == 0))


def kv_stats(k: torch.Tensor, v: torch.Tensor, k_mean: Optional[torch.Tensor], block_size: int, headroom: float,
             nonfinite: torch.Tensor, select: Optional[tuple] = None, rope_dims: int = 0, rotate: bool = False,
             qk_smooth: Optional[torch.Tensor] = None, out: Optional[tuple] = None, mean_in: bool = False) -> tuple:
    """Universal scales of a first prefill ``k, v [b, H, T, D]`` in one launch, no host sync.

    Args:
        k_mean: a contiguous fp32 ``[b, H, D]`` tensor that receives K's mean over its finite keys
            (``reference.kv_finite_mean_ref(k, reference.k_smooth_mean(k))`` bit for bit: an fp64 sum, exact for
            16-bit keys), or None: no K smoothing. Its contents on entry are not read unless ``mean_in``: then
            they are the mean to use, a non-finite channel replaced by the finite keys' mean.
        headroom: ``h`` of ``scale = h * amax / 127``.
        nonfinite: int32 ``[1]``; set to the number of (row, head, token) vectors with an inf/NaN in K or V.
        select: ``(heads_hi, heads_lo, n_lo)`` for ``head_select: prompt``: int32 ``[H - n_lo]`` / ``[n_lo]``
            filled (ascending) with the heads kept at the layer's bits / stored in 2 bits.
        rope_dims: K channels ``< rope_dims`` get the RoPE-pair scale (``reference.rope_pair_amax_ref``; their
            mean is not subtracted, ``k_mean`` is still written for the prefill).
        rotate: ``rotate_qk`` (hadamard / smooth_hadamard): ``k`` is the caller's unrotated K and the scales are
            those of the stored K, ``reference.rotate_keys_ref(k, qk_smooth)`` (``qk_smooth``: ``rotation.
            smooth_scales`` factors ``s [b, H, D]``, or None for plain hadamard), rotated in the stats kernel.
            ``k_mean`` gets the raw keys' mean (for the prefill, whose quantizer rotates it
            itself); the stored basis' mean ``reference.rotate_mean_ref(k_mean, qk_smooth)`` is a third output,
            the ``k_mean`` to pass to ``store_kv`` / ``store_int8_tokens`` (with ``rotate=True``). Not with
            ``rope_dims`` (a rotated basis has no RoPE pairs).
        out: ``(k_scale, v_scale, k_mean_rotated or None)`` contiguous fp32 ``[b, H, D]`` to write (the cache's
            storage views), else new tensors.
    Returns ``(k_scale, v_scale)`` fp32 ``[b, H, D]``; with ``rotate`` ``(k_scale, v_scale, k_mean_rotated)``
    (the last None without ``k_mean``).
    """
    if rotate and rope_dims:
        raise ValueError(f"rope_dims={rope_dims} (k_scale_range 'rope_pair') does not apply to rotated keys")
    check_qk_smooth(qk_smooth, rotate, k)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    launch = stats_launch(k, v, k_mean is not None, block_size, headroom, None if select is None else select[2],
                          rope_dims, rotate, qk_smooth is not None, mean_in)
    dev = k.device
    if out is None:
        out = (torch.empty(launch.s_shape, dtype=torch.float32, device=dev),
               torch.empty(launch.s_shape, dtype=torch.float32, device=dev),
               torch.empty(launch.s_shape, dtype=torch.float32, device=dev) if rotate and k_mean is not None else None)
    ks, vs, mrot = out
    hi, lo, _ = select if select is not None else (ks, ks, 0)
    launch(k, v, k_mean, ks, vs, mrot, nonfinite, hi, lo, factor_arg(qk_smooth, ks))
    return (ks, vs, mrot) if rotate else (ks, vs)


class StatsLaunch:
    """``kv_stats``' one launch for a fixed key (shapes, strides, dtypes, device, options): grid, scalars and
    constexprs built once; calling it launches over the given tensors, unchecked (``kv_stats`` checks them; the
    cache's first-store plan replays a launch its first layer made through ``kv_stats``)."""

    __slots__ = ("part_shape", "cnt_shape", "s_shape", "grid", "scalars", "kw", "memo")

    def __init__(self, part_shape, cnt_shape, s_shape, grid, scalars, kw):
        self.part_shape, self.cnt_shape, self.s_shape = part_shape, cnt_shape, s_shape
        self.grid, self.scalars, self.kw, self.memo = grid, scalars, kw, {}

    def __call__(self, k, v, k_mean, ks, vs, mrot, nonfinite, hi, lo, f) -> tuple:
        """Launch; returns the tensor arguments (``turbo_attn_hf.first_prefill`` re-addresses them per layer)."""
        dev = k.device
        part, psum, cnt, arrive = stats_workspace(dev, self.part_shape, self.cnt_shape)
        tensors = (k, v, part, psum, cnt, arrive, k_mean if k_mean is not None else ks, ks, vs, nonfinite, hi, lo,
                   mrot if mrot is not None else ks, f, ks)  # ks: no table (LAYERS off)
        lean(_stats_kernel).launch_memo(self.memo, current_cuda_device() if dev.type == "cuda" else -1, self.grid,
                                        tensors, self.scalars, self.kw, LeanLaunch.hooks_active())
        return tensors


def stats_launch(k: torch.Tensor, v: torch.Tensor, has_mean: bool, block_size: int, headroom: float,
                 n_lo: Optional[int], rope_dims: int, rotate: bool, has_factor: bool, mean_in: bool = False
                 ) -> StatsLaunch:
    """The :class:`StatsLaunch` of ``kv_stats`` for these arguments (``n_lo``: ``select[2]`` or None), kept per key."""
    key = (k.shape, k.stride(), v.shape, v.stride(), k.dtype, v.dtype, k.device, has_mean, block_size, headroom,
           n_lo, rope_dims, rotate, has_factor, mean_in)
    launch = _STATS_PLANS.get(key)
    if launch is None:
        if len(_STATS_PLANS) >= 256:
            _STATS_PLANS.clear()
        launch = _STATS_PLANS[key] = _stats_plan(k, v, has_mean, block_size, headroom, n_lo, rope_dims,
                                                 rotate_constexprs(k.shape[-1], rotate, has_factor), mean_in)
    return launch


#: kv_stats' plans by key (shapes, strides, dtypes, device, options)
_STATS_PLANS: dict = {}
_STATS_WORKSPACE: dict = {}


def stats_workspace(device: torch.device, part_shape: tuple, cnt_shape: tuple, layers: int = 1) -> tuple:
    """The stats kernel's partials (fp32), finite K sums (fp64) and counts (views of two buffers) and its arrival
    counters (``cnt_shape[0] + 1`` of a zeroed int32 buffer that every launch leaves at zero: the finishers reset
    them), kept per device and grown on demand (as the decode split's, ``decode._workspace``), the views kept per
    shape: no allocation or view per layer. Launches on one device's stream run in order, so the next layer's stats
    never overwrite partials a finisher still reads; not for concurrent streams. ``layers``: room for that many
    layers' workspaces ``stats_workspace_steps`` bytes apart (one batched launch, ``LAYERS``); the views are the
    first layer's."""
    key = (device.type, device.index)
    ws = _STATS_WORKSPACE.get(key)
    hit = None if ws is None else ws[3].get((part_shape, cnt_shape))
    n_part, n_cnt, n_arr = math.prod(part_shape), math.prod(cnt_shape), cnt_shape[0] + 1
    n_sum = n_part // N_PART  # [b*H, NC, BD]
    s0, s1, s2 = (n // size for n, size in zip(stats_workspace_steps(part_shape, cnt_shape), (4, 8, 4)))
    need = (n_part + n_cnt, n_sum, n_arr) if layers == 1 else (layers * s0, layers * s1, layers * s2)
    if hit is not None and all(t.numel() >= n for t, n in zip(ws[:3], need)):
        return hit
    if ws is None or any(t.numel() < n for t, n in zip(ws[:3], need)):
        old = (0, 0, 0) if ws is None else tuple(t.numel() for t in ws[:3])
        ws = _STATS_WORKSPACE[key] = (
            torch.empty(max(need[0], old[0]), dtype=torch.float32, device=device),
            torch.empty(max(need[1], old[1]), dtype=torch.float64, device=device),
            torch.zeros(max(need[2], old[2]), dtype=torch.int32, device=device), {})
    if len(ws[3]) >= 64:
        ws[3].clear()
    hit = ws[3][(part_shape, cnt_shape)] = (
        ws[0][:n_part].view(part_shape), ws[1][:n_sum].view(*part_shape[:2], part_shape[3]),
        ws[0][n_part:n_part + n_cnt].view(torch.int32).view(cnt_shape), ws[2])
    return hit


def stats_workspace_steps(part_shape: tuple, cnt_shape: tuple) -> tuple:
    """Bytes between two layers' partials (and counts), fp64 sums and arrival counters in a batched stats launch's
    workspace (``stats_workspace(..., layers)``): each a multiple of 128."""
    n_part, n_cnt, n_arr = math.prod(part_shape), math.prod(cnt_shape), cnt_shape[0] + 1
    return tuple(-(-n * size // 128) * 128 for n, size in ((n_part + n_cnt, 4), (n_part // N_PART, 8), (n_arr, 4)))


def stats_chunk_blocks(n_blocks: int, n_rows: int, n_sm: int) -> int:
    """Blocks per ``_stats_kernel`` program for ``n_blocks`` blocks of each of ``n_rows`` (b x H) streams: the
    largest power of two up to ``STATS_CHUNK_BLOCKS`` that still gives one program per SM. A program's time is
    per block (each block's min/max reduces over its tokens), so a short prompt in chunks of 8 blocks ran 16
    programs for 58 us where 1 block each takes 8 us (H100, 1 x 1k, 8 heads; PERF_NOTES, session 15)."""
    nsub = STATS_CHUNK_BLOCKS
    while nsub > 1 and -(-n_blocks // nsub) * n_rows < n_sm:
        nsub //= 2
    return nsub


def _stats_plan(k, v, has_mean, block_size, headroom, n_lo, rope_dims, rot, mean_in) -> StatsLaunch:
    """The one stats launch's shapes (partials, counts, scales), grid, scalars and constexprs."""
    b, H, T, D = k.shape
    bs, BD = int(block_size), _pow2(D)
    nblocks = -(-T // bs)
    nsub = _pow2(nblocks) if interpreting() else stats_chunk_blocks(nblocks, b * H, sm_count(k.device))
    nsub = max(1, min(nsub, _pow2(nblocks)))
    nc = -(-T // (nsub * bs))
    n_gap = float(b * max(T // bs, 1))
    # rotated stats: 8 warps only past head_dim 128. At d 128, 4 warps (255 regs + a 176-208 B stack on sm_90) run
    # 37.5 us against 8 warps' 54.4 (plain 34.6); at d 256, 47.4 against 43.4 (H200, 4k, layer of one 8-head / 1-head
    # model: eval/results/stats_warps_rotated_s30_h200.json): the butterfly's cross-warp layout changes cost more than
    # the spill
    return StatsLaunch(
        (b * H, nc, N_PART, BD), (b * H, nc), (b, H, D), (nc, b * H),
        (T, nc, b, H, float(headroom / 127.0), n_gap, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
         v.stride(2)),
        dict(D=D, BD=BD, BS=bs, NSUB=nsub, VEC=_vec(k, v), ROT=int(rope_dims), **rot, BC=min(_pow2(nc), 64),
             HP=max(2, _pow2(H)), N2=int(n_lo or 0),
             HAS_MEAN=has_mean, SELECT=n_lo is not None, MEAN_IN=bool(mean_in),
             num_warps=8 if rot["ROTATE"] and BD > 128 else 4,
             enable_fp_fusion=False))


# ================================================================================ store: INT8 buffer + blocks
@triton.jit
def _load_rows(p_k, p_v, sk_t, sv_t, i, n, c, take, o_d, m_d, b_f, D: tl.constexpr, BD: tl.constexpr,
               ROTATE: tl.constexpr, ROT_N: tl.constexpr, ROT_C: tl.constexpr):
    """The new tokens among rows ``i`` (< n) of one head's store stream (row i >= c is token ``take + i - c``):
    ``(K, V [R, BD]`` tiles, 0 elsewhere, the mask of the new entries); K rotated with ROTATE (``_rotate_keys``)."""
    m_new = ((i < n) & (i >= c))[:, None] & m_d[None, :]
    t = (take + i - c).to(tl.int64)
    b_k = tl.load(p_k + t[:, None] * sk_t + o_d[None, :], mask=m_new, other=0.0)
    b_v = tl.load(p_v + t[:, None] * sv_t + o_d[None, :], mask=m_new, other=0.0)
    return _rotate_keys(b_k, b_f, ROTATE, ROT_N, ROT_C), b_v, m_new


@triton.jit
def _codes(b_x, p_xb, b_s, b_m, i0, o_r, n, c, s0, C, o_d, m_d,
           D: tl.constexpr, HAS_MEAN: tl.constexpr, TRANS: tl.constexpr):
    """INT8 codes ``[R, BD]`` int32 of stream rows ``i0 + o_r`` of one tensor: the INT8 buffer's waiting slots
    ``s0 + i`` for i < c (``p_xb``: the head's buffer, ``[C, D]``, or ``[D, C]`` with TRANS), then the new
    tokens ``b_x`` quantized with the universal scales (``pack._quantize_universal``). A tile past the waiting
    rows (every first-prefill tile: c = 0) skips the buffer load."""
    b_x8 = _quantize_universal(b_x, b_s, b_m, HAS_MEAN=HAS_MEAN).to(tl.int32)
    if i0 < c:
        i = i0 + o_r
        m_buf = ((i < n) & (i < c))[:, None] & m_d[None, :]
        slot = (s0 + i).to(tl.int64)
        if TRANS:
            p_b = p_xb + o_d[None, :].to(tl.int64) * C + slot[:, None]
        else:
            p_b = p_xb + slot[:, None] * D + o_d[None, :]
        b_x8 = tl.where(m_buf, tl.load(p_b, mask=m_buf, other=0).to(tl.int32), b_x8)
    return b_x8


@triton.jit
def _stream_rows(p_k, p_v, sk_t, sv_t, p_kt, p_vt, b_sk, b_mk, b_sv, i0, o_r, n, c, take, s0, C,
                 o_d, m_d, b_f, D: tl.constexpr, HAS_MEAN: tl.constexpr, BD: tl.constexpr, ROTATE: tl.constexpr,
                 ROT_N: tl.constexpr, ROT_C: tl.constexpr):
    """Rows ``i0 + o_r`` (< n) of one head's store stream: the INT8 buffer's waiting slots ``s0 + i`` for i < c,
    then the new tokens ``take + i - c`` quantized with the universal scales. ``p_kt`` ``[C, D]`` / ``p_vt``
    ``[D, C]``: the head's buffers. Returns (K, V codes ``[R, BD]`` int32, the number of new rows with a
    non-finite element)."""
    b_k, b_v, m_new = _load_rows(p_k, p_v, sk_t, sv_t, i0 + o_r, n, c, take, o_d, m_d, b_f, D, BD, ROTATE, ROT_N,
                                 ROT_C)
    b_k8 = _codes(b_k, p_kt, b_sk, b_mk, i0, o_r, n, c, s0, C, o_d, m_d, D, HAS_MEAN, False)
    b_v8 = _codes(b_v, p_vt, b_sv, b_sv, i0, o_r, n, c, s0, C, o_d, m_d, D, False, True)
    return b_k8, b_v8, _bad_rows(b_k, b_v, m_new)


@triton.jit
def _pack_rows(b_k, b_v, p_kt, p_vt, b_sk, b_mk, b_sv, i0, o_r, n, c, s0, C, gk, gv, gks, gkz, gvsz, i_gb, o_d, m_d,
               D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, HAS_MEAN: tl.constexpr,
               K8: tl.constexpr):
    """Stream rows ``i0 + o_r`` (new tokens: the raw tiles ``b_k, b_v [BS, BD]``) -> block ``i_gb``
    (= (b*H_g + slot)*CAP + block, int64) of a group's storage (format in ``pack.py``): INT8 as is (V
    transposed), INT4/INT2 through ``pack._pack_tile`` (K per channel, V per token); K8: K stays INT8 whatever
    ``BITS``. K is coded, packed and stored before V is coded: the two [BS, BD] int32 code tiles are never live
    together."""
    PB: tl.constexpr = 8 // BITS
    b_k8 = _codes(b_k, p_kt, b_sk, b_mk, i0, o_r, n, c, s0, C, o_d, m_d, D, HAS_MEAN, False)
    if BITS == 8 or K8:
        tl.store(gk + i_gb * (BS * D) + o_r[:, None] * D + o_d[None, :], b_k8.to(tl.int8), mask=m_d[None, :])
    else:
        o_kb = tl.arange(0, BD // PB)
        b_kp, b_ksc, b_kz = _pack_tile(b_k8, m_d[None, :] & (o_r[:, None] < BS), BS, BD, BITS, 0)
        tl.store(gk + i_gb * (BS * D // PB) + o_r[:, None] * (D // PB) + o_kb[None, :], b_kp.to(tl.uint8),
                 mask=(o_kb < D // PB)[None, :])
        tl.store(gks + i_gb * D + o_d, b_ksc.to(tl.int8), mask=m_d)
        tl.store(gkz + i_gb * D + o_d, b_kz.to(tl.int8), mask=m_d)
    b_v8 = _codes(b_v, p_vt, b_sv, b_sv, i0, o_r, n, c, s0, C, o_d, m_d, D, False, True)
    if BITS == 8:
        tl.store(gv + i_gb * (BS * D) + o_d[:, None] * BS + o_r[None, :], tl.trans(b_v8).to(tl.int8),
                 mask=m_d[:, None])
    else:
        o_vb = tl.arange(0, BS // PB)
        b_vp, b_vsc, b_vz = _pack_tile(tl.trans(b_v8), m_d[:, None] & (o_r[None, :] < BS), BD, BS, BITS, 0)
        tl.store(gv + i_gb * (D * BS // PB) + o_d[:, None] * (BS // PB) + o_vb[None, :], b_vp.to(tl.uint8),
                 mask=m_d[:, None])
        tl.store(gvsz + i_gb * (2 * BS) + o_r, b_vsc.to(tl.int8))
        tl.store(gvsz + i_gb * (2 * BS) + BS + o_r, b_vz.to(tl.int8))


@triton.jit(do_not_specialize=["T", "take", "slot_sink", "c", "n", "NPP", "n_pack", "s0", "nb0", "CAP",
                               "stride_kb", "stride_kh", "stride_kt", "stride_vb", "stride_vh", "stride_vt"])
def _store_kv_kernel(
    k, v, sk, mk, sv, kt, vt, flag,
    h0, gk0, gv0, gks0, gkz0, gvsz0,
    h1, gk1, gv1, gks1, gkz1, gvsz1,
    h2, gk2, gv2, gks2, gkz2, gvsz2, smf, tbl,
    T, take, slot_sink, c, n, NPP, n_pack, s0, nb0, CAP,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    H, C,
    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, HAS_SINK: tl.constexpr, BSINK: tl.constexpr,
    BREC: tl.constexpr, H0: tl.constexpr, H1: tl.constexpr, BITS0: tl.constexpr, BITS1: tl.constexpr, BITS2: tl.constexpr,
    K8: tl.constexpr, HAS_MEAN: tl.constexpr, PACK: tl.constexpr, TAIL: tl.constexpr, SPLIT: tl.constexpr,
    COUNT: tl.constexpr,
    VEC: tl.constexpr, ROTATE: tl.constexpr, ROT_N: tl.constexpr, HAS_FACTOR: tl.constexpr, ROT_C: tl.constexpr,
    LAYERS: tl.constexpr = False,
):
    """grid (NPP + tail programs, b*H), with LAYERS (.., .., layers): every pointer moved to the program's layer
    (``_at_layer``, ``tbl``). The store stream of one (b, h) is the INT8 buffer's ``c`` waiting slots
    ``s0..`` followed by the new tokens ``take..T`` of k, v ``[b, H, T, D]`` (``n`` rows in all).
    PACK: program ``j < NPP`` packs stream rows ``[j*BS, (j+1)*BS)`` into block ``nb0 + j`` of the bit group of
    row ``pid1 % H`` of the (group 0, 1, 2) slot order: slot s of group g holds head ``h_g[s]`` (a device map).
    TAIL: the new tokens ``[0, take)`` go to buffer slots ``slot_sink..`` (attention sinks) and stream rows
    ``[n_pack, n)`` to slots ``s0..`` (NPP = 0 in a launch without PACK), in tiles: with SPLIT (``c == 0``: no stream
    row is in the buffer) each tile is a program ``NPP..`` (sink tiles, then recent ones), in parallel; else program
    ``NPP`` does them in order, every buffer row it moves read before any is written (a barrier). A launch with both
    PACK and TAIL must have ``c == 0`` (the packers would read slots the tail overwrites). COUNT: non-finite new rows
    are added to ``flag``. ROTATE: every new K row is rotated as it is loaded (``_rotate_keys``; factors smf
    ``[b*H, D]`` with HAS_FACTOR); sk/mk are the rotated basis' scales and mean."""
    if LAYERS:
        row = tbl + tl.program_id(2).to(tl.int64) * _LAYER_ROW_STORE
        k, v, sk, mk = _at_layer(k, row, 0), _at_layer(v, row, 1), _at_layer(sk, row, 2), _at_layer(mk, row, 3)
        sv, kt, vt, flag = _at_layer(sv, row, 4), _at_layer(kt, row, 5), _at_layer(vt, row, 6), _at_layer(flag, row, 7)
        h0, gk0, gv0, gks0, gkz0, gvsz0 = _group_at_layer(h0, gk0, gv0, gks0, gkz0, gvsz0, row, 8)
        h1, gk1, gv1, gks1, gkz1, gvsz1 = _group_at_layer(h1, gk1, gv1, gks1, gkz1, gvsz1, row, 14)
        h2, gk2, gv2, gks2, gkz2, gvsz2 = _group_at_layer(h2, gk2, gv2, gks2, gkz2, gvsz2, row, 20)
        smf = _at_layer(smf, row, 26)
    pid, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, r = i_bh // H, i_bh % H
    # strides out of the specialization key, multiples of VEC (the launcher checks): 16-byte loads of K/V rows
    stride_kb, stride_kh, stride_kt = _multiple(stride_kb, VEC), _multiple(stride_kh, VEC), _multiple(stride_kt, VEC)
    stride_vb, stride_vh, stride_vt = _multiple(stride_vb, VEC), _multiple(stride_vh, VEC), _multiple(stride_vt, VEC)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    i_h = r
    if pid < NPP:  # a packer: row r is a slot of a bit group, its head comes from the group's map
        if r < H0:
            i_h = tl.load(h0 + r)
        elif r < H0 + H1:
            i_h = tl.load(h1 + r - H0)
        else:
            i_h = tl.load(h2 + r - H0 - H1)
    i_hb = i_b.to(tl.int64) * H + i_h  # (b, head) row of the scales and buffers
    b_sk, b_mk, b_sv = _universal_scales(sk, mk, sv, i_hb * D + o_d, m_d, HAS_MEAN)
    b_f = _key_factor(smf, i_hb * D + o_d, m_d, BD, HAS_FACTOR and ROTATE)
    p_k = k + i_b.to(tl.int64) * stride_kb + i_h.to(tl.int64) * stride_kh
    p_v = v + i_b.to(tl.int64) * stride_vb + i_h.to(tl.int64) * stride_vh
    p_kt = kt + i_hb * C * D
    p_vt = vt + i_hb * C * D
    n_bad = 0 * take
    if PACK:
        if pid < NPP:
            o_r = tl.arange(0, BS)
            i0 = pid * BS
            b_k, b_v, m_new = _load_rows(p_k, p_v, stride_kt, stride_vt, i0 + o_r, n, c, take, o_d, m_d, b_f,
                                         D, BD, ROTATE, ROT_N, ROT_C)
            if r < H0:
                i_gb = (i_b.to(tl.int64) * H0 + r) * CAP + nb0 + pid
                _pack_rows(b_k, b_v, p_kt, p_vt, b_sk, b_mk, b_sv, i0, o_r, n, c, s0, C, gk0, gv0, gks0, gkz0,
                           gvsz0, i_gb, o_d, m_d, D, BD, BS, BITS0, HAS_MEAN, K8)
            elif r < H0 + H1:
                i_gb = (i_b.to(tl.int64) * H1 + r - H0) * CAP + nb0 + pid
                _pack_rows(b_k, b_v, p_kt, p_vt, b_sk, b_mk, b_sv, i0, o_r, n, c, s0, C, gk1, gv1, gks1, gkz1,
                           gvsz1, i_gb, o_d, m_d, D, BD, BS, BITS1, HAS_MEAN, K8)
            else:
                i_gb = (i_b.to(tl.int64) * (H - H0 - H1) + r - H0 - H1) * CAP + nb0 + pid
                _pack_rows(b_k, b_v, p_kt, p_vt, b_sk, b_mk, b_sv, i0, o_r, n, c, s0, C, gk2, gv2, gks2, gkz2,
                           gvsz2, i_gb, o_d, m_d, D, BD, BS, BITS2, HAS_MEAN, K8)
            n_bad = _bad_rows(b_k, b_v, m_new)
    if TAIL:
        # tiles of at most 32 rows (BSINK, BREC): one [256, D] tile of the recent rows made the whole kernel
        # (packers included) compile to 32 registers + a 10 KB stack of spills on sm_90
        nq_sink = tl.cdiv(take, BSINK) if HAS_SINK else 0
        if SPLIT:  # c == 0: no buffer row moves, so every tile is its own program (grid NPP + tiles)
            q = pid - NPP
            if q >= 0:
                if q < nq_sink:
                    n_bad += _sink_tile(p_k, p_v, p_kt, p_vt, stride_kt, stride_vt, b_sk, b_mk, b_sv, b_f, q * BSINK,
                                        take, slot_sink, C, o_d, m_d, D, BD, BSINK, HAS_MEAN, ROTATE, ROT_N, ROT_C)
                else:
                    n_bad += _recent_tile(p_k, p_v, p_kt, p_vt, stride_kt, stride_vt, b_sk, b_mk, b_sv, b_f,
                                          n_pack + (q - nq_sink) * BREC, n, c, take, s0, n_pack, C, o_d, m_d, D, BD,
                                          BREC, HAS_MEAN, ROTATE, ROT_N, ROT_C)
        elif pid == NPP:
            for q in range(0, nq_sink):
                n_bad += _sink_tile(p_k, p_v, p_kt, p_vt, stride_kt, stride_vt, b_sk, b_mk, b_sv, b_f, q * BSINK,
                                    take, slot_sink, C, o_d, m_d, D, BD, BSINK, HAS_MEAN, ROTATE, ROT_N, ROT_C)
            # rows move down within the buffer (stream row i -> slot s0 + i - n_pack): each tile reads all its
            # rows before any is written (a barrier in _recent_tile); a later tile reads higher slots than any
            # earlier tile wrote, and writes only after the barrier that follows every earlier tile's reads
            for i0 in range(n_pack, n, BREC):
                n_bad += _recent_tile(p_k, p_v, p_kt, p_vt, stride_kt, stride_vt, b_sk, b_mk, b_sv, b_f, i0, n, c,
                                      take, s0, n_pack, C, o_d, m_d, D, BD, BREC, HAS_MEAN, ROTATE, ROT_N, ROT_C)
    if COUNT:
        tl.atomic_add(flag, n_bad)


@triton.jit
def _sink_tile(p_k, p_v, p_kt, p_vt, stride_kt, stride_vt, b_sk, b_mk, b_sv, b_f, q0, take, slot_sink, C, o_d, m_d,
               D: tl.constexpr, BD: tl.constexpr, BSINK: tl.constexpr, HAS_MEAN: tl.constexpr, ROTATE: tl.constexpr,
               ROT_N: tl.constexpr, ROT_C: tl.constexpr):
    """New tokens ``[q0, q0 + BSINK) & [0, take)`` -> INT8 buffer slots ``slot_sink + q0..``; returns the non-finite
    rows among them."""
    o_q = tl.arange(0, BSINK)
    m_q = (q0 + o_q < take)[:, None] & m_d[None, :]
    b_k, b_k8 = _new_rows(p_k, stride_kt, b_sk, b_mk, q0 + o_q, m_q, o_d, b_f, HAS_MEAN, D, BD, ROTATE, ROT_N, ROT_C)
    b_v, b_v8 = _new_rows(p_v, stride_vt, b_sv, b_sv, q0 + o_q, m_q, o_d, b_f, False, D, BD, False, ROT_N, ROT_C)
    slot = (slot_sink + q0 + o_q).to(tl.int64)
    tl.store(p_kt + slot[:, None] * D + o_d[None, :], b_k8, mask=m_q)
    tl.store(p_vt + o_d[None, :].to(tl.int64) * C + slot[:, None], b_v8, mask=m_q)
    return _bad_rows(b_k, b_v, m_q)


@triton.jit
def _recent_tile(p_k, p_v, p_kt, p_vt, stride_kt, stride_vt, b_sk, b_mk, b_sv, b_f, i0, n, c, take, s0, n_pack, C, o_d,
                 m_d, D: tl.constexpr, BD: tl.constexpr, BREC: tl.constexpr, HAS_MEAN: tl.constexpr,
                 ROTATE: tl.constexpr, ROT_N: tl.constexpr, ROT_C: tl.constexpr):
    """Store-stream rows ``[i0, i0 + BREC) & [.., n)`` -> INT8 buffer slots ``s0 + i0 - n_pack..``, every row read
    before any is written (a barrier); returns the non-finite new rows among them."""
    o_w = tl.arange(0, BREC)
    b_k8, b_v8, n_bad = _stream_rows(p_k, p_v, stride_kt, stride_vt, p_kt, p_vt, b_sk, b_mk, b_sv, i0, o_w, n, c, take,
                                     s0, C, o_d, m_d, b_f, D, HAS_MEAN, BD, ROTATE, ROT_N, ROT_C)
    tl.debug_barrier()  # every read of this tile before any write
    m_w = (i0 + o_w < n)[:, None] & m_d[None, :]
    slot = (s0 + i0 - n_pack + o_w).to(tl.int64)
    tl.store(p_kt + slot[:, None] * D + o_d[None, :], b_k8.to(tl.int8), mask=m_w)
    tl.store(p_vt + o_d[None, :].to(tl.int64) * C + slot[:, None], b_v8.to(tl.int8), mask=m_w)
    return n_bad


@triton.jit
def _new_rows(p_x, sx, b_s, b_m, o_t, m, o_d, b_f, HAS_MEAN: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
              ROTATE: tl.constexpr, ROT_N: tl.constexpr, ROT_C: tl.constexpr):
    """Rows ``o_t`` of one head's new tokens (masked by ``m``) -> (tile, rotated with ROTATE; INT8 codes)."""
    b_x = tl.load(p_x + o_t[:, None].to(tl.int64) * sx + o_d[None, :], mask=m, other=0.0)
    b_x = _rotate_keys(b_x, b_f, ROTATE, ROT_N, ROT_C)
    return b_x, _quantize_universal(b_x, b_s, b_m, HAS_MEAN=HAS_MEAN)


#: store_kv's constexprs and compiled kernels by what Triton specialises on (but the pointers' alignment)
_STORE_KV_KW: dict = {}
#: rows per tile of the tail program's sink / recent loops: a wider tile spilled the whole kernel to local
#: memory (one kernel, one register count; PERF_NOTES: "why the fused store was slow")
TAIL_ROWS = 32
#: warps of ``_store_kv_kernel``: 8 leaves no spill anywhere; measured 0.93 vs 1.69 ms (int4, 1 x 32k, H100,
#: eval/results/bench_store_h100.json vs bench_store_w4_h100.json), equal elsewhere within noise
STORE_NUM_WARPS = 8


def store_kv(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, k_mean: Optional[torch.Tensor],
             v_scale: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, groups: list, *, take: int,
             slot_sink: int, c: int, s0: int, n_pack: int, nonfinite: Optional[torch.Tensor] = None,
             rotate: bool = False, qk_smooth: Optional[torch.Tensor] = None) -> int:
    """Store new tokens ``k, v [b, H, T, D]`` into the INT8 buffer and the packed groups (no host sync).

    The stream is the buffer's ``c`` waiting slots ``s0..`` then the new tokens ``take..``; its first
    ``n_pack`` rows (a multiple of the block size) become blocks ``n_blocks..`` of every group (``groups``: the
    layer's ``PackedKV`` list, at most three, capacity reserved by the caller, ``heads`` maps on the device); the
    rest go to slots ``s0..``; new tokens ``[0, take)`` go to sink slots ``slot_sink..``. One launch, or two
    when ``c > 0`` and blocks are packed (the packers read slots the tail program overwrites). Returns the
    number of launches. ``rotate``: as ``store_int8_tokens`` (``k`` unrotated, rotated in the kernel with the
    factors ``qk_smooth``; ``k_scale`` / ``k_mean`` the rotated basis', from ``kv_stats(rotate=True)``)."""
    check_qk_smooth(qk_smooth, rotate, k)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    C = k_tail.shape[2]
    check_store_kv(k, C, groups, take=take, slot_sink=slot_sink, c=c, s0=s0, n_pack=n_pack)
    launch = store_kv_launch(k, v, groups, take=take, slot_sink=slot_sink, c=c, s0=s0, n_pack=n_pack, C=C,
                             has_mean=k_mean is not None, count=nonfinite is not None, rotate=rotate,
                             has_factor=qk_smooth is not None)
    launch(k, v, k_scale, k_mean, v_scale, k_tail, v_tail, nonfinite, groups, qk_smooth)
    return len(launch.calls)


def check_store_kv(k: torch.Tensor, C: int, groups: list, *, take: int, slot_sink: int, c: int, s0: int,
                   n_pack: int) -> None:
    """ValueError unless ``store_kv``'s plan fits a buffer of ``C`` slots and the groups (capacity reserved)."""
    H, T = k.shape[1], k.shape[2]
    bs = groups[0].block_size
    n = c + T - take
    if n_pack % bs or n_pack > n or n - n_pack > C - s0 or slot_sink + take > max(s0, slot_sink):
        raise ValueError(f"bad store plan: T={T} take={take} c={c} n_pack={n_pack} s0={s0} C={C} block {bs}")
    if len(groups) > 3 or sum(g.k.shape[1] for g in groups) != H:
        raise ValueError(f"{len(groups)} groups of {[g.k.shape[1] for g in groups]} heads for {H} KV heads")
    nb0, cap = groups[0].n_blocks, groups[0].capacity
    for g in groups:
        if g.n_blocks != nb0 or g.capacity != cap or g.capacity < nb0 + n_pack // bs:
            raise ValueError("the groups' blocks / capacities disagree or the capacity is not reserved")
        if g.flat is None and not all(t.is_contiguous() for _, t in g._tensors()):  # carved views are contiguous
            raise ValueError("the packed groups' buffers must be contiguous")


class StoreKVLaunch:
    """``store_kv``'s one or two launches for a fixed plan: grids, scalars and constexprs built once; calling it
    launches over the given tensors, unchecked (``store_kv`` checks them; the cache's first-store plan replays what
    its first layer's ``store_kv`` call checked)."""

    __slots__ = ("calls", "memo")

    def __init__(self, calls: list, memo: dict):
        self.calls, self.memo = calls, memo  # calls: (memo key, grid, scalars, kwargs) of each launch

    def __call__(self, k, v, k_scale, k_mean, v_scale, k_tail, v_tail, nonfinite, groups, qk_smooth) -> list:
        """Launch; returns the tensor arguments (``turbo_attn_hf.first_prefill`` re-addresses them per layer)."""
        # an absent group (0 heads) repeats group 0's tensors: never used, but every branch must compile with the
        # real pointer types (the head map is loaded as int32 on each branch)
        tensors = [k, v, k_scale, k_mean if k_mean is not None else k_scale, v_scale, k_tail, v_tail,
                   nonfinite if nonfinite is not None else k_tail]
        for g in groups:
            tensors += (g.heads, g.k, g.v, g.k_scale if g.k_scale is not None else g.k,
                        g.k_zero if g.k_zero is not None else g.k, g.v_sz if g.v_sz is not None else g.k)
        tensors += tensors[8:14] * (3 - len(groups))
        tensors.append(factor_arg(qk_smooth, k_scale))
        tensors.append(k_scale)  # no table (LAYERS off)
        hooks = LeanLaunch.hooks_active()
        dev_key = current_cuda_device() if k.is_cuda else -1
        fn = lean(_store_kv_kernel)
        for key, grid, scalars, kw in self.calls:
            fn.launch_memo(self.memo, (dev_key, key), grid, tensors, scalars, kw, hooks)
        return tensors


def store_kv_launch(k: torch.Tensor, v: torch.Tensor, groups: list, *, take: int, slot_sink: int, c: int, s0: int,
                    n_pack: int, C: int, has_mean: bool, count: bool, rotate: bool, has_factor: bool) -> StoreKVLaunch:
    """The :class:`StoreKVLaunch` of a ``store_kv`` call with these arguments (``C``: the INT8 buffer's slots)."""
    b, H, T, D = k.shape
    bs = groups[0].block_size
    nb0, cap = groups[0].n_blocks, groups[0].capacity
    n = c + T - take
    npp = n_pack // bs
    slots = groups + [groups[0]] * (3 - len(groups))
    strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    # everything Triton specialises on, but the pointers' alignment (LeanLaunch.launch_memo): the constexprs (sink
    # / recent rows in tiles of at most TAIL_ROWS: a bigger tile spills the whole kernel, see the kernel), the
    # dtypes (K/V's; the groups' follow their bits), H and C (specialised), whether an int leaves int32
    big = max(T, n, n_pack, cap, *strides) >= 2**31
    vec = _vec(k, v)
    key = (D, bs, s0, C, H, k.dtype, v.dtype, k.device, has_mean, count, tuple(g.k.shape[1] for g in groups),
           tuple((g.bits, g.k_bits) for g in slots), big, vec, rotate, has_factor)
    hit = _STORE_KV_KW.get(key)
    if hit is None:
        hs = [g.k.shape[1] for g in groups] + [0, 0]
        bits = [g.bits for g in slots]
        hit = _STORE_KV_KW[key] = dict(
            D=D, BD=_pow2(D), BS=bs, HAS_SINK=s0 > 0, BSINK=min(_pow2(max(s0, 2)), TAIL_ROWS),
            BREC=min(_pow2(max(C - s0, 2)), TAIL_ROWS), H0=hs[0], H1=hs[1], BITS0=bits[0], BITS1=bits[1],
            BITS2=bits[2], K8=keeps_int8_k(groups), HAS_MEAN=has_mean,
            **rotate_constexprs(k.shape[-1], rotate, has_factor),
            **_no_fma(rotate)), {}
    common, memo = hit
    split = c == 0  # no stream row waits in the buffer: the tail's tiles run as parallel programs
    n_tail = max(1, (-(-take // common["BSINK"]) if s0 > 0 else 0) + -(-(n - n_pack) // common["BREC"])) if split else 1
    calls = []
    for pack, tail in ([(True, True)] if c == 0 or npp == 0 else [(True, False), (False, True)]):
        n_prog = npp if pack else 0
        kw = dict(common, PACK=pack and npp > 0, TAIL=tail, SPLIT=split, COUNT=count, VEC=vec,
                  num_warps=STORE_NUM_WARPS)
        calls.append(((kw["PACK"], tail, split), (n_prog + (n_tail if tail else 0), b * H),
                      (T, take, slot_sink, c, n, n_prog, n_pack, s0, nb0, cap, *strides, H, C), kw))
    return StoreKVLaunch(calls, memo)
