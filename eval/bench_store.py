"""Time to first token, the cache side: one layer's first-prefill store, fused (kernels/store.py) vs PyTorch path.

    python -m eval.bench_store [--out DIR] [--reps N]      # GPU: writes bench_store_<gpu>.json (< 90 s on an H100)
    python -m eval.bench_store --dry-run [--out DIR]       # CPU (Triton interpreter): tiny shapes, launch counts

Per preset (int8 / int4 / mixed), batch (1, 4) and prompt length (1k, 4k, 32k), GQA 8 KV heads, head_dim 128,
bf16 K/V in HF's transposed layout: ``TurboCache(preset).update(k, v, 0)`` on a fresh cache (the first prefill's
store: scales, head choice, INT8 buffer, packed blocks), with ``cache.FUSED_STORE`` True (the fused store) and
False (the PyTorch path it replaced). Columns: median ms with a sync after each store (``store_ms``), the host
part (time until the call returns, ``host_ms``), kernel launches per layer counted by ``torch.profiler``'s CUDA
activity (``gpu_kernels``, memcpys apart), and the launches counted on the host by instrumentation
(``count_launches``: Triton launches, torch ops that launch kernels, host syncs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager

#: torch ops that launch no kernel (views, metadata, allocation): left out of the torch-launch count
_NO_KERNEL = {
    "view", "_unsafe_view", "expand", "slice", "select", "transpose", "t", "permute", "unsqueeze", "squeeze",
    "as_strided", "alias", "detach", "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like",
    "reshape", "_reshape_alias", "lift_fresh", "unbind", "split", "chunk", "narrow", "diagonal", "view_as",
    "_local_scalar_dense", "is_same_size", "set_", "resize_", "detach_", "numpy_T", "split_with_sizes",
}
_SYNC = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2"}


@contextmanager
def _counting():
    """Count Triton launches (JIT, interpreter and ``LeanLaunch``) and kernel-launching torch ops inside."""
    import triton
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from turbo_attn_hf.kernels import launch as L

    counts = {"triton": 0, "torch": 0, "syncs": 0, "ops": {}}
    depth = [0]

    def wrap(run):
        def counted(*a, **kw):
            if depth[0] == 0:
                counts["triton"] += 1
            depth[0] += 1
            try:
                with _disable_current_modes():  # the interpreter's own tensor copies are no launches
                    return run(*a, **kw)
            finally:
                depth[0] -= 1
        return counted

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in _SYNC:
                counts["syncs"] += 1
            if name not in _NO_KERNEL:
                counts["torch"] += 1
                counts["ops"][name] = counts["ops"].get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    # LeanLaunch.relaunch and .fire too: launch_memo's hits and the decode launcher's go straight to them
    patched = [(L.LeanLaunch, "launch"), (L.LeanLaunch, "relaunch"), (L.LeanLaunch, "fire"),
               (triton.runtime.jit.JITFunction, "run")]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        patched.append((InterpretedFunction, "run"))
    except ImportError:  # pragma: no cover
        pass
    saved = [(cls, name, cls.__dict__[name]) for cls, name in patched]  # raw: a staticmethod stays one
    for cls, name, fn in saved:
        setattr(cls, name, staticmethod(wrap(fn.__func__)) if isinstance(fn, staticmethod) else wrap(fn))
    try:
        with Ops():
            yield counts
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    counts["total"] = counts["triton"] + counts["torch"]


def count_launches(fn) -> dict:
    """``{"triton", "torch", "syncs", "total", "ops"}`` for one call of ``fn`` (host-side instrumentation: the
    count is the same on the CPU interpreter as on the GPU)."""
    with _counting() as c:
        fn()
    return c


def _inputs(b, T, hk, d, device, dtype, seed=0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(b, T, hk, d, generator=g, device=device, dtype=dtype).transpose(1, 2)
    v = torch.randn(b, T, hk, d, generator=g, device=device, dtype=dtype).transpose(1, 2)
    return k, v


def _cfg(preset, block=None):
    from turbo_attn_hf.config import TurboConfig

    cfg = TurboConfig.preset(preset)
    if block:
        d = cfg.to_dict()
        d["block_size"] = block
        cfg = TurboConfig.from_dict(d)
    return cfg


def measure(preset, b, T, fused, *, hk=8, d=128, reps=10, device="cuda", block=None) -> dict:
    import torch

    from turbo_attn_hf import cache as C
    from turbo_attn_hf.cache import TurboCache

    cfg = _cfg(preset, block)
    k, v = _inputs(b, T, hk, d, device, torch.bfloat16 if device == "cuda" else torch.float32)
    old = C.FUSED_STORE
    C.FUSED_STORE = fused
    try:
        store = lambda: TurboCache(cfg).update(k, v, 0)  # noqa: E731
        store()  # compile / warm the allocator
        cnt = count_launches(store)
        row = {"preset": preset, "batch": b, "tokens": T, "fused": fused, "triton_launches": cnt["triton"],
               "torch_launches": cnt["torch"], "host_syncs": cnt["syncs"], "launches": cnt["total"]}
        if device != "cuda":
            return row
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            store()
            torch.cuda.synchronize()
        kinds = [e for e in prof.events() if e.device_type.name == "CUDA"]
        row["gpu_kernels"] = sum(1 for e in kinds if "memcpy" not in e.name.lower() and "memset" not in e.name.lower())
        row["gpu_memcpys"] = len(kinds) - row["gpu_kernels"]
        wall, host = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            store()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - t0)
            host.append(t1 - t0)
        row.update(store_ms=statistics.median(wall) * 1e3, host_ms=statistics.median(host) * 1e3)
        return row
    finally:
        C.FUSED_STORE = old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.bench_store", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="result folder (default eval/results/)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .bench_common import machine_info, machine_line, print_table, require_cuda, write_json

    if not args.dry_run:
        require_cuda("bench_store")
    info = machine_info()
    print(machine_line(info), flush=True)
    if args.dry_run:
        grid = [(p, b, T) for p in ("int8", "int4", "mixed") for b in (1, 2) for T in (40, 150)]
        rows = [measure(p, b, T, f, hk=4, d=32, device="cpu", block=16) for p, b, T in grid for f in (False, True)]
        name = "bench_store_dryrun"
    else:
        grid = [(p, b, T) for T in (1024, 4096, 32768) for b in (1, 4) for p in ("int8", "int4", "mixed")]
        rows = [measure(p, b, T, f, reps=args.reps) for p, b, T in grid for f in (False, True)]
        gpu = info.get("device", "gpu").lower()
        name = "bench_store_" + ("h100" if "h100" in gpu else "h200" if "h200" in gpu else "gpu")
    cols = ["preset", "batch", "tokens", "fused", "launches", "triton_launches", "torch_launches", "host_syncs"]
    if not args.dry_run:
        cols += ["gpu_kernels", "gpu_memcpys", "store_ms", "host_ms"]
    print_table(rows, cols)
    path = write_json(name, {"benchmark": "bench_store", "machine": info, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
