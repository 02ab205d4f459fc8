"""Launch a compiled Triton kernel again without Triton's per-call binder (the decode step's host cost).

``JITFunction.run`` specialises every argument in C++, builds ``str(options)`` for its cache key and binds
the arguments on every call: for the decode kernel's ~60 arguments that is about two thirds of a call's
host time on the GPU machine (``eval/PERF_NOTES.md``, round 4). :class:`LeanLaunch` computes the same
specialisation facts in a few tuple operations — per tensor its dtype and 16-byte alignment, per integer
``% 16 == 0``, ``== 1`` and int32 range (``do_not_specialize`` integers: the range only) — and keys the
compiled kernel on them, the keyword arguments (constexprs and options) and the device. The first call of
a key goes through ``fn[grid](...)`` (compile or Triton's own cache, which also validates the pointers);
later calls hand the arguments to the compiled kernel's launcher directly, tensors as their addresses (the
launcher would otherwise call ``data_ptr()`` and ``cuPointerGetAttribute`` per tensor; whether a tensor is on
the GPU is part of the key). A key that Triton would specialise differently never shares a kernel: the key
holds every fact Triton's specialisation reads, so a miss only costs one ordinary launch.

Under ``TRITON_INTERPRET=1`` every call is the ordinary ``fn[grid](...)``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence, Tuple

import torch
from triton import knobs
from triton.runtime.driver import driver

from .interpreter import interpreting

__all__ = ["LeanLaunch"]

def _int_type(x: int) -> str:
    """Triton's integer argument types by value range."""
    if -(1 << 31) <= x < (1 << 31):
        return "i32"
    if 0 <= x < (1 << 32):
        return "u32"
    return "i64" if -(1 << 63) <= x < (1 << 63) else "u64"


def _fact(arg: Any, specialise: bool) -> Any:
    """What Triton's specialisation reads from one runtime argument."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0, arg.is_cuda
    if isinstance(arg, bool) or arg is None or isinstance(arg, float):
        return type(arg)
    if isinstance(arg, int):
        return (_int_type(arg), arg & 15 == 0, arg == 1) if specialise else _int_type(arg)
    return arg  # anything else (e.g. a constexpr passed positionally) is part of the key as itself


class LeanLaunch:
    """``LeanLaunch(jit_fn)[grid](*args, **kwargs)``: the same call as ``jit_fn[grid](...)``, minus the binder.

    ``args`` are the runtime arguments in order; ``kwargs`` the constexprs and launch options, always
    passed by the caller in the same order (another order is another key, still correct)."""

    def __init__(self, fn: Any):
        self.fn = fn
        params = getattr(fn, "params", ())  # an InterpretedFunction (TRITON_INTERPRET=1) has none
        self._names = [p.name for p in params]
        self._specialise = [not p.do_not_specialize for p in params]
        self._defaults = {p.name: p.default for p in params}
        self._kernels: Dict[Tuple, Tuple[Any, Tuple]] = {}

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Sequence[int], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        """Launch; returns ``(compiled kernel, trailing arguments)`` that ran, or None (interpreter, or the
        first launch of a key): what :meth:`relaunch` takes."""
        if interpreting():
            self.fn[tuple(grid)](*args, **kwargs)
            return None
        device = driver.active.get_current_device()
        spec = self._specialise
        call = list(args)  # tensors become their addresses: the launcher then skips data_ptr + cuPointerGetAttribute
        facts = []
        add, tensor = facts.append, torch.Tensor
        for i, a in enumerate(args):  # _fact inlined for the common types: this loop is the hot path's cost
            t = type(a)
            if t is int and -2147483648 <= a < 2147483648:
                add((a & 15 == 0, a == 1) if spec[i] else 0)
            elif t is tensor or isinstance(a, tensor):
                ptr = a.data_ptr()
                add((a.dtype, ptr & 15 == 0, a.is_cuda))  # a CPU tensor: its own key, hence Triton's error
                call[i] = ptr
            else:
                add(_fact(a, spec[i]))
        key = (device, tuple(kwargs.items()), tuple(facts))
        hit = self._kernels.get(key)
        if hit is None:
            kernel = self.fn[tuple(grid)](*args, **kwargs)  # compiles (or Triton's cache) and launches
            kernel = kernel.result() if hasattr(kernel, "result") else kernel  # async compile mode
            tail = tuple(kwargs.get(n, self._defaults[n]) for n in self._names[len(args):])
            self._kernels[key] = (kernel, tail)
            return None
        if not self.hooks_active():
            self.relaunch(hit, grid, call)
            return hit
        kernel, tail = hit  # a profiler's hooks (proton) take the launch metadata, built from the tensors
        g = tuple(grid) + (1, 1)
        stream = driver.active.get_current_stream(device)
        meta = kernel.launch_metadata(g, stream, *args, *tail)
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, meta,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *call, *tail)
        return hit

    @staticmethod
    def hooks_active() -> bool:
        """A profiler's launch hooks are set (they need the tensors, so callers take :meth:`launch` then)."""
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))

    @staticmethod
    def relaunch(hit: Tuple[Any, Tuple], grid: Sequence[int], call: Sequence[Any]) -> None:
        """Launch ``hit`` (as returned by :meth:`launch`) again with the runtime arguments ``call``, tensors
        given as their addresses. The caller guarantees that every specialisation fact of ``call`` equals
        that of the launch ``hit`` came from (dtypes, 16-byte alignment, specialised integers' ``% 16`` and
        ``== 1``, int32 range) and that no launch hooks are set (:meth:`hooks_active`)."""
        kernel, tail = hit
        g = tuple(grid) + (1, 1)
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *call, *tail)

