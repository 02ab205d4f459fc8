"""The first prefill's cache store of a dynamic TurboCache layer, planned per layer shape and replayed (issue 19).

Every layer of a model gets K/V of one shape at the first prefill, and plain ``generate()`` builds a new cache per
call, so the host work of that store — allocations, views, checks, two launches a layer — is paid 32 times per
prompt, on the path to the first token (a 1k prompt is host-bound).

* :class:`FirstStorePlan` (built by the first layer of a format and shape, ``TurboLayer._first_store_plan``): the
  universal scales' headroom, the groups' capacity, the head choice's 2-bit head count and the prepared stats and
  store launches (``kernels.store.StatsLaunch`` / ``StoreKVLaunch``): no check, key or constexpr per layer.
* :class:`Replay` (:func:`record`, after that first layer's launches): the byte size of the layer's and each bit
  group's storage buffer, each launch's compiled kernel, grid and scalars, and where each of its pointers pointed —
  an input (K, V, a smooth_hadamard layer's K -> Q factors), the stats workspace, or a byte offset into one of the
  new buffers — plus
  where each storage tensor of the layer and its groups lies in those buffers. :func:`replay` allocates the buffers
  of the next layer and relaunches with their addresses; the layer's tensors become views on first use
  (``kernels.arena.lazy_view``), after the first token.
* :class:`Batch` (one per cache): the next layers of a forward need not launch their store at once — the first
  prefill's attention reads the prompt's own K/V, not the cache. A layer with a recorded store only queues its K/V
  (kept alive) and its state; the cache flushes the queue after its last layer's update, or any read of a queued
  layer's storage does (``lazy_view``). The flush is one stats and one store launch for all queued layers of a
  plan (:func:`launch_layers`: the kernels' ``LAYERS`` grid axis, each pointer moved by a per-layer table) and
  one allocation per buffer for all of them: the host cost of a layer's store becomes a list append. A
  smooth_hadamard layer queues without its factors: the flush makes those of all its queued layers first, in one
  launch (``kernels.smooth_factors.smooth_factors_layers``), and the layer's ``qk_smooth`` resolves with its views.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from .kernels.arena import buffer_offset, stacked_views, view_spec
from .kernels.device import current_cuda_device, on_device
from .kernels.launch import LeanLaunch, lean

__all__ = ["BATCH_BYTES", "Batch", "FirstStorePlan", "LAYER_VIEWS", "PLANS", "Queue", "Queued", "Replay",
           "launch_layers", "record", "replay"]

#: the layer attributes a first prefill leaves as views of the layer's buffer
LAYER_VIEWS = ("k_tail", "v_tail", "nonfinite", "k_scale", "v_scale", "k_mean", "prefill_k_mean")

#: bytes of K/V that a cache's queued first stores keep alive before they launch (:class:`Batch`): a 1k prompt of
#: the Llama-3-8B shape queues all 32 layers (4 MiB each); a long prompt's layers flush in groups or, above half
#: of it, launch their own store at once (at 32k the store is ~1 % of the prefill and the K/V are 128 MiB a layer)
BATCH_BYTES = 128 << 20


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
    head maps...]`` (factors: a smooth_hadamard layer's ``qk_smooth``: its own launch's output, made before a replay
    now, or the flush's for a queued layer; ``fixed``: the kept head maps' addresses, the groups hold them);
    ``layer_views`` / ``groups[i][2]``: ``{attribute: arena.view_spec}`` in the buffers ``[layer, group 0, ...]``."""

    __slots__ = ("dev_key", "sizes", "launches", "ws_shapes", "workspace", "layer_views", "groups", "fixed",
                 "batched", "fixed_t")

    def __init__(self, dev_key, sizes, launches, ws_shapes, workspace, layer_views, groups, fixed):
        self.dev_key, self.sizes, self.launches, self.ws_shapes = dev_key, sizes, launches, ws_shapes
        self.workspace, self.layer_views, self.groups, self.fixed = workspace, layer_views, groups, fixed
        # launch_layers: per launch [fn, kwargs, grid, template, dtypes, scalars, table row, compiled or None, each
        # table entry's address-list index (the list's length: a zero), its element size]; the kept head maps
        self.batched, self.fixed_t = [], ()


