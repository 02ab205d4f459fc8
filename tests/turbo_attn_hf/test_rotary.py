"""rotary.attach: a turbo_int8 model's layers rotate Q and K by the fused kernel (kernels/rope.py), bit for bit HF's
``apply_rotary_pos_emb``; every other call (another model of the family, a compiled forward, a family whose function
is not the rotate-half form, ``TURBO_ATTN_FUSED_ROPE=0``) keeps HF's own function. Attention runs through the
kernels' PyTorch reference (fixture); the rotary kernel through the interpreter on CPU."""
import logging
import types

import torch

from turbo_attn_hf import rotary
from turbo_attn_hf.kernels import interpreter, rope

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the rotary kernel in the interpreter


def _spy(monkeypatch):
    """Record the query shapes the fused kernel rotates; let it run on this machine (CPU: the interpreter)."""
    monkeypatch.setattr(rope, "use_triton", interpreter.use_triton)
    calls, real = [], rope.rope_rotate_half

    def spy(q, k, cos, sin):
        calls.append(tuple(q.shape))
        return real(q, k, cos, sin)

    monkeypatch.setattr(rope, "rope_rotate_half", spy)
    return calls


def _generate(model, ids):
    return model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)


def test_a_turbo_model_rotates_in_one_launch_with_hfs_tokens(tm, pytorch_reference_kernels, monkeypatch):
    calls = _spy(monkeypatch)
    ids = tm.token_ids(1, 12).to(DEV)
    fused = _generate(tm.make_model("llama", attn="turbo_int8").to(DEV), ids)
    layers = 2
    assert calls == [(1, 4, 12, 64)] * layers + [(1, 4, 1, 64)] * (3 * layers)  # the prompt, then each decode step
    monkeypatch.setenv("TURBO_ATTN_FUSED_ROPE", "0")
    plain = _generate(tm.make_model("llama", attn="turbo_int8").to(DEV), ids)
    assert len(calls) == 4 * layers  # turned off: HF's ops
    assert torch.equal(fused.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(fused.scores, plain.scores))


def test_another_model_of_the_family_keeps_hfs_ops(tm, pytorch_reference_kernels, monkeypatch):
    calls = _spy(monkeypatch)
    turbo = tm.make_model("llama", attn="turbo_int8").to(DEV)
    assert rotary.attach(turbo)
    sdpa = tm.make_model("llama").to(DEV)
    _generate(sdpa, tm.token_ids(1, 8).to(DEV))
    assert calls == []  # its cos is not marked
    turbo.set_attn_implementation("sdpa")  # the same weights switched back (as bench_generate does)
    _generate(turbo, tm.token_ids(1, 8).to(DEV))
    assert calls == []


def test_a_model_type_not_known_to_use_rotate_half_is_left_alone(tm):
    model = tm.make_model("llama", attn="turbo_int8")
    model.config.model_type = "cohere"  # interleaved RoPE
    assert not rotary.attach(model)
    assert not model.model.rotary_emb._forward_hooks


def test_a_compiled_forward_keeps_hfs_ops_without_a_graph_break(monkeypatch):
    calls = _spy(monkeypatch)
    family = types.ModuleType("family_a")
    family.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q * cos.unsqueeze(1), k * sin.unsqueeze(1))
    assert rotary._wrap(family)
    q = k = torch.ones(1, 2, 3, 64, dtype=torch.bfloat16, device=DEV)
    cos = torch.full((1, 3, 64), 2.0, dtype=torch.bfloat16, device=DEV)
    rotary._mark(None, None, (cos, cos))
    step = torch.compile(lambda q, k, c, s: family.apply_rotary_pos_emb(q, k, c, s), fullgraph=True, backend="eager")
    out = step(q, k, cos, cos)  # fullgraph: a graph break in the wrapper would raise
    assert torch.equal(out[0], q * 2) and calls == []


def test_a_family_whose_function_is_not_rotate_half_keeps_it_with_a_log(monkeypatch, caplog):
    calls = _spy(monkeypatch)

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J pairs (2i, 2i + 1): not what the kernel computes
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    family = types.ModuleType("family_interleaved")
    family.apply_rotary_pos_emb = interleaved
    rotary._wrap(family)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 3, 64, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    ang = torch.randn(1, 3, 64, generator=g)
    cos, sin = ang.cos().to(DEV, torch.bfloat16), ang.sin().to(DEV, torch.bfloat16)
    rotary._mark(None, None, (cos, sin))
    with caplog.at_level(logging.WARNING, logger="turbo_attn_hf"):  # the chat demo sets it to ERROR
        for _ in range(2):
            out = family.apply_rotary_pos_emb(q, k, cos, sin)
            ref = interleaved(q, k, cos, sin)
            assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert len(calls) == 1  # the check's one call, then HF's function only
    assert "family_interleaved.apply_rotary_pos_emb is not the rotate-half RoPE" in caplog.text
