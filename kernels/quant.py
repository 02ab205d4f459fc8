"""Fused INT8 quantization of the prefill attention operands (bf16/fp16 -> int8 + fp32 scales).

INT-FlashAttention (Chen et al., 2024, §3): per-token symmetric INT8 for Q and K; V with a scale that
factors out of P.V (here per block of BLOCK_N tokens and per channel). SageAttention (Zhang et al., 2024,
§3.2): K is first centred by its per-channel mean over the tokens (softmax-invariant, removes the channel
outliers of K). FlashAttention-3 (Shah et al., 2024, §3.3): 8-bit wgmma wants both operands K-major, so
V is written transposed, ``[d, tokens]``, tokens contiguous.

Each kernel reads its bf16/fp16 input once (any strides: HF hands over transposed views) and writes the
int8 codes and fp32 scales once. The K mean is the torch reduction ``reference.k_smooth_mean`` (one
read of K, shared with the reference so that both quantize against the same mean, bit for bit).

Rounding: ``trunc(x * (127 / amax) + copysign(0.5, .))`` (half away from zero), ``127 / amax`` and
``amax / 127`` correctly rounded (``div_rn``), FMA contraction off: bit-exact with ``reference.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .interpreter import interpreting
from .reference import DEFAULT_BLOCK_N, k_smooth_mean  # noqa: F401  (k_smooth_mean re-exported)

__all__ = ["quantize_per_token", "quantize_v_blocks", "quantize_v_channels", "k_smooth_mean", "interpreting"]




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


@triton.jit(do_not_specialize=["L", "stride_xb", "stride_xh", "stride_xl", "stride_sb", "stride_sh"])
def _quant_tokens_kernel(
    X, MEAN, X8, S, scale, L, H,
    stride_xb, stride_xh, stride_xl, stride_xd,
    stride_mb, stride_mh,
    stride_ob, stride_oh,
    stride_sb, stride_sh,
    HAS_SMOOTH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
):
    """grid (cdiv(L, BT) * b * H,). X [b, H, L, D] any strides -> X8 [b, H, L, D] contiguous, S [b, H, L]."""
    n_t = tl.cdiv(L, BT)
    i_t, i_bh = tl.program_id(0) % n_t, tl.program_id(0) // n_t  # 1-D grid: b * H may pass 65535
    i_b, i_h = i_bh // H, i_bh % H
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t, m_d = o_t < L, o_d < D
    m_x = m_t[:, None] & m_d[None, :]
    p_x = (X + i_b.to(tl.int64) * stride_xb + i_h.to(tl.int64) * stride_xh
           + o_t[:, None].to(tl.int64) * stride_xl + o_d[None, :] * stride_xd)
    b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
    if HAS_SMOOTH:
        b_mean = tl.load(MEAN + i_b * stride_mb + i_h * stride_mh + o_d, mask=m_d, other=0.0)
        b_x = tl.where(m_x, b_x - b_mean[None, :], 0.0)
    b_amax = tl.max(tl.abs(b_x), 1)
    b_safe = tl.where(b_amax > 0, b_amax, 1.0)
    b_inv = tl.where(b_amax > 0, tl.math.div_rn(tl.full([BT], 127.0, tl.float32), b_safe), 0.0)
    b_x8 = _to_int8_half_away(b_x, b_inv[:, None])
    p_o = (X8 + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
           + o_t[:, None].to(tl.int64) * D + o_d[None, :])
    tl.store(p_o, b_x8, mask=m_x)
    b_s = tl.math.div_rn(b_amax, tl.full([BT], 127.0, tl.float32)) * scale
    tl.store(S + i_b.to(tl.int64) * stride_sb + i_h.to(tl.int64) * stride_sh + o_t, b_s, mask=m_t)


@triton.jit(do_not_specialize=["L", "stride_xb", "stride_xh", "stride_xl"])
def _quant_v_kernel(
    X, AMAX, V8T, SV, L, H,
    stride_xb, stride_xh, stride_xl, stride_xd,
    stride_vb, stride_vh, stride_vd,
    stride_sb, stride_sh,
    HAS_AMAX: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
):
    """grid (Lpad // BN * b * H,). X [b, H, L, D] -> V8T [b, H, D, Lpad] (tokens contiguous; tokens >= L
    are 0), SV [b, H, Lpad // BN, D] = amax over the block's tokens / 127 per channel; with HAS_AMAX the
    per-channel AMAX [b, H, D] (contiguous) over the whole sequence is used instead and the first block
    writes SV [b, H, 1, D]."""
    n_blk = tl.maximum(tl.cdiv(L, BN), 1)
    i_n, i_bh = tl.program_id(0) % n_blk, tl.program_id(0) // n_blk
    i_b, i_h = i_bh // H, i_bh % H
    o_t = i_n * BN + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_x = (o_t < L)[:, None] & m_d[None, :]
    p_x = (X + i_b.to(tl.int64) * stride_xb + i_h.to(tl.int64) * stride_xh
           + o_t[:, None].to(tl.int64) * stride_xl + o_d[None, :] * stride_xd)
    b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
    if HAS_AMAX:
        b_amax = tl.load(AMAX + i_bh.to(tl.int64) * D + o_d, mask=m_d, other=0.0)
    else:
        b_amax = tl.max(tl.abs(b_x), 0)  # [BD]
    b_safe = tl.where(b_amax > 0, b_amax, 1.0)
    b_inv = tl.where(b_amax > 0, tl.math.div_rn(tl.full([BD], 127.0, tl.float32), b_safe), 0.0)
    b_v8t = tl.trans(_to_int8_half_away(b_x, b_inv[None, :]))  # [BD, BN]
    p_v = (V8T + i_b.to(tl.int64) * stride_vb + i_h.to(tl.int64) * stride_vh
           + o_d[:, None].to(tl.int64) * stride_vd + o_t[None, :])
    tl.store(p_v, b_v8t, mask=m_d[:, None])
    b_sv = tl.math.div_rn(b_amax, tl.full([BD], 127.0, tl.float32))
    if HAS_AMAX:
        tl.store(SV + i_b.to(tl.int64) * stride_sb + i_h.to(tl.int64) * stride_sh + o_d, b_sv,
                 mask=m_d & (i_n == 0))
    else:
        tl.store(SV + i_b.to(tl.int64) * stride_sb + i_h.to(tl.int64) * stride_sh + i_n * D + o_d, b_sv,
                 mask=m_d)


# ---------------------------------------------------------------------------------------- launchers
def _as_4d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"expected a tensor [..., L, d]; got shape {tuple(x.shape)}")
    while x.dim() < 4:
        x = x.unsqueeze(0)
    if x.dim() > 4:
        x = x.reshape(-1, *x.shape[-3:])
    return x


def _tile_rows(d: int) -> int:
    if interpreting():
        return 32
    return 64 if d <= 128 else 32


def quantize_per_token(x: torch.Tensor, *, scale: float = 1.0, smooth: Optional[torch.Tensor] = None):
    """Per-token symmetric INT8 (one fused Triton pass).

    x: ``[..., L, d]`` fp16/bf16/fp32, any strides. smooth: optional fp32 ``[..., d]`` subtracted first
    (K's channel mean, ``k_smooth_mean``). Returns ``x8 int8 [..., L, d]`` (contiguous) and
    ``s fp32 [..., L]`` with ``s = amax / 127 * scale`` (0 for an all-zero row, whose codes are 0).
    """
    _check_device(x, "x")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_per_token takes fp16/bf16/fp32, got {x.dtype}")
    lead, (L, d) = x.shape[:-2], x.shape[-2:]
    x4 = _as_4d(x)
    b, h = x4.shape[0], x4.shape[1]
    x8 = torch.empty(b, h, L, d, dtype=torch.int8, device=x.device)
    s = torch.empty(b, h, L, dtype=torch.float32, device=x.device)
    if smooth is not None:
        m = smooth.to(device=x.device, dtype=torch.float32).reshape(b, h, d)
        if m.stride(-1) != 1:
            m = m.contiguous()
        smb, smh = m.stride(0), m.stride(1)
    else:
        m, smb, smh = s, 0, 0  # unused pointer
    if L > 0 and b * h > 0:
        bt = _tile_rows(d)
        grid = (triton.cdiv(L, bt) * b * h,)
        _quant_tokens_kernel[grid](
            x4, m, x8, s, float(scale), L, h,
            x4.stride(0), x4.stride(1), x4.stride(2), x4.stride(3),
            smb, smh, x8.stride(0), x8.stride(1), s.stride(0), s.stride(1),
            HAS_SMOOTH=smooth is not None, D=d, BD=triton.next_power_of_2(d), BT=bt,
            num_warps=4, enable_fp_fusion=False,
        )
    return x8.reshape(*lead, L, d), s.reshape(*lead, L)


def quantize_v_blocks(v: torch.Tensor, block: int = DEFAULT_BLOCK_N):
    """Per-block (``block`` tokens), per-channel symmetric INT8 of V, written transposed (one Triton pass).

    v: ``[b, H, L, d]`` fp16/bf16/fp32, any strides. Returns ``v8t int8 [b, H, d, Lpad]`` (tokens
    contiguous, Lpad = L rounded up to ``block``, padded tokens 0) and ``sv fp32 [b, H, Lpad // block, d]``.
    """
    _check_device(v, "v")
    if v.dim() != 4:
        raise ValueError(f"v must be [b, H, L, d]; got shape {tuple(v.shape)}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 16")
    b, h, L, d = v.shape
    nblk = max(1, triton.cdiv(L, block))
    lpad = nblk * block
    v8t = torch.empty(b, h, d, lpad, dtype=torch.int8, device=v.device)
    sv = torch.empty(b, h, nblk, d, dtype=torch.float32, device=v.device)
    if b * h > 0:
        _quant_v_kernel[(nblk * b * h,)](
            v, sv, v8t, sv, L, h,
            v.stride(0), v.stride(1), v.stride(2), v.stride(3),
            v8t.stride(0), v8t.stride(1), v8t.stride(2), sv.stride(0), sv.stride(1),
            HAS_AMAX=False, D=d, BD=triton.next_power_of_2(d), BN=block, num_warps=4, enable_fp_fusion=False,
        )
    return v8t, sv


def quantize_v_channels(v: torch.Tensor, block: int = DEFAULT_BLOCK_N):
    """Per-channel symmetric INT8 of V over the whole sequence (INT-FlashAttention's V scale), transposed.

    v: ``[b, H, L, d]`` fp16/bf16/fp32, any strides. Returns ``v8t int8 [b, H, d, Lpad]`` (Lpad = L rounded
    up to ``block``, the kernel's KV tile; padded tokens 0) and ``sv fp32 [b, H, 1, d]`` = amax / 127.
    Two reads of V: the channel amax (a torch reduction), then the Triton pass of ``quantize_v_blocks``.
    """
    _check_device(v, "v")
    if v.dim() != 4:
        raise ValueError(f"v must be [b, H, L, d]; got shape {tuple(v.shape)}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 16")
    b, h, L, d = v.shape
    nblk = max(1, triton.cdiv(L, block))
    v8t = torch.empty(b, h, d, nblk * block, dtype=torch.int8, device=v.device)
    sv = torch.empty(b, h, 1, d, dtype=torch.float32, device=v.device)
    if b * h > 0:
        amax = (v.abs().amax(dim=2).float() if L > 0 else
                torch.zeros(b, h, d, dtype=torch.float32, device=v.device)).contiguous()
        _quant_v_kernel[(nblk * b * h,)](
            v, amax, v8t, sv, L, h,
            v.stride(0), v.stride(1), v.stride(2), v.stride(3),
            v8t.stride(0), v8t.stride(1), v8t.stride(2), sv.stride(0), sv.stride(1),
            HAS_AMAX=True, D=d, BD=triton.next_power_of_2(d), BN=block, num_warps=4, enable_fp_fusion=False,
        )
    return v8t, sv
