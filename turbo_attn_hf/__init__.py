"""turbo-attn-hf: INT8 flash attention and a quantized KV cache for Hugging Face Transformers.

``import turbo_attn_hf`` registers ``attn_implementation="turbo_int8"`` (attention function and mask
function) and makes a plain ``model.generate(...)`` of such a model use a ``TurboCache``::

    import turbo_attn_hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="turbo_int8", dtype=torch.bfloat16)
    turbo_attn_hf.set_turbo_config(model, "mixed")   # optional; default "int4" or $TURBO_ATTN_PRESET
    out = model.generate(**inputs)

Importing has no side effects beyond these registrations. Without transformers installed the package
(and ``turbo_attn_hf.kernels``) still imports; nothing is registered.

Public API: ``TurboConfig``, ``TurboCache`` (lazy), ``set_turbo_config(model, config_or_preset)``,
``get_turbo_config(model_or_config)``, ``check_model_config(config)``, ``TurboUnsupportedError``,
``ATTN_NAME``.
"""

from .capabilities import (
    ATTN_NAME,
    DEFAULT_PRESET,
    SUPPORTED_HEAD_DIMS,
    TurboUnsupportedError,
    check_model_config,
    get_turbo_config,
    set_turbo_config,
)
from .config import TurboConfig, TurboConfigError

__all__ = [
    "ATTN_NAME",
    "DEFAULT_PRESET",
    "SUPPORTED_HEAD_DIMS",
    "TurboCache",
    "TurboConfig",
    "TurboConfigError",
    "TurboUnsupportedError",
    "check_model_config",
    "get_turbo_config",
    "register",
    "set_turbo_config",
]
__version__ = "0.1.0"


def register() -> bool:
    """Register turbo_int8 with transformers and install the generate() hook; False without transformers."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    from .attention import turbo_attention_forward
    from .generation import install
    from .masks import turbo_mask

    AttentionInterface.register(ATTN_NAME, turbo_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, turbo_mask)
    install()
    return True


REGISTERED = register()


def __getattr__(name):
    if name == "TurboCache":
        from .cache import TurboCache

        return TurboCache
    raise AttributeError(f"module 'turbo_attn_hf' has no attribute {name!r}")
