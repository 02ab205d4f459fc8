"""Issue 23's speed bar: which launch shape makes the fused Hadamard rotation cheap (GPU, CUDA-graph medians).

``rotation_cost.py --profile`` placed the rotated prefill's extra time in one kernel (``_quant_qk_kernel``, 3-4x its
plain time) and the rotated decode's in ``_decode_kernel`` at head_dim 256 (+2-5 µs). sm_90 SASS of the two (CPU
compile, PERF_NOTES session 30): the quantization pass's ``[64, 128]`` tile on 4 warps pays 39 barriers and
160 shuffles a thread for the butterfly's layout changes; the decode kernel at head_dim 256 on one warp spills
(1369 STL) and the rotation adds 660 more, 244 of them inside the main loop. This sweep times both per launch shape:

* quant: ``quant.quantize_qk`` (Q and K of one layer, K's mean subtracted) plain / rotated, per (rows a tile,
  warps) — ``quant._qk_tile``, the launcher's choice, patched;
* decode: ``turbo_decode_attention`` of one token over a filled int4 layer (and an INT8-K one at head_dim 256),
  plain / rotated, per ``num_warps``;
* stats: the rotated first store's ``_stats_kernel`` (device µs, torch profiler) per ``num_warps``;
* store: the first store's kernels (device µs, torch profiler) per ``store.STORE_NUM_WARPS`` (the store kernel's
  warps; the stats kernel keeps its own), plain / hadamard / smooth_hadamard.

    python -m eval.experiments.rotation_launch_sweep --out eval/results/rotation_launch_sweep_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

QUANT_TILES = ((64, 4), (32, 4), (32, 1), (16, 1), (8, 1), (32, 2), (16, 2), (64, 8), (128, 8))
SHAPES = (("llama3-8b", 32, 8, 128), ("gemma3-270m", 4, 1, 256))


def _layer_inputs(args):
    """``(name, d, L, q, k, v)`` per selected shape and length: one layer's bf16 Q ``[1, HQ, L, d]``, K and V."""
    for name, hq, hk, d in (sh for sh in SHAPES if sh[0] in args.shapes):
        for L in args.lens:
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(1, h, L, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hk, hk))
            yield name, d, L, q, k, v


def _quant_rows(args, bench, log):
    from turbo_attn_hf.kernels import quant

    orig = quant._qk_tile
    try:
        for name, d, L, q, k, _ in _layer_inputs(args):
            mean = quant.k_smooth_mean(k)
            for bt, nw in QUANT_TILES:
                if bt * d > 64 * 256 * 2:
                    continue
                quant._qk_tile = lambda _d, _rot, bt=bt, nw=nw: (bt, nw)
                r = {"shape": name, "d": d, "L": L, "rows": bt, "warps": nw}
                for rot in (False, True):
                    res = bench(lambda: quant.quantize_qk(q, k, smooth=mean, rotate=rot))
                    r["rotated_us" if rot else "plain_us"] = round(1e3 * res.get("ms_graph", float("nan")), 2)
                log.add("quant", r)
    finally:
        quant._qk_tile = orig


