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
per token). On the GPU (and the Triton interpreter) the kernels rotate inside the passes that read Q or K anyway:
the prefill's Q+K quantization, the cache's stats and store kernels, the decode query's prologue
(``hadamard.hadamard_rows``, twin ``reference.fwht_rows``: the same ``H`` as +-1 butterflies in fp32, ``1/sqrt(n)``
folded into a scale, no bf16 rounding of the rotated values); :func:`rotate` serves the PyTorch paths. Torch only
(no transformers, no triton).

``rotate_qk = "smooth_hadamard"`` first migrates scale per channel from K to Q (SmoothAttention, QServe §4.3;
K-only here): ``s_c = sqrt(max_t |K_tc - mean_c|)`` over the first store's finite keys, normalised to geometric
mean 1 per (batch, KV head) (:func:`smooth_scales`), then ``q -> (q·diag(s))·H``, ``k -> (k·diag(1/s))·H``:
``q'·k'ᵀ = q·kᵀ`` exactly in real arithmetic (one fp32 product, rounded once), V untouched. Why K-only: the
cache stores K (``update()``) before any query of the layer is seen, and ``s`` must be fixed then; with the
query's range too (``sqrt(max|K_c| / max|Q_c|)``) Gemma-3's per-layer errors were only 3-5 % lower (PERF_NOTES,
issue 23). The diagonal before the rotation matters: after ``diag(1/s)`` K's outlier channels no longer dominate
the rotated vector's energy, so its per-token amax (prefill) and per-channel universal scale (decode) both
shrink; a diagonal alone changes nothing on the decode path (K's per-channel scale absorbs it).
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["ROTATIONS", "RotationError", "rotation_block", "rot_scale", "rotate_constexprs", "hadamard_matrix",
           "rotate", "smooth_scales", "rotate_qk_pair"]

ROTATIONS = ("none", "hadamard", "smooth_hadamard")
#: bounds of the K -> Q smoothing factors (after the geometric-mean normalisation): a dead channel (max 0) or a
#: huge one must not make q·s overflow or k/s lose all its bits
SMOOTH_RANGE = (2.0 ** -8, 2.0 ** 8)
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


@functools.lru_cache(maxsize=None)  # called per store launch: no tensor built per step
def rot_scale(n: int) -> float:
    """fp32 ``1/sqrt(n)``: the kernels that store K multiply its +-1 products by it (``reference.rotate_keys_ref``)."""
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))


def rotate_constexprs(d: int, rotate: bool, has_factor: bool) -> dict:
    """The rotation constexprs of every kernel that stores K (the store kernels, the static step, the decode launch
    that stores its token) for head dim ``d`` (``has_factor``: smooth_hadamard factors given); all off without
    ``rotate``, which compiles the unrotated kernels."""
    if not rotate:
        return dict(ROTATE=False, ROT_N=16, HAS_FACTOR=False, ROT_C=1.0)
    n = rotation_block(d)
    return dict(ROTATE=True, ROT_N=n, HAS_FACTOR=bool(has_factor), ROT_C=rot_scale(n))


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


def smooth_scales(k: torch.Tensor) -> torch.Tensor:
    """K -> Q smoothing factors from keys ``k [b, Hk, L, d]``: ``s [b, Hk, d]`` fp32,
    ``s_c = sqrt(max_t |k_tc - mean_c|)`` over the finite tokens (a token holding an inf/NaN is left out, as in
    the cache's scales), divided by its geometric mean over the channels, clamped to ``SMOOTH_RANGE``; a channel
    that is 0 everywhere gets the smallest factor. Fixed once (the cache's first store) and reused for every later
    key and query of that layer.

    Plain-PyTorch twin (~12 full-size passes): the attention paths call ``smooth_factors.smooth_factors``, the same
    factors from one Triton pass over K (rel. 1e-5, tests/kernels/test_smooth_factors.py)."""
    kf = k.float()
    ok = torch.isfinite(kf).all(dim=-1, keepdim=True)  # [b, H, L, 1]
    kf = torch.where(ok, kf, torch.zeros((), device=k.device))
    n = ok.sum(dim=2).clamp_min(1)  # [b, H, 1]
    mean = kf.sum(dim=2) / n
    amax = torch.where(ok, (kf - mean[:, :, None]).abs(), torch.zeros((), device=k.device)).amax(dim=2)
    lo, hi = SMOOTH_RANGE
    s = amax.sqrt().clamp_min(lo * lo)  # the geometric mean must not see log(0)
    s = s / s.log().mean(dim=-1, keepdim=True).exp()
    return s.clamp(lo, hi)


def rotate(x: torch.Tensor, smooth: torch.Tensor | None = None, side: str = "k") -> torch.Tensor:
    """``x [..., d] -> x · H`` (fp32 product, rounded once to ``x.dtype``). ``H`` is symmetric and its own
    inverse, so ``rotate(rotate(x)) == x`` up to rounding and ``rotate(q) · rotate(k)ᵀ == q · kᵀ``.

    With ``smooth`` (``s [b, Hk, d]``, :func:`smooth_scales`) and ``x [b, H, L, d]``: keys (``side="k"``,
    H == Hk) become ``(x·diag(1/s))·H``, queries (``side="q"``, H a multiple of Hk: head h uses KV head h // g)
    ``(x·diag(s))·H``, so ``rotate(q, s, "q") · rotate(k, s, "k")ᵀ == q · kᵀ``."""
    h = hadamard_matrix(x.shape[-1], torch.float32, x.device)
    xf = x.float()
    if smooth is not None:
        if side not in ("q", "k"):
            raise ValueError(f"side={side!r} must be 'q' or 'k'")
        s = smooth.to(device=x.device, dtype=torch.float32)
        g = x.shape[1] // s.shape[1]
        if (x.dim() != 4 or x.shape[0] != s.shape[0] or g * s.shape[1] != x.shape[1] or s.shape[-1] != x.shape[-1]
                or (side == "k" and g != 1)):
            raise ValueError(f"smooth factors {tuple(s.shape)} do not fit {side} {tuple(x.shape)} ([b, Hk, d] for "
                             "[b, Hk * g, L, d])")
        s = s.repeat_interleave(g, dim=1) if g > 1 else s
        xf = xf * (s if side == "q" else s.reciprocal())[:, :, None, :]
    return torch.matmul(xf, h).to(x.dtype)


def rotate_qk_pair(q: torch.Tensor, k: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K of one attention call without a TurboCache (the no-cache / DynamicCache path): ``mode`` "none"
    (unchanged), "hadamard" or "smooth_hadamard" (factors from this call's keys)."""
    if mode == "none":
        return q, k
    if mode not in ROTATIONS:
        raise ValueError(f"rotate_qk={mode!r} must be one of {ROTATIONS}")
    s = smooth_scales(k) if mode == "smooth_hadamard" else None
    return rotate(q, s, "q"), rotate(k, s, "k")
