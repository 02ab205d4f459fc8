"""kernels/hadamard.py: ``_rcp_rn``'s arithmetic (the GPU's call-free correctly rounded ``1/s`` of the smoothing
factors) replayed exactly on the CPU.

The PTX (fp32 approximate reciprocal, three fp64 Newton steps by FMA, fp64 -> fp32 rounding) cannot run in the
interpreter, so this replays it with exact arithmetic: each FMA is the nearest double of the exact ``a*b + c``
(``fractions``), the start is the exact reciprocal moved by up to 2^-8 relative (the hardware's is ~2^-23), and the
fp32 rounding is numpy's (to nearest, ties to even). Every result must be the bits of ``np.float32(1) / s``, the
correctly rounded quotient ``div_rn`` and torch give. The sm_90 build of the asm is tests/kernels/test_decode_compile.py
("rotate-store", "gemma").
"""
from fractions import Fraction

import numpy as np

from turbo_attn_hf.kernels.rotation import SMOOTH_RANGE


def _fma(a: float, b: float, c: float) -> float:
    return float(Fraction(a) * Fraction(b) + Fraction(c))  # int / int in Python rounds correctly to nearest


def _rcp_rn_replay(s: np.float32, start: float) -> np.float32:
    d = float(s)
    r = start
    for _ in range(3):
        e = _fma(-d, r, 1.0)
        r = _fma(r, e, r)
    return np.float32(r)


def _factors(n: int, rng) -> np.ndarray:
    """Smoothing factors over SMOOTH_RANGE and every fp32 binade, powers of two and their neighbours."""
    lo, hi = SMOOTH_RANGE
    xs = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.float32)
    wide = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-120, 120, n)).astype(np.float32)
    pow2 = (2.0 ** np.arange(-120, 121)).astype(np.float32)
    near = np.concatenate([np.nextafter(pow2, np.float32(0)), np.nextafter(pow2, np.float32(np.inf))])
    return np.concatenate([xs, wide, pow2, near, np.array([lo, hi], dtype=np.float32)])


def test_rcp_rn_replay_is_the_correctly_rounded_reciprocal():
    rng = np.random.default_rng(0)
    s = _factors(3000, rng)
    want = np.float32(1) / s
    for i, x in enumerate(s):
        exact = 1.0 / float(x)
        for rel in (0.0, 2.0 ** -8, -(2.0 ** -8), float(rng.uniform(-2.0 ** -8, 2.0 ** -8)), 2.0 ** -23):
            got = _rcp_rn_replay(x, float(np.float32(exact * (1 + rel))))
            assert got.view(np.uint32) == want[i].view(np.uint32), (float(x), rel, float(got), float(want[i]))
