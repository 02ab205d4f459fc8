"""turbo-attn-hf: INT8 flash attention and a quantized KV cache for Hugging Face Transformers.

``import turbo_attn_hf`` registers ``attn_implementation="turbo_int8"`` (attention function and mask
function) and makes a plain ``model.generate(...)`` of such a model use a ``TurboCache``::

    import turbo_attn_hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="turbo_int8", dtype=torch.bfloat16)
    turbo_attn_hf.set_turbo_config(model, "mixed")   # optional; default "int4" or $TURBO_ATTN_PRESET
    out = model.generate(**inputs)

Importing is cheap: torch and transformers are not imported here. If ``transformers.modeling_utils`` is
already loaded the registration happens at once; otherwise it happens the moment transformers loads it
(any ``from_pretrained`` does), through a one-shot post-import hook. ``register()`` forces it now, and
reading ``REGISTERED`` does too. Without transformers installed the package (and
``turbo_attn_hf.kernels``) still imports; nothing is registered.

Public API (resolved lazily): ``TurboConfig``, ``TurboCache``, ``set_turbo_config(model, config_or_preset)``,
``get_turbo_config(model_or_config)``, ``check_model_config(config)``, ``TurboUnsupportedError``,
``TurboConfigError``, ``ATTN_NAME``, ``register()``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = [
    "ATTN_NAME",
    "DEFAULT_PRESET",
    "REGISTERED",
    "SUPPORTED_HEAD_DIMS",
    "TurboCache",
    "TurboConfig",
    "TurboConfigError",
    "TurboUnsupportedError",
    "check_model_config",
    "embedded_model",
    "get_turbo_config",
    "register",
    "release_static_cache",
    "set_turbo_config",
]
__version__ = "0.1.0"

#: public name -> submodule that defines it (imported on first access: keeps ``import turbo_attn_hf`` light)
_LAZY = {
    "ATTN_NAME": "capabilities",
    "DEFAULT_PRESET": "capabilities",
    "SUPPORTED_HEAD_DIMS": "capabilities",
    "TurboUnsupportedError": "capabilities",
    "check_model_config": "capabilities",
    "get_turbo_config": "capabilities",
    "set_turbo_config": "capabilities",
    "TurboConfig": "config",
    "TurboConfigError": "config",
    "TurboCache": "cache",
    "embedded_model": "chat",
    "release_static_cache": "generation",
}

#: the transformers module whose loading triggers the deferred registration (it defines AttentionInterface)
_TRIGGER = "transformers.modeling_utils"
_registered = False


def register() -> bool:
    """Register turbo_int8 with transformers and install the generate() hook now (idempotent).

    Returns False when transformers is not installed."""
    global _registered
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    from .attention import turbo_attention_forward
    from .capabilities import ATTN_NAME
    from .generation import install
    from .masks import turbo_mask

    AttentionInterface.register(ATTN_NAME, turbo_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, turbo_mask)
    install()
    _registered = True
    return True


class _RegisterAfterLoad(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """One-shot post-import hook: lets ``_TRIGGER`` load as usual, then calls :func:`register`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self._loader
        self._loader.exec_module(module)
        register()


def _transformers_installed() -> bool:
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["transformers"] is None (blocked)
        return False


def _defer_registration() -> None:
    if _TRIGGER in sys.modules:
        register()
    elif _transformers_installed() and not any(isinstance(f, _RegisterAfterLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLoad())


_defer_registration()


def __getattr__(name):
    if name == "REGISTERED":
        return register()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'turbo_attn_hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
