"""Rotary position embedding of a layer's queries and keys in one launch (the rotate-half form of Llama and most HF
families), bit for bit the PyTorch ops it replaces (``reference.rope_rotate_half``).

Why: a model's eager decode step is host-bound, and HF's ``apply_rotary_pos_emb`` is eight PyTorch kernels a layer
(``q * cos``, the negation and ``cat`` of ``rotate_half``, ``* sin``, the add, for Q and again for K). This kernel
does both tensors in one launch through :func:`launch.lean` (``eval/PERF_NOTES.md``, session 44).

The same roundings as the eager ops in the tensors' dtype (bf16 or fp16): ``a = rnd(x * cos)``, ``b = rnd(rh * sin)``
with ``rh = cat(-x2, x1)``, ``out = rnd(a + b)``; each product of two 16-bit floats is exact in fp32, so fp32
arithmetic and one rounding per op is what PyTorch's CUDA kernels compute. Compiled with ``enable_fp_fusion=False``:
else LLVM turns ``rnd(x * cos)`` and the add into one bf16 FMA for sm_90 (``fma.rn.bf16``), a rounding fewer than
PyTorch's, which moved outputs by an ulp on the H200 (session 44).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import use_triton
from .launch import lean

__all__ = ["rope_rotate_half", "supports"]

_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _rotate(X, O, c, s, pos_x, pos_o, o_d, m, HALF: tl.constexpr):
    """One token's heads of X (row offsets ``pos_x``) rotated into O (``pos_o``); ``m`` masks the padding."""
    x = tl.load(X + pos_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    partner = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
    xp = tl.load(X + pos_x + partner[None, :], mask=m, other=0.0).to(tl.float32)
    rh = tl.where((o_d < HALF)[None, :], -xp, xp)
    a = (x * c[None, :]).to(O.dtype.element_ty).to(tl.float32)
    b = (rh * s[None, :]).to(O.dtype.element_ty).to(tl.float32)
    tl.store(O + pos_o + o_d[None, :], (a + b).to(O.dtype.element_ty), mask=m)


@triton.jit
def _rope_qk_kernel(Q, K, COS, SIN, QO, KO, L, HQ, HK,
                    s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_cb, s_cl, s_qob, s_qoh, s_qol, s_kob, s_koh, s_kol,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    """grid (b * L,): one token's cos / sin loaded once, then all its query heads and key heads."""
    pid = tl.program_id(0)
    i_b = pid // L
    i_l = pid % L
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    c = tl.load(COS + i_b * s_cb + i_l * s_cl + o_d, mask=m_d, other=0.0).to(tl.float32)
    s = tl.load(SIN + i_b * s_cb + i_l * s_cl + o_d, mask=m_d, other=0.0).to(tl.float32)
    o_hq = tl.arange(0, BLOCK_HQ)
    _rotate(Q, QO, c, s, i_b * s_qb + i_l * s_ql + o_hq[:, None] * s_qh, i_b * s_qob + i_l * s_qol
            + o_hq[:, None] * s_qoh, o_d, (o_hq < HQ)[:, None] & m_d[None, :], D // 2)
    o_hk = tl.arange(0, BLOCK_HK)
    _rotate(K, KO, c, s, i_b * s_kb + i_l * s_kl + o_hk[:, None] * s_kh, i_b * s_kob + i_l * s_kol
            + o_hk[:, None] * s_koh, o_d, (o_hk < HK)[:, None] & m_d[None, :], D // 2)


def supports(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rope_rotate_half` computes this call: q ``[b, Hq, L, d]``, k ``[b, Hk, L, d]``, cos and sin
    ``[b or 1, L, d]`` (the whole head rotated: no partial rotary), one 16-bit dtype, channels contiguous, on a
    device that runs the Triton kernels."""
    if not (q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3 and cos.shape == sin.shape
            and cos.stride() == sin.stride()):
        return False
    b, _, L, d = q.shape
    return (q.dtype in _DTYPES and k.dtype == cos.dtype == sin.dtype == q.dtype and d % 2 == 0
            and k.shape[0] == b and k.shape[2] == L and k.shape[3] == d and cos.shape[1:] == (L, d)
            and cos.shape[0] in (1, b) and q.stride(3) == k.stride(3) == cos.stride(2) == 1
            and q.device == k.device == cos.device == sin.device and use_triton(q.device))


def rope_rotate_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` with cos / sin broadcast over the heads,
    in one launch; outputs laid out as the inputs (``empty_like``). The caller checks :func:`supports`."""
    b, hq, L, d = q.shape
    hk = k.shape[1]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    s_cb = cos.stride(0) if cos.shape[0] > 1 else 0
    lean(_rope_qk_kernel)[(b * L,)](
        q, k, cos, sin, qo, ko, L, hq, hk, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), s_cb, cos.stride(1), qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1),
        ko.stride(2), D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HK=triton.next_power_of_2(hk), num_warps=4 if hq * d <= 4096 else 8, enable_fp_fusion=False)
    return qo, ko
