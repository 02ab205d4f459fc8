"""The rotary embedding of a turbo_int8 model's layers in one launch (``kernels/rope.py``) instead of HF's eight ops.

An eager decode step is host-bound, and HF's ``apply_rotary_pos_emb`` costs each layer eight PyTorch launches
(``eval/PERF_NOTES.md``, session 44). :func:`attach` (called by the ``generate()`` hook for a turbo_int8 model):
- registers a forward hook on the model's rotary-embedding modules that marks the ``cos`` they return while the
  model's config selects turbo_int8;
- wraps the ``apply_rotary_pos_emb`` of the model's attention family (its modeling module's function, which the
  attention forward looks up there), so that a call with marked ``cos`` runs the fused kernel and every other call
  (another model of the family in the process, a compiled forward, a shape the kernel does not take) runs HF's own.

The kernel computes HF's bits (the same roundings), and the first fused call of a family on a device and dtype is
checked against HF's function: a family whose function is not the rotate-half form keeps HF's, with a log line.
Only families known to use rotate-half RoPE (``cache.ROTATE_HALF_MODEL_TYPES``) are wrapped.
``TURBO_ATTN_FUSED_ROPE=0`` turns it off (read at each forward).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch

from .capabilities import ATTN_NAME, log_once
from .kernels import rope

__all__ = ["attach", "enabled"]

#: attribute on a ``cos`` tensor made by a hooked rotary module: the fused kernel may rotate with it
_MARK = "_turbo_fused_rope"
_ATTACHED = "_turbo_rope_attached"
_WRAPPED = "_turbo_rope_wrapped"


def enabled() -> bool:
    """Whether ``$TURBO_ATTN_FUSED_ROPE`` allows the fused rotary embedding now (on unless "0")."""
    return os.environ.get("TURBO_ATTN_FUSED_ROPE", "1") != "0"


def _mark(module: Any, args: Any, out: Any, config: Any = None) -> None:
    """Forward hook of a rotary module (once a forward): mark its ``cos`` while ``config`` (the model's text config)
    selects turbo_int8 (``set_attn_implementation("sdpa")`` on the same weights gets HF's ops again) and
    :func:`enabled`, not while compiling (the compiled graph keeps HF's ops)."""
    if torch.compiler.is_compiling() or not isinstance(out, tuple) or not out or not enabled():
        return
    if config is not None and getattr(config, "_attn_implementation", None) != ATTN_NAME:
        return
    if isinstance(out[0], torch.Tensor):
        setattr(out[0], _MARK, True)


def _wrap(family: Any) -> bool:
    """Wrap ``family.apply_rotary_pos_emb`` (idempotent); False if the module has none."""
    original = getattr(family, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if getattr(original, _WRAPPED, False):
        return True
    checked: set = set()  # (device, dtype) of the calls checked against HF's function
    off: list = []  # non-empty once the check failed
    name = family.__name__

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if torch.compiler.is_compiling():  # first: dynamo traces HF's function and nothing of this wrapper
            return original(q, k, cos, sin, *args, **kwargs)
        if (args or kwargs.keys() - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1 or off
                or not getattr(cos, _MARK, False) or not rope.supports(q, k, cos, sin)):
            return original(q, k, cos, sin, *args, **kwargs)
        out = rope.rope_rotate_half(q, k, cos, sin)
        key = (q.device, q.dtype)
        if key not in checked:  # once per device and dtype: the family's function is the rotate-half form
            ref = original(q, k, cos, sin)
            if not (torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])):
                off.append(key)
                log_once(f"rope-{name}", f"turbo_int8: {name}.apply_rotary_pos_emb is not the rotate-half RoPE the "
                         "fused kernel computes; its layers keep HF's rotary ops")
                return ref
            checked.add(key)
        return out

    setattr(apply_rotary_pos_emb, _WRAPPED, True)
    apply_rotary_pos_emb.__wrapped_original__ = original
    family.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def attach(model: Any) -> bool:
    """Give ``model``'s eager forwards the fused rotary embedding (idempotent): hook its rotary modules and wrap
    its attention family's ``apply_rotary_pos_emb``. False when it does not apply (a model type not known to use
    rotate-half RoPE, no rotary module or no such function)."""
    done = model.__dict__.get(_ATTACHED)
    if done is not None:
        return done
    from .cache import ROTATE_HALF_MODEL_TYPES

    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    known = getattr(text, "model_type", None) in ROTATE_HALF_MODEL_TYPES
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")] if known else []
    families = {sys.modules.get(type(m).__module__) for m in model.modules()
                if type(m).__name__.endswith("Attention")} if rotary else set()
    ok = any([_wrap(f) for f in families if f is not None])  # every family, not the first only
    if ok:
        for m in rotary:
            m.register_forward_hook(functools.partial(_mark, config=text))
    model.__dict__[_ATTACHED] = ok
    return ok
