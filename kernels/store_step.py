"""One decode token into a static TurboCache layer, with the lengths on the device (CUDA-graph safe).

``store.py``'s launchers plan each store on the host from Python ints (where the token goes, whether a block is
packed, how many launches). Inside a CUDA graph nothing may change between replays, so here the plan lives in
``lens = [n_blocks, n_tail]`` (int32, on the device) and one launch of fixed arguments does the whole step:

* the token (quantized with the universal scales: ``pack._quantize_universal``, as ``store_int8_tokens``) goes to
  INT8 buffer slot ``n_tail``;
* if that fills the buffer (``n_tail + 1 == C``: ``recent_blocks + 1`` full blocks wait after the sinks), the
  oldest waiting block (slots ``s0 .. s0 + BS``) is packed into block ``n_blocks`` of its head's bit group
  (``store._pack_rows``, the first-prefill store's packer: the same codes) and the rest move down by BS slots —
  exactly what ``TurboLayer._store`` does for one token (``reference.int8_buffer_layout``);
* the program that arrives last (an arrival counter, as the decode kernel's fused merge) writes the new
  ``lens``: every program has read the old one before it arrives.

A step that would pack past the groups' capacity stores nothing and adds 1 to ``overflow`` (the cache raises
on the host at its next host-side call; nothing stored is corrupted).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .decode import _pow2
from .hadamard import _key_factor, _rotate_keys
from .launch import LeanLaunch
from .pack import _bad_rows, _quantize_universal, _universal_scales, keeps_int8_k
from .quant import check_qk_smooth, factor_arg
from .rotation import rotate_constexprs
from .store import TAIL_ROWS, _no_fma, _pack_rows

__all__ = ["store_step"]


@triton.jit
def _group_slot(r, H0, H1):
    """Slot ``r`` of the (group 0, 1, 2) slot order -> (group, index in the group)."""
    g = tl.where(r < H0, 0, tl.where(r < H0 + H1, 1, 2))
    return g, tl.where(g == 0, r, tl.where(g == 1, r - H0, r - H0 - H1))


@triton.jit(do_not_specialize=["CAP"])
def _store_step_kernel(
    k, v, sk, mk, sv, kt, vt, flag, lens, arrive, overflow, smf,
    h0, gk0, gv0, gks0, gkz0, gvsz0,
    h1, gk1, gv1, gks1, gkz1, gvsz1,
    h2, gk2, gv2, gks2, gkz2, gvsz2,
    CAP, stride_kb, stride_kh, stride_vb, stride_vh,
    H: tl.constexpr, C: tl.constexpr, S0: tl.constexpr,
    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BREC: tl.constexpr,
    H0: tl.constexpr, H1: tl.constexpr, BITS0: tl.constexpr, BITS1: tl.constexpr, BITS2: tl.constexpr,
    K8: tl.constexpr, HAS_MEAN: tl.constexpr, COUNT: tl.constexpr,
    ROTATE: tl.constexpr, ROT_N: tl.constexpr, HAS_FACTOR: tl.constexpr, ROT_C: tl.constexpr,
):
    """grid (b*H,): program (b, r) stores the token of the head in slot ``r`` of the group order (group g's
    slot s holds head ``h_g[s]``, a device map) and, when the buffer fills, packs that head's oldest waiting
    block into the group. k, v ``[b, H, 1, D]``; kt ``[b, H, C, D]``, vt ``[b, H, D, C]``; lens, arrive,
    overflow int32. ROTATE: the token's K is rotated first (``hadamard._rotate_keys``, smf the factors
    ``[b, H, D]``)."""
    i_bh = tl.program_id(0)
    i_b, r = i_bh // H, i_bh % H
    n_blocks = tl.load(lens)
    n_tail = tl.load(lens + 1)
    g, s = _group_slot(r, H0, H1)
    i_h = tl.load(tl.where(g == 0, h0, tl.where(g == 1, h1, h2)) + s)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    i_hb = i_b.to(tl.int64) * H + i_h
    b_sk, b_mk, b_sv = _universal_scales(sk, mk, sv, i_hb * D + o_d, m_d, HAS_MEAN)
    p_kt = kt + i_hb * C * D
    p_vt = vt + i_hb * C * D
    full = n_tail + 1 == C  # this token fills the buffer: pack its oldest waiting block
    fits = (n_blocks < CAP) | (full == 0)
    if fits:
        o_1 = tl.arange(0, 1)
        m_1 = (o_1 < 1)[:, None] & m_d[None, :]
        b_k = tl.load(k + i_b.to(tl.int64) * stride_kb + i_h.to(tl.int64) * stride_kh + o_d[None, :],
                      mask=m_1, other=0.0)
        b_v = tl.load(v + i_b.to(tl.int64) * stride_vb + i_h.to(tl.int64) * stride_vh + o_d[None, :],
                      mask=m_1, other=0.0)
        if COUNT:
            tl.atomic_add(flag, _bad_rows(b_k, b_v, m_1))
        if ROTATE:
            b_f = _key_factor(smf, i_hb * D + o_d, m_d, BD, HAS_FACTOR)
            b_k = _rotate_keys(b_k, b_f, ROTATE, ROT_N, ROT_C)
        b_k8 = _quantize_universal(b_k, b_sk, b_mk, HAS_MEAN=HAS_MEAN)
        b_v8 = _quantize_universal(b_v, b_sv, b_sv, HAS_MEAN=False)
        slot = (n_tail + o_1).to(tl.int64)
        tl.store(p_kt + slot[:, None] * D + o_d[None, :], b_k8, mask=m_1)
        tl.store(p_vt + o_d[None, :].to(tl.int64) * C + slot[:, None], b_v8, mask=m_1)
        if full:
            tl.debug_barrier()  # the token's slot is written before the packer reads the buffer
            o_r = tl.arange(0, BS)
            b_z = tl.zeros([BS, BD], dtype=tl.float32)
            # stream rows [0, BS) are all waiting slots s0.. (c = n = BS): _pack_rows reads them from the buffer
            if g == 0:
                i_gb = (i_b.to(tl.int64) * H0 + s) * CAP + n_blocks
                _pack_rows(b_z, b_z, p_kt, p_vt, b_sk, b_mk, b_sv, 0, o_r, BS, BS, S0, C, gk0, gv0, gks0, gkz0,
                           gvsz0, i_gb, o_d, m_d, D, BD, BS, BITS0, HAS_MEAN, K8)
            elif g == 1:
                i_gb = (i_b.to(tl.int64) * H1 + s) * CAP + n_blocks
                _pack_rows(b_z, b_z, p_kt, p_vt, b_sk, b_mk, b_sv, 0, o_r, BS, BS, S0, C, gk1, gv1, gks1, gkz1,
                           gvsz1, i_gb, o_d, m_d, D, BD, BS, BITS1, HAS_MEAN, K8)
            else:
                i_gb = (i_b.to(tl.int64) * (H - H0 - H1) + s) * CAP + n_blocks
                _pack_rows(b_z, b_z, p_kt, p_vt, b_sk, b_mk, b_sv, 0, o_r, BS, BS, S0, C, gk2, gv2, gks2, gkz2,
                           gvsz2, i_gb, o_d, m_d, D, BD, BS, BITS2, HAS_MEAN, K8)
            # the rest moves down by BS slots; each chunk reads before any of its writes, and a chunk's reads
            # lie above every earlier chunk's writes
            o_w = tl.arange(0, BREC)
            for i0 in range(S0 + BS, C, BREC):
                m_w = (i0 + o_w < C)[:, None] & m_d[None, :]
                src = (i0 + o_w).to(tl.int64)
                tl.debug_barrier()
                b_kw = tl.load(p_kt + src[:, None] * D + o_d[None, :], mask=m_w, other=0)
                b_vw = tl.load(p_vt + o_d[None, :].to(tl.int64) * C + src[:, None], mask=m_w, other=0)
                tl.debug_barrier()
                tl.store(p_kt + (src - BS)[:, None] * D + o_d[None, :], b_kw, mask=m_w)
                tl.store(p_vt + o_d[None, :].to(tl.int64) * C + (src - BS)[:, None], b_vw, mask=m_w)
    # the last program to arrive writes the new lengths (every program read them before arriving)
    tl.debug_barrier()
    n_done = tl.atomic_add(arrive, 1, sem="acq_rel", scope="gpu")
    if n_done == tl.num_programs(0) - 1:
        tl.atomic_xchg(arrive, 0, sem="relaxed", scope="gpu")
        if fits:
            if full:
                tl.store(lens, n_blocks + 1)
                tl.store(lens + 1, C - BS)
            else:
                tl.store(lens + 1, n_tail + 1)
        else:
            tl.atomic_add(overflow, 1)


_STORE_STEP = LeanLaunch(_store_step_kernel)


def store_step(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, k_mean: Optional[torch.Tensor],
               v_scale: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, groups: list, n_sink: int,
               lens: torch.Tensor, arrive: torch.Tensor, overflow: torch.Tensor,
               nonfinite: Optional[torch.Tensor] = None, rotate: bool = False,
               qk_smooth: Optional[torch.Tensor] = None) -> None:
    """Store one token ``k, v [b, H, 1, D]`` at ``lens = [n_blocks, n_tail]`` (device int32, updated in place);
    pack a block when the INT8 buffer fills. ``groups``: the layer's ``PackedKV`` list (at most three, contiguous,
    their capacity is the most blocks ever packed; their host ``n_blocks`` is not read or written). ``arrive``:
    an int32 counter, zero between calls; ``overflow`` gets +1 per step that found the groups full (nothing is
    stored then). ``nonfinite``: an int32 counter of stored vectors with an inf/NaN. ``rotate``: ``k`` is the
    caller's unrotated K, stored as ``reference.rotate_keys_ref(k, qk_smooth)`` (as ``store.store_int8_tokens``)."""
    b, H, T, D = k.shape
    check_qk_smooth(qk_smooth, rotate, k)
    if T != 1:
        raise ValueError(f"store_step stores one token per row, got {T}")
    C = k_tail.shape[2]
    bs = groups[0].block_size
    if len(groups) > 3 or sum(g.k.shape[1] for g in groups) != H:
        raise ValueError(f"{len(groups)} groups of {[g.k.shape[1] for g in groups]} heads for {H} KV heads")
    cap = groups[0].capacity
    slots = groups + [groups[0]] * (3 - len(groups))  # absent groups repeat group 0 (never used, must compile)
    args = []
    for g in slots:
        args += [g.heads, g.k, g.v] + [t if t is not None else g.k for t in (g.k_scale, g.k_zero, g.v_sz)]
    hs = [g.k.shape[1] for g in groups] + [0, 0]
    _STORE_STEP[(b * H,)](
        k, v, k_scale, k_mean if k_mean is not None else k_scale, v_scale, k_tail, v_tail,
        nonfinite if nonfinite is not None else arrive, lens, arrive, overflow, factor_arg(qk_smooth, k_scale), *args,
        cap, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=H, C=C, S0=n_sink, D=D, BD=_pow2(D), BS=bs, BREC=min(_pow2(max(C - n_sink - bs, 2)), TAIL_ROWS),
        H0=hs[0], H1=hs[1], BITS0=slots[0].bits, BITS1=slots[1].bits, BITS2=slots[2].bits,
        K8=keeps_int8_k(groups), HAS_MEAN=k_mean is not None, COUNT=nonfinite is not None,
        **rotate_constexprs(k.shape[-1], rotate, qk_smooth is not None), num_warps=4,
        **_no_fma(rotate),
    )
