"""eval/fidelity.py additions of issue 23: --rotate-qk variants, --max-tokens truncation, the per-layer diagnostic."""

import copy

import pytest
import torch

from turbo_attn_hf.eval import fidelity as fid


def test_with_rotation_variants():
    assert fid.with_rotation(["int8", "int4:sink_blocks=0"], "both") == [
        "int8", "int8:rotate_qk=hadamard", "int4:sink_blocks=0", "int4:sink_blocks=0,rotate_qk=hadamard"]
    assert fid.with_rotation(["int8"], "none") == ["int8"]
    names = [i.name for i in fid.impls_for(fid.with_rotation(["int8"], "hadamard"))]
    assert names == ["sdpa-bf16", "turbo-int8[rotate_qk=hadamard]"]
    with pytest.raises(ValueError):
        fid.with_rotation(["int8"], "yes")


def test_truncate_keeps_the_answer():
    ex = fid.Example(torch.arange(100), 70)
    t = fid.truncate_examples([ex], 50)[0]
    assert torch.equal(t.ids, torch.arange(50, 100)) and t.prompt_len == 20
    t = fid.truncate_examples([ex], 20)[0]  # answer (30) longer than the budget: one prompt token left
    assert torch.equal(t.ids, torch.arange(69, 100)) and t.prompt_len == 1
    assert fid.truncate_examples([ex], 500)[0].ids.shape[0] == 100


def test_layer_diagnostic_on_a_tiny_model(monkeypatch):
    from turbo_attn_hf import capabilities

    monkeypatch.setattr(capabilities, "triton_interpret", lambda: False)  # the PyTorch reference: fast on CPU
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from turbo_attn_hf.attention import turbo_attention_forward

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    impls = fid.impls_for(fid.with_rotation(["int8"], "both"))
    ex = fid.Example(torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(1)), 20)
    diag = fid.layer_diagnostic(model, [ex, ex], impls)
    assert ALL_ATTENTION_FUNCTIONS["turbo_int8"] is turbo_attention_forward  # the override is removed
    assert set(diag) == {"turbo-int8", "turbo-int8[rotate_qk=hadamard]"}
    for layers in diag.values():
        assert [l["layer"] for l in layers] == [0, 1]
        for l in layers:
            assert 0 < l["err_bf16"] < l["err"] < 0.1 and l["q_ratio"][0] >= 1 and l["k_ratio_rot"][1] >= 1
    assert "| layer |" in fid.diag_markdown(diag)
