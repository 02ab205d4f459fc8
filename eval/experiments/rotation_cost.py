"""Cost of the unfused Q/K rotation (``kernels/rotation.py``; issue 23 item 5: <= 3 % of the prefill / decode kernel
time) on a GPU: ``rotate_qk_pair`` (prefill, Q and K) against ``prefill.turbo_attention`` (quantization included),
and the query's rotation against one decode call of a TurboCache layer (int4 preset) over a packed cache, both
timed with ``triton.testing.do_bench`` in the same process. Also the fused prefill rotation (Q and K rotated inside
the quantization pass, ``turbo_attention(rotate_qk=True)``): ``fused_<mode>_pct`` = its extra time over the plain
call, with the smooth_hadamard factors computed per call (``_factors_given``: passed in, the rotation alone). Writes JSON.

    python -m eval.experiments.rotation_cost --out eval/results/rotation_cost_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import triton

    from turbo_attn_hf.cache import TurboLayer
    from turbo_attn_hf.config import TurboConfig
    from turbo_attn_hf.kernels import prefill
    from turbo_attn_hf.kernels.rotation import rotate, rotate_qk_pair, smooth_scales

    dev = "cuda"
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100)  # noqa: E731  (ms, median)
    rows = []
    shapes = [("llama3-8b", 32, 8, 128), ("gemma3-270m", 4, 1, 256)]
    for name, hq, hk, d in shapes:
        for L in (1024, 4096, 16384):
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(1, hq, L, d, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(1, hk, L, d, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(1, hk, L, d, device=dev, dtype=torch.bfloat16, generator=g)
            t_att = bench(lambda: prefill.turbo_attention(q, k, v, causal=True))
            r = {"shape": name, "Hq": hq, "Hk": hk, "d": d, "L": L, "prefill_ms": t_att}
            for mode in ("hadamard", "smooth_hadamard"):
                r[f"rot_{mode}_ms"] = bench(lambda: rotate_qk_pair(q, k, mode))
                r[f"rot_{mode}_pct"] = 100 * r[f"rot_{mode}_ms"] / t_att
            s = smooth_scales(k)
            fused = {"hadamard": lambda: prefill.turbo_attention(q, k, v, causal=True, rotate_qk=True),
                     "smooth_hadamard": lambda: prefill.turbo_attention(q, k, v, causal=True, rotate_qk=True,
                                                                        qk_smooth=smooth_scales(k)),
                     "smooth_hadamard_factors_given": lambda: prefill.turbo_attention(q, k, v, causal=True,
                                                                                      rotate_qk=True, qk_smooth=s)}
            t_att = bench(lambda: prefill.turbo_attention(q, k, v, causal=True))  # again, next to the fused calls
            r["prefill_ms_2"] = t_att
            for mode, fn in fused.items():
                r[f"fused_{mode}_ms"] = bench(fn)
                r[f"fused_{mode}_pct"] = 100 * (r[f"fused_{mode}_ms"] - t_att) / t_att
            rows.append(r)
            print(json.dumps(r), flush=True)
    drows = []
    for name, hq, hk, d in shapes:
        for ctx in (4096, 32768):
            for b in (1, 8):
                g = torch.Generator(device=dev).manual_seed(0)
                k = torch.randn(b, hk, ctx, d, device=dev, dtype=torch.bfloat16, generator=g)
                v = torch.randn(b, hk, ctx, d, device=dev, dtype=torch.bfloat16, generator=g)
                q = torch.randn(b, hq, ctx, d, device=dev, dtype=torch.bfloat16, generator=g)
                layer = TurboLayer(dataclasses.replace(TurboConfig.preset("int4"), rotate_qk="none"))
                kk, vv = layer.update(k, v)
                k1 = torch.randn(b, hk, 1, d, device=dev, dtype=torch.bfloat16, generator=g)
                kk, vv = layer.update(k1, k1)
                q1 = torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16, generator=g)
                t_dec = bench(lambda: layer.attention(q1, kk, vv))
                s = smooth_scales(k)
                r = {"shape": name, "Hq": hq, "d": d, "ctx": ctx, "batch": b, "decode_ms": t_dec,
                     "rot_q_ms": bench(lambda: rotate(q1)), "rot_q_smooth_ms": bench(lambda: rotate(q1, s, "q"))}
                r["rot_q_pct"] = 100 * r["rot_q_ms"] / t_dec
                r["rot_q_smooth_pct"] = 100 * r["rot_q_smooth_ms"] / t_dec
                drows.append(r)
                print(json.dumps(r), flush=True)
                del layer, k, v, q
    import subprocess

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "note": "do_bench medians (ms); rot_*: the unfused torch fp32 matmul of kernels/rotation.py; fused_*: "
                    "turbo_attention(rotate_qk=True) (pct over prefill_ms_2, the plain call timed next to it); "
                    "prefill_ms = prefill.turbo_attention (quantization + kernel), decode_ms = TurboLayer.attention "
                    "of one query token (int4 preset, rotate_qk none)"}
    try:
        meta["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    with open(a.out, "w") as f:
        json.dump({**meta, "prefill": rows, "decode": drows}, f, indent=1)


if __name__ == "__main__":
    main()
