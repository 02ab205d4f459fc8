"""The attention function registered as ``AttentionInterface["turbo_int8"]``.

transformers calls it from every attention module as
``fn(module, query, key, value, attention_mask, scaling=, dropout=, sliding_window=, softcap=, **kw)``
with ``query: [b, Hq, Lq, d]``, ``key/value: [b, Hk, Lk, d]`` (RoPE applied, already concatenated with
the cache, not repeated for GQA) and ``attention_mask`` as produced by :func:`turbo_attn_hf.masks.turbo_mask`
(``key_valid: bool [b, Lk]`` or None). It returns ``(out [b, Lq, Hq, d], None)``.

It only chooses among public functions (STYLE: the HF layer picks an op, like FLA's layers):
  * keys that carry ``turbo_cache_layer`` (returned by a TurboCache layer's ``update``): that layer's
    ``attention`` reads its packed INT4/INT2 blocks + INT8 tail directly (a ``rotate_qk`` layer holds rotated K
    and rotates the query itself);
  * otherwise, with ``TurboConfig.prefill_attention`` resolving to ``exact`` (``auto`` on sm_90, where the INT8
    kernel is slower than cuDNN), PyTorch's SDPA in the model dtype (:func:`exact_attention`);
  * else the INT8 flash-attention prefill on the given K/V: the Triton kernel on CUDA, or on CPU
    under ``TRITON_INTERPRET=1``; on CPU without the interpreter the plain-PyTorch reference of the same
    INT8 math (one warning: it is slow);
  * calls that need gradients (training, attention dropout) fall back to PyTorch attention with one
    warning: the INT8 kernels have no backward, and running them would silently cut the gradient.
float32 inputs are cast to bfloat16 before INT8 quantization (one warning) and the output cast back.
``TurboConfig.rotate_qk`` (``auto``: decided for the model here, ``config.resolve_rotate_qk``): the INT8 path over
given K/V has Q and K rotated inside their quantization pass (``turbo_attention(..., rotate_qk=True)``; the
smooth_hadamard factors of kernels/rotation.py computed here).
Refused with an error naming model, value and fix: head_dim outside (64, 80, 96, 128, 256),
``output_attentions``, q_len > kv_len, 4D masks that are not a per-key padding mask.
Checks that depend only on the module (head_dim, GQA ratio, TurboConfig) run once per module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import capabilities as caps
from .capabilities import (
    ATTN_NAME,
    SUPPORTED_HEAD_DIMS,
    TurboUnsupportedError,
    head_dim_error,
    log_once,
    model_name,
    unsupported,
)
from .config import TurboConfig, prefill_attention_path, resolve_rotate_qk
from .kernels.device import on_device, on_tensor_device
from .kernels.reference import turbo_attention as reference_attention
from .kernels.smooth_factors import smooth_factors

try:  # transformers >= 5.x records attentions through hooks; the attention fn never sees the flag
    from transformers.utils.output_capturing import _active_collector as _hf_collector
except Exception:  # pragma: no cover - older layouts / transformers missing
    _hf_collector = None


@dataclass
class _ModuleState:
    """What is checked once per attention module (re-checked after set_turbo_config)."""

    version: int
    head_dim: int
    model: str
    turbo: TurboConfig


#: (id(model config), settings version) -> (config, model name, resolved TurboConfig): the attention modules of one
#: model share its config, so a set_turbo_config costs the next forward one resolution (~40 reads of the config's
#: slow ``__getattribute__``), not one per layer (eval/PERF_NOTES.md, session 16)
_SETTINGS: dict = {}


def _model_settings(config: Any, who: Any, version: int) -> tuple[str, TurboConfig]:
    key = (id(config), version)
    hit = _SETTINGS.get(key) if config is not None else None
    if hit is not None and hit[0] is config:
        return hit[1], hit[2]
    out = model_name(who), resolve_rotate_qk(caps.get_turbo_config(config), config)
    if config is not None:
        if len(_SETTINGS) >= 64:
            _SETTINGS.clear()
        _SETTINGS[key] = (config, *out)
    return out


def _module_state(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> _ModuleState:
    st = getattr(module, "_turbo_attn_state", None)
    version = caps.settings_version()
    if st is not None and st.version == version and st.head_dim == query.shape[-1]:
        return st
    config = getattr(module, "config", None)
    who = config if config is not None else module
    d = query.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise head_dim_error(who, d)
    if key.shape[-1] != d or value.shape[-1] != d:
        raise TurboUnsupportedError(
            f"{ATTN_NAME}: {model_name(who)} has query head_dim {d} but key/value head_dim "
            f"{key.shape[-1]}/{value.shape[-1]}; turbo_int8 needs equal head dims. Load the model with "
            "attn_implementation='sdpa'."
        )
    hq, hk = query.shape[1], key.shape[1]
    if hk == 0 or hq % hk:
        raise TurboUnsupportedError(
            f"{ATTN_NAME}: {model_name(who)} has {hq} query heads and {hk} KV heads; the query heads must be "
            "a multiple of the KV heads (GQA/MQA)."
        )
    st = _ModuleState(version, d, *_model_settings(config, who, version))
    try:
        object.__setattr__(module, "_turbo_attn_state", st)  # plain attribute, not a submodule/buffer
    except Exception:  # pragma: no cover - exotic modules with __slots__
        pass
    return st


def _attentions_requested(kwargs: dict) -> bool:
    if kwargs.get("output_attentions"):
        return True
    if _hf_collector is not None:
        collected = _hf_collector.get()
        return bool(collected) and "attentions" in collected
    return False


def _key_valid(mask: Optional[torch.Tensor], b: int, lk: int, model: str) -> Optional[torch.Tensor]:
    """Per-key validity ``bool [b, Lk]`` from what the model passed as ``attention_mask``."""
    if mask is None:
        return None
    if mask.dim() == 2:  # our mask function's output (or a raw 2D padding mask: same meaning)
        if tuple(mask.shape) != (b, lk):
            raise TurboUnsupportedError(
                f"{ATTN_NAME}: {model} passed a 2D attention mask of shape {tuple(mask.shape)} for {lk} keys "
                f"and batch {b}; expected ({b}, {lk}). Masks must be built by transformers' mask creation "
                "(pass the 2D padding mask to the model, not to the attention layer)."
            )
        return mask if mask.dtype == torch.bool else mask != 0
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1 and mask.shape[-1] == lk:
        # A prepared mask with one query row is a per-key padding mask (decode with a user 4D mask).
        m = mask[:, 0, 0, :]
        if m.dtype == torch.bool:
            return m.expand(b, lk)
        valid = m == 0
        if not bool(((m == 0) | (m <= -1e3)).all()):
            raise unsupported("custom mask functions", model, "a 4D float mask with additive biases")
        return valid.expand(b, lk)
    raise unsupported(
        "custom mask functions", model,
        f"a prepared attention mask of shape {tuple(mask.shape)}; turbo_int8 takes causal/sliding-window "
        "structure from the model and padding from the 2D attention_mask",
    )


# ---------------------------------------------------------------------------------------------- fallbacks
def _allowed(lq: int, lk: int, causal: bool, window: Optional[int], key_valid: Optional[torch.Tensor],
             device: torch.device) -> torch.Tensor:
    """bool ``[1 or b, 1, Lq, Lk]``: which keys each query sees (bottom-right causal, ``window``, ``key_valid``)."""
    qpos = torch.arange(lq, device=device)[:, None] + (lk - lq)
    kpos = torch.arange(lk, device=device)[None, :]
    allowed = kpos <= qpos if causal else torch.ones(lq, lk, dtype=torch.bool, device=device)
    if window is not None:
        allowed = allowed & ((qpos - kpos) < window)
    allowed = allowed[None, None]
    return allowed & key_valid[:, None, None, :] if key_valid is not None else allowed


def torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    key_valid: Optional[torch.Tensor] = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Unquantized PyTorch attention with the same semantics as the kernels (used for gradients).

    q: [b, Hq, Lq, d], k/v: [b, Hk, Lk, d], key_valid: bool [b, Lk]; causal is bottom-right aligned;
    ``window`` w keeps keys with ``q_pos - k_pos < w`` (transformers' sliding_window). Returns [b, Lq, Hq, d].
    """
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    scale = d ** -0.5 if scale is None else scale
    allowed = _allowed(lq, lk, causal, window, key_valid, q.device).expand(b, 1, lq, lk)
    neg = torch.finfo(q.dtype).min
    if softcap is None:
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, neg)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=scale)
    else:
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~allowed, neg)
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        p = torch.nn.functional.dropout(p, p=dropout, training=dropout > 0)
        o = torch.matmul(p, v)
    return o.transpose(1, 2).contiguous()


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    key_valid: Optional[torch.Tensor] = None,
    mask_elems: Optional[int] = None,
) -> torch.Tensor:
    """``prefill_attention: exact``: unquantized attention in the inputs' dtype through PyTorch's SDPA (cuDNN /
    flash on a GPU), the kernels' semantics (bottom-right causal, ``window``, ``key_valid``). A plain causal
    prompt takes SDPA's ``is_causal`` with GQA in the kernel (no mask, no repeated K/V), as transformers' sdpa
    does; a mask is a bool ``[b, 1, Lq, Lk]``; softcap goes through :func:`torch_attention`. ``mask_elems``:
    :func:`exact_mask_elems` of these arguments where the caller has it. Returns ``[b, Lq, Hq, d]``."""
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    if softcap:
        return torch_attention(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap,
                               key_valid=key_valid)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not (exact_mask_elems(q, k, causal, window, key_valid) if mask_elems is None else mask_elems):
        o = sdpa(q, k, v, is_causal=causal and lq > 1, scale=scale, enable_gqa=hq != hk)
        return o.transpose(1, 2).contiguous()
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    allowed = _allowed(lq, lk, causal, window, key_valid, q.device)
    o = sdpa(q, k, v, attn_mask=allowed, scale=scale)
    # a row with no allowed key (a left-padded query) is NaN or 0 by SDPA backend; the kernels give 0 there
    o = o.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    return o.transpose(1, 2).contiguous()


