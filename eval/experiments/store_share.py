"""What the first prefill's cache store adds to a prefill (issue 19: <= 3 % at batch 1 x 32k), GPU.

Same process, same weights, same prompt, turbo_int8 attention in both:
  with_store_ms   ``model(ids, past_key_values=TurboCache(preset), logits_to_keep=1)``: every layer's first prefill
                  stores its K/V (K mean, stats, finish, store kernels) and the attention reuses the store's K mean
  attn_only_ms    ``model(ids, use_cache=False, logits_to_keep=1)``: the same INT8 prefill attention, no cache
  store_share     with_store_ms / attn_only_ms - 1
plus ``sdpa_ms`` (sdpa, no cache) for scale. Median of ``--reps`` runs each after one warm-up, the configs taken in
turn within each rep (drift hits all alike), CUDA synchronised around each forward.

    python -m eval.experiments.store_share [--layers 8] [--context 32768] [--reps 5] [--presets int8,int4,mixed]
    TRITON_INTERPRET=1 python -m eval.experiments.store_share --dry-run   # CPU: a toy model, checks the set-up
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv=None) -> None:
    import torch

    from eval.bench_common import machine_info
    from eval.bench_e2e import LLAMA3_8B, TOY, build_model, set_impl
    from turbo_attn_hf import TurboCache

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--presets", default="int8,int4,mixed")
    ap.add_argument("--out", default="eval/results/store_share.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU toy model (2 layers, 256 tokens, 1 rep)")
    a = ap.parse_args(argv)
    dev = "cpu" if a.dry_run else "cuda"
    if a.dry_run:
        a.layers, a.context, a.reps = 2, 256, 1
    model = build_model(a.layers, TOY if a.dry_run else LLAMA3_8B, dev, torch.bfloat16)
    g = torch.Generator().manual_seed(a.context)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.context), generator=g).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def timed(impl: str, store: bool) -> float:
        set_impl(model, impl)
        kw = dict(past_key_values=TurboCache(impl, config=model.config), use_cache=True) if store else \
            dict(use_cache=False)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, logits_to_keep=1, **kw)
        sync()
        return (time.perf_counter() - t0) * 1e3

    configs = [("sdpa", False)] + [(p, s) for p in a.presets.split(",") for s in (True, False)]
    times = {c: [] for c in configs}
    for c in configs:
        timed(*c)  # warm-up: compiles
    for _ in range(a.reps):
        for c in configs:
            times[c].append(timed(*c))
    rows = []
    sdpa = statistics.median(times[("sdpa", False)])
    for p in a.presets.split(","):
        ws, ao = statistics.median(times[(p, True)]), statistics.median(times[(p, False)])
        rows.append(dict(preset=p, with_store_ms=ws, attn_only_ms=ao, store_share=ws / ao - 1, sdpa_ms=sdpa,
                         with_store_runs=times[(p, True)], attn_only_runs=times[(p, False)]))
        print(f"{p}: with store {ws:.2f} ms, attention only {ao:.2f} ms, store share {100 * (ws / ao - 1):+.2f} % "
              f"(sdpa {sdpa:.2f} ms)", flush=True)
    out = dict(benchmark="store_share", machine=machine_info(), args=vars(a), formulas=__doc__.split("\n\n")[1],
               sdpa_runs=times[("sdpa", False)], rows=rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
