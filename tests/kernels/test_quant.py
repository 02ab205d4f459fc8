"""Fused INT8 quantization kernels vs the reference: bit-exact codes and scales.

Bit-exact by construction: both compute ``x * div_rn(127, amax)`` and round half away from zero in fp32,
with FMA contraction off in the kernels; both subtract the same fp32 K mean (``k_smooth_mean``).
Kernel outputs are allocated poisoned (NaN for floats, -128 for int8, a code no kernel writes), so an
unwritten element fails the comparison. Inputs come in HF's layout (transposed views), contiguous, or with a
token stride that is no multiple of 16 bytes (no 16-byte loads); the real-size GPU test compares the compiled
kernels with the reference on the CPU, and the sm_90 compile check runs this file as a script in a subprocess
without TRITON_INTERPRET.
"""
import json
import os
import subprocess
import sys

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


def _layout(x, layout):
    """[..., H, L, d] contiguous -> "hf": [..., L, H, d] storage viewed as [..., H, L, d]; "odd": rows of a wider
    tensor (token stride not a multiple of 16 bytes: the kernels must not assume 16-byte loads); else ``x``."""
    if layout == "hf":
        return x.transpose(-3, -2).contiguous().transpose(-3, -2)
    if layout == "odd":
        wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 1, dtype=x.dtype, device=x.device)
        wide[..., :-1] = x
        return wide[..., :-1]
    return x


# shape, dtype, layout: tails of the row tile, L a multiple of it, d 80/96 (masked to 128), d 256
TOKEN_CASES = [
    ((2, 3, 37, 80), torch.bfloat16, "hf"),
    ((1, 2, 65, 64), torch.float16, "contig"),
    ((1, 1, 33, 96), torch.bfloat16, "odd"),
    ((1, 1, 128, 96), torch.bfloat16, "hf"),
    ((2, 2, 63, 128), torch.float32, "hf"),
    ((1, 2, 130, 128), torch.float16, "contig"),
    ((1, 1, 40, 64), torch.bfloat16, "odd"),
    ((1, 1, 17, 256), torch.bfloat16, "odd"),
    ((1, 1, 20, 256), torch.bfloat16, "hf"),
    ((3, 40, 64), torch.float16, "contig"),  # [H, L, d]
    ((5, 64), torch.bfloat16, "contig"),  # [L, d]
]


@pytest.mark.parametrize("shape,dtype,layout", TOKEN_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}-{lay}" for s, d, lay in TOKEN_CASES])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smooth"])
def test_per_token_bit_exact(shape, dtype, layout, smooth, device, poisoned_empty):
    x = _layout(_rand(shape, dtype, device), layout)
    x[..., 1, :] = 0  # an all-zero row: codes 0, scale 0
    mean = R.k_smooth_mean(x) if smooth and x.dim() >= 3 else None
    x8, s = quant.quantize_per_token(x, scale=0.0883883 * R.LOG2E, smooth=mean)
    r8, rs = R.quantize_per_token(x.cpu(), scale=0.0883883 * R.LOG2E, smooth=None if mean is None else mean.cpu())
    assert x8.shape == x.shape and x8.dtype == torch.int8 and s.shape == x.shape[:-1] and s.dtype == torch.float32
    assert x8.is_contiguous() and s.is_contiguous()
    assert torch.equal(x8.cpu(), r8), f"{int((x8.cpu() != r8).sum())} codes differ"
    assert torch.equal(s.cpu(), rs)
    if mean is None:
        assert torch.all(x8[..., 1, :] == 0) and torch.all(s[..., 1] == 0)


# (b, HQ, LQ, HK, LK, d), dtype, layout: the prefill's Q and K in one launch (the attention's shapes: LQ <= LK)
QK_CASES = [((2, 4, 37, 2, 37, 80), torch.bfloat16, "hf"), ((1, 4, 20, 1, 65, 64), torch.float16, "contig"),
            ((1, 2, 33, 2, 33, 96), torch.bfloat16, "odd"), ((1, 2, 1, 1, 130, 128), torch.bfloat16, "hf"),
            ((1, 1, 17, 1, 20, 256), torch.bfloat16, "hf")]


