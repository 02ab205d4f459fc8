"""kernels/hadamard.py: the butterfly against its twin, and ``_rcp_rn``'s arithmetic (the GPU's call-free correctly
rounded ``1/s`` of the smoothing factors) replayed exactly on the CPU.

The PTX (fp32 approximate reciprocal, three fp64 Newton steps by FMA, fp64 -> fp32 rounding) cannot run in the
interpreter, so this replays it with exact arithmetic: each FMA is the nearest double of the exact ``a*b + c``
(``fractions``), the start is the exact reciprocal moved by up to 2^-8 relative (the hardware's is ~2^-23), and the
fp32 rounding is numpy's (to nearest, ties to even). Every result must be the bits of ``np.float32(1) / s``, the
correctly rounded quotient ``div_rn`` and torch give. The sm_90 build of the asm is tests/kernels/test_decode_compile.py
("rotate-store", "gemma").
"""
from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.hadamard import hadamard_rows
from turbo_attn_hf.kernels.rotation import SMOOTH_RANGE, rotation_block


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


@triton.jit
def _rows_kernel(x, y, D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr, N: tl.constexpr):
    o = tl.arange(0, R)[:, None] * D + tl.arange(0, BD)[None, :]
    m = (tl.arange(0, BD) < D)[None, :]
    tl.store(y + o, hadamard_rows(tl.load(x + o, mask=m, other=0.0), N), mask=m)


@pytest.mark.parametrize("rows,d", [(4, 256), (1, 256), (4, 128), (2, 96), (8, 64)])
def test_hadamard_rows_equals_the_twin_bit_for_bit(rows, d, device):
    """``hadamard_rows`` computes ``reference.fwht_rows``' sums in its order: the same fp32 bits, blocks of
    ``rotation_block(d)`` (96: three of 32), padded channels staying 0."""
    g = torch.Generator().manual_seed(d + rows)
    x = (torch.randn(rows, d, generator=g) * torch.logspace(-3, 3, d)).to(device)
    y = torch.full_like(x, float("nan"))
    bd = 1 << (d - 1).bit_length()
    _rows_kernel[(1,)](x, y, d, bd, rows, rotation_block(d), num_warps=1)
    assert torch.equal(y.cpu().view(torch.int32), R.fwht_rows(x.cpu()).view(torch.int32))
