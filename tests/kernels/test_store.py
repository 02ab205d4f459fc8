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
