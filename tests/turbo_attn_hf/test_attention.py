"""Unit tests of the HF glue: registration, the mask function, the attention function's routing and errors.

No model here (see test_models.py): a bare module stands in for a transformers attention module.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import turbo_attn_hf
from turbo_attn_hf import TurboConfig, TurboUnsupportedError, capabilities as caps
from turbo_attn_hf.attention import torch_attention, turbo_attention_forward
from turbo_attn_hf.masks import classify_mask_function, turbo_mask

mu = pytest.importorskip("transformers.masking_utils")


def _module(head_dim=64, is_causal=True, **config):
    m = torch.nn.Module()
    m.is_causal = is_causal
    m.config = SimpleNamespace(model_type="tinytest", architectures=["TinyTestForCausalLM"], **config)
    return m


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def _qkv(b=2, hq=4, hk=2, lq=5, lk=21, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, lk, d, generator=g).to(dtype)
    return q, k, v


# ------------------------------------------------------------------------------------------ registration
def test_registered_under_a_safe_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert turbo_attn_hf.REGISTERED
    assert ALL_ATTENTION_FUNCTIONS["turbo_int8"] is turbo_attention_forward
    assert "turbo_int8" in AttentionInterface._global_mapping
    assert ALL_MASK_ATTENTION_FUNCTIONS["turbo_int8"] is turbo_mask
    # transformers matches these substrings to pick code paths
    for bad in ("flash", "sdpa", "flex_attention", "paged"):
        assert bad not in turbo_attn_hf.ATTN_NAME


def test_generate_hook_installed_once():
    from transformers.generation.utils import GenerationMixin

    from turbo_attn_hf import generation

    fn = GenerationMixin._prepare_cache_for_generation
    assert getattr(fn, "_turbo_attn_wrapped", False)
    assert generation.install()  # idempotent: no second wrapper
    assert GenerationMixin._prepare_cache_for_generation is fn


def test_generate_hook_warns_when_transformers_lacks_the_method(monkeypatch):
    from transformers.generation.utils import GenerationMixin

    from turbo_attn_hf import generation

    monkeypatch.delattr(GenerationMixin, "_prepare_cache_for_generation")
    with pytest.warns(RuntimeWarning, match="_prepare_cache_for_generation"):
        assert generation.install() is False


def _run_python(code: str) -> None:
    """Run ``code`` in a fresh interpreter (import-time behaviour); it prints 'ok' when its asserts held."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_kernels_import_without_transformers():
    """turbo_attn_hf.kernels must import (and nothing register) when transformers is absent."""
    _run_python(
        "import sys; sys.modules['transformers'] = None\n"
        "import turbo_attn_hf, turbo_attn_hf.kernels, turbo_attn_hf.kernels.reference\n"
        "assert turbo_attn_hf.REGISTERED is False\n"
        "print('ok')\n"
    )


def test_import_is_light_and_registers_when_transformers_loads():
    """`import turbo_attn_hf` imports neither torch nor transformers (fast CLI start); loading transformers'
    modeling code afterwards registers turbo_int8 and the generate() hook."""
    _run_python(
        "import sys, turbo_attn_hf\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n"
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
        "from transformers.generation.utils import GenerationMixin\n"
        "assert 'turbo_int8' in ALL_ATTENTION_FUNCTIONS\n"
        "assert getattr(GenerationMixin._prepare_cache_for_generation, '_turbo_attn_wrapped', False)\n"
        "assert turbo_attn_hf.REGISTERED is True\n"
        "print('ok')\n"
    )


# ------------------------------------------------------------------------------------------ settings
def test_default_preset_and_env_override(monkeypatch):
    monkeypatch.delenv("TURBO_ATTN_PRESET", raising=False)
    assert turbo_attn_hf.get_turbo_config().name == "int4"
    monkeypatch.setenv("TURBO_ATTN_PRESET", "mixed")
    assert turbo_attn_hf.get_turbo_config().name == "mixed"
    monkeypatch.setenv("TURBO_ATTN_PRESET", "nope")
    with pytest.raises(turbo_attn_hf.TurboConfigError, match="unknown preset 'nope'"):
        turbo_attn_hf.get_turbo_config()


