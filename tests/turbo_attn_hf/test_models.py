"""Whole tiny models with attn_implementation="turbo_int8" against their sdpa/eager twins (no cache).

Architectures and what each exercises: see conftest.py. Error metric: relative RMS of the logits over all
positions (FLA style) plus max-abs. Bounds are measured numbers plus margin; each test also checks that
dropping the feature it covers (window, softcap, scale, padding) would move the logits far past the bound.
"""
from __future__ import annotations

import logging

import pytest
import torch

import turbo_attn_hf
from turbo_attn_hf import TurboUnsupportedError

# turbo_int8 (Triton prefill kernel, interpreter) vs the bf16 reference (sdpa; eager for Gemma-2), batch
# 2 x 40 tokens, measured relative RMS: llama 0.020, qwen2 0.023, mistral 0.021, phi3 0.030, gemma2 0.019,
# gemma3 0.018 (max-abs 0.10-0.29 on logits of RMS 1.1-1.4); the same models' bf16-vs-fp32-eager floor
# is 0.013-0.018. Bounds: 0.05 and 0.6.
LOGITS_REL_BOUND = 0.05
LOGITS_ABS_BOUND = 0.6
SEQ = 40


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits.float()


def test_logits_match_reference(arch, tm):
    model = tm.make_model(arch)
    ids = tm.token_ids(2, SEQ)
    ref = _logits(model, ids)
    model.set_attn_implementation("turbo_int8")
    assert model.config._attn_implementation == "turbo_int8"
    out = _logits(model, ids)
    err, mx = tm.rel_rms(out, ref), (out - ref).abs().max().item()
    assert err < LOGITS_REL_BOUND and mx < LOGITS_ABS_BOUND, f"{arch}: rel {err:.4f} max {mx:.3f}"

    # The check can see a dropped feature: measured 0.36 (qwen2 window), 0.83 (mistral window),
    # 0.49 / 0.24 / 0.26 (gemma2 window / softcap / query_pre_attn_scalar), 0.51 (gemma3 window);
    # all > 4x the bound.
    ablations = {
        "qwen2": [dict(sliding_window=10**6)],
        "mistral": [dict(sliding_window=10**6)],
        "gemma2": [dict(sliding_window=10**6), dict(attn_logit_softcapping=None), dict(query_pre_attn_scalar=256)],
        "gemma3": [dict(sliding_window=10**6)],
    }.get(arch, [])
    for over in ablations:
        wrong = _logits(tm.make_model(arch, **over), ids)
        assert tm.rel_rms(wrong, ref) > 4 * LOGITS_REL_BOUND, (arch, over)


def test_from_pretrained_with_turbo_int8(tmp_path, tm):
    model = tm.make_model("llama")
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    from turbo_attn_hf.loading import LOAD_KWARGS  # no Hub kernels offline (transformers >= 5.25 defaults to them)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="turbo_int8", dtype=torch.bfloat16,
                                                  **LOAD_KWARGS)
    assert loaded.config._attn_implementation == "turbo_int8"
    ids = tm.token_ids(1, 24)
    model.set_attn_implementation("turbo_int8")
    assert torch.equal(_logits(loaded.eval(), ids), _logits(model, ids))


