"""Tiny random Hugging Face models for the turbo_int8 model tests (no Hub access: built from configs).

Each architecture exercises one seam of the attention function:
  llama    GQA 4:1, head_dim 64
  qwen2    sliding window on layer 1 only (use_sliding_window, max_window_layers=1), window 8, qkv bias
  mistral  sliding window 12 on every layer, GQA 2:1
  phi3     head_dim 96 (non-power of two), fused qkv
  gemma2   head_dim 256, attention logit softcap 5, query_pre_attn_scalar 64 (scale != d**-0.5),
           alternating sliding (window 12) / full layers; its reference is "eager" (sdpa has no softcap)
  gemma3   (text) head_dim 256, q/k norms, query_pre_attn_scalar 64, sliding (window 12) + full layer

initializer_range 0.1 (instead of 0.02) makes attention rows peaked, so a dropped window, mask or
softcap moves the logits far more than INT8 quantization does (the tests check that margin).
Weights are bfloat16: bf16 matmuls run fine on CPU, and bf16/fp16 is the kernels' input dtype.
"""
from __future__ import annotations

import pytest
import torch

import turbo_attn_hf  # noqa: F401  (registers turbo_int8)

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _configs():
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    return {
        "llama": (LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=64, **COMMON), "sdpa"),
        "qwen2": (Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                              num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                              max_window_layers=1, **COMMON), "sdpa"),
        "mistral": (MistralConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, sliding_window=12, **COMMON), "sdpa"),
        "phi3": (Phi3Config(hidden_size=192, intermediate_size=256, num_attention_heads=2,
                            num_key_value_heads=2, **COMMON), "sdpa"),
        "gemma2": (Gemma2Config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=64,
                                attn_logit_softcapping=5.0, final_logit_softcapping=30.0, sliding_window=12,
                                **COMMON), "eager"),
        "gemma3": (Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=64, sliding_window=12,
                                    layer_types=["sliding_attention", "full_attention"], **COMMON), "sdpa"),
    }


ARCHS = ("llama", "qwen2", "mistral", "phi3", "gemma2", "gemma3")


def make_model(arch: str, dtype=torch.bfloat16, seed: int = 0, attn: str | None = None, **overrides):
    """A tiny random causal LM of ``arch`` in eval mode; ``attn`` defaults to the reference implementation."""
    from transformers import AutoModelForCausalLM

    config, ref_attn = _configs()[arch]
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn or ref_attn, dtype=dtype)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens (no early stop / pad)
    return model.eval()


def reference_attn(arch: str) -> str:
    return _configs()[arch][1]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS of (a - b) relative to the RMS of b (FLA-style error for quantized outputs)."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def token_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def tm():
    """The helpers of this file (test modules cannot import a conftest by name)."""
    from types import SimpleNamespace

    return SimpleNamespace(make_model=make_model, reference_attn=reference_attn, rel_rms=rel_rms,
                           token_ids=token_ids, turbo_cache_available=turbo_cache_available, ARCHS=ARCHS,
                           VOCAB=VOCAB)


@pytest.fixture
def pytorch_reference_kernels(monkeypatch):
    """Run INT8 prefill and decode attention through kernels/reference.py instead of the Triton interpreter.

    Same quantized math (the kernels are tested against it in tests/kernels); ~4x faster on CPU, which is
    what lets the generate() tests fit the CPU budget. test_generate_through_triton_kernels still runs
    the Triton kernels. (Cache packing keeps using its kernel: it has no PyTorch path; the rotary embedding
    runs HF's own ops, which the fused kernel equals bit for bit.) No effect on CUDA.
    """
    from turbo_attn_hf import capabilities

    monkeypatch.setattr(capabilities, "triton_interpret", lambda: False)
    try:
        from turbo_attn_hf import cache
    except ImportError:
        return
    monkeypatch.setattr(cache, "use_triton", lambda device: device.type == "cuda")
    from turbo_attn_hf import ops

    monkeypatch.setattr(ops, "use_triton", lambda device: device.type == "cuda")
    from turbo_attn_hf.kernels import rope

    monkeypatch.setattr(rope, "use_triton", lambda device: device.type == "cuda")


def turbo_cache_available() -> bool:
    try:
        from turbo_attn_hf.cache import TurboCache  # noqa: F401
    except ImportError:
        return False
    return True