def _qk_case(shape, dtype, layout, device, smooth):
    """Q and K of a QK_CASES entry, a NaN in one key and an all-zero query row; K's smoothing mean or None."""
    b, hq, lq, hk, lk, d = shape
    q = _layout(_rand((b, hq, lq, d), dtype, device, seed=3), layout)
    k = _layout(_rand((b, hk, lk, d), dtype, device, seed=4), layout)
    k[..., min(2, lk - 1), 5] = float("nan")
    q[..., 0, :] = 0
    return q, k, (R.k_smooth_mean(k) if smooth else None)


@pytest.mark.parametrize("shape,dtype,layout", QK_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}-{lay}" for s, d, lay in QK_CASES])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smooth"])
def test_qk_one_launch_equals_two_passes(shape, dtype, layout, smooth, device, poisoned_empty):
    """``quantize_qk`` (``_quant_qk_kernel``, what turbo_attention launches) == ``quantize_per_token`` of Q and
    of K, bit for bit, poisoned tokens included."""
    q, k, mean = _qk_case(shape, dtype, layout, device, smooth)
    got = quant.quantize_qk(q, k, q_scale=0.0883883 * R.LOG2E, smooth=mean)
    want = (*quant.quantize_per_token(q, scale=0.0883883 * R.LOG2E), *quant.quantize_per_token(k, smooth=mean))
    for name, g, w in zip(("q8", "sq", "k8", "sk"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous(), name
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(), w.nan_to_num()), name


@pytest.mark.parametrize("shape,dtype,layout", QK_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}-{lay}" for s, d, lay in QK_CASES])
@pytest.mark.parametrize("programs", [1, 3, 256])
def test_k_mean_from_split_sums_is_the_torch_mean(shape, dtype, layout, programs, device, monkeypatch,
                                                  poisoned_empty):
    """K's channel mean from ``_k_sum_kernel``'s fp64 sums of token splits (1 split, uneven splits, one a tile) ==
    ``reference.k_smooth_mean`` bit for bit, NaN channel included: as ``quant.k_mean`` and finished by the Q+K pass
    (``smooth="k"``, what turbo_attention runs without a given mean)."""
    q, k, mean = _qk_case(shape, dtype, layout, device, True)
    spec = quant._k_sum_spec
    monkeypatch.setattr(quant, "_k_sum_spec", lambda k4, n=None: spec(k4, programs))
    got = quant.k_mean(k)
    assert got.dtype == torch.float32 and torch.equal(got.isnan(), mean.isnan())
    assert torch.equal(got.nan_to_num(), mean.nan_to_num())
    got = quant.quantize_qk(q, k, q_scale=0.0883883 * R.LOG2E, smooth="k")
    want = quant.quantize_qk(q, k, q_scale=0.0883883 * R.LOG2E, smooth=mean)
    for name, g, w in zip(("q8", "sq", "k8", "sk"), got, want):
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(), w.nan_to_num()), name


def test_k_sum_splits_cover_every_token():
    """``_k_sum_spec``'s splits: whole tiles, none empty, together every token, about the programs asked for."""
    for b, h, L, d in [(1, 8, 32768, 128), (4, 16, 4096, 128), (1, 1, 1, 64), (2, 3, 1000, 256), (64, 32, 128, 64)]:
        k4 = torch.empty(b, h, L, d, device="meta")
        grid, (L_, _, ns, ch, *_), kw, parts = quant._k_sum_spec(k4, 264)
        assert parts == ns and grid == (b * h * ns,) and ch % kw["BT"] == 0
        assert (ns - 1) * ch < L <= ns * ch, (b, h, L, ns, ch)


