"""Packed KV format: Triton pack/unpack kernels == the PyTorch reference (bit-exact), PackedKV storage."""
import pytest
import torch

from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.pack import PackedKV, kv_bytes_per_token, pack_blocks, quantize_int8, unpack_blocks


def _tiles(n, r, c, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (n, r, c), generator=g, dtype=torch.int8)
    x[0, :, 0] = 5  # a constant channel (scale_int -> 1)
    return x.to(device)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("tile,axis", [("K", 0), ("V", 0), ("V", 1)], ids=["K", "V", "rows"])
@pytest.mark.parametrize("D,BS", [(32, 16), (80, 16), (96, 64), (64, 64)], ids=lambda x: str(x))
def test_pack_matches_reference(bits, tile, axis, D, BS, device):
    # K tiles [BS, D] per channel; V tiles [D, BS] per token (axis 0: min/max over the padded head dim at
    # D 80/96); axis 1 (one group per row) is the generic other case
    shape = (3, BS, D) if tile == "K" else (3, D, BS)
    x = _tiles(*shape, seed=D + BS, device=device)
    if axis == 0:
        x[1, :, 3] = torch.tensor([-127, 127] * (shape[1] // 2), dtype=torch.int8)  # full range group
    p, s, z = pack_blocks(x, bits, axis)
    pr, sr, zr = R.pack_blocks_ref(x.cpu(), bits, axis)
    assert torch.equal(p.cpu(), pr) and torch.equal(s.cpu(), sr) and torch.equal(z.cpu(), zr)
    y = unpack_blocks(p, s, z, bits, axis)
    yr = R.unpack_blocks_ref(pr, sr, zr, bits, axis)
    assert torch.equal(y.cpu(), yr)
    # quantization error of the round trip: at most half an integer step (eq. 7-8), except where rounding up
    # would restore past 127: that code is rounded down (restored value below x by less than one step)
    step = (sr.to(torch.int32).unsqueeze(axis + 1))
    y32, x32 = yr.to(torch.int32), x.cpu().to(torch.int32)
    err = (y32 - x32).abs()
    capped = (y32 + step > 127) & (y32 < x32) & (err < step)
    assert bool(((2 * err <= step) | capped).all()), f"worst {err.max()}"
    assert int(y32.max()) <= 127 and int(y32.min()) >= -127
    # restore is linear in the code (no clamp active): what the decode kernel's fold relies on
    pb = 8 // bits
    shifts = torch.arange(pb, dtype=torch.int32) * bits
    code = ((pr.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)
    lin = code * sr.to(torch.int32).unsqueeze(axis + 1) + zr.to(torch.int32).unsqueeze(axis + 1)
    assert torch.equal(lin, y32)
    assert int(sr.min()) >= 1 and int(sr.max()) <= -(-254 // ((1 << bits) - 1))


def test_pack_strided_input_equals_contiguous(device):
    # V tiles are packed from a transposed view of [N, BS, D] without a copy
    x = _tiles(2, 16, 32, seed=3, device=device)
    a = pack_blocks(x.transpose(1, 2), 4, axis=0)
    b = pack_blocks(x.transpose(1, 2).contiguous(), 4, axis=0)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_quantize_int8_matches_reference(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 32, generator=g).to(device, torch.bfloat16)
    mean = x.float().mean(2)
    scale = (x.float() - mean[:, :, None]).abs().amax(2) / 127 * 0.5  # half the range: outliers clamp
    a = quantize_int8(x, scale, mean)
    r = R.quantize_int8_universal_ref(x.cpu(), scale.cpu(), mean.cpu())
    assert torch.equal(a.cpu(), r)
    assert int(a.abs().max()) == 127


def _quant_inputs(b, H, T, D, dtype, layout, seed=0, device="cpu"):
    """x [b, H, T, D] in ``layout`` (contiguous; "hf": a transposed [b, T, H, D]; "strided": a token and channel
    slice with a channel step of 2, last dim not contiguous), fp32 scale and mean [b, H, D] that put values
    exactly on .5 boundaries, on ±127.5 and far past ±127 steps, plus inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, H, D, generator=g).transpose(1, 2) * 3 if layout == "hf" else \
        torch.randn(b, H, T + 5, 2 * D, generator=g)[:, :, 3:3 + T, ::2] * 3 if layout == "strided" else \
        torch.randn(b, H, T, D, generator=g) * 3
    x = x.to(dtype)
    # channel 0: n/16, all n of [-255, 255] in turn (exact in bf16); with scale 1/8 and mean 1/4 the quotient
    # n/2 - 2 is a half-integer for every odd n, and reaches ±127.5 and beyond
    x[:, :, :, 0] = ((torch.arange(T) * 37 % 511 - 255) / 16).to(dtype)
    x[0, 0, 0, 1:4] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
    scale = torch.rand(b, H, D, generator=g) * 0.05 + 1e-3  # small: many values clamp
    scale[:, :, 0] = 0.125
    scale[:, :, 2] = 1e-30  # quotients past the int32 range
    mean = torch.randn(b, H, D, generator=g)
    mean[:, :, 0] = 0.25
    return x.to(device), scale.to(device), mean.to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "hf", "strided"])
@pytest.mark.parametrize("b,H,T,D", [(2, 3, 65, 32), (1, 2, 63, 80), (1, 1, 1, 64)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("with_mean", [True, False], ids=["mean", "no-mean"])
def test_quantize_int8_triton_equals_torch_formula(dtype, layout, b, H, T, D, with_mean, device):
    # one Triton pass (the interpreter on CPU) == the PyTorch formula (reference.quantize_int8_universal_ref),
    # bit for bit; T 65 / 63 / 1: tiles of 32 (interpreter) and 64 rows with a partial last one
    x, scale, mean = _quant_inputs(b, H, T, D, dtype, layout, seed=T + D, device=device)
    m = mean if with_mean else None
    a = quantize_int8(x, scale, m)
    r = R.quantize_int8_universal_ref(x.cpu(), scale.cpu(), None if m is None else m.cpu())
    assert a.is_contiguous() and a.dtype == torch.int8
    diff = (a.cpu() != r).nonzero()
    assert len(diff) == 0, f"{len(diff)} codes differ, first at {diff[0].tolist()}"
    assert (r == 127).any() and (r == -127).any()  # the clamp was exercised
    if T > 1 and not with_mean:  # the .5 boundaries: half-integers n/2 round away from zero
        n = (torch.arange(T) * 37 % 511 - 255).float()
        assert torch.equal(r[0, 0, :, 0].float(), (torch.sign(n) * torch.floor(n.abs() / 2 + 0.5)).clamp(-127, 127))


def test_quantize_int8_rejects_bad_arguments():
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="scale must be fp32"):
        quantize_int8(x, torch.ones(1, 2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[b, H, T, D\]"):
        quantize_int8(x[0], torch.ones(1, 2, 8))


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_blocks_of_strided_views_into_buffer_slices(bits, device):
    # PackedKV.append's call: [b, H, n, BS, D] views of a head and token slice of the codes (K tiles, and V
    # tiles transposed) packed straight into slices of larger buffers == packing contiguous [N, R, C] copies
    b, H, n, BS, D = 2, 3, 3, 16, 32
    g = torch.Generator().manual_seed(bits)
    x8 = torch.randint(-127, 128, (b, H + 2, n * BS + 21, D), generator=g, dtype=torch.int8).to(device)
    kb = x8[:, 1:1 + H, 5:5 + n * BS].reshape(b, H, n, BS, D)
    for tiles in (kb, kb.transpose(-1, -2)):
        r, c = tiles.shape[-2:]
        bufs = (torch.full((b, H, n + 2, r, c * bits // 8), 7, dtype=torch.uint8, device=device),
                torch.full((b, H, n + 2, c), -128, dtype=torch.int8, device=device),
                torch.full((b, H, n + 2, c), -128, dtype=torch.int8, device=device))
        out = tuple(t[:, :, 1:1 + n] for t in bufs)
        assert all(a is o for a, o in zip(pack_blocks(tiles, bits, 0, out=out), out))
        ref = R.pack_blocks_ref(tiles.reshape(-1, r, c).cpu(), bits, 0)
        for o, buf, rf, fill in zip(out, bufs, ref, (7, -128, -128)):
            assert torch.equal(o.cpu(), rf.view(o.shape))
            assert bool((buf[:, :, 0] == fill).all() and (buf[:, :, -1] == fill).all())  # nothing written outside
        assert all(torch.equal(a.cpu(), rf.view(a.shape)) for a, rf in zip(pack_blocks(tiles, bits, 0), ref))


@pytest.mark.gpu
def test_quantize_int8_triton_equals_torch_formula_real_size():
    # prefill size on a GPU: b 2, 8 KV heads, 4096 + 5 tokens (a partial last tile), d 128, bf16 in HF's
    # transposed layout; the Triton pass == the torch formula on the same device, bit for bit
    x, scale, mean = _quant_inputs(2, 8, 4096 + 5, 128, torch.bfloat16, "hf", device="cuda")
    for m in (mean, None):
        a = quantize_int8(x, scale, m)
        r = R.quantize_int8_universal_ref(x, scale, m)
        assert torch.equal(a, r), f"{int((a != r).sum())} codes differ"


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_packedkv_incremental_append_equals_one_shot(bits, device):
    b, H, BS, D = 2, 2, 16, 32
    g = torch.Generator().manual_seed(bits)
    k8 = torch.randint(-127, 128, (b, H, 5 * BS, D), generator=g, dtype=torch.int8).to(device)
    v8 = torch.randint(-127, 128, (b, H, 5 * BS, D), generator=g, dtype=torch.int8).to(device)
    heads = torch.tensor([1, 0], dtype=torch.int32)
    one = PackedKV.empty(bits, heads, b, D, BS, device, capacity=8)
    one.append(k8, v8)
    inc = PackedKV.empty(bits, heads, b, D, BS, device)  # capacity 1: grows by a quarter, at least 4 blocks
    caps = []
    for lo, hi in [(0, 1), (1, 3), (3, 4), (4, 5)]:
        inc.append(k8[:, :, lo * BS:hi * BS], v8[:, :, lo * BS:hi * BS])
        caps.append(inc.capacity)
    assert caps == [1, 5, 5, 5] and inc.n_blocks == one.n_blocks == 5
    inc.reserve(21)
    assert inc.capacity == 21  # what is asked, when more than a quarter
    inc.reserve(22)
    assert inc.capacity == 26  # a quarter more
    for name, t in one._tensors():
        assert torch.equal(getattr(inc, name)[:, :, :5], t[:, :, :5]), name
    # unpack_block gives back the (dequantized) INT8 tokens, V transposed back to [BS, D]
    k, v = inc.unpack_block(2)
    if bits == 8:
        assert torch.equal(k, k8[:, :, 2 * BS:3 * BS]) and torch.equal(v, v8[:, :, 2 * BS:3 * BS])
    else:
        kr = R.unpack_blocks_ref(*R.pack_blocks_ref(k8[:, :, 2 * BS:3 * BS].reshape(-1, BS, D).cpu(), bits, 0),
                                 bits, 0)
        assert torch.equal(k.reshape(-1, BS, D).cpu(), kr)
    assert inc.used_bytes() == b * H * 5 * BS * kv_bytes_per_token(D, bits, BS)
    old = inc.k.clone()
    inc.index_batch(torch.tensor([1, 1, 0]))
    assert inc.k.shape[0] == 3 and torch.equal(inc.k[2], old[0]) and torch.equal(inc.k[0], old[1])


@pytest.mark.parametrize("bits", [4, 2])
def test_packedkv_v_scale_zero_share_one_row_per_block(bits, device):
    """V's per-token scales and zeros of a block are one contiguous [2, BS] row of ``v_sz`` (the decode kernel
    reads both in one load); ``v_scale``/``v_zero`` are views of it, also after growth and batch reindexing, and
    separate tensors handed to the constructor are stacked into that layout."""
    b, H, BS, D = 2, 2, 16, 32
    g = torch.Generator().manual_seed(bits)
    k8 = torch.randint(-127, 128, (b, H, 3 * BS, D), generator=g, dtype=torch.int8).to(device)
    v8 = torch.randint(-127, 128, (b, H, 3 * BS, D), generator=g, dtype=torch.int8).to(device)
    pk = PackedKV.empty(bits, torch.tensor([0, 1], dtype=torch.int32), b, D, BS, device)
    pk.append(k8, v8)
    pk.index_batch(torch.tensor([1, 0, 1]))
    for t in (pk.v_scale, pk.v_zero):
        assert t.data_ptr() - pk.v_sz.data_ptr() in (0, BS) and t._base is not None
    assert pk.v_sz.shape[2:] == (pk.capacity, 2, BS) and pk.v_sz.stride()[2:] == (2 * BS, BS, 1)
    _, vs_ref, vz_ref = R.pack_blocks_ref(v8[0].reshape(H, 3, BS, D).transpose(-1, -2).reshape(-1, D, BS).cpu(),
                                          bits, 0)
    assert torch.equal(pk.v_scale[1, :, :3].reshape(-1, BS).cpu(), vs_ref)
    assert torch.equal(pk.v_zero[1, :, :3].reshape(-1, BS).cpu(), vz_ref)
    again = PackedKV(bits=bits, heads=pk.heads, k=pk.k, v=pk.v, k_scale=pk.k_scale, k_zero=pk.k_zero,
                     v_scale=pk.v_scale.clone(), v_zero=pk.v_zero.clone(), n_blocks=pk.n_blocks)
    assert torch.equal(again.v_sz, pk.v_sz) and again.v_sz.stride()[2:] == (2 * BS, BS, 1)


def test_bytes_per_token_arithmetic():
    # d=128, block 64: int4 = 2*128/2 codes + 2*128/64 K scale/zero + 2 V scale/zero (per token) = 134 bytes
    # per head per token (bf16: 512) -> 0.262x; int2 = 64 + 4 + 2 = 70
    assert kv_bytes_per_token(128, 4, 64) == 134
    assert kv_bytes_per_token(128, 2, 64) == 70
    assert kv_bytes_per_token(128, 8, 64) == 256
    assert kv_bytes_per_token(128, 4, 64) / 512 <= 0.3
    assert (kv_bytes_per_token(128, 4, 64) + kv_bytes_per_token(128, 2, 64)) / 2 / 512 <= 0.22


def test_pack_rejects_bad_bits():
    x = torch.zeros(1, 16, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="bits=3"):
        pack_blocks(x, 3, 0)
    with pytest.raises(ValueError, match="bits=8"):
        pack_blocks(x, 8, 0)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_blocks(torch.zeros(1, 16, 18, dtype=torch.int8), 2, 0)


def test_cpu_without_interpreter_uses_the_pytorch_twin(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = _tiles(2, 16, 32, seed=9)
    p, s, z = pack_blocks(x, 2, 0)
    assert all(torch.equal(a, b) for a, b in zip((p, s, z), R.pack_blocks_ref(x, 2, 0)))
    assert torch.equal(unpack_blocks(p, s, z, 2, 0), R.unpack_blocks_ref(p, s, z, 2, 0))
    xq, scale, mean = _quant_inputs(1, 2, 9, 32, torch.bfloat16, "hf")
    assert torch.equal(quantize_int8(xq, scale, mean), R.quantize_int8_universal_ref(xq, scale, mean))
