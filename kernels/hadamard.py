"""Hadamard transform of a tile's rows in registers: the rotation of ``rotate_qk`` (issue 23) inside the kernels
that read Q or K anyway (quant.py's Q/K pass, store.py's K stats and codes, decode.py's query prologue).

``hadamard_rows(x [R, BD], N)`` = ``x . H+-1``: the unnormalised Sylvester Hadamard (``(-1)^popcount(i & j)``,
``reference.hadamard_pm1``), block-diagonal with blocks of N channels, computed as log2(N) butterfly stages
(``(a + b, a - b)`` over channel pairs ``(i, i + h)``, h = 1, 2, ..., N / 2) in fp32. Why a butterfly and not a
``tl.dot`` with the +-1 matrix: it needs no ``[BD, BD]`` operand (64 K values at d 256, which spilled), no bf16
split of the input (fp32 sums keep all 24 bits) and works for any row count (the decode query has 4). Twin:
``reference.fwht_rows``: the same additions in the same order, so kernel and reference agree bit for bit.
The caller folds ``1/sqrt(N)``; padded channels (D < BD) must be 0 and D a multiple of N (``rotation_block``).
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
