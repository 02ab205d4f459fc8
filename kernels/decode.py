"""Decode attention over the packed KV cache: a query chunk against INT4/INT2/INT8 blocks + the INT8 tail.

What it implements:
- TurboAttention (Kang et al., 2024) §3.1 eq. 8 / §3.3: packed INT4/INT2 blocks are turned back into INT8
  in registers by integer arithmetic (``code * scale_int + zero``), then INT8 x INT8 -> INT32 dots run
  (INT-FlashAttention) for Q·Kᵀ and P·V; the INT8 tail buffer (< BS tokens, universal scale) is read in
  the same pass. §4 SAS (sparse activated softmax) as an option.
- INT-FlashAttention's static P scale: ``p8 = round(127 * exp2(s - m))``; the row sum ``l`` accumulates the
  same integers, so ``O = Σ p8·v8 / Σ p8 · s_v`` (the 1/127 cancels; every row stays a convex combination
  of the quantized values).
- FlashAttention-3's K-major rule for 8-bit dots: K tiles are ``[tokens, D]`` (D contiguous), V tiles
  ``[D, tokens]`` (tokens contiguous), so both dots read their reduction axis contiguously.
- GQA packing: the G query heads of one KV head and the chunk's Lq queries form the M rows of one
  program (row ``r = head_in_group * Lq + query``), so K/V tiles are read once per KV head.
- Sliding window: tiles that no query of the chunk can see are not visited (``first_visible_tile``).
- Lean Attention's split of the context over the GPU: the tiles of each (batch, KV head, M tile) are cut
  into equal contiguous shares so that the grid is about ``waves x #SMs``; partial ``(m, l, O)`` triples
  merge by the associative rescale in a second small kernel. This is the two-kernel split-K variant of
  stream-K (no cross-(batch, head) shares); with one share the first kernel writes the output directly.

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
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .pack import PackedKV, _dequant_tile, _unpack_tile
from .softmax import sas_exp2

__all__ = ["turbo_decode_attention", "plan_splits", "first_visible_tile"]


def _interpreter_index_compat() -> None:
    """TRITON_INTERPRET=1 with NumPy >= 2.3: Triton 3.6's interpreter converts a runtime scalar (a 1-element
    array) to a Python int with ``int(arr)``, which NumPy now refuses, so ``for t in range(lo, hi)`` with
    runtime bounds fails. Re-register ``tensor.__index__`` through ``.item()``. Interpreter only; idempotent."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.runtime.interpreter as interp
    except ImportError:  # pragma: no cover
        return
    if getattr(interp, "_turbo_index_compat", False) or not hasattr(interp, "_patch_lang_tensor"):
        return
    orig = interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = _patch_lang_tensor
    interp._turbo_index_compat = True


_interpreter_index_compat()

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------- Triton
@triton.jit
def _attend_tile(
    b_acc, b_m, b_l, b_q, b_sq, b_qb, b_k, b_v, o_key, m_key, o_pos, window, softcap, sas_thr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, USE_SAS: tl.constexpr,
):
    """One online-softmax step: q8 [BM, BD] · k8 [BS, BD]ᵀ -> scores, p8 [BM, BS] · v8 [BD, BS]ᵀ."""
    b_s = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.int32).to(tl.float32) * b_sq[:, None]
    if HAS_SOFTCAP:  # base-2 logits: softcap * tanh(s / softcap), tanh via exp2 (reference formula)
        b_s = b_s + b_qb[:, None]
        b_s = (1.0 - 2.0 / (tl.exp2(b_s * (2.0 / softcap)) + 1.0)) * (softcap * 1.4426950408889634)
    m_s = m_key[None, :]
    if IS_CAUSAL:
        m_s = m_s & (o_key[None, :] <= o_pos[:, None])
    if HAS_WINDOW:
        m_s = m_s & (o_key[None, :] > o_pos[:, None] - window)
    b_s = tl.where(m_s, b_s, float("-inf"))
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    b_alpha = tl.exp2(b_m - b_ms)
    if USE_SAS:
        b_p = sas_exp2(b_s - b_ms[:, None], sas_thr)
    else:
        b_p = tl.exp2(b_s - b_ms[:, None])
    b_p8 = (b_p * 127.0 + 0.5).to(tl.int8)
    b_l = b_l * b_alpha + tl.sum(b_p8.to(tl.int32), 1).to(tl.float32)
    b_pv = tl.dot(b_p8, tl.trans(b_v), out_dtype=tl.int32).to(tl.float32)
    b_acc = b_acc * b_alpha[:, None] + b_pv
    return b_acc, b_mn, b_l


