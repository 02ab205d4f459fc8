"""What ``attn_implementation="turbo_int8"`` supports, which TurboConfig a model uses, and the error texts.

Capabilities are data (vLLM's attention backends declare head sizes and dtypes the same way): the table
below answers "is this model supported?" and every refusal message is built from it, naming the model,
the feature, the value, the limit and the fix.

Settings: a model's TurboConfig is stored as a plain dict under ``config.turbo_attn`` (so it survives
``save_pretrained`` / ``from_pretrained`` and JSON), on the model config and on its text config.
Without one, the default preset is used: ``int4``, or the preset named by the environment variable
``TURBO_ATTN_PRESET``. Environment variables of this package are read here and nowhere else.

No transformers import at module level: ``turbo_attn_hf.kernels`` must import without transformers, and
importing it runs ``turbo_attn_hf/__init__`` (which imports this file).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Union

import torch

from .config import TurboConfig, shared_config

logger = logging.getLogger("turbo_attn_hf")

#: The ``attn_implementation`` name we register. It must not contain "flash", "sdpa" or
#: "flex_attention": transformers matches those substrings to decide code paths.
ATTN_NAME = "turbo_int8"

# ---------------------------------------------------------------------------------------------- capabilities
#: Head dims the INT8 prefill and decode kernels are compiled for.
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
#: Attention input dtypes the kernels take directly.
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
#: float32 inputs are cast to bfloat16 before INT8 quantization (range-safe; bf16 rounding, 2^-9
#: relative, is below the INT8 step of 1/127 of the row max) and the output is cast back.
CAST_DTYPES = {torch.float32: torch.bfloat16}

#: Feature -> (supported, what happens / the fix). Used by :func:`check_model_config` and the errors.
FEATURES: dict[str, tuple[bool, str]] = {
    "causal": (True, "bottom-right aligned when q_len < kv_len (cache prefix)"),
    "non-causal (is_causal=False module)": (True, "full attention with the padding mask"),
    "gqa/mqa": (True, "K/V are never repeated"),
    "sliding_window": (True, "from the attention call's `sliding_window` (Mistral, Qwen2, Gemma-2, Phi-3)"),
    "softcap": (True, "Gemma-2 attention logit softcapping"),
    "padding (2D attention_mask)": (True, "as a per-key validity vector, left or right padding"),
    "dynamic cache / TurboCache": (True, "DynamicCache (quantized on the fly) or TurboCache"),
    "static cache": (False, "query not bottom-right aligned with the keys; use the default dynamic cache"),
    "bidirectional attention": (False, "config.is_causal=False / use_bidirectional_attention; use sdpa"),
    "chunked attention": (False, "attention_chunk_size (Llama 4 style); use sdpa"),
    "packed sequences": (False, "pass an attention_mask instead of packed position_ids, or use sdpa"),
    "custom mask functions": (False, "or_mask_function / and_mask_function / block masks; use sdpa"),
    "output_attentions": (False, "the fused kernels never form the attention matrix; use 'eager'"),
    "training (gradients / dropout)": (True, "no backward kernel: falls back to PyTorch attention, one warning"),
    "float32 inputs": (True, "cast to bfloat16 before INT8 quantization, output cast back, one warning"),
    "NaN / Inf in Q, K, V": (True, "NaN output rows exactly where sdpa's would be; the cache counts bad tokens"),
    "several GPUs (device_map)": (True, "kernels launch on each layer's GPU (2 GPUs: one GPU's tokens)"),
    "tensor parallelism (tp_plan)": (True, "each rank caches its own KV heads (2 GPUs: TP 1's choices)"),
}


class TurboUnsupportedError(NotImplementedError):
    """The model or call uses a feature turbo_int8 cannot compute exactly; the message names it and the fix."""


def model_name(obj: Any) -> str:
    """A readable model name from a module, a model or a config (architecture, else model_type, else class)."""
    if obj is None:
        return "this model"
    if isinstance(obj, str):
        return obj
    config = getattr(obj, "config", obj)
    archs = getattr(config, "architectures", None)
    if archs:
        return str(archs[0])
    mt = getattr(config, "model_type", None)
    if mt:
        return str(mt)
    return type(obj).__name__


def unsupported(feature: str, model: Any, detail: str = "") -> TurboUnsupportedError:
    """Build the refusal for ``feature`` (a key of :data:`FEATURES`) on ``model``."""
    _, fix = FEATURES.get(feature, (False, "load the model with attn_implementation='sdpa'"))
    msg = f"{ATTN_NAME}: {model_name(model)} uses {feature}, which turbo_int8 does not support"
    if detail:
        msg += f" ({detail})"
    msg += f"; {fix}."
    if "sdpa" not in fix and "eager" not in fix:
        msg += " To run this model anyway, load it with attn_implementation='sdpa'."
    return TurboUnsupportedError(msg)


def head_dim_error(model: Any, head_dim: int) -> TurboUnsupportedError:
    return TurboUnsupportedError(
        f"{ATTN_NAME}: {model_name(model)} has head_dim {head_dim}, which is not supported "
        f"{SUPPORTED_HEAD_DIMS}; load the model with attn_implementation='sdpa'."
    )


def config_head_dim(config: Any) -> Optional[int]:
    hd = getattr(config, "head_dim", None)
    if hd:
        return int(hd)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if hidden and heads:
        return int(hidden) // int(heads)
    return None


def check_model_config(config: Any) -> list[str]:
    """Problems turbo_int8 would refuse for this (text) config, as error texts; empty when supported.

    Checks what a config reveals before any forward: head_dim, bidirectional attention, chunked
    attention. Call-time features (masks, output_attentions, static caches) are checked when they occur.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    problems = []
    hd = config_head_dim(config)
    if hd is not None and hd not in SUPPORTED_HEAD_DIMS:
        problems.append(str(head_dim_error(config, hd)))
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        problems.append(str(unsupported("bidirectional attention", config)))
    if getattr(config, "attention_chunk_size", None) is not None:
        problems.append(str(unsupported("chunked attention", config)))
    return problems