def record(layer: Any, plan: FirstStorePlan, k: torch.Tensor, v: torch.Tensor, stats_args: tuple,
           store_args: list) -> Optional[Replay]:
    """The :class:`Replay` of the first store ``layer`` just made with ``plan`` (``*_args``: the tensors its two
    launches took), or None where it cannot be replayed: storage not in one buffer each, a RoPE-pair mean (a new
    tensor), a launch not memoised (Triton's interpreter, launch hooks, unaligned pointers) or a pointer to anything
    else. A smooth_hadamard layer's factors are an input, as K and V: a replay now takes the layer's own launch's, a
    queued layer's come from its flush (``Batch.flush``: one launch for all of them)."""
    from .kernels.store import stats_workspace

    if plan.rot or plan.store is None or layer._flat is None or any(g.flat is None for g in layer.groups):
        return None
    dev_key = current_cuda_device() if k.is_cuda else -1
    bufs = [layer._flat] + [g.flat for g in layer.groups]
    ws_shapes = (plan.stats.part_shape, plan.stats.cnt_shape)
    ws = stats_workspace(k.device, *ws_shapes)
    fixed = tuple(g.heads for g in layer.groups if view_spec(g.heads, bufs) is None)  # kept head maps: fixed
    ins = (k, v, factors_of(layer, k), *ws, *fixed)

    def where(t: torch.Tensor) -> Optional[tuple]:  # (index in replay's address list, byte offset)
        at = buffer_offset(t, bufs)
        if at is not None:
            return at
        return next(((len(bufs) + j, 0) for j, x in enumerate(ins) if t is x), None)

    from .kernels.store import LAYER_ROW_STATS, LAYER_ROW_STORE, _stats_kernel, _store_kv_kernel

    launches = [(plan.stats.memo.get(dev_key), plan.stats.grid, stats_args, plan.stats.scalars, _stats_kernel,
                 plan.stats.kw, LAYER_ROW_STATS)]
    launches += [(plan.store.memo.get((dev_key, key)), grid, store_args, scalars, _store_kv_kernel, kw, LAYER_ROW_STORE)
                 for key, grid, scalars, kw in plan.store.calls]
    out, batched = [], []
    n_addr = len(bufs) + len(ins)
    for hit, grid, args, scalars, fn, kw, row in launches:
        tpl = [where(t) for t in args]
        if None in tpl:
            return None
        out.append((hit, tuple(grid), tpl, list(scalars)))
        pad = row - (len(tpl) - 1)  # the last argument is the table's place
        gather = np.array([i for i, _ in tpl[:-1]] + [n_addr] * pad, dtype=np.int64)
        esize = np.array([t.element_size() for t in args[:-1]] + [1] * pad, dtype=np.int64)
        batched.append([fn, dict(kw, LAYERS=True), tuple(grid), tpl, tuple(t.dtype for t in args[:-1]),
                        list(scalars), row, None, gather, esize])
    layer_views = {name: view_spec(getattr(layer, name), bufs) for name in LAYER_VIEWS}
    layer_views["_flat"] = (0, (bufs[0].numel(),), (1,), torch.uint8, 0)
    groups = []
    for g in layer.groups:
        views = {name: view_spec(getattr(g, name), bufs) for name in g.TENSORS}
        heads = view_spec(g.heads, bufs)  # head_select's maps are views of the layer's buffer; else a kept map
        if heads is not None:
            views["heads"] = heads
        views["flat"] = (len(groups) + 1, (g.flat.numel(),), (1,), torch.uint8, 0)
        groups.append((g.bits, g.heads if heads is None else None, views))
    if None in layer_views.values() or any(None in views.values() for _, _, views in groups):
        return None
    rp = Replay(dev_key, tuple(b.numel() for b in bufs), None if any(o[0] is None for o in out) else out, ws_shapes,
                stats_workspace, layer_views, groups, tuple(t.data_ptr() for t in fixed))
    rp.batched, rp.fixed_t = batched, fixed
    return rp


def factors_of(layer: Any, k: torch.Tensor) -> torch.Tensor:
    """The factors input of a layer's first store: its ``qk_smooth`` (smooth_hadamard), else ``k`` (a placeholder
    no launch points to, so the address list keeps one layout)."""
    f = getattr(layer, "qk_smooth", None)
    return k if f is None else f