def exact_mask_elems(q: torch.Tensor, k: torch.Tensor, causal: bool, window: Optional[int],
                     key_valid: Optional[torch.Tensor]) -> int:
    """Elements of the bool mask :func:`exact_attention` builds for these arguments (0: none, SDPA's own causal)."""
    b, lq, lk = q.shape[0], q.shape[2], k.shape[2]
    if key_valid is None and window is None and (not causal or lq == lk):
        return 0
    return (b if key_valid is not None else 1) * lq * lk


def exact_path_elems(cfg: TurboConfig, q: torch.Tensor, k: torch.Tensor, *, causal: bool, window: Optional[int],
                     softcap: Optional[float], key_valid: Optional[torch.Tensor],
                     device: Optional[torch.device] = None) -> Optional[int]:
    """Where attention of ``q`` over the given ``k`` runs :func:`exact_attention` (``TurboConfig.prefill_attention``
    resolved for this device, softcap and mask size), the elements of its mask (:func:`exact_mask_elems`, 0: none);
    else None. The one rule for the first prefill of a TurboCache layer (``device``: the layer's, no
    ``torch.device`` made per call) and for calls without a cache."""
    elems = exact_mask_elems(q, k, causal, window, key_valid)
    path = prefill_attention_path(cfg, device or q.device, softcap, elems, keys=k.shape[2], head_dim=q.shape[3],
                                  dtype=k.dtype)
    return elems if path == "exact" else None


