"""Host cost of one decode step of one cache layer: ``TurboCache.update`` (1 token) + ``layer.attention``.

    python -m eval.bench_layer_step [--out DIR]

A model's decode step is bound by host work when each layer launches many small kernels (the Llama-3-8B-shaped
end-to-end run, eval/bench_e2e.py, spends ~40 ms per step of which the attention kernels are < 1 ms). Per preset
(GQA 32/8, head_dim 128; batch 1 at 8k, batch 8 at 32k): median wall time per step with a sync after it,
the host part (time until the calls return, before the sync), and the pipelined time per step (50 steps, one
sync), each with the decode-step store fused into one Triton launch (``cache.FUSED_STORE``, the default) and
with the PyTorch path. Writes ``layer_step.json`` (default eval/results/).
"""

from __future__ import annotations

import argparse
import statistics
import time

from .bench_common import machine_info, machine_line, print_table, require_cuda, write_json

HK, HQ, D = 8, 32, 128


def step_times(preset: str, b: int, T: int, fused_store: bool) -> dict:
    import torch

    from turbo_attn_hf import cache as C
    from turbo_attn_hf.cache import TurboCache

    C.FUSED_STORE = fused_store

    k = torch.randn(b, HK, T, D, device="cuda", dtype=torch.bfloat16)
    cache = TurboCache(preset)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    k1 = torch.randn(b, HK, 1, D, device="cuda", dtype=torch.bfloat16)
    step, host = [], []
    for i in range(80):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kk, vv = cache.update(k1, k1, 0)
        layer.attention(q, kk, vv)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 5:  # warm-up: compilation, allocator
            host.append(t1 - t0)
            step.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        kk, vv = cache.update(k1, k1, 0)
        layer.attention(q, kk, vv)
    torch.cuda.synchronize()
    C.FUSED_STORE = True
    return {"preset": preset, "batch": b, "context": T, "fused_store": fused_store, "step_us": statistics.median(step) * 1e6,
            "host_us": statistics.median(host) * 1e6, "pipelined_us": (time.perf_counter() - t0) / 50 * 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.bench_layer_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    require_cuda("bench_layer_step")
    info = machine_info()
    print(machine_line(info), flush=True)
    rows = [step_times(p, b, T, f) for b, T in ((1, 8192), (8, 32768)) for p in ("int8", "int4", "mixed")
            for f in (False, True)]
    print_table(rows, ["preset", "batch", "context", "fused_store", "step_us", "host_us", "pipelined_us"])
    write_json("layer_step", {"benchmark": "layer_step", "machine": info, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