@triton.jit(do_not_specialize=["n_blocks", "n_tail", "Lq", "kv_len", "T0", "TPS", "window"])
def _decode_kernel(
    q, sk, mk, heads, kp, ks, kz, vp, vs, vz, kt, vt, sv, kvalid, o, po, pml,
    n_blocks, n_tail, Lq, kv_len, T0, TPS, window, softcap, sas_thr, qscale,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_sb, stride_sh, stride_vb, stride_vh,
    H, HK,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
    BITS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_KVALID: tl.constexpr, USE_SAS: tl.constexpr, SPLIT: tl.constexpr,
):
    """grid = (n_splits, n_m_tiles, b * H); H = KV heads of this bit group, heads[H] their layer index.

    q [b, HQ, Lq, D] (any float dtype, strides given, D contiguous); sk/mk/sv [b, HK, D] fp32 (K scale,
    K mean, V scale); packed blocks as in pack.py; kt [b, HK, BS, D], vt [b, HK, D, BS] int8 tail;
    kvalid [b, kv_len] int8; o [b, Lq, HQ, D]; po [S, b*H, n_m*BM, BD] and pml [S, b*H, n_m*BM, 2] fp32
    partials (SPLIT only). Strides stay specialised (multiples of 16 -> 16-byte vector loads).
    """
    tl.static_assert(BITS == 2 or BITS == 4 or BITS == 8)
    i_s, i_m, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = tl.load(heads + i_h).to(tl.int64)
    i_b64 = i_b.to(tl.int64)
    HQ = HK * G
    M = G * Lq
    PB: tl.constexpr = 8 // BITS
    BDK: tl.constexpr = BD // PB  # packed bytes per K row (padded)
    DK: tl.constexpr = D // PB
    BSB: tl.constexpr = BS // PB  # packed bytes per V row

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

    # ---- query: fold K's per-channel scale in, per-row symmetric INT8 (round half away), as prepare_query_ref
    p_q = q + i_b64 * stride_qb + o_qh[:, None].to(tl.int64) * stride_qh + o_qi[:, None] * stride_ql + o_d[None, :]
    b_qf = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    b_sk = tl.load(sk + o_kvh + o_d, mask=m_d, other=0.0)
    b_qs = b_qf * b_sk[None, :]
    b_amax = tl.max(tl.abs(b_qs), 1)
    b_inv = tl.where(b_amax > 0, tl.math.div_rn(tl.full([BM], 127.0, tl.float32), tl.where(b_amax > 0, b_amax, 1.0)),
                     0.0)
    b_x = b_qs * b_inv[:, None]
    b_x = tl.where(b_x >= 0, b_x + 0.5, b_x - 0.5).to(tl.int32)
    b_q = tl.minimum(tl.maximum(b_x, -127), 127).to(tl.int8)
    b_sq = tl.math.div_rn(b_amax, tl.full([BM], 127.0, tl.float32)) * qscale
    if HAS_SOFTCAP and HAS_MEAN:  # smoothing correction qscale * q.mean_k, added before the cap
        b_mk = tl.load(mk + o_kvh + o_d, mask=m_d, other=0.0)
        b_qb = tl.sum(b_qf * b_mk[None, :], 1) * qscale
    else:
        b_qb = tl.zeros([BM], dtype=tl.float32)

    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)

    n_tiles = n_blocks
    if n_tail > 0:
        n_tiles += 1
    t_lo = T0 + i_s * TPS  # T0: first tile any query of the chunk can see (sliding window)
    t_hi = t_lo + TPS
    if t_hi > n_tiles:
        t_hi = n_tiles
    t_hp = t_hi  # end of this share's packed tiles
    if t_hp > n_blocks:
        t_hp = n_blocks
    p_kb = kp + i_b64 * stride_kb + i_h * stride_kh
    p_vb = vp + i_b64 * stride_vb + i_h * stride_vh
    o_sbase = i_b64 * stride_sb + i_h * stride_sh
    # ---- packed blocks
    for t in range(t_lo, t_hp):
        if BITS == 8:
            b_k = tl.load(p_kb + t * (BS * D) + o_n[:, None] * D + o_d[None, :],
                          mask=m_d[None, :], other=0)
            b_v = tl.load(p_vb + t * (D * BS) + o_d[:, None] * BS + o_n[None, :],
                          mask=m_d[:, None], other=0)
        else:
            o_dk = tl.arange(0, BDK)
            if D == BD:
                b_kp = tl.load(p_kb + t * (BS * DK) + o_n[:, None] * DK + o_dk[None, :])
            else:
                b_kp = tl.load(p_kb + t * (BS * DK) + o_n[:, None] * DK + o_dk[None, :],
                               mask=(o_dk < DK)[None, :], other=0)
            o_sb = tl.arange(0, BSB)
            b_vp = tl.load(p_vb + t * (D * BSB) + o_d[:, None] * BSB + o_sb[None, :],
                           mask=m_d[:, None], other=0)
            o_sc = o_sbase + t * D + o_d
            b_ks = tl.load(ks + o_sc, mask=m_d, other=0).to(tl.int32)
            b_kz = tl.load(kz + o_sc, mask=m_d, other=0).to(tl.int32)
            b_vs = tl.load(vs + o_sc, mask=m_d, other=0).to(tl.int32)
            b_vz = tl.load(vz + o_sc, mask=m_d, other=0).to(tl.int32)
            b_k = _dequant_tile(_unpack_tile(b_kp, BS, BD, BITS), b_ks, b_kz, 0)
            b_v = _dequant_tile(_unpack_tile(b_vp, BD, BS, BITS), b_vs, b_vz, 1)
        o_key = t * BS + o_n
        if HAS_KVALID:
            m_key = tl.load(kvalid + i_b64 * kv_len + o_key) != 0
        else:
            m_key = o_n < BS
        b_acc, b_m, b_l = _attend_tile(b_acc, b_m, b_l, b_q, b_sq, b_qb, b_k, b_v, o_key, m_key, o_pos,
                                       window, softcap, sas_thr, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_SAS)
    # ---- INT8 tail (the last tile). All BS slots are read (stale slots hold finite int8); keys at or past
    # n_tail are masked in the scores, so their p8 is 0.
    if t_hi > n_blocks:
        p_kt = kt + (o_kvh * BS + o_n[:, None] * D + o_d[None, :])
        b_k = tl.load(p_kt, mask=m_d[None, :], other=0)
        p_vt = vt + (o_kvh * BS + o_d[:, None] * BS + o_n[None, :])
        b_v = tl.load(p_vt, mask=m_d[:, None], other=0)
        o_key = n_blocks * BS + o_n
        m_key = o_n < n_tail
        if HAS_KVALID:
            m_key = m_key & (tl.load(kvalid + i_b64 * kv_len + o_key, mask=m_key, other=0) != 0)
        b_acc, b_m, b_l = _attend_tile(b_acc, b_m, b_l, b_q, b_sq, b_qb, b_k, b_v, o_key, m_key, o_pos,
                                       window, softcap, sas_thr, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_SAS)

    if SPLIT:
        n_mp = tl.num_programs(1) * BM
        o_p = (i_s.to(tl.int64) * tl.num_programs(2) + i_bh) * n_mp + i_m * BM + tl.arange(0, BM)
        tl.store(po + o_p[:, None] * BD + o_d[None, :], b_acc)
        tl.store(pml + o_p * 2, b_m)
        tl.store(pml + o_p * 2 + 1, b_l)
    else:
        b_sv = tl.load(sv + o_kvh + o_d, mask=m_d, other=0.0)
        b_o = tl.where(b_l[:, None] > 0, b_acc / tl.maximum(b_l, 1.0)[:, None], 0.0) * b_sv[None, :]
        p_o = o + ((i_b64 * Lq + o_qi) * HQ + o_qh)[:, None] * D + o_d[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["Lq", "S"])
