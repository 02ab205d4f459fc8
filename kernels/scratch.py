"""Temporaries a launcher keeps from one call to the next.

Every layer of a forward calls the prefill (and the first prefill's stats pass) with the same shapes, and each
call allocated the same quantized operands and partials again: at a 1k prompt those allocations are host time the
GPU waits for (eval/PERF_NOTES.md, session 15). A plan keeps one set per (device, stream) instead. Kernels on one
stream run in order, so the next call's writes come after the last call's reads; a call on another stream gets
new tensors. Sets are kept up to ``SCRATCH_MAX_BYTES`` each and ``SCRATCH_TOTAL_BYTES`` for the process (long
prompts allocate as before: their allocation is a small part of their time)."""

from __future__ import annotations

import torch

__all__ = ["Scratch", "SCRATCH_MAX_BYTES", "SCRATCH_TOTAL_BYTES"]

SCRATCH_MAX_BYTES = 64 << 20
SCRATCH_TOTAL_BYTES = 256 << 20
_held = [0]  # bytes held by live Scratch sets


class Scratch:
    """Tensors of fixed ``specs`` (``(shape, dtype)`` pairs) on ``device``: :meth:`get` returns the kept set when
    the current stream is the one it was made on, else new tensors (kept when they fit the budgets)."""

    __slots__ = ("specs", "device", "nbytes", "bufs", "stream")

    def __init__(self, specs: tuple, device: torch.device):
        self.specs, self.device = specs, device
        self.nbytes = sum(torch.Size(sh).numel() * dt.itemsize for sh, dt in specs)
        self.bufs, self.stream = None, None

    def get(self) -> tuple:
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None
        if self.bufs is not None and stream == self.stream:
            return self.bufs
        bufs = tuple(torch.empty(sh, dtype=dt, device=self.device) for sh, dt in self.specs)
        if self.bufs is None and self.nbytes <= SCRATCH_MAX_BYTES and _held[0] + self.nbytes <= SCRATCH_TOTAL_BYTES:
            _held[0] += self.nbytes
            self.bufs, self.stream = bufs, stream
        return bufs

    def __del__(self):
        if self.bufs is not None:
            _held[0] -= self.nbytes
