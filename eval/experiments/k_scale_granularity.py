"""Would a coarser K scale keep the prefill's accuracy? CPU, reference math only (no kernel, no GPU).

    python -m eval.experiments.k_scale_granularity [--blocks 32,64,128] [--out DIR]

The prefill loop is issue-bound (eval/PERF_NOTES.md, prefill session 6). One K scale per block of keys
(SageAttention's granularity) instead of one per token would fold ``sk·sq`` into the FMA that forms the logits:
one instruction less per score, if the block is at least the kernel's KV tile. This measures what that costs in
accuracy, with ``kernels.reference.int8_flash_attention`` fed K codes whose scale is the amax over each block of
keys (every other step as ``reference.turbo_attention``: smoothed K, per-token Q, V per block and channel or per
channel), against fp64 attention of the same bf16 inputs: INT-FlashAttention's MRE and FlashAttention-3's outlier
RMSE (formulas and distributions as ``eval.kernel_accuracy``; the issue's bound is RMSE <= 9.1e-3). d 128,
b 1, 4 heads, L 1k / 2k, causal and not, seed 0.
"""

from __future__ import annotations

import argparse
from typing import Optional

from ..bench_common import machine_info, parse_int_list, write_json
from ..kernel_accuracy import FA3_DIST, MRE_FORMULA, RMSE_FORMULA, metrics, sample


def quantize_k_blocks(k, block: int, smooth):
    """Smoothed K ``[b, H, L, d]`` -> (int8 codes, per-token fp32 scales equal within each block of ``block``
    keys: the block's amax / 127), the reference's rounding."""
    import torch

    from turbo_attn_hf.kernels import reference as R

    kf = k.float() - smooth[..., None, :]
    b, h, L, d = kf.shape
    nb = -(-L // block)
    padded = torch.zeros(b, h, nb * block, d)
    padded[:, :, :L] = kf
    amax = padded.view(b, h, nb, block * d).abs().amax(-1).repeat_interleave(block, -1)[..., :L]
    return R._symmetric_int8(kf, amax, -1).contiguous(), R._div127(amax).contiguous()


def attention(q, k, v, causal: bool, k_block: Optional[int], v_scale: str):
    import torch

    from turbo_attn_hf.kernels import reference as R

    d = q.shape[-1]
    bn = R.default_block_n(d)
    q8, sq = R.quantize_per_token(q, scale=d ** -0.5 * R.LOG2E)
    mu = R.k_smooth_mean(k)
    k8, sk = R.quantize_per_token(k, smooth=mu) if k_block is None else quantize_k_blocks(k, k_block, mu)
    v8t, sv = (R.quantize_v_blocks if v_scale == "block" else R.quantize_v_channels)(v, bn)
    return R.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=causal, Lk=k.shape[2], out_dtype=torch.float32,
                                  block_n=bn).float()


def main(argv: Optional[list[str]] = None) -> int:
    import torch

    from turbo_attn_hf.kernels.reference import attention_fp64

    ap = argparse.ArgumentParser(prog="python -m eval.experiments.k_scale_granularity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="32,64,128", help="K scale blocks (keys) besides per token")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = ([(None, "block"), (None, "channel")] + [(kb, "block") for kb in parse_int_list(args.blocks)]
                + [(128, "channel")])
    rows = []
    for dist, L in (("fa3_outlier", 1024), ("fa3_outlier", 2048), ("normal", 1024), ("uniform", 1024)):
        for causal in (False, True):
            gen = torch.Generator().manual_seed(0)
            q, k, v = (sample(dist, (1, 4, L, 128), "cpu", gen).to(torch.bfloat16) for _ in range(3))
            ref = attention_fp64(q.double(), k.double(), v.double(), causal=causal)
            for k_block, v_scale in variants:
                m = metrics(attention(q, k, v, causal, k_block, v_scale), ref)
                rows.append(dict(dist=dist, L=L, causal=causal, k_scale=k_block or "token", v_scale=v_scale, **m))
                print(f"{dist:11s} L {L} causal {causal!s:5s} K scale per {str(k_block or 'token'):5s} V per "
                      f"{v_scale:7s} MRE {m['mre'] * 100:.2f} %  RMSE {m['rmse']:.2e}", flush=True)
    path = write_json("k_scale_granularity", {
        "benchmark": "k_scale_granularity", "machine": machine_info(), "rows": rows,
        "formulas": {"mre": MRE_FORMULA, "rmse": RMSE_FORMULA, "fa3_outlier_distribution": FA3_DIST},
        "config": {"d": 128, "b": 1, "heads": 4, "seed": 0, "inputs": "bf16", "block_n": 128,
                   "what": "reference only; K scale per token (shipped) or per block of keys"}}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
