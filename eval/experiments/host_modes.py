"""The GPU host's modes (issue 19): per round and config, one prefill forward's host issue time (wall clock and the
thread's CPU time: equal when nothing else takes the core) and its wall time; every 4th round a cProfile'd forward.

    python -m eval.experiments.host_modes LAYERS T ROUNDS CONFIGS OUT.json   # PIN=core pins the process to one core

Llama-3-8B shape, random bf16 weights, 1 x T, fresh cache per forward, configs alternating per round."""
import cProfile, pstats, sys, time, json, os, statistics
import torch
from eval.bench_e2e import LLAMA3_8B, build_model, timed_prefill
L, T, R = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfgs = sys.argv[4].split(",")
out = sys.argv[5]
if os.environ.get("PIN"):
    os.sched_setaffinity(0, {int(os.environ["PIN"])})
model = build_model(L, LLAMA3_8B, "cuda", torch.bfloat16)
ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
def fwd(c, prof=None):
    return timed_prefill(model, ids, c, (prof.enable, prof.disable) if prof else (None, None))
for c in cfgs:
    for _ in range(3): fwd(c)
rows = []
for r in range(R):
    for c in cfgs:
        h, th, w = fwd(c)
        row = dict(round=r, cfg=c, host=round(h, 3), thread=round(th, 3), wall=round(w, 3))
        if r % 4 == 3:
            pr = cProfile.Profile()
            ph, pth, pw = fwd(c, pr)
            st = pstats.Stats(pr).stats
            agg = {}
            for (p, n, fn), (_, nc, tt, ct, _) in st.items():
                nm = p.split('/')[-1] + ":" + fn
                agg[nm] = (round(tt * 1e3, 3), round(ct * 1e3, 3), nc)
            row["prof_host"] = round(ph, 3)
            row["prof"] = sorted(agg.items(), key=lambda kv: -kv[1][0])[:40]
        rows.append(row)
    print(r, " ".join(f"{x['cfg']}:{x['host']:.1f}/{x['thread']:.1f}/{x['wall']:.1f}" for x in rows[-len(cfgs):]), flush=True)
json.dump(dict(machine=torch.cuda.get_device_name(), rows=rows, pin=os.environ.get("PIN")), open(out, "w"))
