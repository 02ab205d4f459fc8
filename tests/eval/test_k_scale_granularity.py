"""eval.experiments.k_scale_granularity: the per-block K quantization it measures is the reference's per-token one at
block 1, and one scale per block otherwise."""
import torch

from turbo_attn_hf.eval.experiments.k_scale_granularity import attention, quantize_k_blocks
from turbo_attn_hf.kernels import reference as R


def test_k_blocks_of_one_token_are_the_per_token_quantization():
    k = torch.randn(1, 2, 37, 16)
    mu = R.k_smooth_mean(k)
    k8, sk = quantize_k_blocks(k, 1, mu)
    k8_ref, sk_ref = R.quantize_per_token(k, smooth=mu)
    assert torch.equal(k8, k8_ref) and torch.equal(sk, sk_ref)


def test_one_scale_per_block_of_keys():
    k = torch.randn(1, 2, 37, 16)
    k8, sk = quantize_k_blocks(k, 16, R.k_smooth_mean(k))
    assert sk.shape == (1, 2, 37)
    for b0 in (0, 16, 32):
        assert torch.unique(sk[..., b0:b0 + 16][0, 0]).numel() == 1
    assert k8.abs().amax() <= 127


def test_per_token_variant_equals_reference_turbo_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 70, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    out = attention(q, k, v, True, None, "block")
    ref = R.turbo_attention(q.float(), k.float(), v.float(), causal=True).float()
    assert torch.allclose(out, ref, atol=1e-6)