def test_set_turbo_config_stores_a_json_serialisable_dict():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_hidden_layers=1, vocab_size=64)
    holder = SimpleNamespace(config=cfg)
    assert turbo_attn_hf.set_turbo_config(holder, "int8") is holder
    assert turbo_attn_hf.get_turbo_config(holder).name == "int8"
    assert turbo_attn_hf.get_turbo_config(cfg).bits == 8
    custom = TurboConfig(bits=4, softmax="sas", name="mine")
    turbo_attn_hf.set_turbo_config(cfg, custom)
    d = json.loads(cfg.to_json_string())
    assert d["turbo_attn"]["softmax"] == "sas"
    assert type(cfg).from_dict(d).turbo_attn["name"] == "mine"  # survives save/load
    with pytest.raises(TypeError, match="preset name"):
        turbo_attn_hf.set_turbo_config(cfg, 3)


def test_switching_presets_back_returns_the_same_config_object(tmp_path, monkeypatch):
    """Memos keyed by the config object (layer formats, cache templates, resolved rotate_qk) keep hitting when a
    model switches presets and back, and across caches made from a preset name: one TurboConfig per settings (equal
    dicts of two models, a preset name, the same YAML's content), a packaged preset's YAML read once; a YAML path is
    read again each time (it may have changed)."""
    from transformers import LlamaConfig

    from turbo_attn_hf import TurboCache, config as config_mod
    from turbo_attn_hf.config import resolve_rotate_qk, shared_config

    monkeypatch.setattr(config_mod, "_SHARED", {})  # no earlier test's entries: none of this test's is evicted
    monkeypatch.setattr(config_mod, "_SHARED_PRESETS", {})
    monkeypatch.setattr(caps, "_dict_cache", {})  # nor a per-model entry of a config object at a reused address
    cfgs = [LlamaConfig(hidden_size=128, num_attention_heads=2, num_hidden_layers=1, vocab_size=64) for _ in range(2)]
    turbo_attn_hf.set_turbo_config(cfgs[0], "int4")
    first = turbo_attn_hf.get_turbo_config(cfgs[0])
    resolved = resolve_rotate_qk(first, cfgs[0])
    turbo_attn_hf.set_turbo_config(cfgs[0], "int8")
    assert turbo_attn_hf.get_turbo_config(cfgs[0]).bits == 8
    turbo_attn_hf.set_turbo_config(cfgs[0], "int4")
    assert turbo_attn_hf.get_turbo_config(cfgs[0]) is first
    assert resolve_rotate_qk(turbo_attn_hf.get_turbo_config(cfgs[0]), cfgs[0]) is resolved
    turbo_attn_hf.set_turbo_config(cfgs[1], "int4")
    assert turbo_attn_hf.get_turbo_config(cfgs[1]) is first
    turbo_attn_hf.set_turbo_config(cfgs[1], dataclasses.replace(TurboConfig.preset("int4"), sink_blocks=3))
    assert turbo_attn_hf.get_turbo_config(cfgs[1]).sink_blocks == 3
    assert turbo_attn_hf.get_turbo_config(cfgs[0]) is first
    # caches built from a preset name or a dict share the model's object (TurboCache resolves rotate_qk per model)
    assert shared_config("int4") is first and shared_config(first.to_dict()) is first
    assert TurboCache("int4", config=cfgs[0]).turbo_config is TurboCache("int4", config=cfgs[0]).turbo_config
    assert TurboCache("int4", config=cfgs[0]).turbo_config is resolved
    assert TurboConfig.preset("int4") is not first  # the public constructor still makes a new object
    path = tmp_path / "mine.yaml"
    dataclasses.replace(first, sink_blocks=2).to_yaml(path)
    mine = shared_config(str(path))
    assert mine.sink_blocks == 2 and shared_config(str(path)) is mine
    dataclasses.replace(first, sink_blocks=5).to_yaml(path)
    assert shared_config(str(path)).sink_blocks == 5


