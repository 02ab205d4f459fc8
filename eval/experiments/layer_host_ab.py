"""Host time of one layer's first prefill (cache update + attention), turbo presets against sdpa, interleaved.

The GPU machine's host drifts 20-40 % between processes and within one (eval/PERF_NOTES.md, sessions 15-17), so
separate loops per config (``host_step``) cannot resolve a 20 us change a layer. Here every iteration runs one layer
call of each config back to back on the same tensors — sdpa + DynamicCache, then each turbo preset with a fresh
TurboCache — and the GPU is drained between iterations (never inside a timed call), so all configs see the same host
state; reported per config: the median and the min of its calls, and the median of its per-iteration difference to
sdpa's call.

    python -m eval.experiments.layer_host_ab --device cuda --iters 400 --context 1024 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from eval.experiments.host_step import _Attn, _model_config


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="int8,int4,mixed")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hk,head_dim (Llama-3-8B)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill-attention", default="", help="the presets' prefill_attention (default: auto)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from transformers import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from turbo_attn_hf.attention import turbo_attention_forward
    from turbo_attn_hf.cache import TurboCache
    from turbo_attn_hf.config import TurboConfig

    hq, hk, d = map(int, a.heads.split(","))
    cfg = _model_config(1, hq, hk, d)
    mod = _Attn(cfg, 0)
    g = torch.Generator().manual_seed(0)
    b, T = a.batch, a.context
    q, k, v = (torch.randn(b, h, T, d, generator=g).to(torch.bfloat16).to(a.device) for h in (hq, hk, hk))
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    configs = {"sdpa": None}
    for p in a.presets.split(","):
        tc = TurboConfig.preset(p)
        if a.prefill_attention:
            tc = dataclasses.replace(tc, prefill_attention=a.prefill_attention)
        configs[p] = tc

    def call(tc) -> float:
        if tc is None:
            cache, fn = DynamicCache(), sdpa_attention_forward
        else:
            cache, fn = TurboCache(tc, config=cfg), turbo_attention_forward
        t0 = time.perf_counter()
        kk, vv = cache.update(k, v, 0)
        fn(mod, q, kk, vv, None, scaling=d ** -0.5, dropout=0.0)
        return (time.perf_counter() - t0) * 1e6

    for _ in range(20):  # compile, plans, workspaces
        for tc in configs.values():
            call(tc)
    sync()
    times = {name: [] for name in configs}
    for _ in range(a.iters):
        for name, tc in configs.items():
            times[name].append(call(tc))
            sync()
    rows = []
    for name, ts in times.items():
        diff = [t - s for t, s in zip(ts, times["sdpa"])]
        rows.append(dict(config=name, median_us=round(statistics.median(ts), 1), min_us=round(min(ts), 1),
                         minus_sdpa_median_us=round(statistics.median(diff), 1)))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
        with open(a.json, "w") as f:
            json.dump(dict(machine=dev, batch=b, context=T, heads=a.heads, iters=a.iters, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