@pytest.mark.parametrize("rows", [8, 16])
@pytest.mark.parametrize("shape,dtype,layout", QK_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}-{lay}" for s, d, lay in QK_CASES])
def test_qk_rotated_one_warp_tiles_give_the_same_bits(shape, dtype, layout, rows, device, monkeypatch):
    """The rotated Q+K pass's GPU tiles (one warp over 8 or 16 rows, ``quant._qk_tile``) give the default tile's codes
    and scales bit for bit: rows are independent, only the masks at the last tile move (L 17-130)."""
    q, k, mean = _qk_case(shape, dtype, layout, device, True)
    want = quant.quantize_qk(q, k, q_scale=0.0883883 * R.LOG2E, smooth=mean, rotate=True)
    monkeypatch.setattr(quant, "_qk_tile", lambda d, rotate: (rows, 1))
    got = quant.quantize_qk(q, k, q_scale=0.0883883 * R.LOG2E, smooth=mean, rotate=True)
    for name, g, w in zip(("q8", "sq", "k8", "sk"), got, want):
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(), w.nan_to_num()), name


@pytest.mark.parametrize("shape,dtype,layout", QK_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}-{lay}" for s, d, lay in QK_CASES])
@pytest.mark.parametrize("mode", ["hadamard", "smooth_hadamard"])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smooth"])
def test_qk_fused_rotation_equals_reference(shape, dtype, layout, mode, smooth, device, poisoned_empty):
    """rotate_qk inside ``quantize_qk`` (issue 23 item 5) == ``reference.quantize_per_token(rotate=True)`` of Q and
    of K, poisoned tokens included: the +-1 products are exact, only the order of the fp32 sums differs (the
    interpreter's numpy matmul vs torch's), so a scale may move by an ulp (seen: 1 of 17 rows, d256 smooth) and a
    code sitting on a rounding boundary by one; and the codes dequantize to ``rotation.rotate``'s Q and K (K
    centred) within half an INT8 step plus the split's tails."""
    from turbo_attn_hf.kernels.rotation import rotate, smooth_scales

    _, hq, _, hk, _, d = shape
    q, k, mean = _qk_case(shape, dtype, layout, device, smooth)
    s = smooth_scales(k) if mode == "smooth_hadamard" else None
    got = quant.quantize_qk(q, k, q_scale=0.0883883 * R.LOG2E, smooth=mean, rotate=True, qk_smooth=s)
    fq = fk = None
    if s is not None:
        fq, fk = s.repeat_interleave(hq // hk, dim=1).cpu(), (torch.ones_like(s) / s).cpu()
    want = (*R.quantize_per_token(q.cpu(), scale=0.0883883 * R.LOG2E, rotate=True, factor=fq),
            *R.quantize_per_token(k.cpu(), smooth=None if mean is None else mean.cpu(), rotate=True, factor=fk))
    for name, g, w in zip(("q8", "sq", "k8", "sk"), got, want):
        g = g.cpu()
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous(), name
        assert torch.equal(g.isnan(), w.isnan()), name
        if g.dtype == torch.int8:
            diff = (g.int() - w.int()).abs()
            assert diff.max() <= 1 and (diff > 0).sum() <= max(1, g.numel() // 1000), f"{name}: {int((diff > 0).sum())}"
        else:
            torch.testing.assert_close(g.nan_to_num(), w.nan_to_num(), rtol=2.0 ** -21, atol=0, msg=name)
    q8, sq, k8, sk = (t.cpu().float() for t in got)
    sf = None if s is None else s.cpu()
    qr = rotate(q.cpu().float(), sf, "q") * (0.0883883 * R.LOG2E)
    kr = rotate(k.cpu().float(), sf, "k")
    if mean is not None:
        kr = kr - rotate(R._finite_or_zero(mean.cpu())[:, :, None], sf, "k")
    # x . diag(f) enters the dots as two bf16 heads: each channel's dropped tail is < 2^-14 of it
    tails = [(x.cpu().float() * (1 if f is None else f[:, :, None])).abs().sum(-1, keepdim=True) * 2.0 ** -14 / d ** 0.5
             for x, f in ((q, fq), (k, fk))]
    for name, x8, sx, ref, tail in (("q", q8, sq, qr, tails[0] * (0.0883883 * R.LOG2E)), ("k", k8, sk, kr, tails[1])):
        ok = torch.isfinite(sx)[..., None].expand_as(ref)
        err = (x8 * sx[..., None] - ref).abs()
        bound = 0.5 * sx[..., None] + tail + 1e-6 * ref.abs()  # half a step, the tails, fp32 sums
        assert (err[ok] <= bound.expand_as(ref)[ok]).all(), f"{name}: {(err - bound)[ok].max().item()}"


def test_per_token_error_bound(device):
    """|dequant - x| <= step / 2 (+ fp32 rounding), step = amax / 127, codes within +-127."""
    x = _rand((2, 2, 50, 128), torch.float32, device)
    x8, s = quant.quantize_per_token(x)
    assert int(x8.abs().max()) == 127 and int(x8.min()) >= -127
    err = (x8.float() * s[..., None] - x).abs()
    assert torch.all(err <= s[..., None] * (0.5 + 1e-5))


# shape, block, dtype, layout (test_v_blocks_bit_exact; test_v_channels_bit_exact takes HF's): L < block, L a
# multiple of it, tails, d 80/96 (masked to 128), d 256
V_CASES = [((2, 3, 37, 80), 16, torch.bfloat16, "hf"), ((2, 3, 37, 80), 64, torch.bfloat16, "contig"),
           ((1, 2, 64, 64), 64, torch.float16, "contig"), ((1, 1, 100, 96), 32, torch.bfloat16, "odd"),
           ((1, 1, 128, 96), 128, torch.bfloat16, "hf"), ((1, 2, 130, 128), 64, torch.float16, "hf"),
           ((1, 2, 63, 64), 32, torch.float32, "contig"), ((1, 1, 40, 64), 16, torch.bfloat16, "hf"),
           ((1, 1, 20, 256), 16, torch.float32, "contig"), ((1, 1, 20, 256), 64, torch.bfloat16, "odd"),
           ((1, 1, 5, 64), 64, torch.float16, "contig")]


@pytest.mark.parametrize("shape,block,dtype,layout", V_CASES,
                         ids=[f"{'x'.join(map(str, s))}-B{b}-{lay}" for s, b, _, lay in V_CASES])
def test_v_blocks_bit_exact(shape, block, dtype, layout, device, poisoned_empty):
    v = _layout(_rand(shape, dtype, device, seed=1), layout)
    v[..., 0] = 0  # an all-zero channel: codes 0, scale 0
    v8t, sv = quant.quantize_v_blocks(v, block)
    r8t, rsv = R.quantize_v_blocks(v.cpu(), block)
    b, h, L, d = shape
    lpad = -(-L // block) * block
    assert v8t.shape == (b, h, d, lpad) and sv.shape == (b, h, lpad // block, d) and v8t.is_contiguous()
    assert torch.equal(v8t.cpu(), r8t), f"{int((v8t.cpu() != r8t).sum())} codes differ"
    assert torch.equal(sv.cpu(), rsv)
    assert torch.all(v8t[..., L:] == 0), "padded tokens must be 0"
    assert torch.all(sv[..., 0] == 0)


def test_v_blocks_in_mma_order_are_the_natural_codes_permuted(device, poisoned_empty):
    """``mma_order`` (the Gluon prefill's P.V operand order) writes the same codes and scales, each 32 tokens'
    columns permuted by ``prefill_hopper.mma_key_order``; a block that is not a multiple of 32 is refused."""
    from turbo_attn_hf.kernels.prefill_hopper import mma_key_order

    v = _rand((1, 2, 100, 64), torch.bfloat16, device, seed=5)
    v8t, sv = quant.quantize_v_blocks(v, 64)
    p8t, psv = quant.quantize_v_blocks(v, 64, mma_order=True)
    assert torch.equal(p8t.cpu(), v8t.cpu()[..., mma_key_order(v8t.shape[-1])]) and torch.equal(psv, sv)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_v_blocks(v, 16, mma_order=True)


@pytest.mark.parametrize("layout", ["contig", "hf"])
def test_v_operand_half_is_v_padded_with_its_bad_tokens_zeroed(layout, device, poisoned_empty):
    """The Gluon prefill's 16-bit P.V operand: V itself, contiguous, each head's rows padded with zeros to whole
    blocks, a token holding a NaN/Inf zeroed and flagged NaN in the key scales (as the INT8 V pass flags it)."""
    v = _layout(_rand((2, 3, 200, 64), torch.bfloat16, device, seed=4), layout)
    v[1, 2, 150, 5] = float("inf")
    v[0, 1, 7, 0] = float("nan")
    sk = torch.ones(2, 3, 204, device=device)
    out = quant.v_operand_half(v, 128, poison=sk)
    want = torch.nn.functional.pad(v.cpu(), (0, 0, 0, 56))
    want[1, 2, 150] = 0
    want[0, 1, 7] = 0
    assert out.shape == (2, 3, 256, 64) and out.is_contiguous() and torch.equal(out.cpu(), want)
    assert sorted(map(tuple, sk.isnan().nonzero().tolist())) == [(0, 1, 7), (1, 2, 150)]
    with pytest.raises(ValueError, match="fp16/bf16"):
        quant.v_operand_half(v.float(), 128)


@pytest.mark.parametrize("shape,block,dtype", [c[:3] for c in V_CASES],
                         ids=[f"{'x'.join(map(str, s))}-B{b}" for s, b, _, _ in V_CASES])
def test_v_channels_bit_exact(shape, block, dtype, device, poisoned_empty):
    """One scale per (b, head, channel) over the whole sequence; tokens padded to ``block`` with 0."""
    v = _layout(_rand(shape, dtype, device, seed=2), "hf")
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


def test_quant_empty_sequence(device, poisoned_empty):
    """L = 0: no K rows; V gives one block of zero codes and zero scales, as the reference."""
    x = torch.zeros(1, 2, 0, 64, dtype=torch.bfloat16, device=device)
    x8, s = quant.quantize_per_token(x, smooth=torch.zeros(1, 2, 64, device=device))
    assert x8.shape == (1, 2, 0, 64) and s.shape == (1, 2, 0)
    v8t, sv = quant.quantize_v_blocks(x, 32)
    r8t, rsv = R.quantize_v_blocks(x.cpu(), 32)
    assert torch.equal(v8t.cpu(), r8t) and torch.equal(sv.cpu(), rsv)
    assert v8t.shape == (1, 2, 64, 32) and torch.all(v8t == 0) and torch.all(sv == 0)


def _equal_nan(a, r):
    return torch.equal(torch.isnan(a), torch.isnan(r)) and torch.equal(a.nan_to_num(0.0), r.nan_to_num(0.0))


# (shape, dtype, layout): a NaN element, a token of -Inf, an fp16 overflow (a value past 65504 -> Inf)
NONFINITE_CASES = [((2, 3, 37, 80), torch.bfloat16, "hf"), ((1, 2, 65, 64), torch.float16, "contig"),
                   ((1, 2, 40, 128), torch.float32, "odd")]


@pytest.mark.parametrize("shape,dtype,layout", NONFINITE_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}-{lay}" for s, d, lay in NONFINITE_CASES])
def test_nonfinite_tokens_bit_exact(shape, dtype, layout, device, poisoned_empty):
    """Tokens holding a NaN/Inf: codes 0, scale NaN (Q/K) or key scale marked NaN (V, ``poison``), left out of the
    statistics (K mean channel -> 0, V block and channel scales), as the reference, bit for bit."""
    x = _rand(shape, torch.float32, device, seed=3)
    x[0, 0, 5, 7] = float("nan")
    x[-1, -1, 30] = float("-inf")
    x[0, -1, 17, 2] = 1e5 if dtype == torch.float16 else float("inf")
    x = _layout(x.to(dtype), layout)
    rows = ~torch.isfinite(x.cpu()).all(-1)
    assert int(rows.sum()) == 3
    mean = R.k_smooth_mean(x)
    for smooth in (None, mean):
        x8, s = quant.quantize_per_token(x, scale=0.3, smooth=smooth)
        r8, rs = R.quantize_per_token(x.cpu(), scale=0.3, smooth=None if smooth is None else smooth.cpu())
        assert torch.equal(x8.cpu(), r8) and _equal_nan(s.cpu(), rs)
        assert torch.equal(torch.isnan(rs), rows) and torch.all(r8[rows] == 0)
    for fn, ref_fn in ((quant.quantize_v_blocks, R.quantize_v_blocks),
                       (quant.quantize_v_channels, R.quantize_v_channels)):
        sk = torch.ones(*shape[:2], shape[2] + 3, device=device)
        rsk = torch.ones(*shape[:2], shape[2] + 3)
        v8t, sv = fn(x, 16, poison=sk)
        r8t, rsv = ref_fn(x.cpu(), 16, poison=rsk)
        assert torch.equal(v8t.cpu(), r8t) and torch.equal(sv.cpu(), rsv) and torch.isfinite(rsv).all()
        assert _equal_nan(sk.cpu(), rsk) and torch.equal(torch.isnan(rsk[..., :shape[2]]), rows)
    with pytest.raises(ValueError, match="poison"):
        quant.quantize_v_blocks(x, 16, poison=torch.ones(*shape[:2], shape[2] - 1, device=device))


def test_interpreter_fast_nan_max_is_the_generic_reduction(monkeypatch):
    """CPU: conftest reduces our NaN-keeping ``_max_nan`` with ``np.max`` in the interpreter (70-90 % of a model
    test's time otherwise); the interpreter's own element-by-element reduction gives the same codes and scales,
    NaN and Inf tokens included."""
    from triton.runtime import interpreter

    fast = interpreter.ReduceOps.apply_impl
    if not getattr(fast, "turbo_nan_max", False):
        pytest.skip("the interpreter's reduction is not replaced here (CUDA, or another Triton)")
    x = _rand((1, 2, 20, 64), torch.float32, "cpu", seed=5)
    x[0, 0, 3, 7], x[0, 1, 11, 2], x[0, 1, 19] = float("nan"), float("inf"), float("-inf")

    def run():
        sk = torch.ones(1, 2, 20)
        return (*quant.quantize_per_token(x, scale=0.3), *quant.quantize_v_blocks(x, 16, poison=sk), sk)

    got = run()
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", fast.generic)
    want = run()
    assert all(_equal_nan(g, w) for g, w in zip(got, want))
    assert int(torch.isnan(got[1]).sum()) == 3  # the three poisoned tokens' scales


@pytest.mark.gpu
@pytest.mark.parametrize("d,block", [(128, 128), (64, 128), (256, 64)], ids=["D128-BN128", "D64-BN128", "D256-BN64"])
def test_quant_real_size_gpu(d, block):
    """FA3-protocol size with HF's layout (transposed views), compiled: K per token (mean-smoothed) and V per
    block == reference.py on the CPU, bit for bit (same fp32 mean, div_rn scales, no FMA contraction)."""
    b, h, L = 4, 16, 4096 + 37
    g = torch.Generator(device="cuda").manual_seed(0)
    k = (torch.randn(b, L, h, d, device="cuda", generator=g) * 3 + 0.5).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, L, h, d, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    mean = R.k_smooth_mean(k)
    out = (*quant.quantize_per_token(k, smooth=mean), *quant.quantize_v_blocks(v, block))
    torch.cuda.synchronize()
    ref = (*R.quantize_per_token(k.cpu(), smooth=mean.cpu()), *R.quantize_v_blocks(v.cpu(), block))
    for name, a, r in zip(("k8", "sk", "v8t", "sv"), out, ref):
        a = a.cpu()
        assert a.shape == r.shape and a.dtype == r.dtype, f"{name}: {a.shape} {a.dtype} vs {r.shape} {r.dtype}"
        assert torch.equal(a, r), f"{name}: {int((a != r).sum())} of {a.numel()} differ"


# ----------------------------------------------------------------------------- sm_90 compile (no GPU needed)
# (d, block, dtype, layout, smooth): the prefill's blocks per head_dim, HF and contiguous layouts, fp32; each case
# compiles both kernels (K per token, V per block). Cold compile ~5 s each on 2 CPU cores.
COMPILE_CASES = [(128, 128, "bfloat16", "hf", True), (80, 64, "float16", "contig", False),
                 (256, 64, "float32", "hf", True)]
# kernel -> its launcher's call on a [b, H, L, d] tensor
COMPILE_KERNELS = {
    "_quant_tokens_kernel": lambda x, block, mean: quant.quantize_per_token(x, smooth=mean),
    "_quant_v_kernel": lambda x, block, mean: quant.quantize_v_blocks(
        x, block, poison=torch.empty(x.shape[:3], device="meta")),  # as the prefill launches it
    "_quant_v_kernel/mma_order": lambda x, block, mean: quant.quantize_v_blocks(  # as for the Gluon prefill
        x, block, poison=torch.empty(x.shape[:3], device="meta"), mma_order=True),
    "_quant_v_kernel/half": lambda x, block, mean: quant.v_operand_half(  # the Gluon prefill's 16-bit V
        x.to(torch.bfloat16) if x.dtype == torch.float32 else x, block, poison=torch.empty(x.shape[:3],
                                                                                         device="meta")),
    # the prefill's Q+K pass with rotate_qk: its +-1 Hadamard dots (smooth: two bf16 terms; bf16 plain: one)
    "_quant_qk_kernel": lambda x, block, mean: quant.quantize_qk(
        x, x, smooth=mean, rotate=True,
        qk_smooth=None if mean is None else torch.empty(x.shape[0], x.shape[1], x.shape[3], device="meta")),
    # without a given mean (turbo_attention's default): K's fp64 split sums, finished by the Q+K pass
    "_k_sum_kernel": lambda x, block, mean: quant.k_mean(x),
    "_quant_qk_kernel/k_mean": lambda x, block, mean: quant.quantize_qk(x, x, smooth="k"),
}


def _compile_sm90(kernel_name, d, block, dtype, layout, smooth):
    """Compile ``kernel_name`` for sm_90 with the arguments its launcher launches it with (recorded on meta
    tensors) and the JIT's specialization (16-byte aligned pointers; integers outside do_not_specialize: 1 as a
    constant, multiples of 16 marked). Returns the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel_name, variant = kernel_name.split("/")[0], kernel_name
    kernel, calls = getattr(quant, kernel_name), []
    recorded = {n for n in dir(quant) if n.startswith("_") and n.endswith("_kernel")}
    saved = {n: getattr(quant, n) for n in recorded}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):  # the launcher's other kernels are recorded and dropped
            return lambda *args, **kw: calls.append((args, kw)) if self.name == kernel_name else None

    check = quant._check_device
    for n in recorded:
        setattr(quant, n, Recorder(n))
    quant._check_device = lambda *a: None
    try:
        dt = getattr(torch, dtype)
        x = torch.empty(2, 16, 4096, d, dtype=dt, device="meta")
        if layout == "hf":
            x = torch.empty(2, 4096, 16, d, dtype=dt, device="meta").transpose(1, 2)
        COMPILE_KERNELS[variant](x, block, torch.empty(2, 16, d, device="meta") if smooth else None)
    finally:
        for n, k in saved.items():
            setattr(quant, n, k)
        quant._check_device = check
    (args, kw), = calls
    names = [p.name for p in kernel.params if not p.is_constexpr]
    dns = {p.name for p in kernel.params if p.do_not_specialize}
    types = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
             torch.int8: "*i8"}
    sig, attrs = {}, {}
    constexprs = {k: v for k, v in kw.items() if k not in ("num_warps", "enable_fp_fusion")}
    for name, a in zip(names, args):
        i = kernel.arg_names.index(name)
        if isinstance(a, torch.Tensor):
            sig[name], attrs[(i,)] = types[a.dtype], [["tt.divisibility", 16]]
        elif isinstance(a, float):
            sig[name] = "fp32"
        elif name not in dns and a == 1:
            sig[name], constexprs[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if name not in dns and a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({k: "constexpr" for k in constexprs})
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = dict(num_warps=kw["num_warps"], enable_fp_fusion=kw["enable_fp_fusion"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]


def test_quant_kernels_compile_for_sm90():
    """Both kernels of the prefill's K and V passes go through the real pipeline (TTIR -> PTX -> cubin) for sm_90,
    and their HF-layout loads are 16-byte vectors (the VEC stride hint; without it every bf16 element is a 2-byte
    load); V's codes are stored as vectors in both key orders."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, json.dumps(COMPILE_CASES)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"compile subprocess failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    out = json.loads(lines[-1])
    if "unavailable" in out:
        pytest.skip(f"cannot compile Triton kernels for sm_90 on this machine: {out['unavailable']}")
    assert len(out["results"]) == len(COMPILE_CASES) * len(COMPILE_KERNELS)
    failed = {k: v for k, v in out["results"].items() if not isinstance(v, dict)}
    assert not failed, "quantization kernels fail to compile for sm_90:\n" + "\n".join(
        f"{k}: {v}" for k, v in failed.items())
    for case, loads in out["results"].items():
        assert loads["scalar"] == 0 and loads["vector"] > 0, f"{case}: global loads {loads}"
        if case.startswith("_quant_v_kernel"):  # V's codes leave in vectors (the mma order permutes registers)
            assert loads["byte_stores"] == 0, f"{case}: {loads['byte_stores']} byte stores of V's codes"
        if case.startswith("_quant_qk_kernel/k_mean") and "True)" in case:  # torch's sum / L: one IEEE division
            assert loads["div_rn_f64"] > 0, f"{case}: the K mean's fp64 division is not div.rn.f64"


def _compile_main(cases):
    try:  # a trivial kernel first: a failure here is the machine (no ptxas ...), not the kernel
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget

        @triton.jit
        def _copy(x, y):
            tl.store(y + tl.arange(0, 16), tl.load(x + tl.arange(0, 16)))

        triton.compile(triton.compiler.ASTSource(fn=_copy, signature=dict(x="*fp32", y="*fp32")),
                       target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # noqa: BLE001 - any failure means "cannot compile for sm_90 on this machine"
        print(json.dumps({"unavailable": f"{type(e).__name__}: {str(e)[-300:]}"}))
        return
    res = {}
    for kernel_name in COMPILE_KERNELS:
        for c in cases:
            key = f"{kernel_name} {tuple(c)!r}"
            try:
                ptx = _compile_sm90(kernel_name, *c)
                # tile loads: v4 = 16 bytes; 2-byte (b16) loads of a bf16/fp16 tile would mean the VEC hint is lost
                res[key] = {"vector": ptx.count("ld.global.v4"), "scalar": ptx.count("ld.global.b16"),
                            "byte_stores": ptx.count("st.global.b8"), "div_rn_f64": ptx.count("div.rn.f64")}
            except Exception as e:  # noqa: BLE001 - report every failing case, not only the first
                res[key] = f"{type(e).__name__}: {str(e)[-600:]}"
    print(json.dumps({"results": res}))


if __name__ == "__main__":
    _compile_main([tuple(c) for c in json.loads(sys.argv[1])])
