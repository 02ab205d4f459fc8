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

import functools
import operator
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from triton import knobs
from triton.runtime.driver import driver

from .interpreter import interpreting

__all__ = ["LeanLaunch", "lean"]

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
        params = getattr(fn, "params", None)  # an InterpretedFunction (TRITON_INTERPRET=1) has none
        self._plain = params is None  # not a JIT function (a test's recorder): always called as ``fn[grid](...)``
        params = params or ()
        self._names = [p.name for p in params]
        self._specialise = [not p.do_not_specialize for p in params]
        self._defaults = {p.name: p.default for p in params}
        self._kernels: Dict[Tuple, Tuple[Any, Tuple]] = {}

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Sequence[int], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        """Launch; returns ``(compiled kernel, trailing arguments)`` that ran, or None (the interpreter, a plain
        function): what :meth:`relaunch` takes."""
        if self._plain or interpreting():
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
            hit = self._kernels[key] = self.launch_bound(grid, args, kwargs)
            return hit  # what ran: a caller's memo can relaunch it from the next call on
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

    def launch_bound(self, grid: Sequence[int], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        """``fn[grid](*args, **kwargs)`` through Triton's binder (compiles, or Triton's cache); returns ``(compiled
        kernel, trailing arguments)`` for :meth:`relaunch`, or None (the interpreter, a plain function). For callers
        whose arguments this class cannot key (Gluon's tensor descriptors): they key the facts themselves."""
        if self._plain or interpreting():
            self.fn[tuple(grid)](*args, **kwargs)
            return None
        kernel = self.fn[tuple(grid)](*args, **kwargs)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel  # async compile mode
        return kernel, tuple(kwargs.get(n, self._defaults[n]) for n in self._names[len(args):])

    def launch_memo(self, memo: Dict[Any, Any], key: Any, grid: Sequence[int], tensors: Sequence[torch.Tensor],
                    scalars: Sequence[Any], kwargs: Dict[str, Any], hooks: bool) -> None:
        """Launch ``fn[grid](*tensors, *scalars, **kwargs)`` for a caller whose own ``key`` fixes every
        specialisation fact of the call but the tensors' 16-byte alignment: the tensors' dtypes and devices, the
        integers' Triton facts (``% 16``, ``== 1`` where specialised, int32 range), ``kwargs`` and the current
        device. ``memo`` (the caller's dict) maps ``key`` to the kernel compiled for 16-byte aligned tensors; a
        hit with every tensor so aligned is relaunched with the addresses — no per-argument facts, no binder.
        ``hooks``: :meth:`hooks_active`, read once by the caller. Anything else is an ordinary :meth:`launch`."""
        ptrs = list(map(_data_ptr, tensors))
        aligned = not (functools.reduce(operator.or_, ptrs, 0) & 15)
        hit = memo.get(key) if aligned and not hooks else None
        if hit is not None:
            self.relaunch(hit, grid, ptrs + list(scalars))
            return
        hit = self.launch(grid, (*tensors, *scalars), kwargs)
        if hit is not None and aligned:
            memo[key] = hit

    @staticmethod
    def hooks_active() -> bool:
        """A profiler's launch hooks are set (they need the tensors, so callers take :meth:`launch` then)."""
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))

    @staticmethod
    def bind(hit: Tuple[Any, Tuple], grid: Sequence[int]) -> Tuple:
        """What :meth:`fire` needs to relaunch ``hit`` on ``grid``, looked up once: a caller that relaunches one
        kernel on one grid every step (``decode.run_step``) skips the per-call lookups of :meth:`relaunch`."""
        kernel, tail = hit
        direct = _direct_of(kernel)
        if direct is None:
            return None, hit, grid
        g = tuple(grid) + (1, 1)
        return direct[0], (g[0], g[1], g[2]), (kernel.function, direct[1], direct[2], kernel.packed_metadata, tail)

    @staticmethod
    def fire(bound: Tuple, call: Sequence[Any]) -> None:
        """:meth:`relaunch` of what :meth:`bind` bound, with the runtime arguments ``call`` (the same conditions)."""
        launch, g, rest = bound
        if launch is None:
            LeanLaunch.relaunch(g, rest, call)
            return
        fn, coop, pdl, meta, tail = rest
        launch(g[0], g[1], g[2], _raw_stream(_cuda_device()), fn, coop, pdl, None, None, meta, None, None, None, *call,
               *tail)

    @staticmethod
    def relaunch(hit: Tuple[Any, Tuple], grid: Sequence[int], call: Sequence[Any]) -> None:
        """Launch ``hit`` (as returned by :meth:`launch`) again with the runtime arguments ``call``, tensors
        given as their addresses. The caller guarantees that every specialisation fact of ``call`` equals
        that of the launch ``hit`` came from (dtypes, 16-byte alignment, specialised integers' ``% 16`` and
        ``== 1``, int32 range) and that no launch hooks are set (:meth:`hooks_active`)."""
        kernel, tail = hit
        g = tuple(grid) + (1, 1)
        direct = _direct_of(kernel)
        if direct is not None:  # Triton's C launcher itself, the CUDA stream read in C (PERF_NOTES, session 16)
            launch, coop, pdl = direct
            launch(g[0], g[1], g[2], _raw_stream(_cuda_device()), kernel.function, coop, pdl, None, None,
                   kernel.packed_metadata, None, None, None, *call, *tail)
            return
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *call, *tail)


_UNSET = object()
_data_ptr = torch.Tensor.data_ptr
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_cuda_device = getattr(torch._C, "_cuda_getDevice", None)


def _direct_of(kernel: Any) -> Optional[Tuple[Callable, Any, Any]]:
    """:func:`_direct_launch` of ``kernel``, kept on it (looked up once per compiled kernel)."""
    direct = kernel.__dict__.get("_turbo_direct", _UNSET) if hasattr(kernel, "__dict__") else None
    if direct is _UNSET:
        direct = kernel.__dict__["_turbo_direct"] = _direct_launch(kernel)
    return direct


def _direct_launch(kernel: Any) -> Optional[Tuple[Callable, Any, Any]]:
    """``(launch, cooperative, pdl)`` of a compiled kernel whose launcher is Triton's CUDA one and needs no scratch
    allocation per launch: what ``CudaLauncher.__call__`` hands its C ``launch`` besides the grid, stream and
    arguments (a Python frame, a nested function and two scratch checks fewer per launch); None for anything
    else (another backend, a kernel with global / profile scratch, a test's stand-in), which launches through
    ``kernel.run`` on the driver's current stream."""
    run = kernel.__dict__.get("_run")
    if (type(run).__name__ != "CudaLauncher" or _raw_stream is None or _cuda_device is None
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or type(driver.active).__name__ != "CudaDriver"):
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl


_LEANS: Dict[int, Tuple[Any, LeanLaunch]] = {}


def lean(fn: Any) -> LeanLaunch:
    """The :class:`LeanLaunch` of ``fn``, made once per function object. Callers look their kernel up by its module
    name at call time (``lean(_my_kernel)``), so a test that swaps the module's kernel (a recorder) is obeyed.
    Keyed by ``id`` (a ``JITFunction``'s own hash digests its source: microseconds a call), checked by identity."""
    hit = _LEANS.get(id(fn))
    if hit is None or hit[0] is not fn:
        hit = _LEANS[id(fn)] = (fn, LeanLaunch(fn))
    return hit[1]
