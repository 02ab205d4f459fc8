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


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_packedkv_incremental_append_equals_one_shot(bits, device):
    b, H, BS, D = 2, 2, 16, 32
    g = torch.Generator().manual_seed(bits)
    k8 = torch.randint(-127, 128, (b, H, 5 * BS, D), generator=g, dtype=torch.int8).to(device)
    v8 = torch.randint(-127, 128, (b, H, 5 * BS, D), generator=g, dtype=torch.int8).to(device)
    heads = torch.tensor([1, 0], dtype=torch.int32)
    one = PackedKV.empty(bits, heads, b, D, BS, device, capacity=8)
    one.append(k8, v8)
    inc = PackedKV.empty(bits, heads, b, D, BS, device)  # capacity 1: grows by doubling
    caps = []
    for lo, hi in [(0, 1), (1, 3), (3, 4), (4, 5)]:
        inc.append(k8[:, :, lo * BS:hi * BS], v8[:, :, lo * BS:hi * BS])
        caps.append(inc.capacity)
    assert caps == [1, 3, 6, 6] and inc.n_blocks == one.n_blocks == 5
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