# ------------------------------------------------------------------------------------------ mask function
def test_mask_recognises_causal_and_sliding_window():
    assert classify_mask_function(mu.causal_mask_function) == (True, None)
    assert classify_mask_function(mu.sliding_window_causal_mask_function(7)) == (True, 7)


@pytest.mark.parametrize(
    "make_fn, feature",
    [
        (lambda: mu.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long)), "chunked attention"),
        (lambda: mu.bidirectional_mask_function, "bidirectional attention"),
        (lambda: mu.sliding_window_bidirectional_mask_function(4), "bidirectional attention"),
        (lambda: mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: q < 2), "custom mask functions"),
        (lambda: mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: k > 0), "custom mask functions"),
        (lambda: mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(torch.zeros(1, 4))),
         "packed sequences"),
    ],
    ids=["chunked", "bidirectional", "bidirectional-window", "or-mask", "and-mask", "packed"],
)
def test_mask_refuses_what_it_cannot_represent(make_fn, feature):
    cfg = SimpleNamespace(architectures=["TinyTestForCausalLM"])
    with pytest.raises(TurboUnsupportedError, match=feature) as e:
        turbo_mask(batch_size=1, q_length=4, kv_length=4, mask_function=make_fn(), config=cfg)
    assert "TinyTestForCausalLM" in str(e.value)


def test_mask_padding_becomes_key_valid_vector():
    am = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    # no padding at all -> None (the kernels skip the validity loads)
    assert turbo_mask(2, 6, 6, attention_mask=torch.ones(2, 6, dtype=torch.bool),
                      mask_function=mu.causal_mask_function) is None
    assert turbo_mask(2, 6, 6, attention_mask=None) is None
    kv = turbo_mask(2, 6, 6, attention_mask=am, mask_function=mu.causal_mask_function)
    assert kv.dtype == torch.bool and kv.shape == (2, 6) and torch.equal(kv, am)
    # sliding-window cache layer: keys start at kv_offset (decode step: 1 query, 3 kept keys + 1 new)
    kv = turbo_mask(2, 1, 4, q_offset=4, kv_offset=1, attention_mask=am,
                    mask_function=mu.sliding_window_causal_mask_function(4))
    assert torch.equal(kv, am[:, 1:5])
    # a mask shorter than the keys: missing positions are padding (as transformers' prepare_padding_mask)
    kv = turbo_mask(2, 2, 8, q_offset=6, attention_mask=am, mask_function=mu.causal_mask_function)
    assert kv.shape == (2, 8) and not kv[:, 6:].any()


def test_mask_refuses_static_cache_alignment():
    """A chunk of queries against a static cache's padded capacity is misaligned: refused. One query token is exact
    once every slot after it is masked (the static TurboCache's decode step, or any static cache)."""
    with pytest.raises(TurboUnsupportedError, match="static cache"):
        turbo_mask(1, 3, 16, q_offset=0, kv_offset=0, mask_function=mu.causal_mask_function)
    with pytest.raises(TurboUnsupportedError, match="static cache"):
        turbo_mask(1, 3, 16, q_offset=torch.tensor(4), mask_function=mu.causal_mask_function)
    kv = turbo_mask(1, 1, 16, q_offset=torch.tensor(4), mask_function=mu.causal_mask_function)
    assert torch.equal(kv, (torch.arange(16) <= 4)[None])


