"""Orthonormal Hadamard rotation of Q and K per head (``TurboConfig.rotate_qk = "hadamard"``; issue 23).

Why: per-token INT8 of a vector with a few outlier channels leaves the other channels a handful of levels
(Gemma-3: per-token max/mean |Q|, |K| up to 24). ``x -> x·H`` with ``H`` orthonormal spreads every channel
over all of them (QuaRot; FlashAttention-3's "incoherent processing"), so the per-token amax shrinks towards
the RMS, while ``(q·H)·(k·H)ᵀ = q·kᵀ`` leaves attention exact up to rounding. V is never rotated.

``H`` is the Sylvester Hadamard matrix divided by ``sqrt(n)`` (symmetric, ``H·H = I``), block-diagonal with
blocks of ``n = rotation_block(d)``: the whole head for d = 64/128/256, blocks of 16 (d = 80) or 32 (d = 96)
— the largest power of two dividing d. A block-diagonal Hadamard is still orthonormal (exact); it mixes only
within its block, so it spreads an outlier over n channels instead of d (weaker, never wrong).

The product is computed in fp32 and rounded once to the input dtype (bf16 ``1/sqrt(128)`` is not exact; a
bf16 matrix would scale every logit by 1 - 2.2e-4). A finite token can overflow only if its L2 norm exceeds
the dtype's max (``|x·H|_inf <= |x|_2``); a token with an inf/NaN stays non-finite (the quantizers' rule is
per token). This module is the single place that rotates: the cache, the attention function and the
reference all call :func:`rotate`. Torch only (no transformers, no triton).
"""

from __future__ import annotations

import math

import torch

__all__ = ["ROTATIONS", "RotationError", "rotation_block", "hadamard_matrix", "rotate"]

ROTATIONS = ("none", "hadamard")
#: smallest Hadamard block accepted: a 2..8-wide block barely spreads an outlier (head dims here are >= 64)
MIN_BLOCK = 16


class RotationError(ValueError):
    """A head dim that has no Hadamard rotation here (needs a power-of-two factor >= MIN_BLOCK)."""


def rotation_block(d: int) -> int:
    """Hadamard block size for head dim ``d``: the largest power of two dividing d (64 -> 64, 80 -> 16,
    96 -> 32, 128 -> 128, 256 -> 256). Raises :class:`RotationError` when that is below ``MIN_BLOCK``."""
    n = d & -d
    if d <= 0 or n < MIN_BLOCK:
        raise RotationError(
            f"rotate_qk='hadamard' needs a head_dim with a power-of-two factor >= {MIN_BLOCK}; head_dim {d} "
            f"has {n if d > 0 else 0}. Use rotate_qk='none' for this model."
        )
    return n


_CACHE: dict = {}


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """The ``[d, d]`` orthonormal (block-diagonal) Hadamard matrix, cached per (d, dtype, device)."""
    key = (d, dtype, str(device))
    h = _CACHE.get(key)
    if h is None:
        n = rotation_block(d)
        s = torch.ones(1, 1, dtype=torch.float64)
        while s.shape[0] < n:  # Sylvester: H_2n = [[H, H], [H, -H]]
            s = torch.cat([torch.cat([s, s], 1), torch.cat([s, -s], 1)], 0)
        full = torch.block_diag(*([s / math.sqrt(n)] * (d // n)))
        h = _CACHE[key] = full.to(dtype=dtype, device=device)
    return h


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., d] -> x · H`` (fp32 product, rounded once to ``x.dtype``). ``H`` is symmetric and its own
    inverse, so ``rotate(rotate(x)) == x`` up to rounding and ``rotate(q) · rotate(k)ᵀ == q · kᵀ``."""
    h = hadamard_matrix(x.shape[-1], torch.float32, x.device)
    return torch.matmul(x.float(), h).to(x.dtype)
