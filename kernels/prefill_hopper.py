"""INT8 flash-attention forward for Hopper (sm_90) in Gluon: warp-specialized, TMA-fed, two consumer warpgroups.

The quantized math of ``prefill._int8_attn_fwd_kernel`` (INT-FlashAttention with block-scaled P) on the same operands
(``q8 [b, Hq, Lq, d]``, ``sq``, ``k8 [b, Hk, Lk, d]``, ``sk``, ``v8t [b, Hk, d, Lpad]``, ``sv``), its int32 dots
converted by I2F and one rounding of ``x * s`` (``i2f``; twin: ``reference.int8_flash_attention(...,
int_to_float="exact")``; without it, the portable kernel's magic-number FMA and its output bit for bit), split into
warp-specialized partitions as FlashAttention-3 is on Hopper (issue 20):
- a producer partition (one warpgroup, few registers) copies the Q tile once and each KV block's K and V^T tiles
  into a ring of shared-memory slots with TMA, guarded by ``ready`` / ``empty`` mbarriers;
- two consumer warpgroups own 64 query rows each of a 128-row tile and share every slot: each runs ``IGMMA`` Q.K^T,
  the online softmax and ``IGMMA`` P.V on its rows in order, P.V in ``pv_parts`` MMAs over the block's keys, each
  issued as soon as its codes are ready; the warp schedulers interleave the two halves.
With ``keys_permuted`` V^T's keys are stored in ``mma_key_order`` (the V pass writes them so), which makes P's codes
in the score accumulator's registers the P.V operand's own, without lane shuffles.
With a 16-bit V (``PV_HALF_DTYPES``: V itself, padded to whole blocks, as ``quant.v_operand_half`` writes it;
``turbo_attention``'s plan on bf16 / fp16 inputs) P.V runs on 16-bit operands, SageAttention's split: P =
exp2(t sq - c) rounded to V's type (the score accumulator's registers are the operand's as they are) accumulates onto
acc in fp32, so there is no int32 tile to fold, and the registers that frees hold FlashAttention-3's in-warpgroup
order (block j's Q.K^T beside block j-1's P.V, ``_step_half``); at head_dim 256 (acc alone is 128 registers) each
block's P.V is waited for before the next Q.K^T, in two ring slots of 96 KB; at head_dim 64 two CTAs share an SM
(``two_ctas``: 64-key blocks in that serial order, 80 launch registers, 4 slots of 12 KB), so four consumer warpgroups
hide each other's latency and one CTA's first and last blocks overlap the other's loop. Twin:
``reference.int8_flash_attention`` with the 16-bit V (its KV block ``reference.PV_HALF_BLOCK_N``). Measured on an
H200 (PERF_NOTES sessions 45, 47-49): 1.02-1.14x the INT8 P.V's speed and about half its error; 1.01-1.20x the
portable kernel, 0.87-1.03x cuDNN's bf16 attention at d 128, 0.88-1.03x at d 256
(kernel alone; the portable kernel there is 0.42-0.53x). FA3's
schedules that hold a second score tile (the next Q.K^T beside the softmax or the fold) spill or are slower here,
as are three consumer warpgroups (sessions 35, 44, 45); ``SCHEDULE`` holds the switches that are kept.
Why Gluon: ``tl.dot`` gives neither the producer/consumer split nor async wgmma control (``eval/PERF_NOTES.md``,
prefill rows 1-15; DESIGN.md §8). Gluon's API moves between Triton releases, so the path is gated on the versions
it was compiled and tested with (``TESTED_TRITON``) and the portable kernel stays the fallback for everything
outside ``supports``: a sliding window, softcap, a padding mask, SAS, static P scale, head_dim outside 64/128/256
(256: P.V on 16-bit V only).

Both 8-bit wgmma operands must be K-major: K tiles ``[BN, d]`` (d contiguous) are the B operand of Q.K^T through
a permuted view, V^T tiles ``[d, BN]`` (tokens contiguous) that of P.V; P goes from registers (int8 A operand).
Non-finite inputs follow ``reference.nonfinite_rows`` as the portable kernel does: with the INT8 P.V a NaN key scale
found by a scan of sk before the loop starts l at NaN in the rows that see it; with the 16-bit P.V the NaN scores
carry it there themselves; masked blocks keep NaN in the row max.
"""

from __future__ import annotations

import functools
import operator

import torch
import triton
import triton.language as tl  # PropagateNan: Gluon reuses triton.language's enum

from .device import current_cuda_device
from .launch import LeanLaunch, lean
from .reference import MAGIC, MAGIC_BITS, P_BLOCK_GAP, PV_HALF_BLOCK_N, PV_HALF_DTYPES, SQ_MIN

try:  # Gluon is experimental: a Triton without it (or with another API) keeps the portable kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "TESTED_TRITON", "PART_M", "BLOCK_N", "HEAD_DIMS", "INT8_PV_HEAD_DIMS", "SCHEDULE",
           "PV_HALF_DTYPES", "supports",
           "gluon_available", "schedule_constexprs", "mma_key_order", "WsLaunch", "launch_ws"]