# ------------------------------------------------------------------------------------------ attention fn
def test_attention_plumbing_matches_reference():
    """scaling, GQA, bottom-right causal, window, softcap and key_valid reach the kernel: same output as
    kernels.reference.turbo_attention called directly."""
    from turbo_attn_hf.kernels.reference import turbo_attention as ref

    q, k, v = _qkv(lq=5, lk=21)
    key_valid = torch.ones(2, 21, dtype=torch.bool)
    key_valid[1, 12:14] = False
    mod = _module()
    turbo_attn_hf.set_turbo_config(mod, TurboConfig(bits=4, softmax="sas", name="t"))
    args = dict(scale=0.1, window=9, softcap=2.0, key_valid=key_valid)
    out, w = turbo_attention_forward(mod, q, k, v, key_valid, scaling=0.1, sliding_window=9, softcap=2.0)
    assert w is None and out.shape == (2, 5, 4, 64) and out.dtype == torch.bfloat16
    exp = ref(q, k, v, causal=True, softmax="sas", **args)
    # Triton kernel (interpreter) vs its PyTorch twin: measured 3.9e-3 relative RMS (bf16 output rounding); bound 1e-2.
    assert rel_rms(out, exp) < 1e-2
    # Dropping any one argument moves the reference by (measured) window 0.77, key_valid 0.38,
    # softcap 0.15, scale 0.093: all far above the bound, so the check above sees a lost argument.
    for drop in ("window", "key_valid", "softcap", "scale"):
        wrong = ref(q, k, v, causal=True, softmax="sas", **{**args, drop: None})
        assert rel_rms(wrong, exp) > 5e-2, drop


def test_turbo_config_reaches_the_kernel(monkeypatch):
    from turbo_attn_hf import attention

    seen = {}

    def fake(q, k, v, **kw):
        seen.update(kw)
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)

    monkeypatch.setattr(attention, "_prefill_fn", lambda device, model: fake)
    mod = _module()
    turbo_attn_hf.set_turbo_config(mod, TurboConfig(softmax="sas", sas_threshold=4.5, smooth_k=False))
    q, k, v = _qkv()
    turbo_attention_forward(mod, q, k, v, None)
    assert seen["softmax"] == "sas" and seen["sas_threshold"] == 4.5 and seen["smooth_k"] is False
    assert seen["causal"] is True and seen["window"] is None and seen["key_valid"] is None


def test_attention_is_causal_from_module_and_kwargs():
    from turbo_attn_hf.kernels.reference import turbo_attention as ref

    q, k, v = _qkv(b=1, lq=7, lk=7)
    full = ref(q, k, v, causal=False)
    causal = ref(q, k, v, causal=True)
    out_mod, _ = turbo_attention_forward(_module(is_causal=False), q, k, v, None)
    out_kw, _ = turbo_attention_forward(_module(is_causal=True), q, k, v, None, is_causal=False)
    out_c, _ = turbo_attention_forward(_module(is_causal=True), q, k, v, None)
    assert rel_rms(out_mod, full) < 1e-2 and rel_rms(out_kw, full) < 1e-2 and rel_rms(out_c, causal) < 1e-2


def test_turbo_cache_layer_is_used_when_keys_carry_it():
    calls = {}

    class FakeLayer:
        def attention(self, query, key, value, **kw):
            calls.update(kw)
            return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype)

    q, k, v = _qkv(lq=1, lk=9)
    k.turbo_cache_layer = FakeLayer()
    kv = torch.ones(2, 9, dtype=torch.bool)
    kv[0, 0] = False
    out, _ = turbo_attention_forward(_module(), q, k, v, kv, scaling=0.2, sliding_window=4, softcap=3.0)
    assert out.shape == (2, 1, 4, 64)
    assert calls["scale"] == 0.2 and calls["window"] == 4 and calls["softcap"] == 3.0 and calls["causal"] is True
    assert torch.equal(calls["key_valid"], kv)