def _decode_rows(args, bench, log):
    from turbo_attn_hf.cache import TurboLayer
    from turbo_attn_hf.config import TurboConfig
    from turbo_attn_hf.kernels.decode import turbo_decode_attention

    for name, hq, hk, d in (sh for sh in SHAPES if sh[0] in args.shapes):
        for ctx, b in args.decode:
            for k_bits in (("head", 8) if d == 256 else ("head",)):
                g = torch.Generator(device="cuda").manual_seed(0)
                k = torch.randn(b, hk, ctx, d, device="cuda", dtype=torch.bfloat16, generator=g)
                v = torch.randn(b, hk, ctx, d, device="cuda", dtype=torch.bfloat16, generator=g)
                q1 = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
                k1 = torch.randn(b, hk, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
                layer = TurboLayer(dataclasses.replace(TurboConfig.preset("int4"), packed_k_bits=k_bits))
                layer.update(k, v)
                layer.update(k1, k1)
                dargs, kw = layer.decode_inputs()
                for nw in args.warps:
                    r = {"shape": name, "d": d, "ctx": ctx, "batch": b, "k_bits": k_bits, "warps": nw}
                    for rot in (False, True):
                        res = bench(lambda: turbo_decode_attention(q1, *dargs, num_warps=nw, rotate=rot, **kw))
                        r["rotated_us" if rot else "plain_us"] = round(1e3 * res.get("ms_graph", float("nan")), 2)
                    log.add("decode", r)
                del layer, k, v


def _stats_rows(args, log):
    """The cache's first store, rotated: ``_stats_kernel``'s device µs per ``num_warps`` (8 when rotated today)."""
    from turbo_attn_hf import first_prefill
    from turbo_attn_hf.cache import TurboLayer
    from turbo_attn_hf.config import TurboConfig
    from turbo_attn_hf.kernels import store

    from .rotation_cost import _kernel_us

    orig = store._stats_plan
    cfg = dataclasses.replace(TurboConfig.preset("int4"), rotate_qk="hadamard")
    try:
        for name, d, L, _, k, v in _layer_inputs(args):
            for nw in args.stats_warps:
                def plan(*a, nw=nw, **kw):
                    launch = orig(*a, **kw)
                    launch.kw = {**launch.kw, "num_warps": nw}
                    return launch
                store._stats_plan = plan
                store._STATS_PLANS.clear()
                first_prefill.PLANS.clear()  # the cache's first-store plans hold a stats launch each
                r = {"shape": name, "d": d, "L": L, "stats_warps": nw,
                     "kernels_us": _kernel_us(lambda: TurboLayer(cfg).update(k, v))}
                log.add("stats", r)
    finally:
        store._stats_plan = orig
        store._STATS_PLANS.clear()


def _store_rows(args, log):
    """The cache's first store: every kernel's device µs per ``store.STORE_NUM_WARPS``, rotate_qk none / hadamard /
    smooth_hadamard (the rotated store kernel packs 64-row blocks through the butterfly: its cross-warp layout
    changes, as the stats kernel's, may cost more than fewer warps' registers)."""
    from turbo_attn_hf import first_prefill
    from turbo_attn_hf.cache import TurboLayer
    from turbo_attn_hf.config import TurboConfig
    from turbo_attn_hf.kernels import store

    from .rotation_cost import _kernel_us

    orig = store.STORE_NUM_WARPS
    try:
        for name, d, L, _, k, v in _layer_inputs(args):
            for nw in args.store_warps:
                store.STORE_NUM_WARPS = nw
                store._STORE_KV_KW.clear()  # its memos hold the kernels compiled for the last warp count
                for rot in ("none", "hadamard", "smooth_hadamard"):
                    cfg = dataclasses.replace(TurboConfig.preset("int4"), rotate_qk=rot)
                    first_prefill.PLANS.clear()  # the first-store plans hold their store launches
                    us = _kernel_us(lambda: TurboLayer(cfg).update(k, v))
                    r = {"shape": name, "d": d, "L": L, "store_warps": nw, "rotate_qk": rot, "kernels_us": us,
                         "total_us": round(sum(us.values()), 2)}
                    log.add("store", r)
    finally:
        store.STORE_NUM_WARPS = orig
        store._STORE_KV_KW.clear()
        first_prefill.PLANS.clear()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--decode", default="4096x1,4096x8,32768x1,32768x8", help="CTXxBATCH,...")
    ap.add_argument("--warps", default="1,2", help="decode num_warps to try")
    ap.add_argument("--shapes", default=",".join(n for n, *_ in SHAPES), help="shape names to run")
    ap.add_argument("--stats-warps", default="4,8,16", help="rotated stats kernel num_warps to try")
    ap.add_argument("--store-warps", default="2,4,8", help="store kernel num_warps to try (store.STORE_NUM_WARPS)")
    ap.add_argument("--skip", default="", help="quant,decode,stats,store")
    a = ap.parse_args(argv)
    a.lens = [int(x) for x in a.lens.split(",") if x]
    a.shapes = a.shapes.split(",")
    a.stats_warps = [int(x) for x in a.stats_warps.split(",") if x]
    a.store_warps = [int(x) for x in a.store_warps.split(",") if x]
    a.warps = [int(x) for x in a.warps.split(",") if x]
    a.decode = [tuple(int(y) for y in x.split("x")) for x in a.decode.split(",") if x]
    from ..bench_common import RowLog, bench_graph_ms, machine_info

    bench = lambda f: bench_graph_ms(f, rep=50)  # noqa: E731
    log = RowLog(a.out, {"machine": machine_info(),
                         "note": "CUDA-graph medians (µs) of quantize_qk (Q + K of one layer, K's mean subtracted) per "
                                 "(rows, warps) and of turbo_decode_attention (1 token over a filled int4 layer) per "
                                 "num_warps, plain / rotated; stats / store: the first store's kernels' device µs"})
    if "quant" not in a.skip:
        _quant_rows(a, bench, log)
    if "decode" not in a.skip:
        _decode_rows(a, bench, log)
    if "stats" not in a.skip:
        _stats_rows(a, log)
    if "store" not in a.skip:
        _store_rows(a, log)

if __name__ == "__main__":
    main()