def _merge_kernel(
    po, pml, heads, sv, o, Lq, S, H, HK,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
):
    """grid = (n_m_tiles, b * H): merge S partial (m, l, acc) by the associative rescale, write o."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = tl.load(heads + i_h).to(tl.int64)
    i_b64 = i_b.to(tl.int64)
    HQ = HK * G
    M = G * Lq
    o_r = i_m * BM + tl.arange(0, BM)
    m_r = o_r < M
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    n_mp = tl.num_programs(0) * BM
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    for s in range(0, S):
        o_p = (s * tl.num_programs(1) + i_bh) * n_mp + o_r
        b_ms = tl.load(pml + o_p * 2)
        b_ls = tl.load(pml + o_p * 2 + 1)
        b_as = tl.load(po + o_p[:, None] * BD + o_d[None, :])
        b_mn = tl.maximum(b_m, b_ms)
        b_mz = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_a0 = tl.exp2(b_m - b_mz)
        b_a1 = tl.exp2(b_ms - b_mz)
        b_l = b_l * b_a0 + b_ls * b_a1
        b_acc = b_acc * b_a0[:, None] + b_as * b_a1[:, None]
        b_m = b_mn
    b_sv = tl.load(sv + (i_b64 * HK + i_hk) * D + o_d, mask=m_d, other=0.0)
    b_o = tl.where(b_l[:, None] > 0, b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None], 0.0) * b_sv[None, :]
    o_qi = o_r % Lq
    o_qh = i_hk * G + o_r // Lq
    p_o = o + ((i_b64 * Lq + o_qi) * HQ + o_qh)[:, None] * D + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])


# ----------------------------------------------------------------------------------------- launcher
@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def first_visible_tile(kv_len: int, lq: int, window: Optional[int], block: int) -> int:
    """First tile (block) that a query of the chunk can see: with a sliding window ``w`` the first query
    (position ``kv_len - lq``) sees keys from ``kv_len - lq - w + 1`` on; earlier tiles are skipped."""
    if not window:
        return 0
    return max(0, (kv_len - lq - int(window) + 1) // block)


def plan_splits(n_tiles: int, work_units: int, device: torch.device, waves: float = 2.0,
                n_splits: Optional[int] = None) -> tuple[int, int]:
    """Shares of the context per (batch, head, M tile): ``(n_splits, tiles_per_split)``.

    About ``waves x #SMs`` programs in all (Lean Attention), never an empty share. On CPU (interpreter)
    4 "SMs" are assumed so tests exercise the split + merge path.
    """
    if n_tiles <= 0:
        return 1, 1
    if n_splits is None:
        if device.type == "cuda":
            sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        else:
            sms = 4
        n_splits = max(1, math.ceil(waves * sms / max(work_units, 1)))
    n_splits = max(1, min(int(n_splits), n_tiles))
    tps = math.ceil(n_tiles / n_splits)
    return math.ceil(n_tiles / tps), tps


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
    softmax: str = "exact",
    sas_threshold: float = 6.0,
    n_splits: Optional[int] = None,
    waves: float = 2.0,
    block_m: Optional[int] = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of a query chunk over a packed KV cache (all of ``groups``' blocks, then the tail).

    Args:
        q: ``[b, HQ, Lq, D]`` bf16/fp16/fp32 queries (RoPE applied); query ``i`` sits at position
            ``kv_len - Lq + i`` where ``kv_len = n_blocks * BS + n_tail`` (the new tokens are stored already).
        groups: one :class:`~.pack.PackedKV` per bit width; together their ``heads`` cover ``0..HK-1``
            once; all hold the same ``n_blocks``.
        k_tail: ``[b, HK, BS, D]`` int8; v_tail: ``[b, HK, D, BS]`` int8 (transposed); ``n_tail < BS`` valid.
        k_scale, v_scale: ``[b, HK, D]`` fp32 universal INT8 scales; k_mean: ``[b, HK, D]`` fp32 or None.
        scale: softmax scale (default ``D**-0.5``). causal: mask keys after each query's position.
        window: sliding window (key ``j`` visible from position ``i`` iff ``i - j < window``).
        softcap: logit softcapping ``softcap * tanh(s / softcap)``. key_valid: ``[b, kv_len]`` bool.
        softmax: ``"exact"`` or ``"sas"``; sas_threshold in natural-log units.
        n_splits / waves / block_m / num_warps / num_stages: launch overrides (tests, tuning).
    Returns:
        ``[b, Lq, HQ, D]`` in ``q.dtype``.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [b, HQ, Lq, D], got shape {tuple(q.shape)}")
    b, HQ, Lq, D = q.shape
    HK = k_tail.shape[1]
    BS = k_tail.shape[2]
    if HQ % HK:
        raise ValueError(f"{HQ} query heads are not a multiple of {HK} KV heads")
    if softmax not in ("exact", "sas"):
        raise ValueError(f"softmax={softmax!r} must be 'exact' or 'sas'")
    if not groups:
        raise ValueError("groups is empty: pass at least one PackedKV (possibly with 0 blocks)")
    n_blocks = groups[0].n_blocks
    if any(g_.n_blocks != n_blocks for g_ in groups):
        raise ValueError(f"bit groups hold different block counts {[g_.n_blocks for g_ in groups]}")
    if not 0 <= n_tail < BS:
        raise ValueError(f"n_tail={n_tail} must lie in [0, {BS})")
    kv_len = n_blocks * BS + n_tail
    if Lq > kv_len:
        raise ValueError(f"query chunk of {Lq} tokens exceeds the {kv_len} stored tokens (store first)")
    G = HQ // HK
    scale = D ** -0.5 if scale is None else float(scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    has_softcap = bool(softcap)
    o = torch.empty(b, Lq, HQ, D, dtype=q.dtype, device=q.device)
    kvalid = None
    if key_valid is not None:
        if tuple(key_valid.shape) != (b, kv_len):
            raise ValueError(f"key_valid must be [b, kv_len] = {(b, kv_len)}, got {tuple(key_valid.shape)}")
        kvalid = key_valid.to(torch.int8).contiguous()
    BD = triton.next_power_of_2(D)
    M = G * Lq
    BM = block_m or min(64, max(16, triton.next_power_of_2(M)))
    n_m = triton.cdiv(M, BM)
    n_tiles = n_blocks + (1 if n_tail > 0 else 0)
    t0 = first_visible_tile(kv_len, Lq, window, BS)
    k_tail, v_tail = k_tail.contiguous(), v_tail.contiguous()
    sk = k_scale.float().contiguous()
    sv = v_scale.float().contiguous()
    mk = k_mean.float().contiguous() if k_mean is not None else sk
    for grp in groups:
        H = len(grp.heads)
        if H == 0:
            continue
        S, tps = plan_splits(n_tiles - t0, b * H * n_m, q.device, waves, n_splits)
        split = S > 1
        if split:
            po = torch.empty(S, b * H, n_m * BM, BD, dtype=torch.float32, device=q.device)
            pml = torch.empty(S, b * H, n_m * BM, 2, dtype=torch.float32, device=q.device)
        else:
            po = pml = sv
        kp, vp = grp.k, grp.v
        packed = grp.bits != 8
        ks = grp.k_scale if packed else kp
        sst = (ks.stride(0), ks.stride(1)) if packed else (0, 0)
        _decode_kernel[(S, n_m, b * H)](
            q, sk, mk, grp.heads, kp, ks, grp.k_zero if packed else kp, vp,
            grp.v_scale if packed else kp, grp.v_zero if packed else kp,
            k_tail, v_tail, sv, kvalid if kvalid is not None else k_tail, o, po, pml,
            n_blocks, n_tail, Lq, kv_len, t0, tps, int(window or 0), float(softcap or 1.0),
            float(sas_threshold * LOG2E), float(scale * LOG2E),
            q.stride(0), q.stride(1), q.stride(2),
            kp.stride(0), kp.stride(1), sst[0], sst[1], vp.stride(0), vp.stride(1),
            H, HK,
            G=G, D=D, BD=BD, BS=BS, BM=BM, BITS=grp.bits, IS_CAUSAL=bool(causal),
            HAS_WINDOW=bool(window), HAS_SOFTCAP=has_softcap, HAS_MEAN=k_mean is not None,
            HAS_KVALID=kvalid is not None, USE_SAS=softmax == "sas", SPLIT=split,
            num_warps=num_warps, num_stages=num_stages,
        )
        if split:
            _merge_kernel[(n_m, b * H)](po, pml, grp.heads, sv, o, Lq, S, H, HK,
                                        G=G, D=D, BD=BD, BM=BM, num_warps=num_warps)
    return o