def test_head_dim_error_names_model_value_and_fix():
    q, k, v = _qkv(d=112)
    with pytest.raises(TurboUnsupportedError) as e:
        turbo_attention_forward(_module(), q, k, v, None)
    msg = str(e.value)
    assert "TinyTestForCausalLM" in msg and "head_dim 112" in msg and "(64, 80, 96, 128, 256)" in msg
    assert "attn_implementation='sdpa'" in msg


def test_refuses_output_attentions_and_bad_shapes():
    q, k, v = _qkv(lq=5, lk=21)
    with pytest.raises(TurboUnsupportedError, match="output_attentions"):
        turbo_attention_forward(_module(), q, k, v, None, output_attentions=True)
    with pytest.raises(TurboUnsupportedError, match="q_len <= kv_len"):
        turbo_attention_forward(_module(), k.repeat(1, 2, 1, 1), q[:, :2], q[:, :2], None)
    dense = torch.ones(2, 1, 5, 21, dtype=torch.bool)
    with pytest.raises(TurboUnsupportedError, match="prepared attention mask"):
        turbo_attention_forward(_module(), q, k, v, dense)
    with pytest.raises(TurboUnsupportedError, match="2D attention mask"):
        turbo_attention_forward(_module(), q, k, v, torch.ones(2, 30, dtype=torch.bool))


def test_4d_single_row_mask_is_a_padding_mask():
    q, k, v = _qkv(lq=1, lk=21)
    kv = torch.ones(2, 21, dtype=torch.bool)
    kv[:, :3] = False
    bias = torch.zeros(2, 1, 1, 21).masked_fill(~kv[:, None, None, :], torch.finfo(torch.float32).min)
    a, _ = turbo_attention_forward(_module(), q, k, v, kv)
    b_, _ = turbo_attention_forward(_module(), q, k, v, bias)
    assert torch.equal(a, b_)


def test_training_falls_back_to_pytorch_attention_once(caplog):
    q, k, v = (t.float().requires_grad_() for t in _qkv(lq=6, lk=6))
    caps._logged.discard("grad-fallback")
    with caplog.at_level(logging.WARNING, logger="turbo_attn_hf"):
        out, _ = turbo_attention_forward(_module(), q, k, v, None, dropout=0.0)
        turbo_attention_forward(_module(), q, k, v, None, dropout=0.0)
    assert sum("no backward" in r.message for r in caplog.records) == 1
    exp = torch_attention(q, k, v)
    assert torch.allclose(out, exp)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_float32_is_cast_to_bf16_with_one_warning(caplog):
    q, k, v = _qkv(dtype=torch.float32)
    caps._logged.discard(f"cast-{torch.float32}")
    with caplog.at_level(logging.WARNING, logger="turbo_attn_hf"):
        out, _ = turbo_attention_forward(_module(), q, k, v, None)
        turbo_attention_forward(_module(), q, k, v, None)
    assert out.dtype == torch.float32
    assert sum("cast to torch.bfloat16" in r.message for r in caplog.records) == 1
    from turbo_attn_hf.kernels.reference import attention_fp64

    # INT8 error on N(0,1) inputs, Lk 21: measured 1.08e-2 relative RMS vs fp64 (reference); bound 3e-2.
    assert rel_rms(out, attention_fp64(q, k, v)) < 3e-2


def test_cpu_without_interpreter_uses_reference_with_one_warning(monkeypatch, caplog):
    from turbo_attn_hf.kernels.reference import turbo_attention as ref

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    caps._logged.discard("cpu-reference")
    q, k, v = _qkv()
    with caplog.at_level(logging.WARNING, logger="turbo_attn_hf"):
        out, _ = turbo_attention_forward(_module(), q, k, v, None)
        turbo_attention_forward(_module(), q, k, v, None)
    msgs = [r.message for r in caplog.records if "reference" in r.message]
    assert len(msgs) == 1 and "slow" in msgs[0] and "INT8" in msgs[0]
    assert torch.equal(out, ref(q, k, v, softmax=turbo_attn_hf.get_turbo_config().softmax))


