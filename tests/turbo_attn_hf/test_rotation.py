"""rotate_qk="hadamard" (issue 23): the rotation itself, its exactness, its gain on outlier channels, and that
every path (first prefill, cache store + decode query, no-cache attention fn) rotates Q and K exactly once.

Outlier margin (synthetic: Q, K ~ N(0,1), bf16, b1 Hq2 Hk1 L256; Q channels (5, 40, 77) and K channels
(17, 40, 90) x10; relative RMS vs fp64 attention; kernels' PyTorch reference), measured seeds 0-2:
  d128 prefill: none 3.08-3.91 %, hadamard 1.37-1.57 % (ratio 2.23-2.49); decode (int8, block 16, 200-token
  prefill then 8-token chunks, last chunk): none 5.2-10.1 %, hadamard 1.48-2.15 % (ratio 2.7-5.0)
  d96 (block-diagonal, blocks of 32) prefill ratio 2.21-2.45, decode 3.1-8.1
  -> asserted: rotated error < unrotated / 1.8 on both paths (seed 0).
(At x30 the unrotated prefill ratio is 3.5-4.9; the decode reference returns NaN on 8-token chunks there with
or without rotation — a pre-existing decode issue reported separately, so the test stays at x10.)
"""
from __future__ import annotations

import pytest
import torch

import turbo_attn_hf
from turbo_attn_hf import TurboConfig
from turbo_attn_hf.attention import torch_attention, turbo_attention_forward
from turbo_attn_hf.cache import TurboCache, TurboLayer
from turbo_attn_hf.config import TurboConfigError
from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.rotation import RotationError, hadamard_matrix, rotate, rotation_block

MARGIN = 1.8  # measured ratios 2.2-8 (module doc)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def outlier_qkv(d=128, L=256, mult=10.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, L, d, generator=g)
    k = torch.randn(1, 1, L, d, generator=g)
    v = torch.randn(1, 1, L, d, generator=g)
    q[..., [5, 40, 77 % d]] *= mult
    k[..., [17, 40, 90 % d]] *= mult
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


