"""Host time of HF's compiled decode call (inductor + CUDA graphs), sdpa StaticCache vs static TurboCache, per layer count, 1 x 1k:
median wall of model._compiled_call per step (no sync: the host part), and the step (N 128, 3 reps). `python -m eval.experiments.host_compiled_call 8,16,32 OUT.json`."""
import sys, time, statistics, json, torch
from eval.bench_e2e import build_model, LLAMA3_8B, set_impl
from eval.bench_generate import generate_timed, reset_compile, reset_static_len
res = {}
for L in [int(x) for x in sys.argv[1].split(",")]:
    model = build_model(L, LLAMA3_8B, "cuda", torch.bfloat16)
    g = model.generation_config; g.eos_token_id = g.pad_token_id = g.cache_implementation = None
    ids = torch.randint(0, model.config.vocab_size, (1, 1024), device="cuda"); mask = torch.ones_like(ids)
    host = []
    orig = model.get_compiled_call
    def gcc(cfg, _orig=orig):
        f = _orig(cfg)
        def timed(*a, **k):
            t0 = time.perf_counter(); out = f(*a, **k); host.append(time.perf_counter() - t0); return out
        return timed
    model.get_compiled_call = gcc
    for impl in ("sdpa", "int4"):
        set_impl(model, impl); reset_static_len(model); reset_compile(model)
        spec = {"impl": impl, "static": True, "compile": True}
        for n in (129, 129, 1):
            generate_timed(model, ids, mask, spec, n)
        host.clear(); t1, tn = [], []
        for _ in range(3):
            t1.append(generate_timed(model, ids, mask, spec, 1)[0]); tn.append(generate_timed(model, ids, mask, spec, 129)[0])
        step = (statistics.median(tn) - statistics.median(t1)) / 128 * 1e3
        h = statistics.median(host) * 1e3
        res[f"{impl}_L{L}"] = dict(step_ms=step, host_call_ms=h, host_p90=sorted(host)[int(0.9 * len(host))] * 1e3)
        print(f"L{L} {impl}: step {step:.3f} ms, compiled call host {h:.3f} ms (p90 {res[f'{impl}_L{L}']['host_p90']:.3f})", flush=True)
        reset_compile(model)
    del model; torch.cuda.empty_cache()
json.dump(res, open(sys.argv[2], "w"), indent=1)
