"""Several storage tensors of different dtypes carved out of one byte allocation.

A first prefill made 12 (int4) to 19 (mixed) ``torch.empty`` calls a layer, ~4-8 us each of host time on the GPU
machine, where ``as_strided`` over an existing buffer costs ~1.5 us (eval/PERF_NOTES.md, session 17): the cache
asks for one buffer per layer and one per bit group and takes typed views of it. Every view starts on an
``ALIGN``-byte boundary (Triton specialises pointers on 16-byte alignment) and is contiguous.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch

__all__ = ["ALIGN", "buffer_offset", "carve", "layout", "lazy_view", "make_views", "stacked_views", "view_spec"]

#: byte alignment of every view (Triton's pointer specialisation needs 16; 128 keeps rows on cache-line starts)
ALIGN = 128


@functools.lru_cache(maxsize=1024)
def layout(specs: tuple) -> tuple[int, tuple]:
    """``specs``: ``((name, shape, dtype), ...)`` -> ``(total bytes, ((name, shape, strides, dtype, element offset),
    ...))`` (contiguous strides; offsets in units of the view's own element size)."""
    off, out = 0, []
    for name, shape, dtype in specs:
        size = torch.empty((), dtype=dtype).element_size()
        shape = tuple(int(s) for s in shape)
        strides, n = [], 1
        for s in reversed(shape):
            strides.append(n)
            n *= s
        out.append((name, shape, tuple(reversed(strides)), dtype, off // size))
        off += -(-n * size // ALIGN) * ALIGN
    return max(off, ALIGN), tuple(out)


def carve(specs: tuple, alloc: Callable[[str, tuple, torch.dtype], torch.Tensor], one_buffer: bool = True) -> dict:
    """One ``alloc("flat", (nbytes,), torch.uint8)`` for every ``(name, shape, dtype)`` of ``specs``; returns
    ``{name: contiguous view}`` plus ``"flat"``: the byte buffer they share. ``one_buffer=False``: one
    ``alloc(name, shape, dtype)`` each and ``"flat"`` None (storage a compiled graph mutates: aot_autograd takes no
    mutation of views of one buffer in different dtypes)."""
    if not one_buffer:
        out = {name: alloc(name, shape, dtype) for name, shape, dtype in specs}
        out["flat"] = None
        return out
    nbytes, parts = layout(specs)
    flat = alloc("flat", (nbytes,), torch.uint8)
    out = {"flat": flat}
    typed = {torch.uint8: flat}
    for name, shape, strides, dtype, off in parts:
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = flat.view(dtype)  # ALIGN-multiple byte size: every dtype divides it
        out[name] = base.as_strided(shape, strides, off)
    return out


def buffer_offset(t: torch.Tensor, buffers: Sequence[torch.Tensor]) -> Optional[tuple]:
    """``(buffer index, byte offset)`` of ``t``'s first element in ``buffers`` (byte tensors), or None."""
    p = t.data_ptr()
    for i, buf in enumerate(buffers):
        base = buf.data_ptr()
        if base <= p < base + buf.numel():
            return i, p - base
    return None


def view_spec(t: Optional[torch.Tensor], buffers: Sequence[torch.Tensor]) -> Optional[tuple]:
    """Where the view ``t`` lies in ``buffers`` (byte tensors): ``(buffer index, shape, strides, dtype, element
    offset)``, ``("none",)`` for None, or None when ``t`` is not a view of one of them."""
    if t is None:
        return ("none",)
    at = buffer_offset(t, buffers)
    if at is None or at[1] % t.element_size():
        return None
    return at[0], tuple(t.shape), tuple(t.stride()), t.dtype, at[1] // t.element_size()


def lazy_view(obj: object, name: str) -> object:
    """For ``__getattr__``: make every view ``obj._lazy = (buffers, {attr: view_spec}[, byte bases])`` names (``None``
    for ``("none",)``; a view of buffer ``i`` starts ``bases[i]`` bytes in) as an attribute of ``obj``, then return
    ``name``'s; AttributeError when ``name`` is not one. ``buffers`` None: the views are made already (``{attr:
    tensor}``, :func:`stacked_views`). A first prefill replayed per layer (``turbo_attn_hf.first_prefill``) leaves its
    layer's views to the first use, after the first token. An attribute set since keeps its value. A ``_lazy`` that
    is not a tuple is a queued store (``first_prefill.Queued``): its ``resolve()`` launches the queue if it has not
    and gives the tuple."""
    d = obj.__dict__
    lazy = d.get("_lazy")
    if lazy is not None and type(lazy) is not tuple:  # a store queued, maybe not launched yet: where it lies
        lazy = d["_lazy"] = lazy.resolve()
    if lazy is None or name not in lazy[1]:
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
    buffers, views, *bases = d.pop("_lazy")
    if buffers is None:
        for attr, t in views.items():
            if attr not in d:
                d[attr] = t
        return d[name]
    names = [attr for attr in views if attr not in d]
    for attr, t in zip(names, make_views(buffers, [views[attr] for attr in names], bases[0] if bases else None)):
        d[attr] = t
    return d[name]


def stacked_views(buffers: Sequence[torch.Tensor], specs: dict, steps: Sequence[int], n: int) -> dict:
    """``{attr: n views}``: for each ``view_spec`` of ``specs`` (``{attr: spec}``), the views of ``n`` layers whose
    buffer ``i`` lies ``steps[i]`` bytes after the previous layer's (``("none",)`` -> n Nones). One ``as_strided``
    and one ``unbind`` per attribute for all layers, not a Python-level ``as_strided`` per view: a cache's first
    decode step makes ~14 views a layer (eval/PERF_NOTES.md session 37)."""
    typed: dict = {}
    out = {}
    for attr, spec in specs.items():
        if spec[0] == "none":
            out[attr] = (None,) * n
            continue
        i, shape, strides, dtype, off = spec
        base = typed.get((i, dtype))
        if base is None:
            base = typed[(i, dtype)] = buffers[i].view(dtype)
        step, rem = divmod(steps[i], dtype.itemsize)
        if rem:
            raise ValueError(f"layers {steps[i]} bytes apart hold no whole {dtype} elements")
        out[attr] = base.as_strided((n,) + tuple(shape), (step,) + tuple(strides), off).unbind(0)
    return out


def make_views(buffers: Sequence[torch.Tensor], specs: Sequence[tuple], bases: Optional[Sequence[int]] = None
               ) -> list:
    """The tensors ``specs`` (``view_spec``'s tuples) name in ``buffers`` (byte tensors; ``("none",)`` -> None);
    ``bases``: a view of buffer ``i`` starts ``bases[i]`` bytes in."""
    typed: dict = {}
    out = []
    for spec in specs:
        if spec[0] == "none":
            out.append(None)
            continue
        i, shape, strides, dtype, off = spec
        base = typed.get((i, dtype))
        if base is None:
            base = typed[(i, dtype)] = buffers[i].view(dtype)
        if bases is not None:
            off += bases[i] // dtype.itemsize
        out.append(base.as_strided(shape, strides, off))
    return out
