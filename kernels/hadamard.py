"""Hadamard transform of a tile's rows in registers: the rotation of ``rotate_qk`` (issue 23) inside the kernels
that read Q or K anyway (quant.py's Q/K pass, store.py's K stats and codes, decode.py's query prologue).

``hadamard_rows(x [R, BD], N)`` = ``x . H+-1``: the unnormalised Sylvester Hadamard (``(-1)^popcount(i & j)``,
``reference.hadamard_pm1``), block-diagonal with blocks of N channels, computed as log2(N) butterfly stages
(``(a + b, a - b)`` over channel pairs ``(i, i + h)``, h = 1, 2, ..., N / 2) in fp32. Why a butterfly and not a
``tl.dot`` with the +-1 matrix: it needs no ``[BD, BD]`` operand (64 K values at d 256, which spilled), no bf16
split of the input (fp32 sums keep all 24 bits) and works for any row count (the decode query has 4). Twin:
``reference.fwht_rows``: the same additions in the same order, so kernel and reference agree bit for bit.
The caller folds ``1/sqrt(N)``; padded channels (D < BD) must be 0 and D a multiple of N (``rotation_block``).
``_rotate_keys`` / ``_key_factor``: raw K rows into the cache's stored basis, shared by every kernel that stores K
(the store kernels, the static step, the decode launch that stores its step's token).
"""

import triton
import triton.language as tl


@triton.jit
def hadamard_rows(x, N: tl.constexpr):
    """``x [R, BD]`` fp32 -> ``x . H+-1`` with blocks of N (a power of two, 2 <= N <= BD <= 1024) channels."""
    R: tl.constexpr = x.shape[0]
    BD: tl.constexpr = x.shape[1]
    for s in tl.static_range(10):
        if (1 << s) < N:  # stage s pairs channels i and i + 2**s
            y = tl.permute(tl.reshape(x, [R, BD >> (s + 1), 2, 1 << s]), [0, 1, 3, 2])  # pair member last
            a, b = tl.split(y)
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, BD])
    return x


@triton.jit
def _key_factor(smf, o_s, m_d, BD: tl.constexpr, HAS_FACTOR: tl.constexpr, RCP: tl.constexpr = False):
    """K's smoothing factor ``1/s`` of one (b, h) at offsets ``o_s`` (correctly rounded, as
    ``reference.rotate_keys_ref`` and the prefill's quantizer), 1 without factors. RCP (a GPU build): ``_rcp_rn``,
    the same bits without ``div_rn``'s slow-path calls, which made the decode kernel spill (PERF_NOTES session 41)."""
    b_f = tl.full([BD], 1.0, tl.float32)
    if HAS_FACTOR:
        b_f = _factor_inverse(tl.load(smf + o_s, mask=m_d, other=1.0), RCP)
    return b_f


@triton.jit
def _factor_inverse(b_s, RCP: tl.constexpr):
    """``1/s`` of loaded smoothing factors, correctly rounded (RCP: ``_rcp_rn``, else ``div_rn``)."""
    if RCP:
        return _rcp_rn(b_s)
    return tl.math.div_rn(tl.full(b_s.shape, 1.0, tl.float32), b_s)


@triton.jit
def _rcp_rn(x):
    """fp32 ``1/x`` correctly rounded, for finite normal ``x`` (the smoothing factors: ``rotation.SMOOTH_RANGE``),
    without a call: the fp32 approximate reciprocal (~2^-23 relative error), three Newton steps in fp64
    (``r += r * (1 - x * r)`` by FMA: the error squares each step, to the fp64 rounding), rounded to fp32. The
    result is the correctly rounded one because ``1/x`` lies at least 2^-48 (relative) from every fp32 rounding
    midpoint (``x = S 2^a``, ``S < 2^24``: ``1 - x M`` is a nonzero multiple of 2^-48 for a midpoint ``M``), far beyond
    the fp64 error; tests/kernels/test_rotation_rcp.py replays the arithmetic exactly with start errors up to 2^-8."""
    return tl.inline_asm_elementwise(
        """{
        .reg .f32 a;
        .reg .f64 d, nd, r, e;
        rcp.approx.ftz.f32 a, $1;
        cvt.f64.f32 r, a;
        cvt.f64.f32 d, $1;
        neg.f64 nd, d;
        fma.rn.f64 e, nd, r, 0d3FF0000000000000;
        fma.rn.f64 r, r, e, r;
        fma.rn.f64 e, nd, r, 0d3FF0000000000000;
        fma.rn.f64 r, r, e, r;
        fma.rn.f64 e, nd, r, 0d3FF0000000000000;
        fma.rn.f64 r, r, e, r;
        cvt.rn.f32.f64 $0, r;
        }""", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mul(a, b, RN: tl.constexpr):
    """fp32 ``a * b`` rounded on its own: RN (a GPU kernel compiled with FMA contraction) keeps the next add from
    fusing it — PTX ``mul.rn.f32``, no flush to zero (libdevice's ``mul_rn`` is ``mul.rn.ftz``) — as a kernel
    compiled without contraction (``store._no_fma``) and the twin round it."""
    if RN:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return a * b


@triton.jit
def _rotate_keys(b_k, b_f, ROTATE: tl.constexpr, ROT_N: tl.constexpr, ROT_C: tl.constexpr, RN: tl.constexpr = False):
    """Raw key rows ``[R, BD]`` -> the stored basis: ``(k . diag(b_f) . H+-1) * ROT_C`` in fp32
    (``hadamard_rows``; ROT_C = fp32 1/sqrt(ROT_N), one rounding), unchanged without ROTATE.
    In the pass that loads the rows anyway: every statistic, mean subtraction, code and pack after it sees rotated K
    (twin ``reference.rotate_keys_ref``). RN: see ``_mul`` (the decode launch's store of its step's token)."""
    if ROTATE:
        b_k = _mul(hadamard_rows(_mul(b_k.to(tl.float32), b_f[None, :], RN), ROT_N), ROT_C, RN)
    return b_k