def test_module_checks_run_once_and_expire_on_set_turbo_config():
    mod = _module()
    q, k, v = _qkv()
    turbo_attention_forward(mod, q, k, v, None)
    st = mod._turbo_attn_state
    turbo_attention_forward(mod, q, k, v, None)
    assert mod._turbo_attn_state is st
    turbo_attn_hf.set_turbo_config(mod, "mixed")
    turbo_attention_forward(mod, q, k, v, None)
    assert mod._turbo_attn_state is not st and mod._turbo_attn_state.turbo.name == "mixed"


# ------------------------------------------------------------------------------------------ prefill_attention
def _fp64_attention(q, k, v, scale, causal, window, key_valid):
    """Exact attention in fp64 with the kernels' semantics (bottom-right causal; a row with no key is 0)."""
    q, k, v = q.double(), k.double(), v.double()
    hq, hk = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    lq, lk = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) * scale
    qpos = torch.arange(lq)[:, None] + (lk - lq)
    kpos = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        ok &= kpos <= qpos
    if window is not None:
        ok &= (qpos - kpos) < window
    ok = ok[None, None]
    if key_valid is not None:
        ok = ok & key_valid[:, None, None, :]
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("lq,lk", [(21, 21), (5, 21), (1, 9)])
@pytest.mark.parametrize("causal,window,padded", [(True, None, False), (True, 6, False), (True, None, True),
                                                  (False, None, True), (True, 6, True)])
def test_exact_attention_equals_fp64_attention(lq, lk, causal, window, padded):
    """``prefill_attention: exact`` keeps the kernels' semantics: GQA, bottom-right causal, window, padding, and
    a row with no valid key is 0 (SDPA gives NaN there); fp32 inputs, so the bound is fp32 rounding."""
    from turbo_attn_hf.attention import exact_attention

    q, k, v = _qkv(lq=lq, lk=lk, dtype=torch.float32)
    kv = None
    if padded:
        kv = torch.ones(2, lk, dtype=torch.bool)
        kv[0, : lk - 1] = False  # row 0: only the last key is valid, so early causal rows have none
    out = exact_attention(q, k, v, scale=0.11, causal=causal, window=window, key_valid=kv)
    exp = _fp64_attention(q, k, v, 0.11, causal, window, kv)
    assert out.shape == (2, lq, 4, 64) and out.is_contiguous()
    assert torch.isfinite(out).all()
    assert (out.double() - exp).abs().max() < 1e-5


def test_exact_attention_with_softcap_is_torch_attention():
    from turbo_attn_hf.attention import exact_attention

    q, k, v = _qkv(lq=7, lk=7, dtype=torch.float32)
    out = exact_attention(q, k, v, scale=0.2, softcap=3.0)
    assert torch.equal(out, torch_attention(q, k, v, scale=0.2, softcap=3.0))


def test_prefill_attention_resolution(monkeypatch):
    """``auto``: exact on sm_90 CUDA devices (where it is the faster path), INT8 on other GPUs, on CPU and with a
    softcap; explicit values are kept; a bad value is a one-line error naming the field."""
    from turbo_attn_hf import config as C

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    auto = TurboConfig()
    assert auto.prefill_attention == "auto"
    assert C.prefill_attention_path(auto, cpu) == "int8"
    monkeypatch.setattr(C, "_capability_major", lambda device: 9)
    assert C.prefill_attention_path(auto, cuda) == "exact"
    assert C.prefill_attention_path(auto, cuda, softcap=30.0) == "int8"
    monkeypatch.setattr(C, "_capability_major", lambda device: 8)
    assert C.prefill_attention_path(auto, cuda) == "int8"
    monkeypatch.setattr(C, "_capability_major", lambda device: 9)
    # a mask of more than EXACT_MASK_LIMIT elements (padding / window at long prompts): the INT8 kernel, unless asked
    assert C.prefill_attention_path(auto, cuda, mask_elems=C.EXACT_MASK_LIMIT) == "exact"
    assert C.prefill_attention_path(auto, cuda, mask_elems=C.EXACT_MASK_LIMIT + 1) == "int8"
    assert C.prefill_attention_path(TurboConfig(prefill_attention="exact"), cuda, mask_elems=1 << 40) == "exact"
    assert C.prefill_attention_path(TurboConfig(prefill_attention="exact"), cpu) == "exact"
    assert C.prefill_attention_path(TurboConfig(prefill_attention="int8"), cuda) == "int8"
    with pytest.raises(C.TurboConfigError, match="prefill_attention='fp8' must be one of"):
        TurboConfig(prefill_attention="fp8")
    assert TurboConfig.from_dict(TurboConfig(prefill_attention="exact").to_dict()).prefill_attention == "exact"


