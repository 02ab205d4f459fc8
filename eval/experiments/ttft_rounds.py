"""TTFT diagnosis (issue 19): Llama-3-8B shape, L layers, 1 x T, plain generate(max_new_tokens=1) (GPU).

    python -m eval.experiments.ttft_rounds LAYERS T1,T2 ROUNDS OUT.json [CONFIGS]   # e.g. 32 1024,4096 7 x.json
CONFIGS: sdpa,int8,int4,mixed (default); a suffix ``@int8`` / ``@exact`` sets the preset's ``prefill_attention``
(session 16), ``@perlayer`` launches each layer's first store at once instead of batching a forward's (session 20),
in the same process (session 15's ``@8``, the stats pass's old fixed chunks, and ``@alloc``, a
reverted scratch reuse: trees ba483a5 and 3f56f35). ``TTFT_STATIC=1``: the static cache
(``cache_implementation="static"``, the compiled path's prefill; one token, so nothing is compiled), no forward-only
timing. ``TTFT_GC=off``: the garbage collector frozen and disabled after the model is built.
Per shape: R rounds, each round one generate(1) per config in turn (alternating, same process); then a
torch.profiler trace of one generate(1) per config: wall, GPU kernel sum, GPU busy (union), idle gaps inside the
first forward, launches, top kernels; and the forward alone (model(ids, past_key_values=fresh cache)).
``TTFT_HEAD_DIM=256``: the same hidden size in heads of 256 (16 query / 4 KV heads; issue 20's head_dim 256 path)."""
import json, statistics, sys, time, os, tempfile
import torch
from eval.bench_e2e import build_model, LLAMA3_8B, set_impl, new_cache
from turbo_attn_hf import TurboCache
from eval.bench_generate import generate_timed
L = int(sys.argv[1]); shapes = [int(x) for x in sys.argv[2].split(",")]; R = int(sys.argv[3]); out = sys.argv[4]
STATIC = os.environ.get("TTFT_STATIC") == "1"
cfgs = sys.argv[5].split(",") if len(sys.argv) > 5 else ["sdpa", "int8", "int4", "mixed"]
import dataclasses
from turbo_attn_hf import TurboConfig
from eval.bench_e2e import first_stores_per_layer
def use(c):
    name, _, path = first_stores_per_layer(c).partition("@")  # ``@perlayer``: session 20's A/B
    if name == "sdpa" or not path:
        set_impl(model, name)
    else:
        set_impl(model, dataclasses.replace(TurboConfig.preset(name), prefill_attention=path))
