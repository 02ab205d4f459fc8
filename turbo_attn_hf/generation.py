"""Default TurboCache for a plain ``model.generate(...)`` of a model loaded with ``turbo_int8``.

transformers rejects custom ``cache_implementation`` names and has no registry of cache classes, so at
registration we wrap ``GenerationMixin._prepare_cache_for_generation``. We rely on two things only: its first
two parameters, ``generation_config`` and ``model_kwargs`` (stable since 4.46), and that it stores the cache
it builds as a ``Cache`` value in ``model_kwargs``. The *key* is not assumed: transformers <= 5.23 writes
``model_kwargs["past_key_values"]``, 5.24 renamed it to ``model_kwargs["cache"]``, so the wrapper finds the
cache by type and by what changed during the call. It calls the original first, then replaces the cache
it built by ``TurboCache.from_template(cache, turbo_config, text_config)`` only if all hold:

  * the user passed no cache (looked up *before* calling the original, not through private flags);
  * the model's text config says ``turbo_int8`` now (checked on every call, so
    ``set_attn_implementation("sdpa")`` switches back to the DynamicCache);
  * ``generation_config.cache_implementation`` is None or ``"dynamic"`` and the built cache is exactly a
    ``DynamicCache`` (not a subclass, offloaded or encoder-decoder) -> the dynamic ``TurboCache``; or
    ``cache_implementation`` is ``"static"`` and the built cache is exactly a ``StaticCache`` -> a static
    ``TurboCache`` of the same capacity (``max_cache_len``), which generate() then compiles like HF's own
    (its layers are ``is_compileable``; the decode step is two custom ops per layer: ``turbo_attn_hf.ops``).

Assistant models (assisted decoding) get ``activate_past_recording()`` on the new cache as the
original did on the DynamicCache. Nothing sets ``_layer_type`` on any class. A turbo_int8 model also gets its
layers' rotary embedding in one launch (``rotary.attach``), whichever cache it runs with.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from .capabilities import ATTN_NAME, get_turbo_config, log_once

_WRAPPED_FLAG = "_turbo_attn_wrapped"
#: tokens: the static TurboCache that generate(cache_implementation="static") builds holds a multiple of this (the
#: packed storage of 1024 more tokens is ~0.2x of a bf16 cache's 1024 tokens; a recompile is 25-70 s on a GPU)
STATIC_CAPACITY_STEP = 1024
_STATIC_ATTR = "_turbo_static_cache"  # the model attribute holding the reused static TurboCache


def cache_entries(model_kwargs: dict) -> dict[str, Any]:
    """The ``Cache`` objects in ``model_kwargs`` by key (``past_key_values`` or ``cache``, whichever
    this transformers version uses)."""
    from transformers.cache_utils import Cache

    return {k: v for k, v in model_kwargs.items() if isinstance(v, Cache)}


@functools.lru_cache(maxsize=None)
def cache_kwarg() -> str:
    """The keyword ``generate()`` and ``forward()`` take a cache under on the installed transformers:
    ``"cache"`` since 5.24 (``past_key_values`` still accepted there, deprecated), else ``"past_key_values"``.
    Detected from generate()'s output fields, renamed in the same release."""
    import dataclasses

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return "cache" if "cache" in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)} else "past_key_values"


def cache_arg(cache: Any) -> dict[str, Any]:
    """``{cache_kwarg(): cache}``: a cache passed to ``generate()`` or ``forward()`` under this version's keyword
    (``past_key_values=`` warns on 5.24 and goes in 5.40 / 6.0)."""
    return {cache_kwarg(): cache}


def output_cache(out: Any) -> Any:
    """The cache a ``generate()`` or ``forward()`` output returns (``out.cache`` since 5.24, whose deprecated
    ``past_key_values`` alias logs a warning), or None."""
    return getattr(out, cache_kwarg(), None)