# ------------------------------------------------------------------------------------------ the rotation
@pytest.mark.parametrize("d,block", [(64, 64), (80, 16), (96, 32), (128, 128), (256, 256)])
def test_orthonormal_symmetric_involution(d, block):
    assert rotation_block(d) == block
    h = hadamard_matrix(d, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.equal(h.abs() > 0, torch.block_diag(*[torch.ones(block, block)] * (d // block)).bool())
    x = torch.randn(3, 2, 7, d)
    assert torch.allclose(rotate(rotate(x)), x, atol=1e-5)
    assert hadamard_matrix(d) is hadamard_matrix(d)  # cached per (d, dtype, device)


def test_head_dims_without_a_block_refuse():
    with pytest.raises(RotationError, match="head_dim 72"):
        rotation_block(72)  # 8 x 9: no power-of-two block >= 16
    with pytest.raises(TurboConfigError, match="rotate_qk"):
        TurboConfig(rotate_qk="quarot")


@pytest.mark.parametrize("d", [64, 96, 256])
def test_unquantized_attention_unchanged(d):
    """Q·Kᵀ is invariant: exact attention of rotated Q/K equals that of Q/K to fp32 rounding."""
    q, k, v = (t.float() for t in outlier_qkv(d=d, L=64))
    a = R.attention_fp64(q, k, v)
    b = R.attention_fp64(rotate(q), rotate(k), v)
    assert rel(b, a) < 1e-5


# ------------------------------------------------------------------------------------------ outlier gain
@pytest.mark.parametrize("d", [128, 96])
def test_rotation_beats_plain_int8_on_outlier_channels(d, pytorch_reference_kernels):
    q, k, v = outlier_qkv(d=d)
    exact = R.attention_fp64(q, k, v)
    e_none = rel(R.turbo_attention(q, k, v), exact)
    e_rot = rel(R.turbo_attention(rotate(q), rotate(k), v), exact)
    assert e_rot < e_none / MARGIN, (e_none, e_rot)

    errs = {}
    for mode in ("none", "hadamard"):  # decode path: universal K scales folded into the query
        layer = TurboLayer(TurboConfig(bits=8, block_size=16, rotate_qk=mode))
        kk, vv = layer.update(k[:, :, :200], v[:, :, :200])
        layer.attention(q[:, :, :200], kk, vv)
        for s in range(200, 256, 8):
            kk, vv = layer.update(k[:, :, s:s + 8], v[:, :, s:s + 8])
            out = layer.attention(q[:, :, s:s + 8], kk, vv)
        errs[mode] = rel(out, exact[:, -8:])
    assert errs["hadamard"] < errs["none"] / MARGIN, errs


# ------------------------------------------------------------------------------------------ rotated exactly once
def test_cache_stores_rotated_k_and_rotates_each_query_once(pytorch_reference_kernels):
    """A rotate_qk layer == a plain layer fed rotated K and queried with rotated Q, bit for bit, on the first
    prefill and on decode steps that pack blocks; its keys carry the state; foreign keys are refused."""
    q, k, v = outlier_qkv(d=128, L=120)
    rot = TurboLayer(TurboConfig(bits=4, block_size=16, rotate_qk="hadamard"))
    plain = TurboLayer(TurboConfig(bits=4, block_size=16))
    assert rot.rotated and not plain.rotated
    for s, e in ((0, 70), (70, 78), (78, 79), (79, 120)):
        kr, vr = rot.update(k[:, :, s:e], v[:, :, s:e])
        kp, vp = plain.update(rotate(k[:, :, s:e]), v[:, :, s:e])
        assert kr.turbo_rotated and not kp.turbo_rotated and kr.turbo_cache_layer is rot
        assert torch.equal(rot.attention(q[:, :, s:e], kr, vr), plain.attention(rotate(q[:, :, s:e]), kp, vp))
    n = rot.n_tail  # slots past n_tail are unwritten (torch.empty) and never read
    assert rot.n_blocks == plain.n_blocks > 0 and n == plain.n_tail
    assert torch.equal(rot.k_scale, plain.k_scale) and torch.equal(rot.k_tail[:, :, :n], plain.k_tail[:, :, :n])
    with pytest.raises(ValueError, match="rotated"):
        rot.attention(q[:, :, -1:], k, v)  # unrotated keys that did not come from update()


def _module(d, cfg):
    from types import SimpleNamespace

    m = torch.nn.Module()
    m.is_causal = True
    m.config = SimpleNamespace(model_type="tinytest", architectures=["TinyTestForCausalLM"])
    turbo_attn_hf.set_turbo_config(m.config, cfg)
    return m


def test_attention_fn_without_turbo_cache_rotates_q_and_k(pytorch_reference_kernels):
    """No TurboCache (model(ids), DynamicCache): the attention fn rotates both, once."""
    q, k, v = outlier_qkv(d=128, L=48)
    cfg = TurboConfig(bits=8, rotate_qk="hadamard")
    out, _ = turbo_attention_forward(_module(128, cfg), q, k, v, None)
    assert torch.equal(out, R.turbo_attention(rotate(q), rotate(k), v))
    out, _ = turbo_attention_forward(_module(128, cfg), q[:, :, -5:], k, v, None)  # decode over a DynamicCache
    assert torch.equal(out, R.turbo_attention(rotate(q[:, :, -5:]), rotate(k), v))
    exact = torch_attention(q.float(), k.float(), v.float())
    assert rel(turbo_attention_forward(_module(128, cfg), q, k, v, None)[0], exact) < 0.05


# ------------------------------------------------------------------------------------------ tiny models
@pytest.mark.parametrize("arch_name", ["llama", "gemma3"])
def test_generate_with_rotation_tracks_reference(arch_name, tm, pytorch_reference_kernels):
    """Same bounds as test_generation.py (mean gap < 0.4, max < 1.6), int4 block 16 so blocks get packed."""
    from test_generation import _assert_tracks  # same folder (pytest puts it on sys.path): its bounds and helper

    cfg = TurboConfig(bits=4, block_size=16, rotate_qk="hadamard", name="int4-b16-had")
    model = tm.make_model(arch_name, attn="turbo_int8")
    turbo_attn_hf.set_turbo_config(model, cfg)
    ids = tm.token_ids(2, 20)
    out = model.generate(ids, max_new_tokens=13, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, TurboCache) and cache.turbo_config.rotate_qk == "hadamard"
    assert all(l.rotated for l in cache.layers if isinstance(l, TurboLayer))
    _assert_tracks(tm.make_model(arch_name), out.sequences, 20)
    # the no-cache path (log-likelihood) rotates inside the attention fn: logits near the reference's
    with torch.no_grad():
        a = model(out.sequences, use_cache=False).logits.float()
        b = tm.make_model(arch_name)(out.sequences).logits.float()
    assert tm.rel_rms(a, b) < 0.1
