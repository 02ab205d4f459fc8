"""Default TurboCache for a plain ``model.generate(...)`` of a model loaded with ``turbo_int8``.

transformers rejects custom ``cache_implementation`` names and has no registry of cache classes, so at
import we wrap ``GenerationMixin._prepare_cache_for_generation`` (its first two parameters,
``generation_config`` and ``model_kwargs``, have been stable since 4.46; it writes
``model_kwargs["past_key_values"]`` in place). The wrapper calls the original first, then replaces the
cache it built by ``TurboCache.from_template(cache, turbo_config, text_config)`` only if all hold:

  * the user passed no cache (looked up *before* calling the original, not through private flags);
  * the model's text config says ``turbo_int8`` now (checked on every call, so
    ``set_attn_implementation("sdpa")`` switches back to the DynamicCache);
  * ``generation_config.cache_implementation`` is None or ``"dynamic"``;
  * the built cache is exactly a ``DynamicCache`` (not a subclass, static, offloaded or encoder-decoder).

Assistant models (assisted decoding) get ``activate_past_recording()`` on the new cache as the
original did on the DynamicCache. Nothing sets ``_layer_type`` on any class. Until
``turbo_attn_hf.cache.TurboCache`` exists the DynamicCache is kept (one info log).
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

from .capabilities import ATTN_NAME, get_turbo_config, log_once

_CACHE_NAME = "past_key_values"
_WRAPPED_FLAG = "_turbo_attn_wrapped"


def _load_turbo_cache():
    try:
        from .cache import TurboCache
    except ImportError as e:  # cache.py is written by another part of the project
        log_once(
            "no-turbocache",
            f"{ATTN_NAME}: turbo_attn_hf.cache.TurboCache is not available ({e}); generate() keeps the "
            "DynamicCache (attention still runs the INT8 kernels, quantizing the cache on the fly).",
            logging.INFO,
        )
        return None
    return TurboCache


def uses_turbo(model: Any) -> bool:
    """Whether the model's (text) config currently selects turbo_int8."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) == ATTN_NAME


def maybe_swap_cache(model: Any, generation_config: Any, model_kwargs: dict) -> bool:
    """Replace a freshly built DynamicCache in ``model_kwargs`` by a TurboCache; True if replaced."""
    from transformers.cache_utils import DynamicCache

    if not uses_turbo(model):
        return False
    if getattr(generation_config, "cache_implementation", None) not in (None, "dynamic"):
        return False
    cache = model_kwargs.get(_CACHE_NAME)
    if type(cache) is not DynamicCache:
        return False
    TurboCache = _load_turbo_cache()
    if TurboCache is None:
        return False
    text_config = model.config.get_text_config(decoder=True)
    new = TurboCache.from_template(cache, get_turbo_config(model), text_config)
    if getattr(generation_config, "is_assistant", False):
        activate = getattr(new, "activate_past_recording", None)
        if activate is None:
            log_once(
                "assistant-dynamic",
                f"{ATTN_NAME}: TurboCache cannot record the past for assisted decoding; the assistant model "
                "keeps a DynamicCache.",
            )
            return False
        activate()
    model_kwargs[_CACHE_NAME] = new
    return True


def install() -> bool:
    """Wrap ``GenerationMixin._prepare_cache_for_generation`` (idempotent); False if it is missing."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:  # pragma: no cover
        return False
    original = getattr(GenerationMixin, "_prepare_cache_for_generation", None)
    if original is None:
        warnings.warn(
            f"{ATTN_NAME}: transformers.GenerationMixin has no _prepare_cache_for_generation; generate() will use "
            "a DynamicCache. Pass past_key_values=TurboCache(...) explicitly to get the quantized cache.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    if getattr(original, _WRAPPED_FLAG, False):
        return True

    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        user_cache = model_kwargs.get(_CACHE_NAME) is not None
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        if not user_cache:
            maybe_swap_cache(self, generation_config, model_kwargs)
        return result

    setattr(_prepare_cache_for_generation, _WRAPPED_FLAG, True)
    _prepare_cache_for_generation.__wrapped_original__ = original
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    return True
