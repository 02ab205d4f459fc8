"""Host time of HF's compiled decode call (inductor + CUDA graphs), sdpa StaticCache vs static TurboCache, per layer
count, 1 x 1k: median wall of model._compiled_call per step (no sync: the host part), the step (N 128, 3 reps), and
what cudagraph trees does per replay (``CUDAGraphNode.run``: its host time, the graph's inputs, the inputs it copies
into its static buffers every replay — the ones not marked static).

    python -m eval.experiments.host_compiled_call 8,16,32 OUT.json [sdpa,int4,mixed] [--profile]

``--profile``: cProfile of one timed generate() per config, the compiled call's functions by own time (what the host
does per step besides the replay).
"""
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

from eval.bench_e2e import LLAMA3_8B, build_model, set_impl
from eval.bench_generate import generate_timed, reset_compile, reset_static_len


def replay_probe():
    """Wraps ``CUDAGraphNode.run``: ``stats`` gets (host seconds, inputs, non-static inputs) per replay."""
    from torch._inductor import cudagraph_trees as ct

    stats = []
    orig = ct.CUDAGraphNode.run

    def run(self, new_inputs):
        n_in, n_copy = len(new_inputs), len(self.non_static_input_idx)
        t0 = time.perf_counter()
        out = orig(self, new_inputs)
        stats.append((time.perf_counter() - t0, n_in, n_copy))
        return out

    ct.CUDAGraphNode.run = run
    return stats


def main() -> None:
    layers = [int(x) for x in sys.argv[1].split(",")]
    impls = sys.argv[3].split(",") if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else ["sdpa", "int4"]
    profile = "--profile" in sys.argv
    replays = replay_probe()
    res = {}
    for L in layers:
        model = build_model(L, LLAMA3_8B, "cuda", torch.bfloat16)
        g = model.generation_config
        g.eos_token_id = g.pad_token_id = g.cache_implementation = None
        ids = torch.randint(0, model.config.vocab_size, (1, 1024), device="cuda")
        mask = torch.ones_like(ids)
        host = []
        orig = model.get_compiled_call

        def gcc(cfg, _orig=orig):
            f = _orig(cfg)

            def timed(*a, **k):
                t0 = time.perf_counter()
                out = f(*a, **k)
                host.append(time.perf_counter() - t0)
                return out
            return timed
        model.get_compiled_call = gcc
        for impl in impls:
            set_impl(model, impl)
            reset_static_len(model)
            reset_compile(model)
            spec = {"impl": impl, "static": True, "compile": True}
            for n in (129, 129, 1):
                generate_timed(model, ids, mask, spec, n)
            host.clear()
            replays.clear()
            t1, tn = [], []
            for _ in range(3):
                t1.append(generate_timed(model, ids, mask, spec, 1)[0])
                tn.append(generate_timed(model, ids, mask, spec, 129)[0])
            step = (statistics.median(tn) - statistics.median(t1)) / 128 * 1e3
            h = statistics.median(host) * 1e3
            r = res[f"{impl}_L{L}"] = dict(step_ms=step, host_call_ms=h,
                                           host_p90=sorted(host)[int(0.9 * len(host))] * 1e3)
            if replays:
                r.update(replay_ms=statistics.median(x[0] for x in replays) * 1e3,
                         graph_inputs=max(x[1] for x in replays), copied_inputs=max(x[2] for x in replays),
                         replays=len(replays))
            if profile:
                prof = cProfile.Profile()
                prof.enable()
                generate_timed(model, ids, mask, spec, 129)
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                print(f"--- profile L{L} {impl}, 128 steps\n" + text.getvalue()[-7000:], flush=True)
            print(f"L{L} {impl}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in r.items()), flush=True)
            reset_compile(model)
        del model
        torch.cuda.empty_cache()
    json.dump(res, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
