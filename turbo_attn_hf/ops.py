"""The static TurboCache's decode step as two ``torch.library`` custom ops, so torch.compile traces a decode step
without a graph break and CUDA graphs capture it (HF's ``cache_implementation="static"`` + ``CompileConfig``).

* ``turbo_attn::store_step``: one token per row into a layer's storage, lengths on the device
  (``kernels.store_step.store_step``); mutates the INT8 buffer, the packed groups, the lengths and the counters.
* ``turbo_attn::decode_step``: attention of the step's query over that storage (``kernels.decode`` with
  ``lens=``: the split plan is made for the capacity, the kernel reads the lengths).

The storage, lengths included, goes in as a layer's few byte buffers and an int naming where each tensor lies in
them (a layout of ``step_layout``'s registry; the views are made in the op bodies, which a CUDA-graph replay does
not run), not as its ~12-18 tensors: every graph input costs the compiled call host time at every step (eval/PERF_NOTES.md,
session 24). On a CPU without the Triton interpreter the ops run the PyTorch store and ``reference.turbo_decode_ref``
on host copies of the lengths (CPU: no graph to capture).
"""

from __future__ import annotations

import weakref
from typing import List, NamedTuple, Optional

import torch

from .kernels.arena import make_views, view_spec
from .kernels.device import on_tensor_device
from .kernels.interpreter import use_triton
from .kernels.pack import PackedKV

__all__ = ["STEP_TENSORS", "StepStorage", "step_layout", "step_storage"]

#: a static layer's tensors a decode step reads or writes (None allowed), in ``StepStorage``'s order
STEP_TENSORS = ("k_tail", "v_tail", "k_scale", "v_scale", "k_mean", "qk_smooth", "counters", "nonfinite", "lens")
_GROUP_TENSORS = ("heads", "k", "v", "k_scale", "k_zero", "v_sz")
_LAYOUTS: list = []  # layout id -> (n buffers, layer specs, (((bits, k_bits), group specs), ...))
_LAYOUT_IDS: dict = {}
#: id of a layer's first buffer -> (layout, weak refs of its buffers, the views): an eager step passes the same
#: tensor objects every time, so the decode entry (kept per storage tensor objects) is found again, not rebuilt
#: (~60 us). The entry goes when that buffer object does (its views share the storage, not the Python object).
_VIEWS: dict = {}


class StepStorage(NamedTuple):
    k_tail: torch.Tensor
    v_tail: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_mean: Optional[torch.Tensor]
    qk_smooth: Optional[torch.Tensor]
    counters: torch.Tensor  # int32 [2]: arrival (zero between calls), overflow steps
    nonfinite: torch.Tensor  # int32 [1]: stored vectors with an inf/NaN
    lens: torch.Tensor  # int32 [2]: n_blocks, n_tail (the kernels read and write them)
    groups: list  # PackedKV per bit width


def step_layout(layer, buffers: List[torch.Tensor]) -> int:
    """The id of where ``layer``'s ``STEP_TENSORS`` and its groups' tensors lie in ``buffers`` (byte tensors):
    the ops' ``layout`` argument. ValueError names a tensor outside them."""
    specs = tuple(view_spec(getattr(layer, n), buffers) for n in STEP_TENSORS)
    groups = tuple(((g.bits, g.k_bits), tuple(view_spec(getattr(g, n), buffers) for n in _GROUP_TENSORS))
                   for g in layer.groups)
    missing = [n for n, sp in zip(STEP_TENSORS, specs) if sp is None] + [
        f"group {i} {n}" for i, (_, gs) in enumerate(groups) for n, sp in zip(_GROUP_TENSORS, gs) if sp is None]
    if missing:
        raise ValueError(f"static TurboCache layer {layer.layer_idx}: {', '.join(missing)} not in the step's buffers")
    key = (len(buffers), specs, groups)
    i = _LAYOUT_IDS.get(key)
    if i is None:
        i = _LAYOUT_IDS[key] = len(_LAYOUTS)
        _LAYOUTS.append(key)
    return i


def step_storage(buffers: List[torch.Tensor], layout: int, n_blocks: int = 0) -> StepStorage:
    """The tensors ``step_layout`` named, as views of ``buffers`` (groups as ``PackedKV`` of ``n_blocks``): the same
    view objects for the same buffer objects and layout."""
    _, specs, groups = _LAYOUTS[layout]
    key = id(buffers[0])
    hit = _VIEWS.get(key)
    if hit is not None and hit[0] == layout and len(hit[1]) == len(buffers) and all(
            r() is t for r, t in zip(hit[1], buffers)):
        views = hit[2]
    else:
        views = make_views(buffers, specs + tuple(sp for _, gspecs in groups for sp in gspecs))
        refs = (weakref.ref(buffers[0], lambda _, k=key: _VIEWS.pop(k, None)),) + tuple(map(weakref.ref, buffers[1:]))
        _VIEWS[key] = (layout, refs, views)
    n = len(specs)
    packed = [PackedKV(bits, *views[n + 6 * i:n + 6 * i + 5], n_blocks=n_blocks, v_sz=views[n + 6 * i + 5],
                       k_bits=kb) for i, ((bits, kb), _) in enumerate(groups)]
    return StepStorage(*views[:n], packed)


