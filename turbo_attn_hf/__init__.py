"""turbo-attn-hf: INT8 flash attention and a quantized KV cache for Hugging Face Transformers.

``import turbo_attn_hf`` registers ``attn_implementation="turbo_int8"`` (placeholder: filled in by the
HF-glue work).
"""
from .config import TurboConfig

__all__ = ["TurboConfig"]
__version__ = "0.1.0"