def _fits(rp: Replay, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor) -> bool:
    """Whether ``rp``'s launches take these inputs: the device it recorded on, 16-byte aligned pointers."""
    return (rp.dev_key == (current_cuda_device() if k.is_cuda else -1)
            and not (k.data_ptr() | v.data_ptr() | f.data_ptr()) & 15)


def replay(rp: Replay, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor) -> Optional[list]:
    """Run a recorded first store over new ``k, v`` and factors ``f`` (:func:`factors_of`; the recorded shapes and
    strides) into new buffers: returns them (``[layer, group 0, ...]``), or None — nothing launched or allocated —
    when it cannot (another device, launch hooks, a pointer off 16-byte alignment, launches not memoised)."""
    if rp.launches is None or LeanLaunch.hooks_active() or not _fits(rp, k, v, f):
        return None
    dev = k.device
    bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for n in rp.sizes]
    at = [b.data_ptr() for b in bufs]  # the template's address list: the new buffers, then the inputs
    at += (k.data_ptr(), v.data_ptr(), f.data_ptr())
    at += [t.data_ptr() for t in rp.workspace(dev, *rp.ws_shapes)]
    at += rp.fixed
    for hit, grid, tpl, scalars in rp.launches:
        LeanLaunch.relaunch(hit, grid, [at[i] + off for i, off in tpl] + scalars)
    return bufs


class Batch:
    """A cache's queued first stores (module doc). ``gen``: the :class:`Queue` being filled; a flush launches it
    and starts another."""

    __slots__ = ("gen",)

    def __init__(self):
        self.gen = Queue(self)

    @property
    def items(self) -> list:
        return self.gen.items

    def add(self, rp: Replay, k: torch.Tensor, v: torch.Tensor, f: Optional[torch.Tensor]) -> Optional["Queue"]:
        """Queue a layer's first store as ``rp`` recorded it (``f``: :func:`factors_of`, kept alive with K/V; None:
        a smooth_hadamard layer whose factors the flush makes, for all such layers in one launch); returns the
        :class:`Queue` it joined (the layer's place: its last item), or None (nothing queued) where it cannot wait:
        another device than the recording's, a pointer off 16-byte alignment, K/V over half of ``BATCH_BYTES``."""
        n = k.numel() * k.element_size() + v.numel() * v.element_size()
        if 2 * n > BATCH_BYTES or not _fits(rp, k, v, k if f is None else f):
            return None
        gen = self.gen
        if gen.nbytes + n > BATCH_BYTES:
            self.flush()
            gen = self.gen
        gen.items.append((rp, k, v, f))
        gen.nbytes += n
        return gen

    def flush(self) -> None:
        """Launch every queued store (:func:`launch_layers`, per recorded plan); a new queue takes the next ones."""
        gen, self.gen = self.gen, Queue(self)
        by_plan: dict = {}
        for j, it in enumerate(gen.items):
            by_plan.setdefault(id(it[0]), []).append(j)
        out = [None] * len(gen.items)
        for js in by_plan.values():
            items = [gen.items[j] for j in js]
            made_f = _pending_factors(items)
            bigs = launch_layers(items)
            made: dict = {}  # the views of these layers, made for all at the first one's use (resolve)
            for jl, j in enumerate(js):
                out[j] = (bigs, jl, len(js), made, made_f.get(jl))
        gen.items, gen.out = [(it[0],) for it in gen.items], out  # K/V (and factors) no longer kept alive


class Queue:
    """One flush's worth of a :class:`Batch`: ``items`` ``(replay, k, v, factors)``; ``out`` once launched: per item
    the buffers, its index in them, the layers they hold and those layers' views made so far (shared)."""

    __slots__ = ("batch", "items", "nbytes", "out")

    def __init__(self, batch: Batch):
        self.batch, self.items, self.nbytes, self.out = batch, [], 0, None