def uses_turbo(model: Any) -> bool:
    """Whether the model's (text) config currently selects turbo_int8."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) == ATTN_NAME


def maybe_swap_cache(model: Any, generation_config: Any, model_kwargs: dict, before: dict[str, Any]) -> bool:
    """Replace the DynamicCache that ``_prepare_cache_for_generation`` just put in ``model_kwargs`` (the
    one Cache entry not in ``before``) by a TurboCache under the same key; True if replaced."""
    from transformers.cache_utils import DynamicCache

    if not uses_turbo(model):
        return False
    impl = getattr(generation_config, "cache_implementation", None)
    if impl not in (None, "dynamic", "static"):
        return False
    built = {k: v for k, v in cache_entries(model_kwargs).items() if before.get(k) is not v}
    if len(built) != 1:
        if built:
            log_once("several-caches", f"{ATTN_NAME}: generate() built several caches ({sorted(built)}); "
                     "none is replaced by a TurboCache. Pass one explicitly to quantize the cache.")
        return False
    (key, cache), = built.items()
    from .cache import TurboCache

    text_config = model.config.get_text_config(decoder=True)
    if impl == "static":
        from transformers.cache_utils import StaticCache

        if type(cache) is not StaticCache:
            return False
        # every turbo layer keeps all tokens (a sliding window is applied in attention), so the capacity is the
        # longest of HF's layers and of this call's max_length
        cap = max([int(getattr(layer, "max_cache_len", 0) or 0) for layer in cache.layers]
                  + [int(getattr(generation_config, "max_length", 0) or 0),
                     int(getattr(generation_config, "max_cache_len", 0) or 0)])
        # the capacity is a constant of the compiled step (a new one recompiles it): whole multiples of
        # STATIC_CAPACITY_STEP let calls of nearby lengths share one compiled graph
        cap = -(-cap // STATIC_CAPACITY_STEP) * STATIC_CAPACITY_STEP
        new = _reused_static_cache(model, get_turbo_config(model), text_config, cap)
    elif type(cache) is not DynamicCache:
        return False
    else:
        new = TurboCache.from_template(cache, get_turbo_config(model), text_config)
    if getattr(generation_config, "is_assistant", False):
        new.activate_past_recording()
    model_kwargs[key] = new
    return True


def _reused_static_cache(model: Any, turbo_config: Any, text_config: Any, cap: int):
    """The static TurboCache of this model's previous ``generate(cache_implementation="static")``, reset, when it has
    the same config and capacity; else a new one (kept on the model for the next call). Its storage keeps its
    addresses across calls, so HF's compiled decode step replays its CUDA graph instead of recording it again each
    call (as HF 4.x reused its StaticCache). Like that cache, it is reset by the next such call:
    ``turbo_attn_hf.release_static_cache(model)`` frees it."""
    from .cache import TurboCache, _resolve_config

    old = getattr(model, _STATIC_ATTR, None)
    if (old is not None and getattr(old, "_text_config", None) is text_config
            and {getattr(l, "max_cache_len", cap) for l in old.layers} == {cap}
            and old.turbo_config == _resolve_config(turbo_config, text_config)):
        old.reset()
        return old
    release_static_cache(model)  # free the old storage before the new one is allocated
    new = TurboCache(turbo_config, config=text_config, max_cache_len=cap)
    new._text_config = text_config
    setattr(model, _STATIC_ATTR, new)
    return new


def release_static_cache(model: Any) -> None:
    """Drop the static TurboCache a model keeps between ``generate(cache_implementation="static")`` calls."""
    if getattr(model, _STATIC_ATTR, None) is not None:
        setattr(model, _STATIC_ATTR, None)


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
            "a DynamicCache. Pass a TurboCache(...) to generate() explicitly (past_key_values=, or cache= on "
            "transformers >= 5.24) to get the quantized cache.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    if getattr(original, _WRAPPED_FLAG, False):
        return True

    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        before = cache_entries(model_kwargs)  # a user's cache is already here, under whichever key
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        if uses_turbo(self):
            from .rotary import attach

            attach(self)  # the layers' rotary embedding in one launch (idempotent)
        if not before:
            maybe_swap_cache(self, generation_config, model_kwargs, before)
        return result

    setattr(_prepare_cache_for_generation, _WRAPPED_FLAG, True)
    _prepare_cache_for_generation.__wrapped_original__ = original
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    return True