@pytest.mark.parametrize("arch_name", ["llama", "mistral", "gemma2"])
def test_left_padded_batch_matches_rows_alone(arch_name, tm):
    """Rows of 36 and 22 tokens, the short one left-padded: each row's logits equal the row run alone."""
    model = tm.make_model(arch_name, attn="turbo_int8")
    long_ids, short_ids = tm.token_ids(1, 36, seed=3), tm.token_ids(1, 22, seed=4)
    pad = 36 - 22
    ids = torch.cat([long_ids, torch.cat([torch.zeros(1, pad, dtype=torch.long), short_ids], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    batch = _logits(model, ids, attention_mask=mask)
    alone_long, alone_short = _logits(model, long_ids), _logits(model, short_ids)
    # Measured relative RMS batch-vs-alone: long row 0 (same K/V); short row 0.018-0.022 (the K mean and
    # the V block scales see the pad positions). Bound 0.05 (the turbo-vs-sdpa bound). Ignoring the
    # padding (attention_mask dropped) measured 0.28-0.70.
    assert tm.rel_rms(batch[0], alone_long[0]) < 1e-6
    err = tm.rel_rms(batch[1, pad:], alone_short[0])
    assert err < LOGITS_REL_BOUND, err
    unmasked = _logits(model, ids)
    assert tm.rel_rms(unmasked[1, pad:], alone_short[0]) > 4 * LOGITS_REL_BOUND


def test_float32_model_runs_through_bf16_cast(tm, caplog):
    ref_model = tm.make_model("llama", dtype=torch.float32)
    ids = tm.token_ids(2, 24)
    ref = _logits(ref_model, ids)
    ref_model.set_attn_implementation("turbo_int8")
    turbo_attn_hf.capabilities._logged.discard(f"cast-{torch.float32}")
    with caplog.at_level(logging.WARNING, logger="turbo_attn_hf"):
        out = _logits(ref_model, ids)
    assert sum("cast to torch.bfloat16" in r.message for r in caplog.records) == 1  # once, not per layer
    assert out.dtype == torch.float32
    # measured 0.015 relative RMS against fp32 sdpa; bound 0.05.
    assert tm.rel_rms(out, ref) < LOGITS_REL_BOUND


def test_unsupported_head_dim_is_refused(tm):
    model = tm.make_model("llama", head_dim=32)
    model.set_attn_implementation("turbo_int8")
    with pytest.raises(TurboUnsupportedError, match=r"llama has head_dim 32.*\(64, 80, 96, 128, 256\)"):
        _logits(model, tm.token_ids(1, 8))


def test_output_attentions_is_refused(tm):
    model = tm.make_model("llama", attn="turbo_int8")
    with pytest.raises(TurboUnsupportedError, match="output_attentions"):
        model(tm.token_ids(1, 8), output_attentions=True)


def test_packed_sequences_and_bidirectional_are_refused(tm):
    model = tm.make_model("llama", attn="turbo_int8")
    ids = tm.token_ids(1, 12)
    packed_positions = torch.cat([torch.arange(6), torch.arange(6)])[None]
    with pytest.raises(TurboUnsupportedError, match="packed sequences"):
        _logits(model, ids, position_ids=packed_positions, use_cache=False)  # (with a cache HF ignores packing)
    model.config.is_causal = False
    with pytest.raises(TurboUnsupportedError, match="bidirectional attention"):
        _logits(model, ids)


def test_training_uses_pytorch_attention_and_backpropagates(tm):
    model = tm.make_model("mistral", dtype=torch.float32)
    ids = tm.token_ids(2, 20)
    model.train()
    ref_loss = model(ids, labels=ids).loss
    ref_loss.backward()
    ref_grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.zero_grad()
    model.set_attn_implementation("turbo_int8")
    loss = model(ids, labels=ids).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    # unquantized fallback: same loss and gradient as sdpa up to fp32 reduction order
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad, ref_grad, rtol=1e-3, atol=1e-6)


@pytest.mark.gpu
def test_logits_match_reference_on_gpu(arch, tm):
    """GPU: compiled kernels, the same tiny models and bounds as test_logits_match_reference (same math)."""
    model = tm.make_model(arch).cuda()
    ids = tm.token_ids(2, SEQ).cuda()
    ref = _logits(model, ids)
    model.set_attn_implementation("turbo_int8")
    out = _logits(model, ids)
    err, mx = tm.rel_rms(out, ref), (out - ref).abs().max().item()
    assert err < LOGITS_REL_BOUND and mx < LOGITS_ABS_BOUND, f"{arch}: rel {err:.4f} max {mx:.3f}"