HD = int(os.environ.get("TTFT_HEAD_DIM", "128"))
model = build_model(L, dict(LLAMA3_8B, head_dim=HD, num_attention_heads=4096 // HD, num_key_value_heads=1024 // HD),
                    "cuda", torch.bfloat16)
if os.environ.get("TTFT_GC") == "off":  # session 20: is the host's slow mode the garbage collector?
    import gc
    gc.collect(); gc.freeze(); gc.disable()
g = model.generation_config; g.eos_token_id = g.pad_token_id = g.cache_implementation = None
res = {}
def sync(): torch.cuda.synchronize()
def fwd(impl, ids):
    c = None if impl == "sdpa" else TurboCache(config=model.config)  # the model's TurboConfig (``use``)
    c = c or new_cache(model, "sdpa")
    sync(); t0 = time.perf_counter()
    with torch.no_grad():
        model(ids, past_key_values=c, logits_to_keep=1, use_cache=True)
    sync(); return time.perf_counter() - t0
def trace(impl, ids, mask, spec):
    from torch.profiler import profile, ProfilerActivity
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "t.json")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            dt, _ = generate_timed(model, ids, mask, spec, 1)
        prof.export_chrome_trace(p)
        ev = [e for e in json.load(open(p))["traceEvents"] if e.get("ph") == "X"]
    ks = sorted([(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in ev if e.get("cat") == "kernel"])
    busy = 0.0; cur_s = cur_e = None; gaps = []
    for s, e, _ in ks:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s; gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None: busy += cur_e - cur_s
    from collections import Counter
    ms = Counter(); n = Counter()
    for s, e, name in ks: ms[name[:70]] += (e - s) / 1e3; n[name[:70]] += 1
    launches = sum(1 for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in e["name"])
    allocs = sum(1 for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and ("Malloc" in e["name"] or "MemAlloc" in e["name"]))
    syncs = [(e["name"], float(e["dur"]) / 1e3) for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and "ynchron" in e["name"]]
    span = (ks[-1][1] - ks[0][0]) / 1e3 if ks else 0
    big_gaps = sorted(gaps, reverse=True)[:8]
    return dict(wall_ms=dt * 1e3, kernels=len(ks), gpu_sum_ms=sum(ms.values()), gpu_busy_ms=busy / 1e3, gpu_span_ms=span,
                idle_in_span_ms=span - busy / 1e3, biggest_gaps_us=[round(x, 1) for x in big_gaps], launches=launches,
                mallocs=allocs, syncs=syncs[:10],
                top=[(k, round(v, 3), n[k]) for k, v in ms.most_common(14)])
for T in shapes:
    ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda"); mask = torch.ones_like(ids)
    times = {c: [] for c in cfgs}; ftimes = {c: [] for c in cfgs}
    for c in cfgs:
        use(c)
        for _ in range(3): generate_timed(model, ids, mask, {"impl": c.split("@")[0], "static": STATIC, "compile": False}, 1)
    for r in range(R):
        for c in cfgs:
            use(c)
            spec = {"impl": c.split("@")[0], "static": STATIC, "compile": False}
            if STATIC:  # the model keeps one static TurboCache: the call before this one makes it this preset's
                generate_timed(model, ids, mask, spec, 1)
            times[c].append(generate_timed(model, ids, mask, spec, 1)[0] * 1e3)
        for c in cfgs:
            use(c); ftimes[c].append(times[c][-1] if STATIC else fwd(c, ids) * 1e3)
    row = {}
    for c in cfgs:
        row[c] = dict(ttft_med=statistics.median(times[c]), ttft_min=min(times[c]), ttft_all=[round(x, 2) for x in times[c]],
                      fwd_med=statistics.median(ftimes[c]), fwd_min=min(ftimes[c]))
        if "sdpa" in times:  # each round's ratio to sdpa's call of the same round: pairs away the host's drift
            row[c]["ttft_paired_med"] = statistics.median(a / b for a, b in zip(times[c], times["sdpa"]))
    for c in cfgs:
        s = row["sdpa"]
        print(f"T={T} {c:6s} ttft med {row[c]['ttft_med']:7.2f} ({row[c]['ttft_med']/s['ttft_med']:.3f}x) min {row[c]['ttft_min']:7.2f} "
              f"({row[c]['ttft_min']/s['ttft_min']:.3f}x) | fwd med {row[c]['fwd_med']:7.2f} ({row[c]['fwd_med']/s['fwd_med']:.3f}x) "
              f"min {row[c]['fwd_min']:7.2f} | paired {row[c].get('ttft_paired_med', 1.0):.3f}x  all {row[c]['ttft_all']}",
              flush=True)
    for c in cfgs:
        use(c)
        tr = trace(c, ids, mask, {"impl": c.split("@")[0], "static": STATIC, "compile": False})
        row[c]["trace"] = tr
        print(f"  trace {c}: wall {tr['wall_ms']:.2f} kernels {tr['kernels']} launches {tr['launches']} gpu_sum {tr['gpu_sum_ms']:.2f} "
              f"busy {tr['gpu_busy_ms']:.2f} span {tr['gpu_span_ms']:.2f} idle {tr['idle_in_span_ms']:.2f} gaps {tr['biggest_gaps_us']} "
              f"mallocs {tr['mallocs']} syncs {tr['syncs']}", flush=True)
        for k, v, n in tr["top"]: print(f"      {v:8.3f} ms {n:5d}  {k}")
    res[T] = row
json.dump(dict(machine=torch.cuda.get_device_name(), layers=L, head_dim=HD, rounds=R, rows=res), open(out, "w"),
          indent=1)