# ---------------------------------------------------------------------------------------------- environment
ENV_PRESET = "TURBO_ATTN_PRESET"
DEFAULT_PRESET = "int4"


def env_preset() -> str:
    """Preset used when a model carries no TurboConfig: ``$TURBO_ATTN_PRESET`` or ``int4``."""
    return os.environ.get(ENV_PRESET, "").strip() or DEFAULT_PRESET


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``); the kernels' own rule."""
    from .kernels.interpreter import interpreting

    return interpreting()


# ---------------------------------------------------------------------------------------------- settings
CONFIG_ATTR = "turbo_attn"
_dict_cache: dict[int, tuple[dict, TurboConfig]] = {}
#: Bumped by every :func:`set_turbo_config`, so per-module state cached by the attention function expires.
_settings_version = 0


def settings_version() -> int:
    return _settings_version


def _as_turbo_config(config_or_preset: Union[TurboConfig, str, dict]) -> TurboConfig:
    if isinstance(config_or_preset, TurboConfig):
        config_or_preset.validate()
        return config_or_preset
    if isinstance(config_or_preset, (str, dict)):
        return shared_config(config_or_preset)
    raise TypeError(
        f"expected a TurboConfig, a preset name ('int8', 'int4', 'mixed') or a dict, got "
        f"{type(config_or_preset).__name__}"
    )


def _configs_of(model_or_config: Any) -> list:
    config = getattr(model_or_config, "config", model_or_config)
    out = [config]
    if hasattr(config, "get_text_config"):
        text = config.get_text_config(decoder=True)
        if text is not config:
            out.append(text)
    return out


def set_turbo_config(model, config_or_preset: Union[TurboConfig, str, dict]):
    """Choose the TurboConfig of ``model`` (a PreTrainedModel or a config); returns ``model``.

    ``config_or_preset``: a :class:`TurboConfig`, a preset name (``"int8"``, ``"int4"``, ``"mixed"``), a
    YAML path or a dict. Stored as a dict under ``config.turbo_attn`` (model config and text config),
    where the attention function and the ``generate()`` hook find it.
    """
    global _settings_version
    cfg = _as_turbo_config(config_or_preset)
    for c in _configs_of(model):
        setattr(c, CONFIG_ATTR, cfg.to_dict())
    _settings_version += 1
    return model


def get_turbo_config(model_or_config: Any = None) -> TurboConfig:
    """The TurboConfig of a model / config (``config.turbo_attn``), else the default preset.

    The default is ``int4`` unless ``TURBO_ATTN_PRESET`` names another preset (or a YAML path).
    """
    if model_or_config is not None:
        for c in reversed(_configs_of(model_or_config)):
            d = getattr(c, CONFIG_ATTR, None)
            if isinstance(d, TurboConfig):
                return d
            if isinstance(d, dict):
                hit = _dict_cache.get(id(c))
                if hit is not None and hit[0] == d:
                    return hit[1]
                cfg = shared_config(d)
                _dict_cache[id(c)] = (dict(d), cfg)
                return cfg
    return shared_config(env_preset())


# ---------------------------------------------------------------------------------------------- one-time logs
_logged: set[str] = set()


def log_once(key: str, msg: str, level: int = logging.WARNING) -> None:
    """Log ``msg`` once per process for ``key`` (fallbacks and casts are reported once, not per layer)."""
    if key in _logged:
        return
    _logged.add(key)
    logger.log(level, msg)
