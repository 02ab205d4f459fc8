"""A/B of the Gluon Hopper prefill kernel's variants against the portable INT8 kernel and SDPA-cuDNN, kernel alone on
the same quantized operands (issue 20): do_bench medians, TFLOP/s, and each variant's max |diff| to the portable
kernel's output (the same math: 0 expected). FA3 protocol shapes (16k tokens, hidden 2048).

    python -m eval.experiments.prefill_hopper_ab [--dims 128,64] [--lens 4096,16384] [--out FILE.json]
        [--variants hopper,hopper+pv1]

A variant is ``hopper`` and the switches of ``prefill_hopper.launch_ws`` it sets, joined by ``+``: ``no<key>`` /
``<key>`` turn a boolean key of ``prefill_hopper.SCHEDULE`` off / on (``noi2f``: the magic-number conversions),
``pv<N>`` sets ``pv_parts``, ``regs<C>_<P>`` the consumer / producer registers (``hopper+pv1+regs240_24``), ``half``
runs P.V on V itself in 16 bits (``hopper+half``).
Schedules measured and removed: three consumer warpgroups (git a158f56), the next block's Q.K^T beside P.V, the row
max as a tree and Q.K^T in halves (git 2baef6d), P's row sums by integer adds (PERF_NOTES sessions 44, 45), FA3's
ping-pong of the two consumers and the stage-removal switches of the session 47 decomposition (git 47809cd).
"""
from __future__ import annotations

import argparse
import functools

import torch
import triton


def _schedule(variant: str) -> dict:
    """``launch_ws`` keywords of a variant name such as ``hopper+noi2f`` or ``hopper+pv1+regs240_24``."""
    from turbo_attn_hf.kernels.prefill_hopper import SCHEDULE

    head, *switches = variant.split("+")
    if head != "hopper":
        raise SystemExit(f"variant {variant!r} must start with 'hopper'")
    kw = {}
    for sw in switches:
        if sw.startswith("regs"):
            kw["worker_regs"] = tuple(int(x) for x in sw[4:].split("_"))
            continue
        if sw == "half":  # not a switch: V itself in 16 bits (P.V on 16-bit operands)
            kw["half"] = True
            continue
        if sw.startswith("pv") and sw[2:].isdigit():
            kw["pv_parts"] = int(sw[2:])
            continue
        on = not sw.startswith("no")
        key = sw if on else sw[2:]
        if key not in SCHEDULE:
            raise SystemExit(f"variant {variant!r}: 'hopper' and any of {sorted(SCHEDULE)} (no<key>, pvN, regsC_P) "
                             "joined by '+'")
        kw[key] = on
    return kw


def main(argv=None) -> int:
    from turbo_attn_hf.kernels import prefill, prefill_hopper, quant, reference

    from eval.bench_common import print_row, write_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--lens", default="4096,16384")
    ap.add_argument("--rep", type=int, default=60)
    ap.add_argument("--out", default="prefill_hopper_ab.json")
    ap.add_argument("--variants", default="hopper,hopper+pv1")
    a = ap.parse_args(argv)
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=a.rep, return_mode="median")  # noqa: E731
    rows = []
    for d in map(int, a.dims.split(",")):
        for L in map(int, a.lens.split(",")):
            b, h = max(1, 16384 // L), 2048 // d
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            q8, sq = quant.quantize_per_token(q, scale=d ** -0.5 * reference.LOG2E)
            k8, sk = quant.quantize_per_token(k, smooth=reference.k_smooth_mean(k))
            v8t, sv = quant.quantize_v_blocks(v, prefill_hopper.BLOCK_N)
            for causal in (False, True):
                fl = 4 * b * h * L * L * d / (2 if causal else 1)
                out = torch.empty(b, L, h, d, device="cuda", dtype=torch.bfloat16)
                fns = {"portable": lambda: prefill.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=causal,
                                                                        _kernel="portable")}
                for name in a.variants.split(","):
                    kw = _schedule(name)
                    vt = v8t
                    if kw.pop("half", False):  # V itself (launch_ws pads each head's rows to whole blocks)
                        vt = v
                    elif {**prefill_hopper.SCHEDULE, **kw}["keys_permuted"]:  # as the V pass writes it
                        vt = v8t[..., prefill_hopper.mma_key_order(v8t.shape[-1]).to(v8t.device)].contiguous()
                        kw["v8t_in_mma_order"] = True
                    fns[name] = functools.partial(prefill_hopper.launch_ws, q8, sq, k8, sk, vt, sv, out,
                                                  causal=causal, Lk=L, **kw)
                fns["sdpa_cudnn"] = None
                ref = fns["portable"]().float()
                exact = reference.attention_fp64(q[:1, :2], k[:1, :2], v[:1, :2], causal=causal)  # [1, L, 2, d]
                for name, fn in fns.items():
                    row = dict(variant=name, d=d, L=L, batch=b, heads=h, causal=causal)
                    try:
                        if fn is None:
                            from torch.nn.attention import SDPBackend, sdpa_kernel

                            def fn():
                                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        else:
                            o = fn().float()
                            row["max_abs_diff_vs_portable"] = float((o - ref).abs().max())
                            err = (o[:1, :, :2].double() - exact).abs().mean() / exact.abs().mean()
                            row["mre_vs_fp64_2heads"] = float(err)
                        ms = bench(fn)
                        row.update(ms=ms, tflops=fl / ms / 1e9)
                    except Exception as e:  # noqa: BLE001 - one variant failing must not stop the table
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    print_row(row, rows)
    write_rows("prefill_hopper_ab", rows, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
