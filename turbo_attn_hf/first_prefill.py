"""The first prefill's cache store of a dynamic TurboCache layer, planned per layer shape and replayed (issue 19).

Every layer of a model gets K/V of one shape at the first prefill, and plain ``generate()`` builds a new cache per
call, so the host work of that store — allocations, views, checks, two launches a layer — is paid 32 times per
prompt, on the path to the first token (a 1k prompt is host-bound).

* :class:`FirstStorePlan` (built by the first layer of a format and shape, ``TurboLayer._first_store_plan``): the
  universal scales' headroom, the groups' capacity, the head choice's 2-bit head count and the prepared stats and
  store launches (``kernels.store.StatsLaunch`` / ``StoreKVLaunch``): no check, key or constexpr per layer.
* :class:`Replay` (:func:`record`, after that first layer's launches): the byte size of the layer's and each bit
  group's storage buffer, each launch's compiled kernel, grid and scalars, and where each of its pointers pointed —
  an input (K, V, the smoothing factors), the stats workspace, or a byte offset into one of the new buffers — plus
  where each storage tensor of the layer and its groups lies in those buffers. :func:`replay` allocates the buffers
  of the next layer and relaunches with their addresses; the layer's tensors become views on first use
  (``kernels.arena.lazy_view``), after the first token.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .kernels.arena import buffer_offset, view_spec
from .kernels.device import current_cuda_device
from .kernels.launch import LeanLaunch

__all__ = ["FirstStorePlan", "LAYER_VIEWS", "PLANS", "Replay", "record", "replay"]

#: the layer attributes a first prefill leaves as views of the layer's buffer
LAYER_VIEWS = ("k_tail", "v_tail", "nonfinite", "k_scale", "v_scale", "k_mean", "prefill_k_mean")


class FirstStorePlan:
    """What a fused first prefill of one layer format and K/V shape does besides allocating (module doc); ``store``
    None: no block to pack (the INT8 buffer alone), ``n_blocks`` / ``n_tail``: the lengths after it; ``replay``: its
    :class:`Replay` once the layer that built it recorded one."""

    __slots__ = ("headroom", "capacity", "n2", "rot", "stats", "store", "n_blocks", "n_tail", "replay")

    def __init__(self, headroom: float, capacity: int, n2: Optional[int], rot: int, stats: Any):
        self.headroom, self.capacity, self.n2, self.rot, self.stats = headroom, capacity, n2, rot, stats
        self.store, self.n_blocks, self.n_tail, self.replay = None, 0, 0, None


#: ``FirstStorePlan`` by the layer format and K/V key of ``TurboLayer._first_store_key``
PLANS: dict = {}


class Replay:
    """A recorded first store (module doc). ``launches``: ``(compiled kernel, grid, pointer template, scalars)``, a
    template entry ``(i, byte offset)`` into the addresses ``[new buffers..., K, V, factors, workspace..., fixed
    head maps...]`` (``fixed``: the kept head maps' addresses, the groups hold them);
    ``layer_views`` / ``groups[i][2]``: ``{attribute: arena.view_spec}`` in the buffers ``[layer, group 0, ...]``."""

    __slots__ = ("dev_key", "sizes", "launches", "ws_shapes", "workspace", "layer_views", "groups", "fixed")

    def __init__(self, dev_key, sizes, launches, ws_shapes, workspace, layer_views, groups, fixed):
        self.dev_key, self.sizes, self.launches, self.ws_shapes = dev_key, sizes, launches, ws_shapes
        self.workspace, self.layer_views, self.groups, self.fixed = workspace, layer_views, groups, fixed


def record(layer: Any, plan: FirstStorePlan, k: torch.Tensor, v: torch.Tensor, factors: torch.Tensor,
           stats_args: tuple, store_args: list) -> Optional[Replay]:
    """The :class:`Replay` of the first store ``layer`` just made with ``plan`` (``*_args``: the tensors its two
    launches took; ``factors``: the smoothing factors' argument), or None where it cannot be replayed: storage not
    in one buffer each, a RoPE-pair mean (a new tensor), a launch not memoised (Triton's interpreter, launch hooks,
    unaligned pointers) or a pointer to anything else."""
    from .kernels.store import stats_workspace

    if plan.rot or plan.store is None or layer._flat is None or any(g.flat is None for g in layer.groups):
        return None
    dev_key = current_cuda_device() if k.is_cuda else -1
    bufs = [layer._flat] + [g.flat for g in layer.groups]
    ws_shapes = (plan.stats.part_shape, plan.stats.cnt_shape)
    ws = stats_workspace(k.device, *ws_shapes)
    fixed = tuple(g.heads for g in layer.groups if view_spec(g.heads, bufs) is None)  # kept head maps: fixed
    ins = (k, v, factors, *ws, *fixed)

    def where(t: torch.Tensor) -> Optional[tuple]:  # (index in replay's address list, byte offset)
        at = buffer_offset(t, bufs)
        if at is not None:
            return at
        return next(((len(bufs) + j, 0) for j, x in enumerate(ins) if t is x), None)

    launches = [(plan.stats.memo.get(dev_key), plan.stats.grid, stats_args, plan.stats.scalars)]
    launches += [(plan.store.memo.get((dev_key, key)), grid, store_args, scalars)
                 for key, grid, scalars, _ in plan.store.calls]
    out = []
    for hit, grid, args, scalars in launches:
        tpl = [where(t) for t in args]
        if hit is None or None in tpl:
            return None
        out.append((hit, tuple(grid), tpl, list(scalars)))
    layer_views = {name: view_spec(getattr(layer, name), bufs) for name in LAYER_VIEWS}
    groups = []
    for g in layer.groups:
        views = {name: view_spec(getattr(g, name), bufs) for name in g.TENSORS}
        heads = view_spec(g.heads, bufs)  # head_select's maps are views of the layer's buffer; else a kept map
        if heads is not None:
            views["heads"] = heads
        groups.append((g.bits, g.heads if heads is None else None, views))
    if None in layer_views.values() or any(None in views.values() for _, _, views in groups):
        return None
    return Replay(dev_key, tuple(b.numel() for b in bufs), out, ws_shapes, stats_workspace, layer_views, groups,
                  tuple(t.data_ptr() for t in fixed))


def replay(rp: Replay, k: torch.Tensor, v: torch.Tensor, factors: Optional[torch.Tensor]) -> Optional[list]:
    """Run a recorded first store over new ``k, v`` (the recorded shapes and strides) into new buffers: returns
    them (``[layer, group 0, ...]``), or None — nothing launched or allocated — when it cannot (another device,
    launch hooks, a pointer off 16-byte alignment)."""
    if rp.dev_key != (current_cuda_device() if k.is_cuda else -1) or LeanLaunch.hooks_active():
        return None
    kp, vp = k.data_ptr(), v.data_ptr()
    fp = factors.data_ptr() if factors is not None else 0
    if (kp | vp | fp) & 15:
        return None
    dev = k.device
    bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for n in rp.sizes]
    at = [b.data_ptr() for b in bufs]  # the template's address list: the new buffers, then the inputs
    at += (kp, vp, fp)
    at += [t.data_ptr() for t in rp.workspace(dev, *rp.ws_shapes)]
    at += rp.fixed
    for hit, grid, tpl, scalars in rp.launches:
        LeanLaunch.relaunch(hit, grid, [at[i] + off for i, off in tpl] + scalars)
    return bufs
