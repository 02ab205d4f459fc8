"""Which CUDA device a Triton launch goes to: Triton launches on the *current* device, not the tensors'."""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["current_cuda_device", "on_device", "on_tensor_device", "sm_count"]

#: the current CUDA device index, read in C (``torch.cuda.current_device()`` adds a Python frame and its lazy-init
#: check: ~3 us a call on the GPU host, several calls a layer and step); callers hold CUDA tensors, so CUDA is up
current_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 off CUDA (the interpreter: a few chunks, so tests cover splits)."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index``, read once (a properties read is ~10 us on the GPU host)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


#: inside a region torch.compile traces, the device guards below are no-ops, checked first: the C device read and
#: ``torch.cuda.device_count`` are not traceable (a graph break per call: the compiled decode step fell apart into ~6
#: CUDA graphs a layer, 4-5x sdpa's step), and the custom ops that launch Triton kernels set their tensors' device
#: in their own (eager) bodies (turbo_attn_hf/ops.py)
_compiling = torch.compiler.is_compiling


@functools.lru_cache(maxsize=1)
def several_gpus() -> bool:
    """More than one visible CUDA device. With one, the current device is the tensors' (cuda:0) and the guards read
    nothing: ~4-5 us a layer call on the GPU host (a C device read and a tensor's index, twice a layer)."""
    return torch.cuda.device_count() > 1


class on_device:
    """Make ``device`` current while Triton launches (it launches on the current CUDA device, which is not
    the tensors' device for layers placed on another GPU by ``device_map``). No-op when already current."""

    __slots__ = ("ctx",)

    def __init__(self, device: torch.device):
        self.ctx = None
        if (device.type == "cuda" and device.index is not None and not _compiling() and several_gpus()
                and device.index != current_cuda_device()):
            self.ctx = torch.cuda.device(device)

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
        return False


def on_tensor_device(t: torch.Tensor):
    """:class:`on_device` for ``t``'s device without making a ``torch.device`` (``t.device``): the per-layer hot
    paths, ~1-2 us a call on the GPU host."""
    if t.is_cuda and not _compiling() and several_gpus() and t.get_device() != current_cuda_device():
        return torch.cuda.device(t.get_device())
    return contextlib.nullcontext()  # made per call: torch.compile traces no module-level context manager
