"""Decode-step store kernel == the PyTorch path (reference quantization + slice writes), bit for bit."""
import pytest
import torch

from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.store import store_int8_tokens


@pytest.mark.parametrize("T,D,slot,mean", [(1, 64, 0, True), (1, 128, 77, True), (5, 80, 40, False),
                                           (16, 32, 48, True)])
def test_store_matches_reference(T, D, slot, mean, device):
    g = torch.Generator().manual_seed(T + D)
    b, H, C = 2, 3, 64
    big = torch.randn(b, H, T + 3, D, generator=g) * 3  # a strided view, as attention hands it over
    k = big[:, :, 2:2 + T].to(torch.bfloat16)
    v = (torch.randn(b, H, T, D, generator=g) * 2).to(torch.bfloat16)
    ks = torch.rand(b, H, D, generator=g) * 0.02 + 0.01  # small scales: some values clamp at ±127
    vs = torch.rand(b, H, D, generator=g) * 0.03 + 0.01
    mu = torch.randn(b, H, D, generator=g) if mean else None
    C = max(C, slot + T)
    kt = torch.full((b, H, C, D), 5, dtype=torch.int8)
    vt = torch.full((b, H, D, C), 5, dtype=torch.int8)
    ekt, evt = kt.clone(), vt.clone()
    ekt[:, :, slot:slot + T] = R.quantize_int8_universal_ref(k, ks, mu)
    evt[:, :, :, slot:slot + T] = R.quantize_int8_universal_ref(v, vs).transpose(-1, -2)
    kt, vt = kt.to(device), vt.to(device)
    store_int8_tokens(k.to(device), v.to(device), ks.to(device), None if mu is None else mu.to(device), vs.to(device),
                      kt, vt, slot)
    assert torch.equal(kt.cpu(), ekt) and torch.equal(vt.cpu(), evt)
    assert (ekt.abs() == 127).any()  # the clamp was exercised


def test_store_overflow_raises(device):
    kt = torch.zeros(1, 1, 16, 32, dtype=torch.int8, device=device)
    x = torch.zeros(1, 1, 4, 32, device=device)
    s = torch.ones(1, 1, 32, device=device)
    with pytest.raises(ValueError, match="overflow the INT8 buffer"):
        store_int8_tokens(x, x, s, None, s, kt, kt.transpose(-1, -2).contiguous(), 14)


# ----------------------------------------------------------------- rotate_qk: the store kernels rotate K (issue 23)
def _groups(head_bits, b, d, bs, nb, device):
    from turbo_attn_hf.kernels.pack import PackedKV

    return [PackedKV.empty(bits, torch.tensor([h for h, x in enumerate(head_bits) if x == bits]), b, d, bs, device,
                           capacity=max(nb, 1)) for bits in (8, 4, 2) if bits in head_bits]


