"""One decode step of generate(cache_implementation="static") compiled, from torch.profiler traces of generate(65)
and generate(1) after the warm-up: step wall vs GPU busy, cudaGraphLaunch host time, kernel us per step (GPU).

    python -m eval.experiments.static_step_trace LAYERS PRESETS OUT.json      # e.g. 8 int4,mixed x.json"""
import sys, json, os, tempfile, time, torch
from collections import Counter
from torch.profiler import profile, ProfilerActivity
from eval.bench_e2e import build_model, LLAMA3_8B, set_impl
from eval.bench_generate import reset_compile, reset_static_len, generate_timed
L = int(sys.argv[1]); model = build_model(L, LLAMA3_8B, "cuda", torch.bfloat16)
g = model.generation_config; g.eos_token_id = g.pad_token_id = g.cache_implementation = None
ids = torch.randint(0, model.config.vocab_size, (1, 1024), device="cuda"); mask = torch.ones_like(ids)
N = 64; res = {}
for impl in sys.argv[2].split(","):
    set_impl(model, impl.split("@")[0]); reset_static_len(model); reset_compile(model)
    spec = {"impl": impl.split("@")[0], "static": True, "compile": True}
    for n in (1 + N, 1 + N, 1): generate_timed(model, ids, mask, spec, n)
    out = {}
    for n in (1, 1 + N):
        with tempfile.TemporaryDirectory() as tmp:
            p = os.path.join(tmp, "t.json")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                dt, _ = generate_timed(model, ids, mask, spec, n)
            prof.export_chrome_trace(p)
            ev = [e for e in json.load(open(p))["traceEvents"] if e.get("ph") == "X"]
        ks = sorted((float(e["ts"]), float(e["dur"]), e["name"][:60]) for e in ev if e.get("cat") == "kernel")
        ms = Counter(); cnt = Counter()
        for s, d, nm in ks: ms[nm] += d / 1e3; cnt[nm] += 1
        glaunch = [float(e["dur"]) for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in e["name"]]
        out[n] = dict(wall=dt * 1e3, ms=ms, cnt=cnt, gl=glaunch, busy=sum(d for _, d, _ in ks) / 1e3)
    a, b = out[1], out[1 + N]
    per = {k: (b["ms"][k] - a["ms"].get(k, 0)) / N for k in b["ms"]}
    per_n = {k: (b["cnt"][k] - a["cnt"].get(k, 0)) / N for k in b["cnt"]}
    row = dict(step_wall_ms=(b["wall"] - a["wall"]) / N, step_gpu_ms=(b["busy"] - a["busy"]) / N,
               graph_launch_us_med=sorted(b["gl"])[len(b["gl"]) // 2] if b["gl"] else None, n_graph_launch=len(b["gl"]),
               kernels={k: [round(v * 1e3, 2), per_n[k]] for k, v in sorted(per.items(), key=lambda x: -x[1]) if v > 0.0005})
    res[impl] = row
    print(impl, "step wall %.3f gpu %.3f ms, graph launch %s us x%d" % (row["step_wall_ms"], row["step_gpu_ms"], row["graph_launch_us_med"], row["n_graph_launch"]), flush=True)
    for k, v in list(row["kernels"].items())[:14]: print("    %8.2f us x%.2f  %s" % (v[0], v[1], k))
    reset_compile(model)
json.dump(res, open(sys.argv[3], "w"), indent=1)