#: Triton releases this kernel was compiled (CPU test) and run with; another release falls back to the portable kernel
TESTED_TRITON = ("3.6",)
#: query rows of a consumer warpgroup (a program has two) and keys of a KV block (the V scale block)
PART_M = 64
BLOCK_N = 128
HEAD_DIMS = (64, 128, 256)
#: head dims of the INT8 P.V; d 256 runs only P.V on 16-bit V (the int32 P.V tile beside a 128-register acc does not
#: fit a consumer's registers)
INT8_PV_HEAD_DIMS = (64, 128)
#: ring slots of K/V tiles per head dim (32 KB a slot at d 128, 48 KB with a 16-bit V; 96 KB at d 256: two slots and
#: the Q tile are 231,472 of the 232,448 bytes a block may have)
_STAGES = {64: 4, 128: 3, 256: 2}
#: the kernel's schedule switches (``launch_ws`` keywords) and their defaults (PERF_NOTES session 45): I2F conversions,
#: P.V in 4 MMAs, V's keys in the operand order (the last two: the INT8 P.V's); the kernel takes FLAGS (the booleans'
#: bits) + PV_PARTS. ``two_ctas``: the 16-bit P.V in two CTAs an SM (None: where ``PV_HALF_BLOCK_N`` names the head
#: dim; False: one CTA, KV blocks of BLOCK_N, for the A/B)
SCHEDULE = {"i2f": True, "pv_parts": 4, "keys_permuted": True, "two_ctas": None}
#: FLAGS' bits; P.V on 16-bit V (from V's dtype) and its serial order (from d: block j-1's P.V waited for before block
#: j's Q.K^T, where the in-warpgroup order's second score tile beside a 128-register acc spills) are not switches
_I2F_BIT, _KEYS_PERMUTED_BIT, _PV_HALF_BIT, _PV_SERIAL_BIT = 1, 2, 4, 8
#: registers per thread of the second consumer and the producer (setmaxnreg); the default partition is consumer 0
_WORKER_REGS = (232, 40)
#: the 16-bit P.V in two CTAs an SM (``two_ctas``; the head dims where it compiles and was faster, PERF_NOTES session
#: 49): KV blocks of ``PV_HALF_BLOCK_N`` keys, each block's P.V waited for before the next Q.K^T, 80 launch
#: registers (ptxas holds every partition to them; 2 x 384 x 80 fit the register file) and 4 ring slots (75 KB a CTA)
_TWO_CTAS = dict(maxnreg=80, worker_regs=(104, 24), stages=4)
_data_ptr = torch.Tensor.data_ptr


def gluon_available() -> bool:
    """Gluon imports and the installed Triton is one this kernel was tested with."""
    return HAVE_GLUON and triton.__version__.rsplit(".", 1)[0] in TESTED_TRITON


def supports(*, d: int, block_n: int, window, softcap, has_key_valid: bool, use_sas: bool, block_p: bool,
             pv_half: bool = False) -> bool:
    """Whether this kernel computes the call (causal bottom-right or full; else the portable kernel does); ``pv_half``:
    P.V would run on 16-bit V (``PV_HALF_DTYPES``, per-block V scales). Device and Triton are the caller's."""
    return (d in (HEAD_DIMS if pv_half else INT8_PV_HEAD_DIMS) and block_n == BLOCK_N and window is None
            and softcap is None and not has_key_valid and not use_sas and block_p)


