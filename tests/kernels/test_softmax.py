"""SAS exp2 helper (kernels/softmax.py) vs its reference and vs exact exp2.

Measured (fp32, 2M points on [-9, 0], reference): max |sas_exp2 - exp2| = 4.0e-4 where kept (the
polynomial's 0.9996 at f = 0), max relative 4.0e-4; exactly 0 beyond the threshold. Bound: 5e-4.
Kernel vs reference: bit-exact in the interpreter; on a GPU the Horner steps contract into FMAs
(<= a few fp32 ulps): bound 1e-6 absolute.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.softmax import sas_exp2


@triton.jit
def _sas_kernel(X, Y, thr2, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    x = tl.load(X + o, mask=m, other=0.0)
    tl.store(Y + o, sas_exp2(x, thr2), mask=m)


def _run(x, thr2, device):
    y = torch.full_like(x, float("nan"), device=device)
    n = x.numel()
    _sas_kernel[(triton.cdiv(n, 4096),)](x.to(device), y, thr2, n, BLOCK=4096)
    return y.cpu()


@pytest.mark.parametrize("threshold", [6.0, 3.0, 100.0])
def test_sas_kernel_matches_reference(threshold, device):
    thr2 = threshold * R.LOG2E
    g = torch.Generator().manual_seed(0)
    x = torch.cat([-torch.rand(50000, generator=g) * 12, -torch.arange(0, 20, dtype=torch.float32),
                   torch.tensor([-0.0, -1e-30, -thr2, -thr2 - 1e-6, -math.inf])])
    got = _run(x, thr2, device)
    want = R.sas_exp2(x, thr2)
    assert (got - want).abs().max().item() <= 1e-6
    assert torch.equal(got == 0, want == 0)


def test_sas_vs_exp2_error_bound(device):
    thr2 = 6.0 * R.LOG2E
    x = -torch.linspace(0, 9, 200001, dtype=torch.float32)
    got = _run(x, thr2, device).double()
    exact = torch.exp2(x.double())
    kept = -x.double() <= thr2
    assert (got - exact).abs()[kept].max().item() <= 5e-4
    assert ((got - exact).abs() / exact)[kept].max().item() <= 5e-4
    assert torch.all(got[~kept] == 0), "weights beyond the threshold must be exactly 0"
    assert torch.all(got[kept] > 0)


def test_reference_poly_constants():
    """POLY3 approximates e^(-x) on [0, 1] (the paper's fit) and the base-2 folding is consistent."""
    xs = torch.linspace(0, 1, 1001, dtype=torch.float64)
    c3, c2, c1, c0 = R.SAS_POLY
    poly = ((c3 * xs + c2) * xs + c1) * xs + c0
    assert (poly - torch.exp(-xs)).abs().max().item() < 1e-3
    fs = torch.linspace(0, 1, 1001, dtype=torch.float64)
    a3, a2, a1, a0 = R.SAS_POLY_BASE2
    assert torch.allclose(((a3 * fs + a2) * fs + a1) * fs + a0,
                          ((c3 * fs * R.LN2 + c2) * fs * R.LN2 + c1) * fs * R.LN2 + c0)