class Queued:
    """The ``_lazy`` of a queued layer (``group`` None) or of one of its bit groups: :meth:`resolve` (``arena.
    lazy_view``, on first use) flushes the queue if it has not launched and gives ``(None, {attr: its view})``: the
    views of all the flush's layers of one plan are made at the first one's use (``arena.stacked_views``)."""

    __slots__ = ("gen", "j", "group")

    def __init__(self, gen: Queue, j: int, group: Optional[int]):
        self.gen, self.j, self.group = gen, j, group

    def resolve(self) -> tuple:
        gen = self.gen
        if gen.out is None:
            gen.batch.flush()
        if gen.out is None:  # its launch raised (e.g. out of memory) and took the queue with it
            raise RuntimeError("turbo_int8: this TurboCache layer's first store failed to launch (see the error raised "
                               "by the forward that queued it); reset the cache or start a new one")
        rp = gen.items[self.j][0]
        bigs, jl, n, made, f = gen.out[self.j]
        stacked = made.get(self.group)
        if stacked is None:  # the first use of this kind of view in the flush: every layer's at once
            views = rp.layer_views if self.group is None else rp.groups[self.group][2]
            stacked = made[self.group] = stacked_views(bigs, views, rp.sizes, n)
        views = {attr: ts[jl] for attr, ts in stacked.items()}
        if f is not None and self.group is None:  # factors the flush made (a layer queued with none)
            views["qk_smooth"] = f
        return None, views


def _pending_factors(items: list) -> dict:
    """The smoothing factors of the ``items`` queued without them (``Batch.add``'s ``f`` None), made by one launch
    (``smooth_factors_layers``) and put in their items: ``{index in items: factors}``."""
    pend = [jl for jl, it in enumerate(items) if it[3] is None]
    if not pend:
        return {}
    from .kernels.smooth_factors import smooth_factors_layers

    k0 = items[pend[0]][1]
    with on_device(k0.device):
        fs = smooth_factors_layers([items[jl][1] for jl in pend]).unbind(0)
    for jl, f in zip(pend, fs):
        rp, k, v, _ = items[jl]
        items[jl] = (rp, k, v, f)
    return dict(zip(pend, fs))


def launch_layers(items: list) -> list:
    """The queued first stores ``items`` (``(replay, k, v, factors)``) of one :class:`Replay` in one launch per
    recorded launch: the kernels' ``LAYERS`` grid axis over the items, each pointer moved per layer by an int64
    table (elements; the layer's and groups' buffers ``sizes`` bytes apart in one allocation each, the inputs where
    they are, the stats workspaces ``stats_workspace_steps`` apart, the kept head maps shared). Returns the
    buffers."""
    from .kernels.store import stats_workspace_steps

    rp, k0, v0, f0 = items[0]
    dev, n = k0.device, len(items)
    with on_device(dev):
        bigs = [torch.empty(n * size, dtype=torch.uint8, device=dev) for size in rp.sizes]
        ws = rp.workspace(dev, *rp.ws_shapes, layers=n)
        s_part, s_sum, s_arr = stats_workspace_steps(*rp.ws_shapes)
        ins = (k0, v0, f0, *ws, *rp.fixed_t)
        addr = [b.data_ptr() for b in bigs] + [t.data_ptr() for t in ins]
        steps = np.array(rp.sizes + (0, 0, 0, s_part, s_sum, s_part, s_arr) + (0,) * (len(rp.fixed_t) + 1),
                         dtype=np.int64)
        delta = np.outer(np.arange(n, dtype=np.int64), steps)  # [layers, addresses + a zero]: bytes from layer 0's
        kvf = np.array([(k.data_ptr(), v.data_ptr(), f.data_ptr()) for _, k, v, f in items], dtype=np.int64)
        delta[:, len(bigs):len(bigs) + 3] = kvf - kvf[0]
        table = torch.from_numpy(np.concatenate([(delta[:, b[8]] // b[9]).reshape(-1) for b in rp.batched]))
        if dev.type == "cuda":  # through pinned memory: a pageable copy would wait for the stream
            table = table.pin_memory().to(dev, non_blocking=True)
        hooks = LeanLaunch.hooks_active()
        at = 0
        for b in rp.batched:
            fn, kw, grid, tpl, dtypes, scalars, row, hit = b[:8]
            grid = grid + (n,)
            if hit is not None and not hooks:
                LeanLaunch.relaunch(hit, grid, [addr[i] + off for i, off in tpl[:-1]] + [table.data_ptr() + 8 * at]
                                    + scalars)
            else:  # the first batch of this plan (compiles) or a profiler's hooks: tensors of the first layer
                args = [bigs[i][off:off + dt.itemsize].view(dt) if i < len(bigs) else ins[i - len(bigs)]
                        for (i, off), dt in zip(tpl[:-1], dtypes)]
                hit = lean(fn).launch(grid, (*args, table[at:], *scalars), kw)
                if not hooks:
                    b[7] = hit
            at += n * row
    return bigs