if HAVE_GLUON:
    _MAGIC = gl.constexpr(MAGIC)
    _MAGIC_BITS = gl.constexpr(MAGIC_BITS)
    _GAP = gl.constexpr(P_BLOCK_GAP)
    _SQ_MIN = gl.constexpr(SQ_MIN)
    _I2F, _KEYS_PERMUTED = gl.constexpr(_I2F_BIT), gl.constexpr(_KEYS_PERMUTED_BIT)
    _PV_HALF = gl.constexpr(_PV_HALF_BIT)
    _PV_SERIAL = gl.constexpr(_PV_SERIAL_BIT)
    _PART0 = gl.constexpr(0)  # consumer partitions' PART: partition arguments must be constexpr objects
    _PART1 = gl.constexpr(1)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, sk_desc, sv_desc, q_smem, k_smem, v_smem, sk_smem, sv_smem, q_bar, ready,
                  empty, q_row, k_row, sk_row, v_row, sv_row, sv_step, n_blocks, BN: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr, FLAGS: gl.constexpr):
        """The Q tile once (every consumer's part), then per block into slot j % STAGES: K [BN, d], V^T [d, BN], the
        keys' scales sk [BN] and V's channel scales sv [d] (so no consumer waits on a global load in its loop); with
        _PV_HALF, V [BN, d] in 16 bits and no sv."""
        PART_M: gl.constexpr = q_desc.block_type.shape[0]
        PARTS: gl.constexpr = q_smem.shape[0]
        mbarrier.expect(q_bar, PARTS * q_desc.block_type.nbytes)
        for i in gl.static_range(PARTS):
            tma.async_copy_global_to_shared(q_desc, [q_row + i * PART_M, 0], q_bar, q_smem.index(i))
        nbytes: gl.constexpr = (k_desc.block_type.nbytes + v_desc.block_type.nbytes + sk_desc.block_type.nbytes
                                + (0 if FLAGS & _PV_HALF else sv_desc.block_type.nbytes))
        for j in range(n_blocks):
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_row + j * BN, 0], bar, k_smem.index(s))
            tma.async_copy_global_to_shared(sk_desc, [sk_row + j * BN], bar, sk_smem.index(s))
            if FLAGS & _PV_HALF:
                tma.async_copy_global_to_shared(v_desc, [v_row + j * BN, 0], bar, v_smem.index(s))
            else:
                tma.async_copy_global_to_shared(v_desc, [v_row, j * BN], bar, v_smem.index(s))
                tma.async_copy_global_to_shared(sv_desc, [(sv_row + j * sv_step) * D], bar, sv_smem.index(s))

    @gluon.jit
    def _first_nan_key(p_sk, lo, hi, SCAN: gl.constexpr):
        """Smallest key index in [lo, hi) whose scale is NaN, else hi (``prefill._first_nan_key``)."""
        lay: gl.constexpr = gl.BlockedLayout([SCAN // 128], [32], [4], [0])
        first = gl.full([SCAN], 0, gl.int32, lay) + hi
        for s in range(lo, hi, SCAN):
            o = s + gl.arange(0, SCAN, layout=lay)
            x = gl.load(p_sk + o, mask=o < hi, other=0.0)
            first = gl.minimum(first, gl.where(x != x, o, hi))
        return gl.min(first, 0)

    @gluon.jit
    def _split_halves(t):
        """(t[:, :n/2], t[:, n/2:]) of a wgmma-layout tile whose top column bit a thread holds in registers: no data
        moves."""
        return t.reshape([t.shape[0], 2, t.shape[1] // 2]).permute(0, 2, 1).split()

    @gluon.jit
    def _scores(s_i32, sk, o_n, o_pos, Lk, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, FLAGS: gl.constexpr):
        """(t, sk): the int32 scores of keys ``o_n`` scaled by their key scales, -inf where masked (and sk with 0
        past Lk: the tile's tail holds the next head's scales, 0 as a masked load)."""
        if MASKED:
            sk = gl.where(o_n < Lk, sk, 0.0)
        if FLAGS & _I2F:
            t = s_i32.to(gl.float32) * sk[None, :]
        else:
            t = gl.fma((s_i32 + _MAGIC_BITS).to(gl.float32, bitcast=True), sk[None, :], -(sk * _MAGIC)[None, :])
        if MASKED:
            m_s = (o_n < Lk)[None, :]
            if IS_CAUSAL:
                m_s = m_s & (o_n[None, :] <= o_pos[:, None])
            t = gl.where(m_s, t, float("-inf"))
        return t, sk

    @gluon.jit
    def _state(bmax, m_i, c_i, MASKED: gl.constexpr):
        """(m, c, c_safe, r) after a block whose scaled row max is ``bmax``: the block P scale's reference point c
        and the rescale r = exp2(c_old - c_new)."""
        if MASKED:
            m_new = gl.maximum(m_i, bmax, propagate_nan=tl.PropagateNan.ALL)
        else:
            m_new = gl.maximum(m_i, bmax)
        c_new = gl.maximum(bmax, m_new - _GAP)
        c_safe = gl.where(c_new == float("-inf"), 0.0, c_new)
        return m_new, c_new, c_safe, gl.exp2(c_i - c_safe)

    @gluon.jit
    def _codes(t, sq, c_safe):
        """bits(127 p + C) of p = exp2(t sq - c): P's int8 code is the low byte."""
        p = gl.exp2(gl.fma(t, sq[:, None], -c_safe[:, None]))
        return gl.fma(p, 127.0, _MAGIC).to(gl.int32, bitcast=True)

    @gluon.jit
    def _operand(p8, p_l: gl.constexpr, FLAGS: gl.constexpr):
        """P's int8 codes [BM, W] (score-accumulator layout) as the P.V MMA's A operand; _KEYS_PERMUTED: in
        ``mma_key_order`` (V^T's keys stored so), which is the accumulator's own register order."""
        if FLAGS & _KEYS_PERMUTED:
            BM: gl.constexpr = p8.shape[0]
            W: gl.constexpr = p8.shape[1]
            p8 = p8.reshape([BM, W // 32, 2, 2, 4, 2]).permute(0, 1, 2, 4, 3, 5).reshape([BM, W])
        return gl.convert_layout(p8, p_l)

    @gluon.jit
    def _issue_pv(t, sq, c_safe, v_tile, ones_smem, start, pv, rs, p_l: gl.constexpr, USE_ACC: gl.constexpr,
                  FLAGS: gl.constexpr):
        """P's codes of the keys [start, start + width) of a block (their scaled scores ``t``) and their P.V and row
        sums issued onto ``pv`` / ``rs`` (a new sum unless USE_ACC), not waited for."""
        row_t: gl.constexpr = gl.SliceLayout(1, t.type.layout)
        p8 = _codes(t, gl.convert_layout(sq, row_t), gl.convert_layout(c_safe, row_t)).to(gl.int8)
        W: gl.constexpr = t.shape[1]
        p8 = _operand(p8, p_l, FLAGS)
        pv = warpgroup_mma(p8, v_tile.slice(start, W, dim=1).permute((1, 0)), pv, use_acc=USE_ACC, is_async=True)
        rs = warpgroup_mma(p8, ones_smem.slice(start, W, dim=1).permute((1, 0)), rs, use_acc=USE_ACC, is_async=True)
        return pv, rs

    @gluon.jit
    def _block(q, k_tile, v_tile, sk_tile, ones_smem, j, sq, l_i, m_i, c_i, o_pos, Lk, s_zero, o_zero, n8_zero,
               p_l: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, PV_PARTS: gl.constexpr,
               FLAGS: gl.constexpr):
        """``prefill._attn_update`` for KV block j (block P scale, exp2 softmax) up to the fold: Q.K^T, the scaled
        scores, the new m, c and rescale r, and P.V with P's row sums (an m64n8 IGMMA of P with a tile of ones,
        ``ones_smem``: the same int32 sums as ~64 integer adds a thread) as PV_PARTS (1, 2 or 4) MMAs over the
        block's keys, each issued as soon as its part's codes are ready, so the tensor cores run a part while the
        next part's exponentials are taken (the parts' int32 sums are the block's). Returns P.V and the row sums
        (waited for), r and l (not yet rescaled nor summed: the caller's ``fma(l, r, sum)``), m, c."""
        BN: gl.constexpr = k_tile.shape[0]
        col_l: gl.constexpr = gl.SliceLayout(0, s_zero.type.layout)
        s_i32 = warpgroup_mma_wait(0, deps=(warpgroup_mma(q, k_tile.permute((1, 0)), s_zero, use_acc=False,
                                                          is_async=True), ))
        t, sk = _scores(s_i32, sk_tile.load(col_l), j * BN + gl.arange(0, BN, layout=col_l), o_pos, Lk, MASKED,
                        IS_CAUSAL, FLAGS)
        m_new, c_new, c_safe, r = _state(gl.max(t, 1) * sq, m_i, c_i, MASKED)
        if PV_PARTS == 1:
            pv, rs = _issue_pv(t, sq, c_safe, v_tile, ones_smem, 0, o_zero, n8_zero, p_l, False, FLAGS)
        else:
            H: gl.constexpr = BN // 2
            t_lo, t_hi = _split_halves(t)
            if PV_PARTS == 4:
                Q: gl.constexpr = H // 2
                a, b = _split_halves(t_lo)
                pv, rs = _issue_pv(a, sq, c_safe, v_tile, ones_smem, 0, o_zero, n8_zero, p_l, False, FLAGS)
                pv, rs = _issue_pv(b, sq, c_safe, v_tile, ones_smem, Q, pv, rs, p_l, True, FLAGS)
                a, b = _split_halves(t_hi)
                pv, rs = _issue_pv(a, sq, c_safe, v_tile, ones_smem, H, pv, rs, p_l, True, FLAGS)
                pv, rs = _issue_pv(b, sq, c_safe, v_tile, ones_smem, H + Q, pv, rs, p_l, True, FLAGS)
            else:
                pv, rs = _issue_pv(t_lo, sq, c_safe, v_tile, ones_smem, 0, o_zero, n8_zero, p_l, False, FLAGS)
                pv, rs = _issue_pv(t_hi, sq, c_safe, v_tile, ones_smem, H, pv, rs, p_l, True, FLAGS)
        # waited here: an MMA in flight across the caller's masked / unmasked branch makes ptxas serialize every wgmma
        pv, rs = warpgroup_mma_wait(0, deps=(pv, rs))
        if MASKED and not IS_CAUSAL:  # the tail block: every row sees its keys < Lk (sk 0 past it); + 0 is exact
            l_i = l_i + gl.sum(sk * 0.0, 0)
        return pv, rs, r, l_i, m_new, c_new

    @gluon.jit
    def _blocks_int8(q, k_smem, v_smem, sk_smem, sv_smem, ones_smem, ready, empty, acc, sq, l_i, m_i, c_i, o_pos, Lk,
                     s_zero, n_full, n_mine, p_l: gl.constexpr, IS_CAUSAL: gl.constexpr, PV_PARTS: gl.constexpr,
                     FLAGS: gl.constexpr):
        """A consumer's blocks with the INT8 P.V: ``_block`` (waited for within the block) and the fold, each slot
        released after it (the schedules that overlap blocks spill the int32 P.V tile: PERF_NOTES sessions 35, 44,
        45). Returns acc, l."""
        STAGES: gl.constexpr = k_smem.shape[0]
        o_l: gl.constexpr = acc.type.layout
        row_l: gl.constexpr = gl.SliceLayout(1, s_zero.type.layout)
        o_zero = gl.zeros(acc.shape, gl.int32, layout=o_l)
        n8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 32])
        n8_zero = gl.zeros([acc.shape[0], 8], gl.int32, layout=n8_l)
        for j in range(n_mine):
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            if j < n_full:
                pv, rs, r, l_i, m_i, c_i = _block(q, k_smem.index(s), v_smem.index(s), sk_smem.index(s), ones_smem, j,
                                                  sq, l_i, m_i, c_i, o_pos, Lk, s_zero, o_zero, n8_zero, p_l, False,
                                                  IS_CAUSAL, PV_PARTS, FLAGS)
            else:
                pv, rs, r, l_i, m_i, c_i = _block(q, k_smem.index(s), v_smem.index(s), sk_smem.index(s), ones_smem, j,
                                                  sq, l_i, m_i, c_i, o_pos, Lk, s_zero, o_zero, n8_zero, p_l, True,
                                                  IS_CAUSAL, PV_PARTS, FLAGS)
            l_i = gl.fma(l_i, r, gl.convert_layout(gl.max(rs, 1), row_l).to(gl.float32))  # each column: the row sum
            acc = _fold(acc, r, pv, sv_smem.index(s), o_l, FLAGS)
            mbarrier.arrive(empty.index(s), count=1)
        return acc, l_i

    @gluon.jit
    def _softmax_half(s_i32, sk_tile, j, sq, l_i, m_i, c_i, o_pos, Lk, p_l: gl.constexpr, V_T: gl.constexpr,
                      MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, FLAGS: gl.constexpr):
        """Block j's softmax for the 16-bit P.V: (P, r, l, m, c) with P = exp2(t sq - c) rounded to ``p_l``'s type
        as the P.V operand (V's type ``V_T``), l = l r + the row sums of the unrounded p (adds, as FlashAttention)."""
        BN: gl.constexpr = s_i32.shape[1]
        col_l: gl.constexpr = gl.SliceLayout(0, s_i32.type.layout)
        t, sk = _scores(s_i32, sk_tile.load(col_l), j * BN + gl.arange(0, BN, layout=col_l), o_pos, Lk, MASKED,
                        IS_CAUSAL, FLAGS)
        m_new, c_new, c_safe, r = _state(gl.max(t, 1) * sq, m_i, c_i, MASKED)
        p = gl.exp2(gl.fma(t, sq[:, None], -c_safe[:, None]))
        if MASKED and not IS_CAUSAL:  # the tail block: every row sees its keys < Lk (sk 0 past it); + 0 is exact
            l_i = l_i + gl.sum(sk * 0.0, 0)
        l_i = gl.fma(l_i, r, gl.sum(p, 1))
        return gl.convert_layout(p.to(V_T), p_l), r, l_i, m_new, c_new

    @gluon.jit
    def _step_half(q, k_tile, sk_tile, v_prev, j, p_prev, acc, sq, l_i, m_i, c_i, o_pos, Lk, s_zero,
                   p_l: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, FLAGS: gl.constexpr):
        """FlashAttention-3's in-warpgroup order for block j >= 1: its Q.K^T and block j-1's P.V issued together,
        block j's softmax while P.V runs, then acc (block j-1 added) rescaled to block j's reference point. The
        second score tile this needs fits beside acc because a 16-bit P.V accumulates onto acc itself (no int32
        tile to fold: PERF_NOTES session 47). _PV_SERIAL (d 256, acc 128 registers): block j-1's P.V is waited
        for before block j's Q.K^T is issued; the other consumer warpgroup's MMAs fill the gap."""
        if FLAGS & _PV_SERIAL:
            acc = warpgroup_mma_wait(0, deps=(warpgroup_mma(p_prev, v_prev, acc, is_async=True), ))
            s_i32 = warpgroup_mma_wait(0, deps=(warpgroup_mma(q, k_tile.permute((1, 0)), s_zero, use_acc=False,
                                                              is_async=True), ))
            p, r, l_i, m_i, c_i = _softmax_half(s_i32, sk_tile, j, sq, l_i, m_i, c_i, o_pos, Lk, p_l, v_prev.dtype,
                                                MASKED, IS_CAUSAL, FLAGS)
        else:
            s_tok = warpgroup_mma(q, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_prev, v_prev, acc, is_async=True)
            s_i32 = warpgroup_mma_wait(1, deps=(s_tok, ))
            p, r, l_i, m_i, c_i = _softmax_half(s_i32, sk_tile, j, sq, l_i, m_i, c_i, o_pos, Lk, p_l, v_prev.dtype,
                                                MASKED, IS_CAUSAL, FLAGS)
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        acc = acc * gl.convert_layout(r, gl.SliceLayout(1, acc.type.layout))[:, None]
        return p, acc, l_i, m_i, c_i

    @gluon.jit
    def _steps_half(q, k_smem, v_smem, sk_smem, ready, empty, lo, hi, p, acc, sq, l_i, m_i, c_i, o_pos, Lk, s_zero,
                    p_l: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, FLAGS: gl.constexpr):
        """``_step_half`` for the blocks [lo, hi) (lo >= 1), each block j-1's slot released once its P.V is in."""
        STAGES: gl.constexpr = k_smem.shape[0]
        for j in range(lo, hi):
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            p, acc, l_i, m_i, c_i = _step_half(q, k_smem.index(s), sk_smem.index(s), v_smem.index((j - 1) % STAGES),
                                               j, p, acc, sq, l_i, m_i, c_i, o_pos, Lk, s_zero, p_l, MASKED,
                                               IS_CAUSAL, FLAGS)
            mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
        return p, acc, l_i, m_i, c_i

    @gluon.jit
    def _blocks_half(q, k_smem, v_smem, sk_smem, ready, empty, acc, sq, l_i, m_i, c_i, o_pos, Lk, s_zero, n_full,
                     n_mine, p_l: gl.constexpr, IS_CAUSAL: gl.constexpr, FLAGS: gl.constexpr):
        """A consumer's blocks with the 16-bit P.V (``_step_half``'s order): block 0's Q.K^T and softmax, the
        unmasked blocks, the masked ones (two loops: no MMA in flight across a masked / unmasked branch), then the
        last block's P.V. Each slot is released once its P.V has been waited for. Returns acc, l."""
        STAGES: gl.constexpr = k_smem.shape[0]
        if n_mine > 0:
            mbarrier.wait(ready.index(0), 0)
            s_i32 = warpgroup_mma_wait(0, deps=(warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero,
                                                              use_acc=False, is_async=True), ))
            if n_full > 0:
                p, r, l_i, m_i, c_i = _softmax_half(s_i32, sk_smem.index(0), 0, sq, l_i, m_i, c_i, o_pos, Lk, p_l,
                                                    v_smem.dtype, False, IS_CAUSAL, FLAGS)
            else:
                p, r, l_i, m_i, c_i = _softmax_half(s_i32, sk_smem.index(0), 0, sq, l_i, m_i, c_i, o_pos, Lk, p_l,
                                                    v_smem.dtype, True, IS_CAUSAL, FLAGS)
            acc = acc * gl.convert_layout(r, gl.SliceLayout(1, acc.type.layout))[:, None]
            p, acc, l_i, m_i, c_i = _steps_half(q, k_smem, v_smem, sk_smem, ready, empty, 1, n_full, p, acc, sq, l_i,
                                                m_i, c_i, o_pos, Lk, s_zero, p_l, False, IS_CAUSAL, FLAGS)
            p, acc, l_i, m_i, c_i = _steps_half(q, k_smem, v_smem, sk_smem, ready, empty, gl.maximum(n_full, 1),
                                                n_mine, p, acc, sq, l_i, m_i, c_i, o_pos, Lk, s_zero, p_l, True,
                                                IS_CAUSAL, FLAGS)
            s = (n_mine - 1) % STAGES
            acc = warpgroup_mma_wait(0, deps=(warpgroup_mma(p, v_smem.index(s), acc, is_async=True), ))
            mbarrier.arrive(empty.index(s), count=1)
        return acc, l_i

    @gluon.jit
    def _fold(acc, r, pv, sv_smem, o_l: gl.constexpr, FLAGS: gl.constexpr):
        """acc * r + float(P.V) * sv: the block's int32 P.V with V's channel scales from the slot ``sv_smem``."""
        sv = sv_smem.load(gl.SliceLayout(0, o_l))
        if FLAGS & _I2F:
            pv_f = pv.to(gl.float32) * sv[None, :]
        else:
            pv_f = gl.fma((pv + _MAGIC_BITS).to(gl.float32, bitcast=True), sv[None, :], -(sv * _MAGIC)[None, :])
        return gl.fma(acc, gl.convert_layout(r, gl.SliceLayout(1, o_l))[:, None], pv_f)

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, sk_smem, sv_smem, ones_smem, q_bar, ready, empty, SQ, SK, O, Lq, Lk, i_m,
                  i_b, i_hq, stride_sqb, stride_sqh, stride_ob, stride_om, stride_oh, sk_row, n_blocks,
                  PART: gl.constexpr, IS_CAUSAL: gl.constexpr, FLAGS: gl.constexpr, PV_PARTS: gl.constexpr):
        """Rows [i_m * 128 + 64 PART, +64) of one (b, head): the portable kernel's program of BLOCK_M 64 over its
        blocks (``_blocks_int8``, or ``_blocks_half`` for a 16-bit V), then the output."""
        BM: gl.constexpr = q_smem.shape[1]
        PARTS: gl.constexpr = q_smem.shape[0]
        D: gl.constexpr = q_smem.shape[2]
        BN: gl.constexpr = k_smem.shape[1]
        STAGES: gl.constexpr = k_smem.shape[0]
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        K_MMA: gl.constexpr = 16 if FLAGS & _PV_HALF else 32  # the P.V MMA's K: 16-bit or 8-bit operands
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, D, K_MMA])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=K_MMA // 8)
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)
        m0 = i_m * (PARTS * BM) + PART * BM
        o_m = m0 + gl.arange(0, BM, layout=row_l)
        o_pos = o_m + (Lk - Lq)
        sq = gl.load(SQ + i_b * stride_sqb + i_hq * stride_sqh + o_m, mask=o_m < Lq, other=0.0)
        l_i = gl.where(sq == sq, 0.0, sq)  # a NaN query scale starts l at NaN
        sq = gl.maximum(sq, _SQ_MIN, propagate_nan=tl.PropagateNan.ALL)
        pos_min = m0 + (Lk - Lq)
        hi = Lk
        if IS_CAUSAL:
            hi = gl.minimum(hi, pos_min + BM)
        full_hi = Lk // BN * BN
        if IS_CAUSAL:
            full_hi = gl.minimum(full_hi, (pos_min + 1) // BN * BN)
        full_hi = gl.minimum(gl.maximum(full_hi, 0), hi)
        # the INT8 P.V turns a NaN p into a code, so rows that see a NaN key scale are found before the loop; with
        # the 16-bit P.V a NaN score gives NaN p, P and row sum in exactly those rows (masked scores are -inf first)
        if not (FLAGS & _PV_HALF):
            if IS_CAUSAL:
                first = _first_nan_key(SK + sk_row, 0, gl.minimum(hi, Lk), 1024)
                l_i = l_i + gl.where(first <= o_pos, float("nan"), 0.0)
            else:
                first = _first_nan_key(SK + sk_row, 0, full_hi, 1024)
                l_i = l_i + gl.where(first < full_hi, float("nan"), 0.0)
        m_i = gl.full([BM], float("-inf"), gl.float32, row_l)
        c_i = gl.full([BM], float("-inf"), gl.float32, row_l)
        acc = gl.zeros([BM, D], gl.float32, layout=o_l)
        s_zero = gl.zeros([BM, BN], gl.int32, layout=s_l)
        q = q_smem.index(PART)
        n_full = full_hi // BN
        n_mine = gl.cdiv(hi, BN)
        mbarrier.wait(q_bar, 0)
        if FLAGS & _PV_HALF:
            acc, l_i = _blocks_half(q, k_smem, v_smem, sk_smem, ready, empty, acc, sq, l_i, m_i, c_i, o_pos, Lk,
                                    s_zero, n_full, n_mine, p_l, IS_CAUSAL, FLAGS)
        else:
            acc, l_i = _blocks_int8(q, k_smem, v_smem, sk_smem, sv_smem, ones_smem, ready, empty, acc, sq, l_i, m_i,
                                    c_i, o_pos, Lk, s_zero, n_full, n_mine, p_l, IS_CAUSAL, PV_PARTS, FLAGS)
        for j in range(n_mine, n_blocks):  # another part's diagonal block lies past these rows: wait, release
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            mbarrier.arrive(empty.index(s), count=1)
        has_key = l_i != 0
        l_o = gl.convert_layout(gl.where(has_key, l_i, 1.0), gl.SliceLayout(1, o_l))
        o = acc / l_o[:, None]
        o = gl.where(gl.convert_layout(has_key, gl.SliceLayout(1, o_l))[:, None], o, 0.0)
        # 16-byte stores of whole row segments (the accumulator's layout stores 4 bytes a thread); at d 256 the layout
        # change's scratch (32 KB) does not fit beside the ring
        if D > 128:
            st_l: gl.constexpr = o_l
        else:
            st_l: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [4, 1], [1, 0])
        o = gl.convert_layout(o.to(O.dtype.element_ty), st_l)
        r_o = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, st_l))
        c_o = gl.arange(0, D, layout=gl.SliceLayout(0, st_l))
        p_o = (O + i_b.to(gl.int64) * stride_ob + i_hq.to(gl.int64) * stride_oh + r_o[:, None].to(gl.int64) * stride_om
               + c_o[None, :])
        gl.store(p_o, o, mask=(r_o < Lq)[:, None])

    @gluon.jit(do_not_specialize=["Lq", "Lk", "K_ROWS"])
    def _int8_attn_fwd_ws_kernel(q_desc, k_desc, v_desc, sk_desc, sv_desc, SQ, SK, O, Lq, Lk, K_ROWS, SK_ROW, HQ, HK,
                                 V_ROWS, NBLK, SV_STEP, stride_sqb, stride_sqh, stride_ob, stride_om, stride_oh,
                                 IS_CAUSAL: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                                 FLAGS: gl.constexpr, PV_PARTS: gl.constexpr, R_CONSUMER: gl.constexpr,
                                 R_PRODUCER: gl.constexpr):
        """grid (cdiv(Lq, 128) * b * HQ,), row blocks of one head neighbours, the longest causal ones first; two
        consumer warpgroups of 64 rows each share every KV slot.
        q_desc over q8 as [b HQ Lq, d] (block [64, d]), k_desc over k8 as [b HK K_ROWS, d] (block [BN, d]),
        v_desc over v8t as [b HK d, Lpad] (block [d, BN]; _PV_HALF: over 16-bit V as [b HK Lpad, d], block [BN, d]),
        sk_desc over sk as [b HK SK_ROW] (block [BN]; SK_ROW a multiple of 4: a 1-D TMA copy starts 16-byte
        aligned), sv_desc over sv as [b HK NBLK d] (block [d]; SV_STEP 0: one block of channel scales for every KV
        block). Rows a tile reads past its head are masked. K_ROWS: k8's rows per head, SK_ROW sk's (both >= Lk),
        V_ROWS the V descriptor's (d, or Lpad with _PV_HALF, whose rows must be finite: a masked p is 0, and 0 times
        a non-finite value is NaN). SK: sk itself (the NaN scan)."""
        PART_M: gl.constexpr = q_desc.block_type.shape[0]
        PARTS: gl.constexpr = 2
        n_m = gl.cdiv(Lq, PARTS * PART_M)
        pid = gl.program_id(0)
        i_m = n_m - 1 - pid % n_m
        i_bh = pid // n_m
        i_b = i_bh // HQ
        i_hq = i_bh % HQ
        i_hk = i_hq // (HQ // HK)
        hi = Lk
        if IS_CAUSAL:
            hi = gl.minimum(hi, (i_m + 1) * (PARTS * PART_M) + (Lk - Lq))
        n_blocks = gl.cdiv(hi, BN)
        q_smem = gl.allocate_shared_memory(gl.int8, [PARTS, PART_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        sk_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BN], sk_desc.layout)
        sv_smem = gl.allocate_shared_memory(gl.float32, [STAGES, D], sv_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ones_smem = gl.allocate_shared_memory(gl.int8, [8, BN], gl.NVMMASharedLayout.get_default_for([8, BN], gl.int8))
        ones_smem.store(gl.full([8, BN], 1, gl.int8, layout=gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])))
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=PARTS)  # every consumer releases a slot
        fence_async_shared()
        q_row = i_bh * Lq + i_m * (PARTS * PART_M)
        k_row = (i_b * HK + i_hk) * K_ROWS  # k8 and sk may hold more rows than the Lk keys attended
        sk_row = (i_b * HK + i_hk) * SK_ROW
        v_row = (i_b * HK + i_hk) * V_ROWS
        sv_row = (i_b * HK + i_hk) * NBLK
        # tuples spelled out in the call: a tuple held in a variable or concatenated unwraps its constexprs
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, ones_smem, q_bar, ready, empty, SQ, SK, O, Lq, Lk,
                         i_m, i_b, i_hq, stride_sqb, stride_sqh, stride_ob, stride_om, stride_oh, sk_row, n_blocks,
                         _PART0, IS_CAUSAL, FLAGS, PV_PARTS)),
            (_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, ones_smem, q_bar, ready, empty, SQ, SK, O, Lq, Lk,
                         i_m, i_b, i_hq, stride_sqb, stride_sqh, stride_ob, stride_om, stride_oh, sk_row, n_blocks,
                         _PART1, IS_CAUSAL, FLAGS, PV_PARTS)),
            (_producer, (q_desc, k_desc, v_desc, sk_desc, sv_desc, q_smem, k_smem, v_smem, sk_smem, sv_smem, q_bar,
                         ready, empty, q_row, k_row, sk_row, v_row, sv_row, SV_STEP, n_blocks, BN, D, STAGES,
                         FLAGS)),
        ], [4, 4], [R_CONSUMER, R_PRODUCER])