def test_long_plain_prompts_take_the_int8_prefill_on_sm90(monkeypatch):
    """``auto`` on sm_90: from ``PREFILL_INT8_FROM_KEYS`` keys at head_dim 128 / 256 a plain prompt takes the INT8
    prefill (the faster path through generate() there), not below, not at other head dims, not with a mask or SAS,
    not where the Gluon kernel would not run it; the attention entry and the cache's store queue ask with the prompt's
    keys (and V's dtype: head_dim 256 runs on 16-bit V only)."""
    from turbo_attn_hf import config as C

    cuda = torch.device("cuda", 0)
    auto, n = TurboConfig(), C.PREFILL_INT8_FROM_KEYS[(9, 128)]
    monkeypatch.setattr(C, "_capability_major", lambda device: 9)
    monkeypatch.setattr(C, "_gluon_prefill_runs", lambda device, d, cfg, dtype=None: cfg.softmax == "exact")
    assert C.prefill_attention_path(auto, cuda, keys=n, head_dim=128) == "int8"
    assert C.prefill_attention_path(auto, cuda, keys=n - 1, head_dim=128) == "exact"
    assert C.prefill_attention_path(auto, cuda, keys=4 * n, head_dim=64) == "exact"
    assert C.prefill_attention_path(auto, cuda, keys=n, head_dim=256, dtype=torch.bfloat16) == "int8"
    assert C.prefill_attention_path(auto, cuda, keys=n - 1, head_dim=256, dtype=torch.bfloat16) == "exact"
    assert C.prefill_attention_path(auto, cuda, mask_elems=n * n, keys=n, head_dim=128) == "exact"  # padding / window
    assert C.prefill_attention_path(TurboConfig(softmax="sas"), cuda, keys=n, head_dim=128) == "exact"
    assert C.prefill_attention_path(TurboConfig(prefill_attention="exact"), cuda, keys=n, head_dim=128) == "exact"
    monkeypatch.setattr(C, "_capability_major", lambda device: 8)  # unlisted: INT8 at every length, as before
    assert C.prefill_attention_path(auto, cuda, keys=16, head_dim=128) == "int8"
    monkeypatch.setattr(C, "_capability_major", lambda device: 9)
    monkeypatch.setattr(C, "_gluon_prefill_runs", lambda device, d, cfg, dtype=None: False)
    assert C.prefill_attention_path(auto, cuda, keys=n, head_dim=128) == "exact"
    q = torch.empty(1, 8, n, 128, device="meta")
    monkeypatch.setattr(C, "_gluon_prefill_runs", lambda device, d, cfg, dtype=None: cfg.softmax == "exact")
    from turbo_attn_hf import attention as A

    assert A.exact_path_elems(auto, q, q[:, :2], causal=True, window=None, softcap=None, key_valid=None,
                              device=cuda) is None
    q64 = q[..., :64]  # head_dim 64: exact at any length (mask elements 0: SDPA's own causal)
    assert A.exact_path_elems(auto, q64, q64[:, :2], causal=True, window=None, softcap=None, key_valid=None,
                              device=cuda) == 0