def _first_store(k, v, mean, head_bits, bs, sink, recent, rotate, qk_smooth, headroom=1.5, mean_in=False):
    """A first prefill as TurboLayer._first_store_fused plans it (kv_stats, then one store_kv that packs blocks):
    (k_scale, v_scale, mean of the stored basis, k_tail, v_tail, groups, n_tail, nonfinite)."""
    from turbo_attn_hf.kernels.store import kv_stats, store_kv

    b, H, T, d = k.shape
    nf = torch.zeros(1, dtype=torch.int32, device=k.device)
    out = kv_stats(k, v, mean, bs, headroom, nf, None, 0, rotate=rotate, qk_smooth=qk_smooth, mean_in=mean_in)
    ks, vs, mk = out if rotate else (*out, mean)
    n_sink, C = sink * bs, (sink + recent + 1) * bs
    n = T - n_sink
    n_pack = (n - recent * bs) // bs * bs
    groups = _groups(head_bits, b, d, bs, n_pack // bs, k.device)
    kt = torch.zeros(b, H, C, d, dtype=torch.int8, device=k.device)
    vt = torch.zeros(b, H, d, C, dtype=torch.int8, device=k.device)
    store_kv(k, v, ks, mk, vs, kt, vt, groups, take=n_sink, slot_sink=0, c=0, s0=n_sink, n_pack=n_pack,
             rotate=rotate, qk_smooth=qk_smooth)
    for g in groups:
        g.n_blocks = n_pack // bs
    return ks, vs, mk, kt, vt, groups, n_sink + n - n_pack, nf


def _rot_kv(b, H, T, d, dtype, seed, device, smooth):
    """K/V, and with ``smooth`` power-of-two factors ``s [b, H, d]``. K on a grid of 1/4 below 32 and s powers of
    two: every +-1 sum of the rotation is exact in fp32 (any order: the GPU's tensor cores, numpy, torch), so
    kernel and twin agree bit for bit on any device."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, H, T, d, generator=g) * 2 + torch.randn(1, H, 1, d, generator=g) * 3  # channel offsets
    k[..., :4] *= 3  # outlier channels
    k = (k * 4).round().clamp(-127, 127) / 4
    s = 2.0 ** torch.randint(-2, 3, (b, H, d), generator=g).float() if smooth else None
    v = torch.randn(b, H, T, d, generator=g).to(device, dtype)
    return k.to(device, dtype), v, None if s is None else s.to(device)


@pytest.mark.parametrize("d,dtype,smooth,head_bits", [
    (64, torch.bfloat16, False, [4, 4]),         # hadamard, bf16: one exact dot
    (128, torch.bfloat16, True, [8, 8]),         # smooth_hadamard: the split dot
    (96, torch.float16, True, [8, 4, 2]),        # block 32 (block-diagonal), fp16, three bit groups
], ids=["d64-hadamard-int4", "d128-smooth-int8", "d96-smooth-fp16-mixed"])
def test_first_store_rotates_keys_in_kernel(d, dtype, smooth, head_bits, device):
    """kv_stats + store_kv with rotate on the caller's K == the same kernels unrotated on reference.rotate_keys_ref(K)
    (fp32), bit for bit (scales, INT8 buffer, packed blocks); == build_packed_cache_ref(rotate=True) on the CPU;
    the rotated mean is the raw mean's rotation; V untouched. One K element inf: counted, its row's Hadamard block
    left out of the rotated statistics, the raw mean fixed in place."""
    b, H, bs, sink, recent = 2, len(head_bits), 16, 1, 1
    T = 6 * bs + 5  # 1 sink block, 4 packed blocks, 1 recent block + 5 tokens in the INT8 buffer
    k, v, s = _rot_kv(b, H, T, d, dtype, d, device, smooth)
    k[1, 0, 40, 5] = float("inf")  # a packed token
    mean = R.k_smooth_mean(k)
    assert not torch.isfinite(mean).all()
    a = _first_store(k, v, mean, head_bits, bs, sink, recent, True, s)
    assert torch.isfinite(mean).all()  # written by the stats kernel (the prefill's raw mean)
    assert torch.equal(mean.cpu(), R.kv_finite_mean_ref(k.cpu(), R.k_smooth_mean(k.cpu())))
    kr = R.rotate_keys_ref(k.cpu(), None if s is None else s.cpu()).to(device)
    c = _first_store(kr, v, a[2].clone(), head_bits, bs, sink, recent, False, None, mean_in=True)
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    for x, y in zip(a[:3], c[:3]):
        assert torch.equal(bits(x), bits(y))
    for x, y in zip(a[3:5], c[3:5]):
        assert torch.equal(x, y)
    for ga, gc in zip(a[5], c[5]):
        for (name, ta), (_, tc) in zip(ga._tensors(), gc._tensors()):
            assert torch.equal(ta, tc), (ga.bits, name)
    assert a[6] == c[6] and int(a[7]) == int(c[7]) == 1
    # the reference twin: raw mean fixed, rotated in fp32; K's scales / codes of the fp32-rotated keys
    sc = None if s is None else s.cpu()
    groups, kt, vt, nt, ks, vs, mk = R.build_packed_cache_ref(k.cpu(), v.cpu(), T, head_bits, bs, True, 1.5, sink,
                                                             recent, rotate=True, qk_smooth=sc)
    torch.testing.assert_close(a[2].cpu(), mk, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(R.rotate_mean_ref(mean.cpu(), sc), mk, rtol=1e-6, atol=1e-6)
    assert torch.equal(a[1].cpu(), vs) and nt == a[6]
    torch.testing.assert_close(a[0].cpu(), ks, rtol=1e-6, atol=0)
    assert torch.equal(a[4].cpu()[..., :nt], vt[..., :nt])
    if torch.equal(bits(a[2].cpu()), bits(mk)) and torch.equal(bits(a[0].cpu()), bits(ks)):  # always on the CPU
        assert torch.equal(a[3].cpu()[:, :, :nt], kt[:, :, :nt])
        for ga, gr in zip(a[5], groups):
            assert torch.equal(ga.k.cpu(), gr.k) and torch.equal(ga.v.cpu(), gr.v)
            if ga.bits != 8:
                assert torch.equal(ga.k_scale.cpu(), gr.k_scale) and torch.equal(ga.k_zero.cpu(), gr.k_zero)
    # the rotation moved K's energy off the outlier channels (the stored basis is not the raw one)
    assert not torch.equal(a[0], _first_store(k, v, R.k_smooth_mean(k), head_bits, bs, sink, recent, False, None)[0])


@pytest.mark.parametrize("T,smooth", [(1, True), (3, False)])
def test_decode_step_store_rotates_keys(T, smooth, device):
    """store_int8_tokens(rotate) on raw K (a 1-token step: its tile padded to 16 rows for the dot) == the unrotated
    store of rotate_keys_ref(K) == quantize_int8_universal_ref of it; V as without rotation."""
    b, H, d, C, slot = 2, 2, 128, 32, 7
    k, v, s = _rot_kv(b, H, 40, d, torch.bfloat16, T, device, smooth)
    sc = None if s is None else s.cpu()
    mean, ks, vs = R.kv_universal_scales_ref(k.cpu(), v.cpu(), True, 1.25, rotate=True, qk_smooth=sc)
    kn, vn = k[:, :, -T:], v[:, :, -T:]
    kr = R.rotate_keys_ref(kn.cpu(), sc)
    out = []
    for x, rot in ((kn, True), (kr.to(device), False)):
        kt = torch.full((b, H, C, d), 5, dtype=torch.int8, device=device)
        vt = torch.full((b, H, d, C), 5, dtype=torch.int8, device=device)
        nf = torch.zeros(1, dtype=torch.int32, device=device)
        store_int8_tokens(x, vn, ks.to(device), mean.to(device), vs.to(device), kt, vt, slot, nonfinite=nf,
                          rotate=rot, qk_smooth=s if rot else None)
        out.append((kt.cpu(), vt.cpu(), int(nf)))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]) and out[0][2] == out[1][2] == 0
    assert torch.equal(out[0][0][:, :, slot:slot + T], R.quantize_int8_universal_ref(kr, ks, mean))
    assert (out[0][0][:, :, :slot] == 5).all() and (out[0][0][:, :, slot + T:] == 5).all()


def test_rotate_argument_errors(device):
    from turbo_attn_hf.kernels.rotation import RotationError
    from turbo_attn_hf.kernels.store import kv_stats

    k = torch.zeros(1, 2, 16, 64, device=device)
    nf = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="rope_dims"):
        kv_stats(k, k, None, 16, 1.0, nf, rope_dims=16, rotate=True)
    with pytest.raises(ValueError, match="needs rotate_qk"):
        kv_stats(k, k, None, 16, 1.0, nf, qk_smooth=torch.ones(1, 2, 64, device=device))
    with pytest.raises(RotationError):
        kv_stats(torch.zeros(1, 2, 16, 40, device=device), torch.zeros(1, 2, 16, 40, device=device), None, 16, 1.0,
                 nf, rotate=True)