def _tma_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when TMA can read it as a dense array (contiguous, 16-byte aligned), else a copy that is."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


class _Desc:
    """What Triton's launcher reads of a ``TensorDescriptor`` (base, shape, strides, padding): a relaunch's
    descriptors, whose shapes, strides and alignment the first, checked launch of its ``WsLaunch`` fixed."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape, strides):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, "zero"


@functools.lru_cache(maxsize=None)
def _layouts(d: int, v_dtype: torch.dtype = torch.int8, bn: int = BLOCK_N):
    """Shared-memory layouts of the five TMA tiles at head_dim ``d`` and KV block ``bn`` (q, k int8; V^T int8 or V
    16-bit; sk, sv fp32)."""
    v_tile = ([d, bn], gl.int8) if v_dtype == torch.int8 else (
        [bn, d], gl.bfloat16 if v_dtype == torch.bfloat16 else gl.float16)
    return tuple(gl.NVMMASharedLayout.get_default_for(blk, dt) for blk, dt in (
        ([PART_M, d], gl.int8), ([bn, d], gl.int8), v_tile, ([bn], gl.float32), ([d], gl.float32)))


def _desc_dims(q8, k8, v, sk, sv, bn: int = BLOCK_N):
    """(shape, strides, block) of the five descriptors: q8 / k8 / v as dense 2-D arrays (v: V^T int8 ``[b, hk, d,
    Lpad]`` or V 16-bit ``[b, hk, Lpad, d]``), sk / sv as 1-D; ``bn``: the kernel's KV block."""
    b, hq, lq, d = q8.shape
    hk, lk, rows, cols = k8.shape[1], k8.shape[2], v.shape[2], v.shape[3]
    v_block = [d, bn] if v.dtype == torch.int8 else [bn, d]
    return (([b * hq * lq, d], [d, 1], [PART_M, d]), ([b * hk * lk, d], [d, 1], [bn, d]),
            ([b * hk * rows, cols], [cols, 1], v_block), ([sk.numel()], [1], [bn]), ([sv.numel()], [1], [d]))


