"""On-device sweep of the INT8 prefill kernel's variants (tiles, KV block, P/V scales, softmax).

    python -m eval.experiments.prefill_sweep --warm 3/12      # compile shard 3 of 12 (run the shards in parallel first)
    python -m eval.experiments.prefill_sweep [--budget-s 150] [--json PATH] [--dims 128,64,256] [--only NAME,...]
    python -m eval.experiments.prefill_sweep --dry-run        # CPU: the variant list and one tiny interpreter call

What it prints (and writes as JSON): for each head_dim d, causal mode and L in 4k / 8k / 16k (FA3 protocol:
16k tokens in total, hidden 2048, so batch = 16384 / L and heads = 2048 / d), the kernel alone (operands
quantized beforehand) for every variant, the whole ``turbo_attention`` (quantization included) with
its defaults and with block_n 64, the quantizers alone, and SDPA flash (FA2) / cuDNN in the same process,
as TFLOP/s with FLOPs = 4 b h L^2 d (halved causal). Before timing, every variant is checked against
``kernels.reference.int8_flash_attention`` on one small shape (rms-relative error of the output).
Variants that fail to compile are reported and skipped. ``kernels/_prefill_old.py`` (the kernel before
the one-FMA epilogue: ``git show 3ac620a~1:kernels/prefill.py``, not committed) is timed as "old" when
present. The 2026-11-22 H200 run (eval/results/prefill_sweep_h200.json, eval/PERF_NOTES.md) also had a
software-pipelined Q.K^T and a warp-specialized loop, removed since (slower / no compile).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

TOTAL_TOKENS = 16384
HIDDEN = 2048
LENGTHS = (4096, 8192, 16384)
FLOPS_FORMULA = "4 * batch * heads * L^2 * head_dim, halved when causal; TFLOP/s = FLOPs / median time"

# name -> options of int8_flash_attention (block_n: KV tile; config: (BLOCK_M, num_warps, num_stages))
_BASE = dict(p_scale="block", v_scale="block", softmax="exact", impl="new")


def _v(name, dims, block_n, config, **kw):
    return dict(_BASE, name=name, dims=dims, block_n=block_n, config=config, **kw)


VARIANTS = [
    # d 128: the target
    _v("old-bn64-64.4.3", (128,), 64, (64, 4, 3), impl="old"),
    _v("bn64-64.4.3", (128,), 64, (64, 4, 3)),
    _v("bn64-64.4.4", (128,), 64, (64, 4, 4)),
    _v("bn64-128.8.3", (128,), 64, (128, 8, 3)),
    _v("bn128-64.4.3", (128,), 128, (64, 4, 3)),
    _v("bn128-64.4.2", (128,), 128, (64, 4, 2)),
    _v("bn128-128.8.2", (128,), 128, (128, 8, 2)),
    _v("bn128-128.8.3", (128,), 128, (128, 8, 3)),
    _v("bn64-64.4.3-vchan", (128,), 64, (64, 4, 3), v_scale="channel"),
    _v("bn128-64.4.3-vchan", (128,), 128, (64, 4, 3), v_scale="channel"),
    _v("bn64-64.4.3-pstatic", (128,), 64, (64, 4, 3), p_scale="static"),
    _v("bn64-64.4.3-sas", (128,), 64, (64, 4, 3), softmax="sas"),
    # d 64
    _v("old-bn64-128.4.3", (64,), 64, (128, 4, 3), impl="old"),
    _v("bn64-128.4.3", (64,), 64, (128, 4, 3)),
    _v("bn64-64.4.3", (64,), 64, (64, 4, 3)),
    _v("bn128-128.4.3", (64,), 128, (128, 4, 3)),
    _v("bn128-128.8.3", (64,), 128, (128, 8, 3)),
    _v("bn128-64.4.3", (64,), 128, (64, 4, 3)),
    # d 256
    _v("old-bn64-64.8.2", (256,), 64, (64, 8, 2), impl="old"),
    _v("bn64-64.8.2", (256,), 64, (64, 8, 2)),
    _v("bn64-64.4.2", (256,), 64, (64, 4, 2)),
    _v("bn128-64.8.2", (256,), 128, (64, 8, 2)),
    _v("bn64-128.8.2", (256,), 64, (128, 8, 2)),
]


def flops(b, h, L, d, causal):
    f = 4.0 * b * h * L * L * d
    return f / 2 if causal else f


def _modules():
    from turbo_attn_hf.kernels import prefill, quant
    from turbo_attn_hf.kernels import reference as R

    try:
        old = importlib.import_module("turbo_attn_hf.kernels._prefill_old")
    except Exception:  # noqa: BLE001 - the untracked copy is optional
        old = None
    return prefill, quant, R, old


class Operands:
    """Quantized operands of one (q, k, v), cached per (block_n, v_scale)."""

    def __init__(self, q, k, v):
        from turbo_attn_hf.kernels import quant
        from turbo_attn_hf.kernels import reference as R

        self.q, self.k, self.v = q, k, v
        d = q.shape[-1]
        self.q8, self.sq = quant.quantize_per_token(q, scale=d ** -0.5 * R.LOG2E)
        self.k8, self.sk = quant.quantize_per_token(k, smooth=quant.k_smooth_mean(k))
        self._v = {}

    def v8(self, block_n, v_scale):
        from turbo_attn_hf.kernels import quant

        key = (block_n, v_scale)
        if key not in self._v:
            fn = quant.quantize_v_blocks if v_scale == "block" else quant.quantize_v_channels
            self._v[key] = fn(self.v, block_n)
        return self._v[key]


def kernel_fn(var, ops, causal):
    """Zero-argument callable running one variant of the kernel alone on ``ops``."""
    prefill, _, _, old = _modules()
    v8t, sv = ops.v8(var["block_n"], var["v_scale"])
    args = (ops.q8, ops.sq, ops.k8, ops.sk, v8t, sv)
    Lk = ops.k.shape[2]
    if var["impl"] == "old":
        if old is None:
            return None
        return lambda: old.int8_flash_attention(*args, causal=causal, softmax=var["softmax"], Lk=Lk,
                                                out_dtype=ops.q.dtype, p_scale=var["p_scale"],
                                                _config=var["config"])
    return lambda: prefill.int8_flash_attention(*args, causal=causal, softmax=var["softmax"], Lk=Lk,
                                                out_dtype=ops.q.dtype, p_scale=var["p_scale"],
                                                block_n=var["block_n"], _config=var["config"])


def make_qkv(b, h, L, d, device, seed=0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(b, h, L, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3)]


def warm(shard, nshards):
    """Compile this shard's (variant, d, causal) kernels by running each once at L 4k."""
    import torch

    jobs = [(var, d, causal) for var in VARIANTS for d in var["dims"] for causal in (False, True)]
    mine = jobs[shard::nshards]
    t0 = time.time()
    for var, d, causal in mine:
        L = LENGTHS[0]
        q, k, v = make_qkv(TOTAL_TOKENS // L, HIDDEN // d, L, d, "cuda")
        try:
            fn = kernel_fn(var, Operands(q, k, v), causal)
            if fn is not None:
                fn()
                torch.cuda.synchronize()
            print(f"warm ok   {var['name']} d{d} {'causal' if causal else 'full'} ({time.time() - t0:.0f}s)")
        except Exception as e:  # noqa: BLE001
            print(f"warm FAIL {var['name']} d{d} causal={causal}: {type(e).__name__}: {str(e)[:300]}")
    # the quantizers and turbo_attention defaults
    for d in (64, 128, 256):
        L = LENGTHS[0]
        q, k, v = make_qkv(TOTAL_TOKENS // L, HIDDEN // d, L, d, "cuda")
        if shard == d % nshards:
            _, quant, _, _ = _modules()
            quant.quantize_v_channels(v, 64)
            quant.quantize_v_channels(v, 128)


def check(var, device, d=128, causal=True, L=1000):
    """rms-relative error of the variant vs the reference on one small shape (b1 h2 L)."""
    _, _, R, _ = _modules()
    q, k, v = make_qkv(1, 2, L, d, device, seed=1)
    ops = Operands(q, k, v)
    fn = kernel_fn(var, ops, causal)
    if fn is None:
        return None
    out = fn().float()
    v8t, sv = ops.v8(var["block_n"], var["v_scale"])
    ref = R.int8_flash_attention(ops.q8, ops.sq, ops.k8, ops.sk, v8t, sv, causal=causal, softmax=var["softmax"],
                                 Lk=L, out_dtype=q.dtype, p_scale=var["p_scale"], block_n=var["block_n"]).float()
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def run(args):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from triton.testing import do_bench

    from ..bench_common import machine_info

    prefill, _, _, _ = _modules()
    info = machine_info()
    print("machine:", json.dumps(info))
    t_start = time.time()
    dims = [int(x) for x in args.dims.split(",")]
    only = set(args.only.split(",")) if args.only else None
    variants = [v for v in VARIANTS if only is None or v["name"] in only]
    rows, checks = [], {}
    for var in variants:
        if 128 not in var["dims"] or 128 not in dims:
            continue
        try:
            checks[var["name"]] = check(var, "cuda")
        except Exception as e:  # noqa: BLE001
            checks[var["name"]] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"check d128 causal L1000 vs reference: {var['name']}: {checks[var['name']]}")

    def bench(fn):
        ms = do_bench(fn, warmup=args.warmup, rep=args.rep)
        return float(ms)

    for d in dims:
        for causal in (False, True):
            for L in LENGTHS:
                if time.time() - t_start > args.budget_s:
                    print(f"budget of {args.budget_s}s spent: stopping before d{d} causal={causal} L{L}")
                    break
                b, h = TOTAL_TOKENS // L, HIDDEN // d
                q, k, v = make_qkv(b, h, L, d, "cuda")
                ops = Operands(q, k, v)
                fl = flops(b, h, L, d, causal)
                base = {}
                for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        def fn(backend=backend):
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        base[name] = bench(fn)
                    except Exception as e:  # noqa: BLE001
                        print(f"{name} failed: {e}")
                entries = []
                for var in variants:
                    if d not in var["dims"]:
                        continue
                    try:
                        fn = kernel_fn(var, ops, causal)
                        if fn is None:
                            continue
                        entries.append(("kernel " + var["name"], bench(fn)))
                    except Exception as e:  # noqa: BLE001
                        print(f"kernel {var['name']} d{d} failed: {type(e).__name__}: {str(e)[:200]}")
                _, quant, R, _ = _modules()

                def quant_only(block_n):
                    quant.quantize_per_token(q, scale=d ** -0.5 * R.LOG2E)
                    quant.quantize_per_token(k, smooth=quant.k_smooth_mean(k))
                    quant.quantize_v_blocks(v, block_n)

                for bn in (64, 128):
                    try:
                        entries.append((f"quant only (block_n {bn})", bench(lambda bn=bn: quant_only(bn))))
                    except Exception as e:  # noqa: BLE001
                        print(f"quant failed: {type(e).__name__}: {str(e)[:200]}")
                for label, kw in (("turbo default (incl. quant)", {}),
                                  ("turbo block_n=64 (incl. quant)", dict(block_n=64))):
                    try:
                        entries.append((label, bench(lambda kw=kw: prefill.turbo_attention(q, k, v, causal=causal,
                                                                                           **kw))))
                    except Exception as e:  # noqa: BLE001
                        print(f"{label} failed: {type(e).__name__}: {str(e)[:200]}")
                entries += [(n, ms) for n, ms in base.items()]
                for name, ms in entries:
                    row = dict(d=d, causal=causal, L=L, batch=b, heads=h, provider=name, ms=ms,
                               tflops=fl / (ms * 1e-3) / 1e12)
                    if "sdpa_flash" in base:
                        row["x_flash"] = base["sdpa_flash"] / ms
                    if "sdpa_cudnn" in base:
                        row["x_cudnn"] = base["sdpa_cudnn"] / ms
                    rows.append(row)
                    print(f"d{d:<4d}{'causal' if causal else 'full':7s}L{L:<6d}{name:38s}{ms:9.3f} ms "
                          f"{row['tflops']:7.1f} TFLOP/s  x_flash {row.get('x_flash', float('nan')):5.2f}  "
                          f"x_cudnn {row.get('x_cudnn', float('nan')):5.2f}", flush=True)
                q = k = v = ops = None  # free before the next shape
                torch.cuda.empty_cache()
    print("\nsummary: kernel alone, mean TFLOP/s over L (4k/8k/16k), best first")
    for d in dims:
        for causal in (False, True):
            agg = {}
            for r in rows:
                if r["d"] == d and r["causal"] == causal:
                    agg.setdefault(r["provider"], []).append(r["tflops"])
            ranked = sorted(((sum(t) / len(t), n, len(t)) for n, t in agg.items()), reverse=True)
            print(f"d{d} {'causal' if causal else 'full'}: "
                  + " | ".join(f"{n} {m:.0f} (n{c})" for m, n, c in ranked[:8]))
    result = dict(machine=info, flops=FLOPS_FORMULA, protocol=f"{TOTAL_TOKENS} tokens, hidden {HIDDEN}, bf16",
                  checks_rms_rel_vs_reference=checks, rows=rows)
    path = args.json or os.path.join(os.environ.get("OUT", "."), "prefill_sweep.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} ({time.time() - t_start:.0f}s)")


def dry_run():
    """CPU check of the script's plumbing: one tiny interpreter call per distinct kernel option set."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    seen = set()
    for var in VARIANTS:
        key = (var["block_n"], var["p_scale"], var["v_scale"], var["softmax"], var["impl"])
        if key in seen or var["impl"] == "old":
            continue
        seen.add(key)
        err = check(dict(var, config=(32, 1, 1)), "cpu", d=64, L=150)
        print(f"dry-run {var['name']}: rms-rel vs reference {err}")
    print(f"{len(VARIANTS)} variants")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warm", help="SHARD/NSHARDS: compile a share of the variants and exit")
    p.add_argument("--dims", default="128,64,256")
    p.add_argument("--only", help="comma-separated variant names")
    p.add_argument("--budget-s", type=float, default=150.0, help="stop starting new shapes after this many s")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--json")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        dry_run()
        return 0
    if args.warm:
        shard, n = (int(x) for x in args.warm.split("/"))
        warm(shard, n)
        return 0
    try:
        run(args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
