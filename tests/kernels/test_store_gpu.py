"""GPU, real sizes: the fused store == the PyTorch path bit for bit (T 4k, head_dim 128, 8 KV heads)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["int8", "int4", "mixed"])
@pytest.mark.parametrize("b", [1, 2])
def test_fused_store_equals_pytorch_path_at_4k(preset, b):
    from turbo_attn_hf import cache as C
    from turbo_attn_hf.cache import TurboCache

    g = torch.Generator(device="cuda").manual_seed(b)
    L = 4096 + 77
    k = (torch.randn(b, L, 8, 128, generator=g, device="cuda") * 2).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, L, 8, 128, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    k = k * torch.linspace(0.5, 2, 8, device="cuda", dtype=torch.bfloat16).view(1, 8, 1, 1)
    layers = []
    for fused in (True, False):
        C.FUSED_STORE = fused
        try:
            cache = TurboCache(preset)
            cuts = [0, 4096, 4096 + 70] + list(range(4096 + 71, L + 1))  # prefill, second prefill, decode steps
            for t0, t1 in zip(cuts[:-1], cuts[1:]):
                cache.update(k[:, :, t0:t1], v[:, :, t0:t1], 0)
            layers.append(cache.layers[0])
        finally:
            C.FUSED_STORE = True
    _assert_same(*layers)


def _assert_same(a, b):
    """The two layers hold the same state, bit for bit (tests/turbo_attn_hf/test_store_fused.py's check)."""
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    assert (a.n_blocks, a.n_tail, a.head_bits, a.headroom) == (b.n_blocks, b.n_tail, b.head_bits, b.headroom)
    assert torch.equal(bits(a.k_scale), bits(b.k_scale)) and torch.equal(bits(a.v_scale), bits(b.v_scale))
    assert torch.equal(bits(a.k_mean), bits(b.k_mean))
    n = a.n_tail
    assert torch.equal(a.k_tail[:, :, :n], b.k_tail[:, :, :n])
    assert torch.equal(a.v_tail[:, :, :, :n], b.v_tail[:, :, :, :n])
    for ga, gb in zip(a.groups, b.groups):
        assert ga.bits == gb.bits and ga.heads.tolist() == gb.heads.tolist()
        for (name, ta), (_, tb) in zip(ga._tensors(), gb._tensors()):
            assert torch.equal(ta[:, :, :ga.n_blocks], tb[:, :, :gb.n_blocks]), name
    assert a.nonfinite_tokens() == b.nonfinite_tokens() == 0
