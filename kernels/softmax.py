"""SAS, the sparse activated softmax of TurboAttention (Kang et al., 2024, §4), as a Triton helper.

``exp(x)`` for ``x = s - rowmax <= 0`` is replaced by: 0 below a threshold (the sparse part), otherwise
LUT(integer part) x POLY3(fraction), ``POLY3(x) = -0.1025 x^3 + 0.4626 x^2 - 0.9922 x + 0.9996`` being the
paper's fit of e^(-x) on [0, 1]. We work in base 2 (the logits are already base 2: log2(e) is folded into
Q's scale), so the "LUT" is an exponent-bit construction and the polynomial runs at x = f ln2 with the ln2
powers folded into the coefficients. Everything is FMA / integer ALU work: no MUFU.EX2 (the unit that
bounds 8-bit attention on Hopper) and no float<->int conversion instruction (same throughput class).

``kernels.reference.sas_exp2`` is the plain-PyTorch twin (same formula, same fp32 steps).
"""

import triton
import triton.language as tl

from .reference import MAGIC, MAGIC_BITS, SAS_POLY_BASE2

__all__ = ["sas_exp2"]

# Triton reads module globals inside @triton.jit only as constexprs.
_A3 = tl.constexpr(SAS_POLY_BASE2[0])
_A2 = tl.constexpr(SAS_POLY_BASE2[1])
_A1 = tl.constexpr(SAS_POLY_BASE2[2])
_A0 = tl.constexpr(SAS_POLY_BASE2[3])
_MAGIC = tl.constexpr(MAGIC)
_MAGIC_BITS = tl.constexpr(MAGIC_BITS)


@triton.jit
def sas_exp2(x, threshold2):
    """SAS approximation of ``exp2(x)`` for fp32 ``x <= 0`` (any shape); ``threshold2 > 0`` in log2 units.

    y = -x; 0 where y > threshold2; else y = n + f (n integer, f in [0, 1]) and the result is
    2^(-n) * POLY3(f ln2). n = floor(y) through the magic number C = 1.5 * 2^23:
    r = (y - 0.5) + C rounds to an integer (y - 1 with f = 1 at odd integers y: the same value), n's bits
    are bits(r) - bits(C), and 2^(-n) is the float with exponent field 127 - n.
    """
    y = -x
    yc = tl.minimum(tl.maximum(y, 0.0), 126.0)
    r = (yc - 0.5) + _MAGIC
    n = r - _MAGIC
    f = yc - n
    poly = ((_A3 * f + _A2) * f + _A1) * f + _A0
    ni = r.to(tl.int32, bitcast=True) - _MAGIC_BITS
    pow2 = ((127 - ni) << 23).to(tl.float32, bitcast=True)
    return tl.where(y > threshold2, 0.0, poly * pow2)
