"""Decode-kernel sweep: correctness at real sizes, then time and bandwidth of launch variants vs SDPA.

    python -m eval.experiments.decode_sweep [--budget 200] [--out DIR]

1. Kernel vs ``reference.turbo_decode_ref`` (same split plan) at b 2, GQA 32/8, d 128, L 4133, for int8 /
   int4 / mixed and each variant below; plus one masked chunk (key_valid left padding, window, SAS, Lq 3).
2. Timing (``triton.testing.do_bench``, median) at 32k context, batch 8 (every variant), then the best
   variants + the default at 32k batch 1 / 32 and 4k batch 8: SDPA bf16 (flash and cuDNN, GQA folded into
   the query length so K/V are read once), the copy ceiling, and per preset µs, GB/s (bytes =
   ``TurboLayer.memory_bytes()``), fraction of the copy ceiling, speed-up over the faster SDPA; the default
   launch also through a CUDA graph (10 calls per replay), which removes the Python launch overhead.
Variants: ``fold`` (scale/zero folded into query and output) vs the INT8-restoring loop, merge ``fused``
(last share merges) vs a merge kernel, ``num_warps``, ``num_stages``, ``waves`` (programs per SM).
Writes ``decode_sweep.json`` (rows + machine line) to ``--out`` (default eval/results/).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from ..bench_common import copy_ceiling, machine_info, machine_line, write_json

HQ, HK, D = 32, 8, 128
PRESET_BITS = {"int8": [8] * HK, "int4": [4] * HK, "mixed": [4] * (HK // 2) + [2] * (HK // 2)}
#: grids timed at every shape and ranked on CUDA-graph time (the others: all variants at 32k batch 8 only)
EVERY_SHAPE = ("launch", "fill", "cap", "merge", "host")
DEFAULT: dict = {}  # the library's defaults (turbo_decode_attention's keyword defaults)


def grid(which: str = "full"):
    """Timed launch variants: ``full`` (everything below), ``reg`` (the register caps only), or one of
    :data:`EVERY_SHAPE` (``launch`` stages x waves, ``cap``, ``merge``, ``fill``: see the comments below)."""
    if which == "host":  # the default launch only: eager, graph and host time (binder-free vs Triton's launch)
        return []
    if which == "launch":
        return [dict(num_stages=st, waves=wv) for st in (2, 3) for wv in (4.0, 5.0, 6.0, 8.0)]
    if which == "cap":  # register caps (ptxas maxnreg) with the waves that fill 10 (192) / 12 (168) programs per SM
        return ([dict(num_stages=2, max_registers=192, waves=wv) for wv in (6.0, 9.6)]
                + [dict(num_stages=2, max_registers=168, waves=wv) for wv in (6.0, 11.6)])
    if which == "merge":  # the partials merged by a 4-warp merge kernel instead of the last 1-warp share
        return [dict(merge="kernel"), dict(merge="kernel", waves=4.0), dict(merge="kernel", waves=8.0),
                dict(waves=4.0)]
    if which == "fill":  # 2 stages, up to one resident wave (8 programs per SM), shorter/longer shares
        return ([dict(num_stages=2, waves=wv) for wv in (6.0, 7.0, 7.7)]
                + [dict(num_stages=2, waves=6.0, min_tiles=mt) for mt in (2, 8)])
    if which == "reg":
        return [dict(num_warps=1, num_stages=st, waves=wv, max_registers=reg)
                for reg in (128, 168) for wv in (4.0, 8.0, 12.0) for st in (3,)] + [dict(waves=8.0)]
    out = [dict(fold=False, merge="kernel", num_warps=4, num_stages=2, waves=2.0)]  # the previous kernel
    for w in (1, 2, 4):
        for st in (2, 3):
            for wv in (2.0, 4.0, 8.0):
                out.append(dict(fold=True, merge="fused", num_warps=w, num_stages=st, waves=wv))
    out.append(dict(fold=True, merge="kernel", num_warps=1, num_stages=2, waves=4.0))
    out.append(dict(fold=True, merge="kernel", num_warps=2, num_stages=2, waves=4.0))
    return out + grid("reg")


def vname(v) -> str:
    """Readable name of a variant (keys left out take the library defaults, shown as 'd')."""
    if not v:
        return "default"
    fold = {True: "fold", False: "restore", None: "d"}[v.get("fold")]
    reg = f"-r{v['max_registers']}" if v.get("max_registers") else ""
    reg += f"-mt{v['min_tiles']}" if v.get("min_tiles") else ""
    return (f"{fold}-{v.get('merge', 'd')}-w{v.get('num_warps', 'd')}-s{v.get('num_stages', 'd')}-"
            f"wv{v.get('waves') or 'd'}{reg}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.experiments.decode_sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; later steps are skipped past it")
    ap.add_argument("--out", default=None)
    ap.add_argument("--grid", choices=("full", "reg") + EVERY_SHAPE, default="full",
                    help="full / reg: variants timed at 32k batch 8 (all, or the register caps); launch / fill / "
                         "cap / merge / host (the default only): timed at every shape, also as CUDA-graph replays")
    ap.add_argument("--baseline", default=None,
                    help="module of an earlier decode kernel to time side by side (e.g. "
                         "turbo_attn_hf.kernels.decode_base, a copy of kernels/decode.py from an earlier commit)")
    ap.add_argument("--profile-host", action="store_true", help="cProfile 200 calls per preset at batch 1")
    ap.add_argument("--no-checks", action="store_true", help="skip the correctness checks (timing only)")
    args = ap.parse_args(argv)
    t_start = time.time()

    import torch
    import triton
    from triton.testing import do_bench

    from turbo_attn_hf.kernels import decode as DK
    from turbo_attn_hf.kernels import reference as R
    from turbo_attn_hf.kernels.pack import PackedKV

    from ..bench_decode import build_layer, sdpa_fold

    info = machine_info()
    print(machine_line(info), flush=True)
    rows, checks = [], []
    payload = {"benchmark": "decode_sweep", "machine": info, "rows": rows, "checks": checks,
               "formulas": {"GBps": "TurboLayer.memory_bytes() (or bf16 K+V for sdpa) / median time",
                            "frac_ceiling": "GBps / measured copy GB/s (read + write)",
                            "x_sdpa": "min(sdpa flash, sdpa cudnn) median / median"}}

    def left() -> float:
        return args.budget - (time.time() - t_start)

    def save():
        write_json("decode_sweep", payload, args.out)

    def call(q, groups, kt, vt, nt, ks, vs, mu, v, **kw):
        return DK.turbo_decode_attention(q, groups, kt, vt, nt, ks, vs, mu, **v, **kw)

    base = None
    if args.baseline:
        import importlib

        base = importlib.import_module(args.baseline)
        payload["baseline"] = args.baseline

    # ---------------------------------------------------------------- 1. correctness
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: interpreter smoke test of the checks only
    b, L = (2, 4096 + 37) if dev == "cuda" else (1, 150)
    k = torch.randn(b, HK, L, D, device=dev) + 0.5 * torch.randn(1, HK, 1, D, device=dev)
    v_ = torch.randn(b, HK, L, D, device=dev)
    check_variants = [DEFAULT, grid()[0], dict(num_warps=1), dict(num_warps=4), dict(num_warps=2, merge="kernel")]
    for name, hb in ({} if args.no_checks else PRESET_BITS).items():
        st = R.build_packed_cache_ref(k, v_, 2048, hb, 64)
        groups_r, kt, vt, nt, ks, vs, mu = st
        groups = [PackedKV(bits=g.bits, heads=g.heads, n_blocks=g.n_blocks,
                           **{n: (None if getattr(g, n) is None else getattr(g, n).contiguous())
                              for n in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")}) for g in groups_r]
        for lq, kw in ((1, {}), (3, {"window": 1000, "softmax": "sas"})):
            q = torch.randn(b, HQ, lq, D, device=dev, dtype=torch.bfloat16) * 2
            if lq > 1:
                kv = torch.ones(b, L, dtype=torch.bool, device=dev)
                kv[0, :(300 if dev == "cuda" else 30)] = False
                kw = dict(kw, key_valid=kv)
            for v in (check_variants if lq == 1 and dev == "cuda" else [DEFAULT]):
                n_tiles = groups[0].n_blocks + -(-nt // 64)
                t0 = DK.first_visible_tile(L, lq, kw.get("window"), 64)
                splits = DK.group_splits(n_tiles - t0, groups, b, 1, q.device, v.get("waves"))
                try:
                    out = call(q, groups, kt, vt, nt, ks, vs, mu, v, **kw)
                    out2 = call(q, groups, kt, vt, nt, ks, vs, mu, v, **kw)  # counters reset: same again
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    ref = R.turbo_decode_ref(q.float(), groups_r, kt, vt, nt, ks, vs, mu, n_splits=splits,
                                             **{a: (c.float() if torch.is_tensor(c) and c.is_floating_point()
                                                    else c) for a, c in kw.items()})
                    d = (out.float() - ref.to(out.dtype).float())  # both rounded to bf16
                    rel = float(d.norm() / ref.float().norm())
                    c = {"preset": name, "lq": lq, "variant": vname(v), "splits": splits, "rms_rel": rel,
                         "max_abs": float(d.abs().max()), "repeat_equal": bool(torch.equal(out, out2)),
                         "ok": bool(rel < 5e-3 and float(d.abs().max()) < 2e-2 and torch.equal(out, out2))}
                except Exception as e:  # noqa: BLE001
                    c = {"preset": name, "lq": lq, "variant": vname(v), "ok": False,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"}
                checks.append(c)
                print("[check]", c, flush=True)
    del k, v_
    save()
    if dev != "cuda":
        print("checks:", sum(c.get("ok", False) for c in checks), "/", len(checks), "ok (cpu: timing skipped)")
        return 0

    # ---------------------------------------------------------------- 2. timing
    ceil = copy_ceiling()
    payload["copy_ceiling"] = ceil
    cgb = ceil["GBps_read_plus_write"]
    print(f"copy ceiling {cgb:.0f} GB/s  (t={time.time() - t_start:.0f}s)", flush=True)

    def bench(fn):
        return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))

    def graph_us(fn):
        """µs per call of ``fn`` replayed from a CUDA graph (10 calls per replay): the GPU time without the
        Python launch cost (do_bench's eager time includes it wherever the host is the slower side)."""
        fn()
        st_ = torch.cuda.Stream()
        st_.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st_):
            fn()
        torch.cuda.current_stream().wait_stream(st_)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(10):
                fn()
        return bench(gr.replay) * 1e3 / 10

    best_by_preset: dict = {}
    for ctx, bsz in ((32768, 8), (32768, 1), (32768, 32), (4096, 8)):
        if left() < 15:
            print(f"budget: skipping ctx {ctx} b {bsz}", flush=True)
            continue
        torch.manual_seed(0)
        kc = torch.randn(bsz, HK, ctx, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(bsz, HK, ctx, D, device="cuda", dtype=torch.bfloat16)
        k1 = torch.randn(bsz, HK, 1, D, device="cuda", dtype=torch.bfloat16)
        v1 = torch.randn(bsz, HK, 1, D, device="cuda", dtype=torch.bfloat16)
        kf, vf = torch.cat([kc, k1], 2), torch.cat([vc, v1], 2)
        q = torch.randn(bsz, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        from torch.nn.attention import SDPBackend

        bf16_bytes = 2 * bsz * HK * (ctx + 1) * D * 2
        base_row = {"context": ctx + 1, "batch": bsz}
        sd = {}
        for be_name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                ms = bench(lambda: sdpa_fold(q, kf, vf, be))
                sd[be_name] = ms
                rows.append({**base_row, "provider": be_name, "us": ms * 1e3, "GBps": bf16_bytes / ms / 1e6,
                             "frac_ceiling": bf16_bytes / ms / 1e6 / cgb})
            except Exception as e:  # noqa: BLE001
                rows.append({**base_row, "provider": be_name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        sdpa_ms = min(sd.values()) if sd else float("nan")
        print(f"ctx {ctx} b {bsz}: sdpa " + ", ".join(f"{n} {m * 1e3:.1f} us" for n, m in sd.items()), flush=True)
        for preset in PRESET_BITS:
            if left() < 8:
                break
            _, layer = build_layer(kc, vc, k1, v1, preset)
            nbytes = layer.memory_bytes()
            a, kw = layer.decode_inputs()
            a = (q,) + a
            if (ctx, bsz) == (32768, 8) or args.grid in EVERY_SHAPE:
                vs_ = [DEFAULT] + grid(args.grid)
            else:
                vs_ = [DEFAULT] + best_by_preset.get(preset, [])[:3] + [grid()[0]]
            res = []
            for v in vs_:
                if left() < 5:
                    break
                try:
                    ms = bench(lambda: call(*a, v, **kw))
                except Exception as e:  # noqa: BLE001
                    rows.append({**base_row, "provider": f"turbo_{preset}", "variant": vname(v),
                                 "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                if args.grid in EVERY_SHAPE:  # rank the launches on GPU time (graph replay)
                    try:
                        g_ms = graph_us(lambda: call(*a, v, **kw)) / 1e3
                        rows.append({**base_row, "provider": f"turbo_{preset}", "variant": vname(v) + "-cudagraph",
                                     "us": g_ms * 1e3, "bytes": nbytes, "GBps": nbytes / g_ms / 1e6,
                                     "frac_ceiling": nbytes / g_ms / 1e6 / cgb, "x_sdpa": sdpa_ms / g_ms})
                        ms = g_ms
                    except Exception as e:  # noqa: BLE001
                        print(f"  cuda graph failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                res.append((ms, v))
                r = {**base_row, "provider": f"turbo_{preset}", "variant": vname(v), "default": v is DEFAULT,
                     "us": ms * 1e3, "bytes": nbytes, "GBps": nbytes / ms / 1e6, "frac_ceiling": nbytes / ms / 1e6 / cgb,
                     "x_sdpa": sdpa_ms / ms}
                rows.append(r)
            extra = {}
            if base is not None:  # the earlier kernel, its defaults
                extra["baseline"] = lambda: base.turbo_decode_attention(*a, **kw)
            if len(a[1]) > 1:  # one launch per bit group (the layout before the groups shared a launch)
                extra["per_group"] = lambda: [DK.turbo_decode_attention(a[0], [g_], *a[2:], **kw) for g_ in a[1]]
            for name, fn in extra.items():
                try:
                    ms_x = bench(fn)
                except Exception as e:  # noqa: BLE001
                    rows.append({**base_row, "provider": f"turbo_{preset}", "variant": name,
                                 "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                rows.append({**base_row, "provider": f"turbo_{preset}", "variant": name, "us": ms_x * 1e3,
                             "bytes": nbytes, "GBps": nbytes / ms_x / 1e6, "frac_ceiling": nbytes / ms_x / 1e6 / cgb,
                             "x_sdpa": sdpa_ms / ms_x})
                if args.grid in EVERY_SHAPE:  # same-process GPU time of the extra, as for the variants
                    try:
                        us = graph_us(fn)
                        rows.append({**base_row, "provider": f"turbo_{preset}", "variant": name + "-cudagraph",
                                     "us": us, "bytes": nbytes, "GBps": nbytes / us / 1e3,
                                     "frac_ceiling": nbytes / us / 1e3 / cgb, "x_sdpa": sdpa_ms * 1e3 / us})
                        print(f"  {preset:5s} {name}: eager {ms_x * 1e3:7.1f} us, graph {us:7.1f} us", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"  cuda graph of {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            # host cost of one call (no synchronisation: the time the Python side takes to queue it), with the
            # binder-free relaunch (kernels/launch.py, the default) and with Triton's own JITFunction launch
            fn = lambda: call(*a, DEFAULT, **kw)  # noqa: E731
            lean_launch = DK._DECODE
            for launch_name, launcher in (("", lean_launch), ("_triton_launch", DK._decode_kernel)):
                DK._DECODE = launcher
                try:
                    fn()
                    torch.cuda.synchronize()
                    t_h = time.perf_counter()
                    for _ in range(50):
                        fn()
                    host_us = (time.perf_counter() - t_h) / 50 * 1e6
                    torch.cuda.synchronize()
                    rows.append({**base_row, "provider": f"turbo_{preset}", "variant": "host_us_per_call" + launch_name,
                                 "us": host_us})
                    ms_x = bench(fn)  # eager (do_bench): includes the host time wherever the host is slower
                    rows.append({**base_row, "provider": f"turbo_{preset}", "variant": "eager" + (launch_name or "_lean"),
                                 "us": ms_x * 1e3, "x_sdpa": sdpa_ms / ms_x})
                finally:
                    DK._DECODE = lean_launch
            if args.profile_host and bsz == 1:  # where the host time of a call goes
                import cProfile
                import io
                import pstats

                pr = cProfile.Profile()
                pr.enable()
                for _ in range(200):
                    fn()
                pr.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
                payload.setdefault("host_profile", {})[preset] = buf.getvalue()
                print(buf.getvalue(), flush=True)
            if (ctx, bsz) == (32768, 8):
                best_by_preset[preset] = [v for _, v in sorted(res, key=lambda x: x[0]) if v is not DEFAULT]
            if res:
                ms, v = min(res, key=lambda x: x[0])
                dflt = next((m for m, vv in res if vv is DEFAULT), float("nan"))
                g_us = float("nan")
                for vv in ([DEFAULT] if v is DEFAULT else [DEFAULT, v]):
                    try:
                        us = graph_us(lambda: call(*a, vv, **kw))
                    except Exception as e:  # noqa: BLE001
                        print(f"  cuda graph failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    if vv is DEFAULT:
                        g_us = us
                    rows.append({**base_row, "provider": f"turbo_{preset}", "variant": vname(vv) + "-cudagraph",
                                 "us": us, "bytes": nbytes, "GBps": nbytes / us / 1e3,
                                 "frac_ceiling": nbytes / us / 1e3 / cgb, "x_sdpa": sdpa_ms * 1e3 / us})
                print(f"  {preset:5s} {nbytes / 1e6:7.1f} MB: default {dflt * 1e3:7.1f} us (graph {g_us:7.1f}), best "
                      f"{ms * 1e3:7.1f} us {vname(v)} -> {nbytes / ms / 1e6:6.0f} GB/s ({nbytes / ms / 1e6 / cgb:.0%}), "
                      f"x sdpa {sdpa_ms / ms:.2f} (default {sdpa_ms / dflt:.2f}, graph {sdpa_ms * 1e3 / g_us:.2f})",
                      flush=True)
            del layer
            save()
        del kf, vf, kc, vc, q
        torch.cuda.empty_cache()

    # ---------------------------------------------------------------- table
    print(f"\n{'ctx':>6} {'b':>3} {'provider':12s} {'variant':34s} {'us':>8} {'GB/s':>6} {'ceil':>5} {'x_sdpa':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['context']:6d} {r['batch']:3d} {r['provider']:12s} {r.get('variant', ''):34s} ERROR {r['error'][:80]}")
            continue
        print(f"{r['context']:6d} {r['batch']:3d} {r['provider']:12s} {r.get('variant', ''):34s} {r['us']:8.1f} "
              f"{r.get('GBps', float('nan')):6.0f} {r.get('frac_ceiling', float('nan')):5.0%} "
              f"{r.get('x_sdpa', float('nan')):6.2f}")
    bad = [c for c in checks if not c.get("ok")]
    print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok" + (f"; FAILED: {bad}" if bad else ""))
    path = write_json("decode_sweep", payload, args.out)
    print(f"wrote {path}  (total {time.time() - t_start:.0f}s)")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
