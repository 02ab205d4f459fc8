"""Cost of ``rotate_qk`` (issue 23 item 5: <= 3 % of the prefill / decode kernel time) on a GPU, every rotation fused
into a pass that reads Q or K anyway, timed with ``triton.testing.do_bench`` (medians, ms) in one process, each
rotated call next to its plain twin on the same tensors:

* prefill: ``prefill.turbo_attention`` (quantization included, causal) plain / ``rotate_qk=True`` / with the
  smooth_hadamard factors given (the cache path: fixed at the first store) — Q and K rotated in the Q+K pass;
* ``smooth_scales``: the factors' computation, once per layer and first prefill;
* store: the first prefill's store of a ``TurboLayer`` (``update``: K mean, stats, scales, codes, packing) with
  ``rotate_qk`` none / hadamard / smooth_hadamard — K rotated in the stats and store kernels (factors included);
* decode: ``turbo_decode_attention`` of one query token over the same int4 storage, plain / ``rotate=True`` /
  with factors — the query rotated in the kernel's prologue;
* decode step: ``TurboLayer.update`` of one token + ``attention`` with rotate_qk none vs smooth_hadamard (the
  layer's whole step as eager generate() runs it).
Writes JSON (``*_pct``: extra time of the rotated call over the plain one). ``--profile`` adds, per prefill, store and
decode row, each kernel's device time per call (torch profiler, 20 calls) of the plain and the rotated call, so the
extra time is placed in a kernel before anything is changed.

    python -m eval.experiments.rotation_cost --out eval/results/rotation_cost_fused_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess

import torch


def _pct(t, t0):
    return 100.0 * (t - t0) / t0


def _kernel_us(fn, n: int = 20) -> dict:
    """{kernel name: device µs per call} of ``fn`` over ``n`` calls (torch profiler, after one warm-up call). Names are
    cut to 100 characters and the kernels that share a cut name summed (until session 43 a cut of 60 kept only one of
    them: torch's elementwise kernels of different functors share their first 60, so a step's total lost some)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            out[e.key[:100]] = out.get(e.key[:100], 0.0) + e.self_device_time_total / n
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="one shape per section")
    ap.add_argument("--profile", action="store_true", help="per-kernel device µs of each plain / rotated call")
    ap.add_argument("--no-step", action="store_true", help="skip the layer-step section (host-bound)")
    a = ap.parse_args(argv)
    import triton

    from turbo_attn_hf.cache import TurboLayer
    from turbo_attn_hf.config import TurboConfig
    from turbo_attn_hf.kernels import prefill
    from turbo_attn_hf.kernels.decode import turbo_decode_attention
    from turbo_attn_hf.kernels.rotation import smooth_scales

    dev = "cuda"
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100)  # noqa: E731
    shapes = [("llama3-8b", 32, 8, 128), ("gemma3-270m", 4, 1, 256)]
    lens = (1024,) if a.quick else (1024, 4096, 16384)
    cfg = {m: dataclasses.replace(TurboConfig.preset("int4"), rotate_qk=m)
           for m in ("none", "hadamard", "smooth_hadamard")}
    from ..bench_common import RowLog

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "note": "do_bench medians (ms); *_pct = extra time of the rotated call over the plain one (prefill / "
                    "decode: min of the two plain timings around it); store = TurboLayer(int4).update(k, v) of a "
                    "first prefill; step = update of 1 token + attention over a filled int4 layer"}
    meta["git"] = os.environ.get("TURBO_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    log = RowLog(a.out, meta)  # the file is rewritten after every row

    def rand(*shape, g):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)

    for name, hq, hk, d in shapes:
        for L in lens:
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v = rand(1, hq, L, d, g=g), rand(1, hk, L, d, g=g), rand(1, hk, L, d, g=g)
            s = smooth_scales(k)
            r = {"shape": name, "Hq": hq, "Hk": hk, "d": d, "L": L}
            r["plain_ms"] = bench(lambda: prefill.turbo_attention(q, k, v, causal=True))
            r["hadamard_ms"] = bench(lambda: prefill.turbo_attention(q, k, v, causal=True, rotate_qk=True))
            r["smooth_ms"] = bench(lambda: prefill.turbo_attention(q, k, v, causal=True, rotate_qk=True, qk_smooth=s))
            r["plain_ms_2"] = bench(lambda: prefill.turbo_attention(q, k, v, causal=True))
            t0 = min(r["plain_ms"], r["plain_ms_2"])
            r["hadamard_pct"], r["smooth_pct"] = _pct(r["hadamard_ms"], t0), _pct(r["smooth_ms"], t0)
            r["smooth_scales_ms"] = bench(lambda: smooth_scales(k))
            r["smooth_scales_pct_of_prefill"] = 100.0 * r["smooth_scales_ms"] / t0
            if a.profile:
                r["kernels_plain_us"] = _kernel_us(lambda: prefill.turbo_attention(q, k, v, causal=True))
                r["kernels_hadamard_us"] = _kernel_us(
                    lambda: prefill.turbo_attention(q, k, v, causal=True, rotate_qk=True))
            log.add("prefill", r)

            st = {"shape": name, "Hk": hk, "d": d, "L": L}
            for m in cfg:
                st[f"{m}_ms"] = bench(lambda: TurboLayer(cfg[m]).update(k, v))
                if a.profile:
                    st[f"kernels_{m}_us"] = _kernel_us(lambda: TurboLayer(cfg[m]).update(k, v))
            for m in ("hadamard", "smooth_hadamard"):
                st[f"{m}_pct"] = _pct(st[f"{m}_ms"], st["none_ms"])
            log.add("store", st)
            del q, k, v

    for name, hq, hk, d in shapes:
        for ctx in ((4096,) if a.quick else (4096, 32768)):
            for b in (1, 8):
                g = torch.Generator(device=dev).manual_seed(0)
                k, v = rand(b, hk, ctx, d, g=g), rand(b, hk, ctx, d, g=g)
                q1 = rand(b, hq, 1, d, g=g)
                layer = TurboLayer(cfg["none"])
                layer.update(k, v)
                k1 = rand(b, hk, 1, d, g=g)
                layer.update(k1, k1)
                args, kw = layer.decode_inputs()
                s = smooth_scales(k)
                r = {"shape": name, "Hq": hq, "d": d, "ctx": ctx, "batch": b}
                r["plain_ms"] = bench(lambda: turbo_decode_attention(q1, *args, **kw))
                r["hadamard_ms"] = bench(lambda: turbo_decode_attention(q1, *args, rotate=True, **kw))
                r["smooth_ms"] = bench(lambda: turbo_decode_attention(q1, *args, rotate=True, qk_smooth=s, **kw))
                r["plain_ms_2"] = bench(lambda: turbo_decode_attention(q1, *args, **kw))
                t0 = min(r["plain_ms"], r["plain_ms_2"])
                r["hadamard_pct"], r["smooth_pct"] = _pct(r["hadamard_ms"], t0), _pct(r["smooth_ms"], t0)
                if a.profile:
                    r["kernels_plain_us"] = _kernel_us(lambda: turbo_decode_attention(q1, *args, **kw))
                    r["kernels_hadamard_us"] = _kernel_us(lambda: turbo_decode_attention(q1, *args, rotate=True, **kw))
                log.add("decode", r)
                if a.no_step:
                    del layer, k, v
                    continue
                stp = {"shape": name, "d": d, "ctx": ctx, "batch": b}
                for m in ("none", "smooth_hadamard"):
                    lay = TurboLayer(cfg[m])
                    lay.update(k, v)

                    def step():
                        kk, vv = lay.update(k1, k1)
                        return lay.attention(q1, kk, vv)
                    stp[f"{m}_ms"] = bench(step)
                    del lay
                stp["smooth_hadamard_pct"] = _pct(stp["smooth_hadamard_ms"], stp["none_ms"])
                log.add("step", stp)
                del layer, k, v


if __name__ == "__main__":
    main()
