"""Where an eager generate() step's wall time goes, per config (issue 18's eager bar): Llama-3-8B shape, L layers,
plain generate() with DynamicCache / the dynamic TurboCache, one shape, every config in one process.

    python -m eval.experiments.eager_step_probe LAYERS BxT N OUT.json [CONFIGS] [--tiny]   # 8 1x4k 64 x.json

Per config, after a warm-up generate(1 + N):
  steps        each decode step's wall ms (a StoppingCriteria clock, CUDA synchronised), gc on and gc off
  gc           collections per generation during one generate(1 + N)
  cprofile     own-time top of one generate(1 + N) (the host's Python), and the time in CUDA-waiting calls
  cuda_api     torch.profiler over one generate(1 + N): per step, the CUDA runtime calls' count and host us
               (launches, mallocs, synchronisations, copies) and the GPU kernels' busy us
``--tiny``: a 2-layer toy model on CPU (turbo: the PyTorch reference), to check the script."""
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
from collections import defaultdict

import torch

from eval.bench_e2e import LLAMA3_8B, TOY, build_model, set_impl
from eval.bench_generate import generate_timed, parse_shapes, step_times

_WAITS = ("synchronize", "item", "tolist", "_local_scalar_dense", "cpu", "__bool__", "nonzero")


def _steps(model, ids, mask, spec, n, gc_off: bool) -> dict:
    if gc_off:
        gc.collect()
        gc.disable()
    try:
        st = step_times(model, ids, mask, spec, n)
    finally:
        gc.enable()
    s = sorted(st["step_ms"])
    return dict(med=round(statistics.median(s), 3), p10=s[len(s) // 10], p90=s[len(s) * 9 // 10], max=s[-1],
                max_at=st["step_ms_max_at"], first=st["step_ms"][:4], all=st["step_ms"])


def _gc_counts(model, ids, mask, spec, n) -> dict:
    counts = defaultdict(int)
    ms = defaultdict(float)
    t0 = {}
    import time

    def cb(phase, info):
        if phase == "start":
            t0["t"] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            ms[info["generation"]] += (time.perf_counter() - t0["t"]) * 1e3

    gc.callbacks.append(cb)
    try:
        generate_timed(model, ids, mask, spec, 1 + n)
    finally:
        gc.callbacks.remove(cb)
    return {f"gen{g}": [counts[g], round(ms[g], 2)] for g in sorted(counts)}


def _cprofile(model, ids, mask, spec, n, top=22) -> dict:
    pr = cProfile.Profile()
    pr.enable()
    generate_timed(model, ids, mask, spec, 1 + n)
    pr.disable()
    stats = pstats.Stats(pr).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in stats.values())
    wait = sum(v[2] for (p, l, name), v in stats.items() if any(w in name for w in _WAITS))
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
    return dict(total_ms=round(total * 1e3, 1), wait_ms=round(wait * 1e3, 1),
                top=[f"{v[2] / n * 1e3:7.3f} ms/step {v[1] / n:7.1f} calls/step {p.split('/')[-1]}:{l}({name})"
                     for (p, l, name), v in rows], cumulative=s.getvalue().splitlines()[:70])


def _cuda_api(model, ids, mask, spec, n) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate_timed(model, ids, mask, spec, 1 + n)
    api = defaultdict(lambda: [0, 0.0])
    kern = [0, 0.0]
    for e in prof.events():
        name = e.name
        if name.startswith("cuda") or name.startswith("cu"):
            if e.device_type == torch.autograd.DeviceType.CPU:
                api[name][0] += 1
                api[name][1] += e.cpu_time_total
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern[0] += 1
            kern[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    out = {k: [round(c / n, 1), round(us / n, 1)] for k, (c, us) in sorted(api.items(), key=lambda kv: -kv[1][1])}
    return dict(per_step_calls_us=out, gpu_kernels_per_step=[round(kern[0] / n, 1), round(kern[1] / n, 1)])


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tiny = "--tiny" in sys.argv
    L, shapes, N, out = int(args[0]), parse_shapes(args[1]), int(args[2]), args[3]
    cfgs = args[4].split(",") if len(args) > 4 else ["sdpa", "int8", "int4", "mixed"]
    dev = "cpu" if tiny else "cuda"
    shape = TOY if tiny else LLAMA3_8B
    model = build_model(L, shape, dev, torch.bfloat16)
    g = model.generation_config
    g.eos_token_id = g.pad_token_id = g.cache_implementation = None
    spec = {"static": False, "compile": False}
    res = {"machine": torch.cuda.get_device_name() if not tiny else "cpu", "layers": L, "new_tokens": N,
           "torch": torch.__version__, "rows": {}}
    b, T = shapes[0]
    ids = torch.randint(0, model.config.vocab_size, (b, T), device=dev)
    mask = torch.ones_like(ids)
    for c in cfgs:
        set_impl(model, c)
        generate_timed(model, ids, mask, dict(spec, impl=c), 1 + N)
        generate_timed(model, ids, mask, dict(spec, impl=c), 1 + N)
    for c in cfgs:
        set_impl(model, c)
        sp = dict(spec, impl=c)
        generate_timed(model, ids, mask, sp, 1 + N)
        row = dict(steps_gc_on=_steps(model, ids, mask, sp, N, False), steps_gc_off=_steps(model, ids, mask, sp, N, True),
                   gc=_gc_counts(model, ids, mask, sp, N))
        row["steps_gc_on2"] = _steps(model, ids, mask, sp, N, False)
        row["cprofile"] = _cprofile(model, ids, mask, sp, N)
        if not tiny:
            row["cuda_api"] = _cuda_api(model, ids, mask, sp, N)
        res["rows"][c] = row
        print(f"== {c}: step med gc on {row['steps_gc_on']['med']} / {row['steps_gc_on2']['med']} "
              f"(p90 {row['steps_gc_on']['p90']}, max {row['steps_gc_on']['max']} at {row['steps_gc_on']['max_at']}) "
              f"| gc off {row['steps_gc_off']['med']} (p90 {row['steps_gc_off']['p90']}) | gc {row['gc']} | "
              f"cprofile total {row['cprofile']['total_ms']} ms wait {row['cprofile']['wait_ms']} ms", flush=True)
        print("\n".join(row["cprofile"]["top"]), flush=True)
        if "cuda_api" in row:
            print("cuda api per step:", json.dumps(row["cuda_api"]), flush=True)
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
