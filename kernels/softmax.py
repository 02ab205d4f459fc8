"""SAS, the sparse activated softmax of TurboAttention (Kang et al., 2024, §4), as a Triton helper.

``exp(x)`` for ``x = s - rowmax <= 0`` is replaced by: 0 below a threshold (the sparse part), otherwise
LUT(integer part) x POLY3(fraction), ``POLY3(x) = -0.1025 x^3 + 0.4626 x^2 - 0.9922 x + 0.9996`` being the
paper's fit of e^(-x) on [0, 1]. We work in base 2 (the logits are already base 2: log2(e) is folded into
Q's scale), so the "LUT" is an exponent-bit construction and the polynomial runs at x = f ln2 with the ln2
powers folded into the coefficients. Everything is FMA / integer ALU work: no MUFU.EX2 (the unit that
bounds 8-bit attention on Hopper) and no float<->int conversion instruction (same throughput class).
In an issue-bound loop it still costs ~10 instructions per value against exact exp2's MUFU + subtract.

``kernels.reference.sas_exp2`` is the plain-PyTorch twin (same formula, same fp32 steps).
"""

import triton
import triton.language as tl

from .reference import MAGIC, SAS_MAX_Y, SAS_POLY_BASE2

__all__ = ["sas_exp2"]

# Triton reads module globals inside @triton.jit only as constexprs.
_A3 = tl.constexpr(SAS_POLY_BASE2[0])
_A2 = tl.constexpr(SAS_POLY_BASE2[1])
_A1 = tl.constexpr(SAS_POLY_BASE2[2])
_A0 = tl.constexpr(SAS_POLY_BASE2[3])
_MAGIC = tl.constexpr(MAGIC)
_MAX_Y = tl.constexpr(SAS_MAX_Y)
_TWO_POW_23 = tl.constexpr(1 << 23)


@triton.jit
def sas_exp2(x, threshold2):
    """SAS approximation of ``exp2(x)`` for fp32 ``x <= 0`` (any shape); ``threshold2 > 0`` in log2 units,
    a scalar or a tensor broadcasting against ``x`` (e.g. one threshold per row). Twin: reference.sas_exp2.

    y = -x; 0 where y > min(threshold2, SAS_MAX_Y); else y = n + f (n integer, f in [0, 1]) and the result
    is 2^(-n) * POLY3(f ln2). n = floor(y) through the magic number C = 1.5 * 2^23: r = (y - 0.5) + C rounds
    to an integer (y - 1 with f = 1 at odd integers y: the same value). 2^(-n) is applied by subtracting n
    from POLY3's exponent field: bits(r) = bits(C) + n and bits(C) has nine low zero bits, so
    (bits(r) << 23) == n << 23 (mod 2^32) -- one integer multiply-add, no clamp (lanes with y beyond the
    threshold, -inf included, compute garbage that the final select drops). Ten instructions per value.
    """
    y = -x
    r = (y - 0.5) + _MAGIC
    n = r - _MAGIC
    f = y - n
    poly = ((_A3 * f + _A2) * f + _A1) * f + _A0
    p = (poly.to(tl.int32, bitcast=True) - r.to(tl.int32, bitcast=True) * _TWO_POW_23).to(tl.float32, bitcast=True)
    return tl.where(y > tl.minimum(threshold2, _MAX_Y), 0.0, p)