def descriptors(q8, k8, v, sk, sv, bn: int = BLOCK_N):
    """TMA descriptors of the operands as dense 2-D (int8 / 16-bit tiles) and 1-D (scales) arrays; ``bn``: the
    kernel's KV block (``ws_spec``'s BN)."""
    return tuple(TensorDescriptor(t, shape, strides, block, lay) for t, (shape, strides, block), lay in zip(
        (q8, k8, v, sk, sv), _desc_dims(q8, k8, v, sk, sv, bn), _layouts(q8.shape[3], v.dtype, bn)))


def schedule_constexprs(**schedule) -> dict:
    """The kernel's FLAGS (bit set of the boolean switches) and PV_PARTS for ``SCHEDULE``'s switches, defaults where
    not given, and TWO_CTAS (``ws_spec``'s: None is the 16-bit P.V's default for the head dim)."""
    unknown = set(schedule) - set(SCHEDULE)
    if unknown:
        raise ValueError(f"unknown schedule switch(es) {sorted(unknown)}; known: {sorted(SCHEDULE)}")
    on = {**SCHEDULE, **schedule}
    if on["pv_parts"] not in (1, 2, 4):
        raise ValueError(f"pv_parts={on['pv_parts']!r}: 1, 2 or 4 (an int8 wgmma takes 32 keys or more)")
    flags = (_I2F_BIT if on["i2f"] else 0) | (_KEYS_PERMUTED_BIT if on["keys_permuted"] else 0)
    return dict(FLAGS=flags, PV_PARTS=int(on["pv_parts"]), TWO_CTAS=on["two_ctas"])


