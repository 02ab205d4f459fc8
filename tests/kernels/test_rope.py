"""kernels/rope.py: the rotary embedding of Q and K in one launch is, bit for bit, its twin
``reference.rope_rotate_half``, which is HF's ``apply_rotary_pos_emb`` (interpreter on CPU, with the interpreter's
fp32 -> bf16 cast rounded to nearest even as on the GPU: ``interpreter._interpreter_bf16_rne``)."""
import pytest
import torch

from turbo_attn_hf.kernels import reference, rope

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter


def _inputs(b, hq, hk, L, d, dtype, cos_batch=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, L, hq, d, generator=g) * 3).to(dtype).transpose(1, 2)  # HF's q_proj(...).view().transpose
    k = (torch.randn(b, L, hk, d, generator=g) * 3).to(dtype).transpose(1, 2)
    ang = torch.randn(cos_batch or b, L, d // 2, generator=g) * 50
    ang = torch.cat([ang, ang], -1)
    return q.to(DEV), k.to(DEV), ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 4, 1, 1, 64), (2, 3, 1, 5, 128), (1, 8, 8, 3, 256), (2, 6, 2, 4, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_is_its_twin_and_hf_bit_for_bit(shape, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, cos, sin = _inputs(*shape, dtype)
    assert rope.supports(q, k, cos, sin)
    out = rope.rope_rotate_half(q, k, cos, sin)
    ref = reference.rope_rotate_half(q, k, cos, sin)
    hf = apply_rotary_pos_emb(q, k, cos, sin)
    for o, r, h, x in zip(out, ref, hf, (q, k)):
        assert torch.equal(o, r) and torch.equal(r, h)
        assert o.stride() == x.stride()  # laid out as the input, as HF's elementwise ops leave it


def test_one_cos_row_broadcasts_over_the_batch():
    q, k, cos, sin = _inputs(3, 2, 1, 4, 64, torch.bfloat16, cos_batch=1)
    out = rope.rope_rotate_half(q, k, cos, sin)
    for o, r in zip(out, reference.rope_rotate_half(q, k, cos, sin)):
        assert torch.equal(o, r)


def test_what_the_kernel_does_not_take_is_refused():
    q, k, cos, sin = _inputs(1, 4, 2, 3, 64, torch.bfloat16)
    assert not rope.supports(q.float(), k.float(), cos.float(), sin.float())  # fp32: FMA contraction, HF's own ops
    assert not rope.supports(q, k, cos.half(), sin.half())  # mixed dtypes promote in PyTorch
    assert not rope.supports(q, k, cos[..., :32], sin[..., :32])  # partial rotary
    assert not rope.supports(q, k[:, :, :2], cos, sin)  # another length
    assert not rope.supports(q[..., ::2], k[..., ::2], cos[..., ::2], sin[..., ::2])  # channels not contiguous
