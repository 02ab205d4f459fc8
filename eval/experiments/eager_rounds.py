"""Issue 18's eager bar (turbo_<preset>_eager decode ms/step <= sdpa_dynamic's), measured so that a host's drift
cannot decide it: Llama-3-8B shape, L layers, plain generate() (DynamicCache / the dynamic TurboCache), every config
of a shape in one process, in alternating rounds.

    python -m eval.experiments.eager_rounds LAYERS SHAPES ROUNDS N OUT.json [CONFIGS]   # 32 1x1k,1x4k 5 64 x.json

A config ``<preset>-store`` runs the preset with ``cache.DEFER_DECODE_STORE`` off (the decode step's store in its own
launch, as before session 22): the A/B of the deferred store in the same rounds.

Per round and config: t(1) = generate(max_new_tokens=1), then t(1 + N); the step is (t(1 + N) - t(1)) / N of that
pair (bench_generate's formula, paired within a round). Reported: median and min of the rounds' steps per config,
and per round the ratio to sdpa's step of the same round (its median: the bar's reading under drift)."""
import json
import statistics
import sys

import torch

from eval.bench_e2e import LLAMA3_8B, build_model
from eval.bench_e2e import set_impl as _set_impl
from eval.bench_generate import generate_timed, parse_shapes, shape_name


def set_impl(model, c: str) -> None:
    from turbo_attn_hf import cache

    cache.DEFER_DECODE_STORE = not c.endswith("-store")
    _set_impl(model, c.removesuffix("-store"))


def main() -> None:
    L, shapes, R, N, out = int(sys.argv[1]), parse_shapes(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    cfgs = sys.argv[6].split(",") if len(sys.argv) > 6 else ["sdpa", "int8", "int4", "mixed"]
    model = build_model(L, LLAMA3_8B, "cuda", torch.bfloat16)
    g = model.generation_config
    g.eos_token_id = g.pad_token_id = g.cache_implementation = None
    spec = {"static": False, "compile": False}
    res = {"machine": torch.cuda.get_device_name(), "layers": L, "rounds": R, "new_tokens": N, "rows": {}}
    for b, T in shapes:
        ids = torch.randint(0, model.config.vocab_size, (b, T), device="cuda")
        mask = torch.ones_like(ids)
        for c in cfgs:  # warm-up: compiles, plans, allocator pools
            set_impl(model, c)
            generate_timed(model, ids, mask, dict(spec, impl=c), 1 + N)
        steps = {c: [] for c in cfgs}
        ttft = {c: [] for c in cfgs}
        for _ in range(R):
            for c in cfgs:
                set_impl(model, c)
                generate_timed(model, ids, mask, dict(spec, impl=c), 1)  # absorbs the settings change
                t1 = generate_timed(model, ids, mask, dict(spec, impl=c), 1)[0]
                tn = generate_timed(model, ids, mask, dict(spec, impl=c), 1 + N)[0]
                steps[c].append((tn - t1) / N * 1e3)
                ttft[c].append(t1 * 1e3)
        row = {}
        for c in cfgs:
            ratio = [s / b0 for s, b0 in zip(steps[c], steps[cfgs[0]])]
            row[c] = dict(step_med=round(statistics.median(steps[c]), 3), step_min=round(min(steps[c]), 3),
                          steps=[round(x, 3) for x in steps[c]], ratio_med=round(statistics.median(ratio), 3),
                          ratios=[round(x, 3) for x in ratio], ttft_med=round(statistics.median(ttft[c]), 2))
            print(f"{shape_name(b, T)} {c:6s} step med {row[c]['step_med']:7.3f} min {row[c]['step_min']:7.3f} ms | "
                  f"x {cfgs[0]} per round: med {row[c]['ratio_med']:.3f} {row[c]['ratios']} | ttft med "
                  f"{row[c]['ttft_med']:.1f}", flush=True)
        res["rows"][shape_name(b, T)] = row
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