def ws_spec(q8, sq, k8, sk, v, sv, out, *, causal: bool, Lk: int, worker_regs=None, **schedule):
    """(grid, scalars, constexprs) of ``_int8_attn_fwd_ws_kernel`` after its five descriptors and 3 tensors
    (sk and sv dense with sk's rows a multiple of 4: ``launch_ws``). ``v``: V^T int8 (INT8 P.V) or V in 16 bits
    (``PV_HALF_DTYPES``, ``[b, hk, Lpad, d]``: P.V on 16-bit operands; ``sv`` is then not read)."""
    b, hq, lq, d = q8.shape
    hk, nblk = k8.shape[1], sv.shape[2]
    if sk.shape[2] < Lk or sk.shape[2] % 4:
        raise ValueError(f"sk {tuple(sk.shape)} must hold >= Lk = {Lk} rows per head, a multiple of 4")
    half = v.dtype in PV_HALF_DTYPES
    if not half and d not in INT8_PV_HEAD_DIMS:
        raise ValueError(f"head_dim {d} runs only P.V on 16-bit V {PV_HALF_DTYPES}; the INT8 P.V takes head_dim "
                         f"{INT8_PV_HEAD_DIMS}")
    if half and (v.shape[2] < Lk or v.shape[2] % BLOCK_N):
        raise ValueError(f"16-bit V {tuple(v.shape)} must hold whole blocks of {BLOCK_N} rows per head, >= Lk = {Lk}")
    grid = (-(-lq // (2 * PART_M)) * b * hq,)
    scalars = (lq, Lk, k8.shape[2], sk.shape[2], hq, hk, v.shape[2], nblk, 1 if nblk > 1 else 0, sq.stride(0),
               sq.stride(1), out.stride(0), out.stride(1), out.stride(2))
    cx = schedule_constexprs(**schedule)
    two = cx.pop("TWO_CTAS")
    two = half and d in PV_HALF_BLOCK_N if two is None else two
    if two and not (half and d in PV_HALF_BLOCK_N):
        raise ValueError(f"two CTAs an SM run the 16-bit P.V at head_dim {sorted(PV_HALF_BLOCK_N)} only")
    if half:  # V's keys in natural order; its 16-bit P is the accumulator's registers as they are
        cx["FLAGS"] = (cx["FLAGS"] & ~_KEYS_PERMUTED_BIT) | _PV_HALF_BIT | (_PV_SERIAL_BIT if d > 128 or two else 0)
    regs, stages, launch = worker_regs or _WORKER_REGS, _STAGES[d], {}
    if two:
        regs, stages, launch = worker_regs or _TWO_CTAS["worker_regs"], _TWO_CTAS["stages"], dict(
            maxnreg=_TWO_CTAS["maxnreg"])
    kw = dict(IS_CAUSAL=bool(causal), D=d, BN=PV_HALF_BLOCK_N[d] if two else BLOCK_N, STAGES=stages, **cx,
              R_CONSUMER=regs[0], R_PRODUCER=regs[1], num_warps=4, **launch)
    return grid, scalars, kw


def mma_key_order(n: int) -> torch.Tensor:
    """``idx`` such that ``v8t[..., idx]`` holds V's keys in the order the P.V operand's registers take them
    (``keys_permuted``): within each 32 keys, slot 16h + 4c + 2e + b holds key 16h + 8e + 2c + b, so the int8 codes of
    P a thread holds in the score accumulator (keys 8i + 2c, +1) are already its A-operand bytes (4 keys 4c..4c+3
    of each 16) and need no lane shuffle. ``n`` a multiple of 32."""
    # keys of a group as [h, e, c, b] read as [h, c, e, b]: the permutation ``_operand`` and the V pass apply
    return torch.arange(n).reshape(n // 32, 2, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(n)


class WsLaunch:
    """The kernel's launch for one set of operand shapes and strides (``prefill._AttnPlan`` keeps one): grid, scalar
    arguments, constexprs and descriptor shapes worked out once; from the second call on, the compiled kernel is
    relaunched through Triton's C launcher with light descriptors, without Gluon's binder and the descriptors' Python
    checks (host time a call: PERF_NOTES session 46). Operands: dense, sk's rows a multiple of 4 (``ws_spec``)."""

    __slots__ = ("grid", "scalars", "kw", "dims", "memo")

    def __init__(self, q8, sq, k8, sk, v8t, sv, out, *, causal: bool, Lk: int, worker_regs=None, **schedule):
        self.grid, self.scalars, self.kw = ws_spec(q8, sq, k8, sk, v8t, sv, out, causal=causal, Lk=Lk,
                                                   worker_regs=worker_regs, **schedule)
        self.dims = _desc_dims(q8, k8, v8t, sk, sv, self.kw["BN"])
        self.memo = {}

    def __call__(self, q8, sq, k8, sk, v8t, sv, out):
        tiles = (q8, k8, v8t, sk, sv)
        aligned = not ((_data_ptr(sq) | _data_ptr(out) | functools.reduce(operator.or_, map(_data_ptr, tiles)))
                       & 15)
        key = current_cuda_device()
        hit = self.memo.get(key) if aligned and not LeanLaunch.hooks_active() else None
        if hit is None:  # Gluon's binder: compiles (or its cache), checks the descriptors, specialises the pointers
            args = (*descriptors(*tiles, self.kw["BN"]), sq, sk, out, *self.scalars)
            hit = lean(_int8_attn_fwd_ws_kernel).launch_bound(self.grid, args, self.kw)
            if aligned and hit is not None:
                self.memo[key] = hit
            return out
        descs = [_Desc(t, shape, strides) for t, (shape, strides, _) in zip(tiles, self.dims)]
        LeanLaunch.relaunch(hit, self.grid, (*descs, _data_ptr(sq), _data_ptr(sk), _data_ptr(out), *self.scalars))
        return out


def launch_ws(q8, sq, k8, sk, v8t, sv, out, *, causal: bool, Lk: int, worker_regs=None, v8t_in_mma_order=False,
              **schedule):
    """Run the kernel once (CUDA sm_90; ``int8_flash_attention`` checks the operands' shapes and dtypes): any
    strides, sk's rows padded here. ``v8t``: V^T int8, or V itself in 16 bits (``[b, hk, >= Lk, d]``, finite, as
    ``quant.v_operand_half`` writes it; its rows padded with zeros to whole blocks here). ``schedule``: ``SCHEDULE``'s
    switches, ``worker_regs``: (consumer, producer) registers, for the A/B (PERF_NOTES). ``v8t_in_mma_order``: v8t's
    keys are already in ``mma_key_order`` (else, with ``keys_permuted``, a copy is). A caller launching one shape again and again keeps a ``WsLaunch``."""
    if sk.shape[2] % 4:  # rows of whole 16-byte units (1-D TMA copies start aligned); the pad is never read as a key
        sk = torch.nn.functional.pad(sk, (0, 4 - sk.shape[2] % 4))
    if v8t.dtype in PV_HALF_DTYPES:  # whole blocks of rows (``ws_spec``)
        if v8t.shape[2] % BLOCK_N:
            v8t = torch.nn.functional.pad(v8t, (0, 0, 0, -v8t.shape[2] % BLOCK_N))
    elif schedule_constexprs(**schedule)["FLAGS"] & _KEYS_PERMUTED_BIT and not v8t_in_mma_order:
        v8t = v8t[..., mma_key_order(v8t.shape[-1]).to(v8t.device)]
    q8, k8, v8t, sk, sv = (_tma_operand(t) for t in (q8, k8, v8t, sk, sv))
    return WsLaunch(q8, sq, k8, sk, v8t, sv, out, causal=causal, Lk=Lk, worker_regs=worker_regs,
                    **schedule)(q8, sq, k8, sk, v8t, sv, out)
