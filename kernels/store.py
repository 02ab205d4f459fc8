"""Decode-step store: quantize new K/V tokens to INT8 and write them into the cache's INT8 buffer, one launch.

A decode step stores 1 (or a few) tokens per layer. Done with PyTorch ops (``pack.quantize_int8`` for K and
V, then two slice copies into the buffers) that is ~22 kernel launches per layer, and the step is bound by
their host cost (eval/PERF_NOTES.md, "Decode step on the host"). This kernel does the same arithmetic
(``pack._quantize_universal``, shared with ``quantize_int8``'s kernel; twin: ``reference.quantize_int8_universal_ref``)
and the two writes in one launch:

    k8 = clamp(round_half_away((k - mean) / s_k), ±127)  -> k_tail[b, h, slot + t, :]
    v8 = clamp(round_half_away(v / s_v), ±127)           -> v_tail[b, h, :, slot + t]   (V transposed)
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .decode import _pow2
from .launch import LeanLaunch
from .pack import _quantize_universal

__all__ = ["store_int8_tokens"]


@triton.jit(do_not_specialize=["slot", "T"])
def _store_tokens_kernel(
    k, v, sk, mk, sv, kt, vt, slot, T,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    H, C,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HAS_MEAN: tl.constexpr,
):
    """grid = (b * H,): tokens ``[0, T)`` of k/v ``[b, H, T, D]`` -> buffer slots ``slot + t``;
    sk/mk/sv ``[b, H, D]`` fp32; kt ``[b, H, C, D]``, vt ``[b, H, D, C]`` int8."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m = (o_t[:, None] < T) & (o_d[None, :] < D)
    o_s = i_bh.to(tl.int64) * D + o_d
    b_sk = tl.load(sk + o_s, mask=o_d < D, other=1.0)
    b_sv = tl.load(sv + o_s, mask=o_d < D, other=1.0)
    b_mk = b_sk
    if HAS_MEAN:
        b_mk = tl.load(mk + o_s, mask=o_d < D, other=0.0)
    b_k = tl.load(k + i_b.to(tl.int64) * stride_kb + i_h * stride_kh + o_t[:, None] * stride_kt + o_d[None, :],
                  mask=m, other=0.0)
    b_v = tl.load(v + i_b.to(tl.int64) * stride_vb + i_h * stride_vh + o_t[:, None] * stride_vt + o_d[None, :],
                  mask=m, other=0.0)
    # pack.quantize_int8's tile math (one helper: the same bits)
    b_k8 = _quantize_universal(b_k, b_sk, b_mk, HAS_MEAN=HAS_MEAN)
    b_v8 = _quantize_universal(b_v, b_sv, b_sv, HAS_MEAN=False)
    o_buf = i_bh.to(tl.int64) * C * D  # the same for [C, D] and [D, C]
    tl.store(kt + o_buf + (slot + o_t[:, None]) * D + o_d[None, :], b_k8, mask=m)
    tl.store(vt + o_buf + o_d[None, :] * C + (slot + o_t[:, None]), b_v8, mask=m)


_STORE = LeanLaunch(_store_tokens_kernel)  # one launch per layer and decode step: skip the binder


def store_int8_tokens(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, k_mean: Optional[torch.Tensor],
                      v_scale: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, slot: int) -> None:
    """Quantize ``k, v [b, H, T, D]`` (last dim contiguous) with the universal scales and write them to
    ``k_tail[:, :, slot:slot+T]`` / ``v_tail[:, :, :, slot:slot+T]`` (contiguous ``[b, H, C, D]`` /
    ``[b, H, D, C]`` int8, ``slot + T <= C``). Scales/mean: contiguous ``[b, H, D]`` fp32."""
    b, H, T, D = k.shape
    C = k_tail.shape[2]
    if slot + T > C:
        raise ValueError(f"{T} tokens at slot {slot} overflow the INT8 buffer of {C} slots")
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _STORE[(b * H,)](
        k, v, k_scale, k_mean if k_mean is not None else k_scale, v_scale, k_tail, v_tail, int(slot), T,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), H, C,
        D=D, BD=_pow2(D), BT=_pow2(T), HAS_MEAN=k_mean is not None,
        num_warps=4,
    )
