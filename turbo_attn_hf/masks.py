"""The mask function registered as ``AttentionMaskInterface["turbo_int8"]``.

transformers builds masks once per forward (``create_causal_mask`` / ``create_sliding_window_causal_mask``)
and calls the registered mask function with (5.17 and 5.23 alike)::

    batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask (2D bool or None),
    allow_is_causal_skip, local_size (sliding layers), dtype, config, use_vmap, device

Our kernels take the causal / sliding-window structure from the attention call (``is_causal``,
``sliding_window``; the contract FlashAttention-2 relies on too), so the only thing the mask has to carry
is padding: we return ``key_valid: bool [b, kv_length]`` (True = attend) or ``None`` when no key is
padded — never a dense ``[b, 1, q, kv]`` mask.

What cannot be expressed that way is refused with an error naming the model and the feature, instead of
being dropped silently: bidirectional and chunked attention, packed sequences, custom or/and mask
functions (e.g. image-token block masks), and caches whose queries are not bottom-right aligned with the
keys (static caches). The mask function is recognised structurally — ``causal_mask_function`` itself or
``and_masks(sliding_window_overlay(w), causal_mask_function)`` — so anything else, including shapes a
future transformers may build, is refused rather than guessed.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from .capabilities import TurboUnsupportedError, model_name, unsupported


def _qualname(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _nonlocals(fn: Callable) -> dict:
    try:
        return inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return {}


def _leaves(fn: Callable) -> list[str]:
    """Qualified names of the primitive mask functions inside and_masks/or_masks combinations."""
    qn = _qualname(fn)
    if qn.startswith(("and_masks.", "or_masks.")):
        out = ["or_masks" if qn.startswith("or_masks.") else "and_masks"]
        for f in _nonlocals(fn).get("mask_functions", ()):
            out += _leaves(f)
        return out
    return [qn]


def classify_mask_function(mask_function: Optional[Callable], config: Any = None) -> tuple[bool, Optional[int]]:
    """``(causal, sliding_window)`` of a transformers mask function, or raise TurboUnsupportedError.

    Recognised: ``causal_mask_function`` -> (True, None); ``sliding_window_causal_mask_function(w)``
    -> (True, w). Everything else is refused with the feature it uses.
    """
    from transformers import masking_utils as mu

    if mask_function is None or mask_function is mu.causal_mask_function:
        return True, None
    qn = _qualname(mask_function)
    if qn.startswith("and_masks."):
        fns = tuple(_nonlocals(mask_function).get("mask_functions", ()))
        if len(fns) == 2 and fns[1] is mu.causal_mask_function:
            overlay = fns[0]
            if _qualname(overlay) == "sliding_window_overlay.<locals>.inner_mask":
                w = _nonlocals(overlay).get("sliding_window")
                if isinstance(w, int) and w > 0:
                    return True, w
    # Not representable: name the feature.
    leaves = " ".join(_leaves(mask_function))
    model = config
    if "packed_sequence" in leaves:
        raise unsupported("packed sequences", model,
                          "position_ids restart inside a row and no attention_mask was given")
    if "chunked_overlay" in leaves:
        raise unsupported("chunked attention", model)
    if "bidirectional" in leaves:
        raise unsupported("bidirectional attention", model)
    if mask_function is getattr(mu, "bidirectional_mask_function", None):
        raise unsupported("bidirectional attention", model)
    raise unsupported("custom mask functions", model, f"mask function {leaves or qn}")


def turbo_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Optional[Callable] = None,
    attention_mask: Optional[torch.Tensor] = None,
    config: Any = None,
    **kwargs,
) -> Optional[torch.Tensor]:
    """Mask interface for turbo_int8: ``key_valid: bool [batch_size, kv_length]`` or ``None`` (no padding).

    Args:
        q_offset, kv_offset: absolute positions of the first query / first key (from the cache).
        mask_function: the pattern transformers wants; only causal and causal sliding-window are accepted.
        attention_mask: the user's 2D padding mask ``[b, >= kv_offset + kv_length]`` (bool) or None.
    """
    # inspect-based, not traceable; a compiled decode step follows an eager prefill whose mask creation built
    # the same mask functions (and generate() builds this step's mask eagerly first), so it was checked there
    if not torch.compiler.is_compiling():
        classify_mask_function(mask_function, config)

    # The kernels align the queries with the *last* keys (bottom-right causal). That holds for dynamic
    # caches (incl. sliding-window layers and TurboCache) and no-cache forwards. A static cache reports keys
    # padded to its capacity: for one query token per row that is still exact if every slot past the query is
    # masked (static_decode_mask; a static TurboCache reads its real length on the device anyway); a chunk of
    # several queries would be misaligned, which is refused.
    if int(q_length) == 1 and (isinstance(q_offset, torch.Tensor) or int(kv_offset) + int(kv_length) > int(q_offset) + 1):
        return static_decode_mask(batch_size, kv_length, q_offset, kv_offset, attention_mask, config)
    if isinstance(q_offset, torch.Tensor):
        raise unsupported("static cache", config, "the cache reports a tensor query offset for a chunk of queries")
    if int(q_offset) + int(q_length) != int(kv_offset) + int(kv_length):
        raise unsupported(
            "static cache", config,
            f"queries end at position {int(q_offset) + int(q_length)} but keys end at "
            f"{int(kv_offset) + int(kv_length)}",
        )

    if attention_mask is None:
        return None
    key_valid = _padding_keys(batch_size, kv_length, kv_offset, attention_mask, config)
    # One host sync per forward (transformers' own masks do the same check); saves the kernel the loads.
    if bool(key_valid.all()):
        return None
    return key_valid.contiguous()


def _padding_keys(batch_size: int, kv_length: int, kv_offset: int, attention_mask: torch.Tensor,
                  config: Any) -> torch.Tensor:
    """The user's 2D padding mask cut to the keys ``[kv_offset, kv_offset + kv_length)``: bool ``[b, kv_length]``
    (a view where possible)."""
    if attention_mask.dim() != 2:
        raise TurboUnsupportedError(
            f"turbo_int8: {model_name(config)} got an attention_mask of shape {tuple(attention_mask.shape)} in "
            "mask creation; expected the 2D padding mask [batch, seq_len]."
        )
    mask = attention_mask.to(torch.bool)
    end = int(kv_offset) + int(kv_length)
    if mask.shape[-1] < end:  # as transformers' prepare_padding_mask: missing positions are padding
        mask = torch.nn.functional.pad(mask, (0, end - mask.shape[-1]), value=False)
    mask = mask[:, int(kv_offset):end]
    if mask.shape[0] != batch_size and mask.shape[0] == 1:
        mask = mask.expand(batch_size, -1)
    return mask


def static_decode_mask(batch_size: int, kv_length: int, q_offset: Any, kv_offset: int,
                       attention_mask: Optional[torch.Tensor], config: Any = None) -> torch.Tensor:
    """``key_valid: bool [b, kv_length]`` for one query token at position ``q_offset`` over a static cache's
    ``kv_length`` slots: the user's padding mask, and no slot after the query (empty capacity). No host sync and
    no data-dependent branch (a compiled decode step traces it); never None: the slots past the query must be
    masked for a cache that hands over its whole capacity."""
    device = attention_mask.device if attention_mask is not None else (
        q_offset.device if isinstance(q_offset, torch.Tensor) else None)
    pos = torch.arange(int(kv_offset), int(kv_offset) + int(kv_length), device=device)
    valid = (pos <= q_offset)[None, :].expand(batch_size, -1)
    if attention_mask is None:
        return valid.contiguous()
    return (_padding_keys(batch_size, kv_length, kv_offset, attention_mask, config) & valid).contiguous()