def _prefill_fn(device: torch.device, model: str) -> Callable[..., torch.Tensor]:
    """The INT8 flash-attention implementation for tensors on ``device``."""
    if device.type == "cuda" or (device.type == "cpu" and caps.triton_interpret()):
        from .kernels.prefill import turbo_attention

        return turbo_attention
    if device.type == "cpu":
        log_once(
            "cpu-reference",
            f"{ATTN_NAME}: CPU tensors without TRITON_INTERPRET=1: running the plain-PyTorch reference of the "
            "same INT8 attention math (kernels/reference.py). It is slow; use a CUDA GPU for speed.",
        )
        return reference_attention
    raise TurboUnsupportedError(
        f"{ATTN_NAME}: {model} runs attention on device '{device.type}'; turbo_int8 supports CUDA GPUs (Triton) "
        "and CPU (Triton interpreter with TRITON_INTERPRET=1, else the PyTorch reference). Load the model "
        "with attn_implementation='sdpa' on this device."
    )


# ---------------------------------------------------------------------------------------------- entry point
def turbo_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """turbo_int8 attention for one transformers attention module.

    Args:
        query: [b, Hq, Lq, d]; key, value: [b, Hk, Lk, d], Hq % Hk == 0, Lq <= Lk, d in (64, 80, 96, 128, 256).
        attention_mask: ``key_valid: bool [b, Lk]`` from the turbo mask function, or None.
        scaling: softmax scale (default d**-0.5). sliding_window: keep keys with q_pos - k_pos < w.
        softcap: logits -> softcap * tanh(logits / softcap) (Gemma-2).
        kwargs: ``is_causal`` overrides ``module.is_causal`` (default True).
    Returns:
        (out [b, Lq, Hq, d] in the query dtype, None)
    """
    st = _module_state(module, query, key, value)
    if _attentions_requested(kwargs):
        raise unsupported("output_attentions", getattr(module, "config", None) or st.model)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)
    b, _, lq, _ = query.shape
    lk = key.shape[2]
    key_valid = _key_valid(attention_mask, b, lk, st.model)
    if sliding_window is not None and sliding_window <= 0:
        sliding_window = None

    # 1. A TurboCache layer returned these keys: it reads its own packed storage.
    layer = getattr(key, "turbo_cache_layer", None)
    if layer is not None:
        with on_tensor_device(query):
            out = layer.attention(
                query, key, value, scale=scaling, causal=is_causal, window=sliding_window, softcap=softcap,
                key_valid=key_valid,
            )
        return out, None

    if lq > lk:
        raise TurboUnsupportedError(
            f"{ATTN_NAME}: {st.model} called attention with {lq} queries but only {lk} keys; turbo_int8 needs "
            "q_len <= kv_len (queries are the last positions of the keys)."
        )

    # 2. Gradients needed: the INT8 kernels have no backward.
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if dropout > 0.0 or needs_grad:
        log_once(
            "grad-fallback",
            f"{ATTN_NAME}: {st.model} is training (gradients or attention dropout {dropout}); the INT8 kernels "
            "have no backward, so these calls use unquantized PyTorch attention.",
        )
        out = torch_attention(
            query, key, value, scale=scaling, causal=is_causal, window=sliding_window, softcap=softcap,
            key_valid=key_valid, dropout=dropout,
        )
        return out, None

    # 3. Attention over the given K/V (prefill, or decode over a DynamicCache): exact where that path is the faster
    # one (TurboConfig.prefill_attention), else INT8 flash attention.
    if lq < lk:
        log_once(
            "decode-unquantized-cache",
            f"{ATTN_NAME}: {st.model} decodes over a cache that is not a TurboCache (e.g. a DynamicCache): the KV "
            "cache stays unquantized (no memory saving) and attention reads all of it every step. Use plain "
            "generate() (it builds a TurboCache) or pass turbo_attn_hf.TurboCache(...) as the cache.",
        )
    cfg = st.turbo
    elems = exact_path_elems(cfg, query, key, causal=is_causal, window=sliding_window, softcap=softcap,
                             key_valid=key_valid)
    if elems is not None:
        return exact_attention(query, key, value, scale=scaling, causal=is_causal, window=sliding_window,
                               softcap=softcap, key_valid=key_valid, mask_elems=elems), None
    in_dtype = query.dtype
    if in_dtype not in caps.KERNEL_DTYPES:
        cast = caps.CAST_DTYPES.get(in_dtype)
        if cast is None:
            raise TurboUnsupportedError(
                f"{ATTN_NAME}: {st.model} runs attention in {in_dtype}; supported: bfloat16, float16 (float32 is "
                "cast to bfloat16). Load the model with torch_dtype=torch.bfloat16."
            )
        log_once(
            f"cast-{in_dtype}",
            f"{ATTN_NAME}: {st.model} runs attention in {in_dtype}; inputs are cast to {cast} before INT8 "
            f"quantization and the output is cast back (load the model in {cast} to skip the casts).",
            logging.WARNING,
        )
        query, key, value = query.to(cast), key.to(cast), value.to(cast)
    elif key.dtype != in_dtype or value.dtype != in_dtype:
        key, value = key.to(in_dtype), value.to(in_dtype)

    fn = _prefill_fn(query.device, st.model)
    # no TurboCache here: K arrives unrotated (DynamicCache / no cache); both are rotated inside their quantization
    # pass (issue 23 item 5: no separate matmul), the smooth_hadamard factors from this call's keys
    # where the Triton prefill runs, the factors too: one pass over K, not ~12 torch passes
    qk_smooth = smooth_factors(key, kernel=fn is not reference_attention) if cfg.rotate_qk == "smooth_hadamard" \
        else None
    with on_device(query.device):
        out = fn(
            query, key, value, scale=scaling, causal=is_causal, window=sliding_window, softcap=softcap,
            key_valid=key_valid, softmax=cfg.softmax, sas_threshold=cfg.sas_threshold, smooth_k=cfg.smooth_k,
            rotate_qk=cfg.rotate_qk != "none", qk_smooth=qk_smooth,
        )
    if out.dtype != in_dtype:
        out = out.to(in_dtype)
    return out, None
