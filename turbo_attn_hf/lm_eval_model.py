"""lm-eval model ``turbo-hf``: Hugging Face causal LMs with ``attn_implementation="turbo_int8"``.

Importing this module registers ``turbo-hf`` with lm-eval (0.4.x). Log-likelihood requests call
``model(ids)`` (the INT8 prefill kernel); generation requests call ``model.generate`` with a fresh
``TurboCache`` per batch (or, with ``cache="default"``, the cache that a plain ``generate()`` builds
for a turbo_int8 model). After every generate call the cache that was used is checked, so a run that
silently fell back to a bf16 ``DynamicCache`` fails instead of reporting the wrong numbers.

Usage::

    import turbo_attn_hf.lm_eval_model  # registers "turbo-hf"
    lm_eval.simple_evaluate(model="turbo-hf",
                            model_args="pretrained=DIR,gguf_file=F.gguf,preset=int4,dtype=bfloat16", ...)
    # or wrap a loaded model
    lm = TurboHFLM(pretrained=model, tokenizer=tok, preset="mixed")

    # the lm-eval CLI, with the model registered first:
    python -m turbo_attn_hf.lm_eval_model --model turbo-hf --model_args pretrained=...,preset=int8 ...

model_args beyond lm-eval's ``hf`` model: ``preset`` (``int8`` | ``int4`` | ``mixed`` | a YAML path),
``config_file`` (a YAML path; wins over ``preset``), ``attn_implementation`` (default ``turbo_int8``;
``sdpa`` / ``eager`` give the baseline through the same class), ``cache`` (``turbo`` | ``default``).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Union

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # lm-eval is an optional dependency
    raise ImportError(
        f"turbo_attn_hf.lm_eval_model needs lm-eval ({e}); install it with: pip install turbo-attn-hf[eval]"
    ) from e

import torch

from .config import TurboConfig

TURBO_IMPL = "turbo_int8"
CACHE_MODES = ("turbo", "default")


def turbo_registered() -> bool:
    """Has ``import turbo_attn_hf`` registered ``attn_implementation="turbo_int8"`` with transformers?"""
    import turbo_attn_hf  # noqa: F401  (registration happens at import)
    from transformers import AttentionInterface

    return TURBO_IMPL in AttentionInterface._global_mapping


def resolve_turbo_config(
    preset: Union[str, TurboConfig, None] = "int8", config_file: Optional[str] = None
) -> TurboConfig:
    """TurboConfig from a preset name / YAML path / object; ``config_file`` wins when given."""
    if config_file:
        return TurboConfig.from_yaml(config_file)
    if isinstance(preset, TurboConfig):
        return preset
    return TurboConfig.preset(preset or "int8")


def _as_bool(v) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


@register_model("turbo-hf", "turbo_hf")
class TurboHFLM(HFLM):
    """lm-eval's HF model with turbo_int8 attention and the quantized KV cache during generation.

    Args:
        pretrained: model id / local dir, or an already-loaded ``PreTrainedModel`` (its attention
            implementation is switched in place with ``set_attn_implementation``).
        preset: ``int8`` | ``int4`` | ``mixed`` | a YAML path | a TurboConfig.
        config_file: YAML of a TurboConfig (e.g. ``configs/<calibrated>.yaml``); overrides ``preset``.
        attn_implementation: ``turbo_int8`` (default), or ``sdpa`` / ``eager`` for baselines.
        cache: ``turbo`` passes a fresh ``TurboCache`` to every ``generate`` call; ``default`` lets
            ``generate`` build its own (the turbo_int8 hook installs a TurboCache then).
        **kwargs: everything lm-eval's ``hf`` model accepts (``dtype``, ``gguf_file``, ``tokenizer``,
            ``batch_size``, ``device``, ``max_length``, ...).
    """

    def __init__(
        self,
        pretrained,
        preset: Union[str, TurboConfig, None] = "int8",
        config_file: Optional[str] = None,
        attn_implementation: str = TURBO_IMPL,
        cache: str = "turbo",
        **kwargs,
    ) -> None:
        if cache not in CACHE_MODES:
            raise ValueError(f"cache={cache!r} is not supported; choose one of {CACHE_MODES}")
        self.attn_implementation = attn_implementation
        self.cache_mode = cache
        self.turbo_config: Optional[TurboConfig] = None
        if attn_implementation == TURBO_IMPL:
            if not turbo_registered():
                raise RuntimeError(
                    "attn_implementation='turbo_int8' is not registered with transformers: "
                    "`import turbo_attn_hf` must register it (is the package installed completely?); "
                    "use attn_implementation='sdpa' for the baseline"
                )
            self.turbo_config = resolve_turbo_config(preset, config_file)

        if isinstance(pretrained, str):
            kwargs["attn_implementation"] = attn_implementation
            super().__init__(pretrained, **kwargs)
        else:
            super().__init__(pretrained, **kwargs)
            if self._model.config._attn_implementation != attn_implementation:
                self._model.set_attn_implementation(attn_implementation)

        if self.turbo_config is not None:
            import turbo_attn_hf

            turbo_attn_hf.set_turbo_config(self._model, self.turbo_config)
        # how many generate() batches ran with which cache class (checked after each call)
        self.cache_types: Counter = Counter()

    # ------------------------------------------------------------------ generation
    @property
    def uses_turbo(self) -> bool:
        return self.turbo_config is not None

    def new_cache(self):
        """A fresh, empty TurboCache for this model and config."""
        import turbo_attn_hf

        return turbo_attn_hf.TurboCache(self.turbo_config, config=self._model.config)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        from .generation import cache_arg, output_cache

        if (self.uses_turbo and self.cache_mode == "turbo"
                and not {"past_key_values", "cache"} & set(generation_kwargs)):
            generation_kwargs.update(cache_arg(self.new_cache()))
        generation_kwargs["return_dict_in_generate"] = True
        out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        cache = output_cache(out)
        name = type(cache).__name__
        self.cache_types[name] += 1
        if self.uses_turbo:
            import turbo_attn_hf

            if not isinstance(cache, turbo_attn_hf.TurboCache):
                raise RuntimeError(
                    f"generate() ran with a {name}, not a TurboCache, although the model uses turbo_int8 "
                    f"(cache={self.cache_mode!r}); the quantized cache was bypassed, so the results would "
                    f"not measure it. Use cache='turbo' or check the turbo_int8 generate hook"
                )
        return out.sequences

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["attn_implementation"] = self.attn_implementation
        info["turbo_config"] = None if self.turbo_config is None else self.turbo_config.to_dict()
        return info


def main() -> None:
    """lm-eval's own CLI with ``turbo-hf`` registered: ``python -m turbo_attn_hf.lm_eval_model ...``."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
