"""Does a real eager ``generate()`` take ``_DecodeStatic.run_step``'s replay on the GPU, and how do the steps compare?

    python -m eval.experiments.replay_probe LAYERS SHAPES ROUNDS [OUT.json]    # 8 4x8k,1x32k 5

Per shape (batch x context), on the Llama-3-8B shape with L layers and random bf16 weights:
  counts   per preset (int8, int4, mixed), one generate(1 + 33) after a warm-up: run_step's replays and declines
           and ``_DecodeStatic.run``'s calls (a decline falls back to ``run``: the first step of a layer, a pack)
  rounds   sdpa + DynamicCache and the three presets take turns; decode ms/step = (t(1 + 33) - t(1)) / 32 per round,
           and the median of the per-round ratios to sdpa's
The counts are what session 31's CPU tests could not show: that the replay holds on CUDA tensors in HF's own step."""
from __future__ import annotations

import collections
import json
import statistics
import sys
import time

import torch

from eval.bench_common import machine_info
from eval.bench_e2e import LLAMA3_8B, build_model, set_impl
from turbo_attn_hf.kernels import decode as D

PRESETS = ("int8", "int4", "mixed")


def _counting() -> collections.Counter:
    """Wrap run_step / run so every call is counted (replay, decline, run)."""
    cnt = collections.Counter()
    run_step, run = D._DecodeStatic.run_step, D._DecodeStatic.run

    def counted_step(self, *a, **k):
        out = run_step(self, *a, **k)
        cnt["replay" if out is not None else "decline"] += 1
        return out

    def counted_run(self, *a, **k):
        cnt["run"] += 1
        return run(self, *a, **k)

    D._DecodeStatic.run_step, D._DecodeStatic.run = counted_step, counted_run
    return cnt


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    layers, shapes, rounds = int(argv[0]), argv[1].split(","), int(argv[2])
    out_path = argv[3] if len(argv) > 3 else None
    cnt = _counting()
    model = build_model(layers, LLAMA3_8B, "cuda", torch.bfloat16)

    def gen(ids, n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    res = {"machine": machine_info(), "layers": layers, "counts": {}, "step_ms_per_round": {}, "paired_vs_sdpa": {}}
    for sh in shapes:
        b, t = sh.split("x")
        ids = torch.randint(0, 128000, (int(b), int(t.rstrip("k")) * 1024), device="cuda")
        res["counts"][sh] = {}
        for p in PRESETS:
            set_impl(model, p)
            gen(ids, 2)
            cnt.clear()
            gen(ids, 33)
            res["counts"][sh][p] = dict(cnt)
            print(f"[{sh} {p}] {dict(cnt)}", flush=True)
        per = collections.defaultdict(list)
        for _ in range(rounds):
            for c in ("sdpa",) + PRESETS:
                set_impl(model, c)
                t1 = gen(ids, 1)
                per[c].append((gen(ids, 33) - t1) / 32 * 1e3)
        res["step_ms_per_round"][sh] = dict(per)
        res["paired_vs_sdpa"][sh] = {
            c: statistics.median(a / s for a, s in zip(per[c], per["sdpa"])) for c in PRESETS}
        print(f"[{sh}] paired vs sdpa {res['paired_vs_sdpa'][sh]}", flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