@torch.library.custom_op("turbo_attn::store_step", mutates_args=("buffers",))
def store_step(k: torch.Tensor, v: torch.Tensor, buffers: List[torch.Tensor], layout: int, n_sink: int,
               rotate: bool) -> None:
    """Store one token ``k, v [b, H, 1, D]`` into the storage ``buffers`` / ``layout`` name (its ``lens``:
    ``[n_blocks, n_tail]``); ``rotate``: K is the caller's, rotated into the stored basis on the way in (the storage's
    ``qk_smooth``: its factors)."""
    s = step_storage(buffers, layout)
    if use_triton(k.device):
        from .kernels.store_step import store_step as launch

        with on_tensor_device(k):  # Triton launches on the current device (a compiled step sets none for us)
            launch(k, v, s.k_scale, s.k_mean, s.v_scale, s.k_tail, s.v_tail, s.groups, n_sink, s.lens,
                   s.counters[0:1], s.counters[1:2], nonfinite=s.nonfinite, rotate=rotate, qk_smooth=s.qk_smooth)
        return
    if rotate:
        from .kernels.reference import rotate_keys_ref

        k = rotate_keys_ref(k, s.qk_smooth)
    _store_step_host(k, v, s.k_scale, s.k_mean, s.v_scale, s.k_tail, s.v_tail, s.groups, n_sink, s.lens, s.counters,
                     s.nonfinite)


@store_step.register_fake
def _(k, v, buffers, layout, n_sink, rotate):
    return None


def _store_step_host(k, v, k_scale, k_mean, v_scale, k_tail, v_tail, groups, n_sink, lens, counters,
                     nonfinite) -> None:
    """The same step in PyTorch on host lengths (CPU without the interpreter)."""
    from .kernels.pack import quantize_int8

    nb, nt = (int(x) for x in lens.tolist())
    C = k_tail.shape[2]
    bs = groups[0].block_size
    full = nt + 1 == C
    if full and nb >= groups[0].capacity:
        counters[1] += 1
        return
    nonfinite += (~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))).sum().to(torch.int32)
    k_tail[:, :, nt:nt + 1] = quantize_int8(k, k_scale, k_mean)
    v_tail[:, :, :, nt:nt + 1] = quantize_int8(v, v_scale).transpose(-1, -2)
    if not full:
        lens[1] = nt + 1
        return
    k8 = k_tail[:, :, n_sink:n_sink + bs]
    v8 = v_tail[:, :, :, n_sink:n_sink + bs].transpose(-1, -2)
    for g in groups:
        g.n_blocks = nb
        idx = g.heads.long()
        g.append(k8.index_select(1, idx), v8.index_select(1, idx))
    k_tail[:, :, n_sink:C - bs] = k_tail[:, :, n_sink + bs:C].clone()
    v_tail[:, :, :, n_sink:C - bs] = v_tail[:, :, :, n_sink + bs:C].clone()
    lens[0] = nb + 1
    lens[1] = C - bs


@torch.library.custom_op("turbo_attn::decode_step", mutates_args=())
def decode_step(q: torch.Tensor, buffers: List[torch.Tensor], layout: int, n_sink: int,
                key_valid: Optional[torch.Tensor], scale: float, causal: bool, window: int, softcap: float,
                softmax: str, sas_threshold: float, rotate: bool) -> torch.Tensor:
    """``[b, Lq, HQ, D]`` attention of ``q [b, HQ, Lq, D]`` over a static layer's storage (``buffers`` /
    ``layout``; ``window`` 0 / ``softcap`` 0.0: none); ``key_valid [b, >= kv_len]`` bool or None; ``rotate``: K is
    stored rotated, the unrotated query is rotated in the kernel (the storage's ``qk_smooth``: the factors)."""
    kw = dict(scale=scale, causal=causal, window=window or None, softcap=softcap or None, n_sink=n_sink,
              softmax=softmax, sas_threshold=sas_threshold, rotate=rotate)
    if use_triton(q.device):
        from .kernels.decode import turbo_decode_attention

        s = step_storage(buffers, layout)
        with on_tensor_device(q):
            return turbo_decode_attention(q, s.groups, s.k_tail, s.v_tail, 0, s.k_scale, s.v_scale, s.k_mean,
                                          key_valid=key_valid, lens=s.lens, qk_smooth=s.qk_smooth, **kw)
    from .kernels.reference import turbo_decode_ref

    nb, nt = (int(x) for x in step_storage(buffers, layout).lens.tolist())
    s = step_storage(buffers, layout, n_blocks=nb)
    if key_valid is not None:
        key_valid = key_valid[:, :nb * s.groups[0].block_size + nt]
    return turbo_decode_ref(q, s.groups, s.k_tail, s.v_tail, nt, s.k_scale, s.v_scale, s.k_mean,
                            key_valid=key_valid, qk_smooth=s.qk_smooth, **kw)


@decode_step.register_fake
def _(q, buffers, layout, n_sink, key_valid, scale, causal, window, softcap, softmax, sas_threshold, rotate):
    b, hq, lq, d = q.shape
    return q.new_empty(b, lq, hq, d)