def test_gluon_prefill_runs_follows_the_prefills_decision(monkeypatch):
    """The rule asks the prefill's own decision (``prefill.gluon_runs``): the kernel choice and ``hopper_takes``."""
    from turbo_attn_hf import config as C
    from turbo_attn_hf.kernels import prefill

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(prefill, "hopper_takes", lambda device, d, block_n, softmax, **kw: "" if softmax == "exact"
                        else "its options")
    with prefill.chosen_kernel("portable"):
        assert not C._gluon_prefill_runs(cuda, 128, TurboConfig())
    with prefill.chosen_kernel("auto"):
        assert C._gluon_prefill_runs(cuda, 128, TurboConfig())
        assert not C._gluon_prefill_runs(cuda, 128, TurboConfig(softmax="sas"))
    # head_dim 256: the Gluon kernel only with P.V on 16-bit V, so the rule passes the prompt's V dtype on
    monkeypatch.setattr(prefill, "hopper_takes", lambda device, d, block_n, softmax, pv_half=False, **kw: ""
                        if d != 256 or pv_half else "its options")
    with prefill.chosen_kernel("auto"):
        assert C._gluon_prefill_runs(cuda, 256, TurboConfig(), torch.bfloat16)
        assert not C._gluon_prefill_runs(cuda, 256, TurboConfig(), torch.float32)


def test_prefill_attention_exact_skips_the_int8_kernel(monkeypatch):
    """Without a TurboCache, ``exact`` runs SDPA on the given K/V (the INT8 path is never asked for)."""
    from turbo_attn_hf import attention
    from turbo_attn_hf.attention import exact_attention

    monkeypatch.setattr(attention, "_prefill_fn", lambda device, model: pytest.fail("INT8 prefill called"))
    mod = _module()
    turbo_attn_hf.set_turbo_config(mod, TurboConfig(prefill_attention="exact"))
    q, k, v = _qkv(lq=9, lk=9)
    kv = torch.ones(2, 9, dtype=torch.bool)
    kv[1, :2] = False
    out, _ = turbo_attention_forward(mod, q, k, v, kv, scaling=0.3, sliding_window=5)
    assert torch.equal(out, exact_attention(q, k, v, scale=0.3, causal=True, window=5, key_valid=kv))


def test_exact_mask_elems_counts_what_exact_attention_builds():
    from turbo_attn_hf.attention import exact_mask_elems

    q, k, _ = _qkv(b=2, lq=5, lk=21)
    q2, k2, _ = _qkv(b=2, lq=21, lk=21)
    kv = torch.ones(2, 21, dtype=torch.bool)
    assert exact_mask_elems(q2, k2, True, None, None) == 0  # SDPA's is_causal, no mask
    assert exact_mask_elems(q2, k2, False, None, None) == 0
    assert exact_mask_elems(q, k, True, None, None) == 5 * 21  # bottom-right causal: a mask
    assert exact_mask_elems(q2, k2, True, 4, None) == 21 * 21
    assert exact_mask_elems(q2, k2, True, None, kv) == 2 * 21 * 21


@pytest.mark.parametrize("path", ["int8", "exact"])
def test_decoding_over_a_dynamic_cache_is_logged_on_either_path(path, caplog):
    """One query over more keys without a TurboCache (a DynamicCache): one log line that the cache is not
    quantized, whichever attention path runs."""
    caps._logged.discard("decode-unquantized-cache")
    mod = _module()
    turbo_attn_hf.set_turbo_config(mod, TurboConfig(prefill_attention=path))
    q, k, v = _qkv(lq=1, lk=9)
    with caplog.at_level(logging.INFO, logger="turbo_attn_hf"):
        for _ in range(2):
            out, _ = turbo_attention_forward(mod, q, k, v, None)
    assert out.shape == (2, 1, 4, 64)
    assert sum("not a TurboCache" in r.getMessage() for r in caplog.records) == 1
