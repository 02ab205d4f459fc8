"""Host time of one prefill forward (issue 19): where a 32-layer turbo forward spends the host time sdpa's does not.

    python -m eval.experiments.forward_profile LAYERS T ROUNDS [CONFIGS]     # e.g. 32 1024 9 sdpa,int8,int4

Llama-3-8B shape, random bf16 weights, 1 x T, ``model(ids, past_key_values=fresh cache, logits_to_keep=1)`` (a cache
built before the clock: DynamicCache for sdpa, TurboCache of the preset). Per config, alternating rounds: wall ms with
the garbage collector on / off (``gc.disable()`` around the forward: is a collection inside the forward part of the
gap?), then one cProfile'd forward: the top functions by own time, and the functions whose own time differs most from
sdpa's (per forward, µs)."""
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time

import torch

from eval.bench_e2e import LLAMA3_8B, build_model, new_cache, set_impl, timed_prefill


def main() -> None:
    L, T, R = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    cfgs = sys.argv[4].split(",") if len(sys.argv) > 4 else ["sdpa", "int8", "int4"]
    model = build_model(L, LLAMA3_8B, "cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")

    def fwd(c, gc_off=False):
        h, _, w = timed_prefill(model, ids, c, (gc.disable, gc.enable) if gc_off else (None, None))
        return h, w

    for c in cfgs:
        for _ in range(3):
            fwd(c)
    rows = {c: dict(host=[], wall=[], host_nogc=[], wall_nogc=[]) for c in cfgs}
    for _ in range(R):
        for c in cfgs:
            h, w = fwd(c)
            rows[c]["host"].append(h); rows[c]["wall"].append(w)
            h, w = fwd(c, gc_off=True)
            rows[c]["host_nogc"].append(h); rows[c]["wall_nogc"].append(w)
    prof = {}
    for c in cfgs:
        set_impl(model, c)
        cache = new_cache(model, c)
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        with torch.no_grad():
            model(ids, past_key_values=cache, logits_to_keep=1, use_cache=True)
        pr.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(pr).stats
        prof[c] = {f"{p.split('/')[-1]}:{n}({fn})": (tt * 1e6, nc) for (p, n, fn), (_, nc, tt, _, _) in st.items()}
    out = {"machine": torch.cuda.get_device_name(), "layers": L, "T": T, "rounds": R, "rows": {}}
    for c in cfgs:
        r = {k: round(statistics.median(v), 2) for k, v in rows[c].items()}
        out["rows"][c] = r
        print(f"{c:6s} host {r['host']:7.2f} wall {r['wall']:7.2f} | gc off: host {r['host_nogc']:7.2f} wall "
              f"{r['wall_nogc']:7.2f}  ms (medians of {R})", flush=True)
    for c in cfgs:
        top = sorted(prof[c].items(), key=lambda kv: -kv[1][0])[:22]
        print(f"--- {c}: own us per forward (calls), total {sum(v[0] for v in prof[c].values()) / 1e3:.1f} ms")
        for k, (us, n) in top:
            print(f"{us:9.0f} {n:6d}  {k}")
        out["rows"][c]["profile_top"] = [(k, round(us), n) for k, (us, n) in top]
        if c != cfgs[0]:
            base = prof[cfgs[0]]
            diff = sorted(((k, v[0] - base[k][0], v[1], base[k][1]) for k, v in prof[c].items() if k in base),
                          key=lambda x: -x[1])[:12]
            print(f"    same functions, {c} - {cfgs[0]} (us, calls vs calls):")
            for k, d, n, nb in diff:
                print(f"    {d:9.0f} {n:6d} {nb:6d}  {k}")
            out["rows"][c]["slower_same_functions"] = [(k, round(d), n, nb) for k, d, n, nb in diff]
    if len(sys.argv) > 5:
        json.dump(out, open(sys.argv[5], "w"), indent=1)


if __name__ == "__main__":
    main()
