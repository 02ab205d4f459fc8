"""What P computed in fp16 would cost in accuracy (issue 20, CPU, reference only): the prefill's exp2 and P's
rounding done as f16x2 (``ex2.approx.f16x2`` on fp16 scores, ``1536 + 127 p`` rounded by an fp16 FMA) would take
~1.75 instructions an element off the INT8 loop (eval/PERF_NOTES.md session 35). Emulated on ``reference.
turbo_attention``: the block's base-2 scores x rounded to fp16, p = fp16(exp2(x)); the same round-to-nearest-even of
127 p follows (exact in fp32 for a p of 11 bits). The rescale r stays fp32. MRE on N(0,1) and U(-0.5, 0.5), FA3's
outlier RMSE, against fp64, beside today's fp32 P on the same inputs.

    python -m eval.experiments.p_f16_accuracy [--lens 1024,2048] [--heads 4] [--out FILE.json]
"""
from __future__ import annotations

import argparse


class _F16Exp2:
    """``torch`` as the reference module sees it, but exp2 of a block's scores ([b, H, Lq, BN]) in fp16."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def exp2(self, x):
        t = self._torch
        if x.dim() == 4:
            return t.exp2(x.to(t.float16).to(t.float32)).to(t.float16).to(t.float32)
        return t.exp2(x)


def main(argv=None) -> int:
    import torch

    from turbo_attn_hf.kernels import reference as R

    from eval.bench_common import print_row, write_rows
    from eval.kernel_accuracy import metrics, sample

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="1024,2048")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default="p_f16_accuracy.json")
    a = ap.parse_args(argv)
    rows = []
    for L in map(int, a.lens.split(",")):
        for dist in ("normal", "uniform", "fa3_outlier"):
            gen = torch.Generator().manual_seed(0)
            q, k, v = (sample(dist, (1, a.heads, L, a.head_dim), "cpu", gen).to(torch.bfloat16) for _ in range(3))
            ref = R.attention_fp64(q.double(), k.double(), v.double(), causal=False)
            for mode in ("fp32", "fp16"):
                if mode == "fp16":
                    R.torch = _F16Exp2(torch)
                try:
                    o = R.turbo_attention(q, k, v, causal=False).float()
                finally:
                    R.torch = torch
                print_row(dict(dist=dist, L=L, p=mode, **metrics(o, ref)), rows)
    write_rows("p_f16_accuracy", rows, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
