"""Fused INT8 quantization kernels vs the reference: bit-exact codes and scales.

Bit-exact by construction: both compute ``x * div_rn(127, amax)`` and round half away from zero in fp32,
with FMA contraction off in the kernels; both subtract the same fp32 K mean (``k_smooth_mean``).
Kernel outputs are allocated poisoned (NaN for floats, -128 for int8, a code no kernel writes), so an
unwritten element fails the comparison.
"""
import pytest
import torch

from turbo_attn_hf.kernels import quant
from turbo_attn_hf.kernels import reference as R


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled floats and -128-filled int8 while the test runs (FLA-style)."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype == torch.int8:
            t.fill_(-128)
        return t

    monkeypatch.setattr(torch, "empty", empty)


def _rand(shape, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    x[..., 3] *= 20  # a channel outlier
    return x.to(dtype=dtype, device=device)


TOKEN_CASES = [
    ((2, 3, 37, 80), torch.bfloat16),
    ((1, 2, 65, 64), torch.float16),
    ((1, 1, 33, 96), torch.bfloat16),
    ((2, 2, 63, 128), torch.float32),
    ((1, 1, 17, 256), torch.bfloat16),
    ((3, 40, 64), torch.float16),  # [H, L, d]
    ((5, 64), torch.bfloat16),  # [L, d]
]


@pytest.mark.parametrize("shape,dtype", TOKEN_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}" for s, d in TOKEN_CASES])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smooth"])
def test_per_token_bit_exact(shape, dtype, smooth, device, poisoned_empty):
    x = _rand(shape, dtype, device)
    x[..., 1, :] = 0  # an all-zero row: codes 0, scale 0
    mean = R.k_smooth_mean(x) if smooth and x.dim() >= 3 else None
    x8, s = quant.quantize_per_token(x, scale=0.0883883 * R.LOG2E, smooth=mean)
    r8, rs = R.quantize_per_token(x.cpu(), scale=0.0883883 * R.LOG2E, smooth=None if mean is None else mean.cpu())
    assert x8.shape == x.shape and x8.dtype == torch.int8 and s.shape == x.shape[:-1] and s.dtype == torch.float32
    assert torch.equal(x8.cpu(), r8), f"{int((x8.cpu() != r8).sum())} codes differ"
    assert torch.equal(s.cpu(), rs)
    if mean is None:
        assert torch.all(x8[..., 1, :] == 0) and torch.all(s[..., 1] == 0)


def test_per_token_strided_input(device, poisoned_empty):
    """HF passes [b, L, H, d] storage viewed as [b, H, L, d]: read through the strides, write contiguous."""
    base = _rand((2, 45, 4, 80), torch.bfloat16, device)
    x = base.transpose(1, 2)
    assert not x.is_contiguous()
    mean = R.k_smooth_mean(x)
    x8, s = quant.quantize_per_token(x, smooth=mean)
    r8, rs = R.quantize_per_token(x.contiguous().cpu(), smooth=mean.cpu())
    assert x8.is_contiguous() and torch.equal(x8.cpu(), r8) and torch.equal(s.cpu(), rs)


def test_per_token_error_bound(device):
    """|dequant - x| <= step / 2 (+ fp32 rounding), step = amax / 127, codes within +-127."""
    x = _rand((2, 2, 50, 128), torch.float32, device)
    x8, s = quant.quantize_per_token(x)
    assert int(x8.abs().max()) == 127 and int(x8.min()) >= -127
    err = (x8.float() * s[..., None] - x).abs()
    assert torch.all(err <= s[..., None] * (0.5 + 1e-5))


V_CASES = [((2, 3, 37, 80), 16, torch.bfloat16), ((1, 2, 64, 64), 64, torch.float16),
           ((1, 1, 100, 96), 32, torch.bfloat16), ((1, 2, 130, 128), 64, torch.bfloat16),
           ((1, 1, 20, 256), 16, torch.float32), ((1, 1, 5, 64), 64, torch.float16)]


@pytest.mark.parametrize("shape,block,dtype", V_CASES, ids=[f"{'x'.join(map(str, s))}-B{b}" for s, b, _ in V_CASES])
def test_v_blocks_bit_exact(shape, block, dtype, device, poisoned_empty):
    v = _rand(shape, dtype, device, seed=1)
    v[..., 0] = 0  # an all-zero channel: codes 0, scale 0
    v8t, sv = quant.quantize_v_blocks(v, block)
    r8t, rsv = R.quantize_v_blocks(v.cpu(), block)
    b, h, L, d = shape
    lpad = -(-L // block) * block
    assert v8t.shape == (b, h, d, lpad) and sv.shape == (b, h, lpad // block, d)
    assert torch.equal(v8t.cpu(), r8t), f"{int((v8t.cpu() != r8t).sum())} codes differ"
    assert torch.equal(sv.cpu(), rsv)
    assert torch.all(v8t[..., L:] == 0), "padded tokens must be 0"
    assert torch.all(sv[..., 0] == 0)


@pytest.mark.parametrize("shape,block,dtype", V_CASES, ids=[f"{'x'.join(map(str, s))}-B{b}" for s, b, _ in V_CASES])
def test_v_channels_bit_exact(shape, block, dtype, device, poisoned_empty):
    """One scale per (b, head, channel) over the whole sequence; tokens padded to ``block`` with 0."""
    v = _rand(shape, dtype, device, seed=2).transpose(1, 2).contiguous().transpose(1, 2)  # HF strides
    v[..., 0] = 0  # an all-zero channel: codes 0, scale 0
    v8t, sv = quant.quantize_v_channels(v, block)
    r8t, rsv = R.quantize_v_channels(v.cpu(), block)
    b, h, L, d = shape
    lpad = -(-L // block) * block
    assert v8t.shape == (b, h, d, lpad) and sv.shape == (b, h, 1, d)
    assert torch.equal(v8t.cpu(), r8t), f"{int((v8t.cpu() != r8t).sum())} codes differ"
    assert torch.equal(sv.cpu(), rsv)
    assert torch.all(v8t[..., L:] == 0)


def test_v_blocks_strided_and_error_bound(device, poisoned_empty):
    base = _rand((1, 70, 2, 64), torch.bfloat16, device, seed=2)
    v = base.transpose(1, 2)
    v8t, sv = quant.quantize_v_blocks(v, 32)
    r8t, rsv = R.quantize_v_blocks(v.contiguous().cpu(), 32)
    assert torch.equal(v8t.cpu(), r8t) and torch.equal(sv.cpu(), rsv)
    # dequantized V (tokens back on the row axis) within half a step of the input
    deq = (v8t.float().view(1, 2, 64, 3, 32) * sv.permute(0, 1, 3, 2)[..., None]).reshape(1, 2, 64, 96)
    err = (deq.transpose(-1, -2)[:, :, :70] - v.float()).abs()
    step = sv.repeat_interleave(32, dim=2)[:, :, :70]
    assert torch.all(err <= step * (0.5 + 1e-5))


def test_quant_input_errors(device):
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        quant.quantize_per_token(torch.ones(4, 64, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="power of two"):
        quant.quantize_v_blocks(torch.ones(1, 1, 8, 64, device=device), 48)
    with pytest.raises(ValueError, match=r"\[b, H, L, d\]"):
        quant.quantize_v_blocks(torch.ones(8, 64, device=device), 16)
