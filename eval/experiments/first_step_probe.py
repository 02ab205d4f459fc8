"""Where plain generate()'s first decode step after a prompt spends its time (issue 18's eager bar).

Session 36's per-step clocks found turbo's first decode step 11-24 ms slower than sdpa + DynamicCache's at every shape
(32 layers, H200) while the later steps were equal or faster. This probe runs on the GPU host (or, ``--stubbed``, on
a CPU with Triton's launches stubbed: the same Python path), every kernel compiled first (two warm-up generate()
calls per config), and for each config reads, for the first decode step and for a later one (``--later``):

* the wall time (median over ``--rounds`` clocked generate() calls, CUDA synchronised after every token);
* Python's garbage collections that ran inside the step (count per generation and their time, ``gc.callbacks``);
* the CUDA runtime / driver calls of the step (``torch.profiler``, CPU activity: launches, synchronisations, memcpy,
  mallocs), started and stopped inside the step;
* cProfile of the step: the functions whose cumulative time differs most between the two steps.

    python -m eval.experiments.first_step_probe --layers 32 --shape 1x4k --configs sdpa_dynamic,turbo_int4_eager \\
        --out eval/results/first_step_probe_h200.json
    # the same host path on a CPU, launches stubbed (a narrow model: its matmuls stay small)
    python -m eval.experiments.first_step_probe --stubbed --narrow --layers 8 --shape 1x128 \\
        --configs sdpa_dynamic,turbo_int8_eager --rounds 12
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import time
from typing import Optional

#: the CUDA API calls counted per step (torch.profiler's CPU-side names; a prefix matches)
API_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaStreamSynchronize", "cudaDeviceSynchronize",
             "cudaEventSynchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaGraphLaunch")


def window_criteria(step: int, on_enter, on_exit):
    """:func:`bench_generate.step_clock` calling ``on_enter()`` when decode step ``step`` begins (after token
    ``step``, the prompt's being token 0) and ``on_exit()`` when it ends, CUDA synchronised at both edges."""
    from eval.bench_generate import step_clock

    def on_token(i: int) -> None:
        if i == step:
            on_enter()
        elif i == step + 1:
            on_exit()

    return step_clock(on_token)


def gc_in_window(run, step: int) -> dict:
    """Collections per generation and their seconds inside decode step ``step`` of ``run(criteria)``."""
    state = {"on": False, "t0": 0.0, "gens": [0, 0, 0], "s": 0.0}

    def cb(phase, info):
        if not state["on"]:
            return
        if phase == "start":
            state["t0"] = time.perf_counter()
            state["gens"][info["generation"]] += 1
        else:
            state["s"] += time.perf_counter() - state["t0"]

    gc.callbacks.append(cb)
    try:
        run(window_criteria(step, lambda: state.update(on=True), lambda: state.update(on=False)))
    finally:
        gc.callbacks.remove(cb)
    return {"collections_by_generation": state["gens"], "gc_ms": state["s"] * 1e3}


def api_in_window(run, step: int) -> dict:
    """CUDA API calls (``API_CALLS``) inside decode step ``step``: count and total CPU µs per name."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    run(window_criteria(step, prof.start, prof.stop))
    out = {}
    for e in prof.key_averages():
        if e.key.startswith(API_CALLS):
            out[e.key] = {"count": e.count, "cpu_us": round(e.cpu_time_total, 1)}
    return out


def cprofile_in_window(run, step: int, dump: Optional[str] = None) -> dict:
    """``{function: (calls, own s, cumulative s)}`` of decode step ``step`` (cProfile); ``dump``: also write the
    profile there (``pstats`` reads it: callers and callees)."""
    pr = cProfile.Profile()
    run(window_criteria(step, pr.enable, pr.disable))
    if dump:
        pr.dump_stats(dump)
    return {f"{f[0].rsplit('site-packages/', 1)[-1]}:{f[1]}({f[2]})": (nc, tt, ct)
            for f, (cc, nc, tt, ct, callers) in pstats.Stats(pr).stats.items()}


def profile_diff(first: dict, later: dict, top: int = 60, by: int = 1) -> list:
    """The functions whose time in the first step exceeds the later step's most, by cumulative (``by`` 1) or own
    (``by`` 2) time: rows of (function, cumulative µs difference, own µs difference, calls difference)."""
    rows = []
    for f in set(first) | set(later):
        a, b = first.get(f, (0, 0.0, 0.0)), later.get(f, (0, 0.0, 0.0))
        rows.append((f, round((a[2] - b[2]) * 1e6, 1), round((a[1] - b[1]) * 1e6, 1), a[0] - b[0]))
    rows.sort(key=lambda r: -r[by])
    return rows[:top]


def probe(model, spec: dict, ids, mask, n: int, rounds: int, later: int, pstats_dir: Optional[str] = None) -> dict:
    from transformers import StoppingCriteriaList

    from eval.bench_e2e import set_impl
    from eval.bench_generate import clocked_generate, generate_timed

    set_impl(model, spec["impl"])

    def run(criteria):
        generate_timed(model, ids, mask, spec, 1 + n, stopping=StoppingCriteriaList([criteria]))

    for _ in range(2):  # compiles, plans, allocator pools
        clocked_generate(model, ids, mask, spec, n)
    steps = [clocked_generate(model, ids, mask, spec, n)[1] for _ in range(rounds)]
    row = {"config": spec["name"], "first_step_ms": statistics.median(s[0] for s in steps) * 1e3,
           "later_step_ms": statistics.median(s[later] for s in steps) * 1e3,
           "first_steps_ms": [round(s[0] * 1e3, 2) for s in steps]}
    for name, fn in (("gc", gc_in_window), ("cuda_api", api_in_window)):
        row[name] = {"first": fn(run, 0), "later": fn(run, later)}
    if pstats_dir:
        os.makedirs(pstats_dir, exist_ok=True)
    dumps = [os.path.join(pstats_dir, f"{spec['name']}_step{i}.pstats") if pstats_dir else None for i in (0, later)]
    first, later_prof = cprofile_in_window(run, 0, dumps[0]), cprofile_in_window(run, later, dumps[1])
    row["cprofile_diff"] = profile_diff(first, later_prof)
    row["cprofile_own_diff"] = profile_diff(first, later_prof, top=30, by=2)
    return row


def main(argv=None) -> int:
    import torch

    from eval.bench_e2e import LLAMA3_8B, TOY, build_model
    from eval.bench_generate import parse_config, parse_shapes

    ap = argparse.ArgumentParser(prog="first_step_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shape", default="1x4k")
    ap.add_argument("--configs", default="sdpa_dynamic,turbo_int4_eager")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--later", type=int, default=4, help="the later decode step compared with the first")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="bench_e2e's TOY shape (a CPU smoke run)")
    ap.add_argument("--narrow", action="store_true",
                    help="Llama-3-8B's attention (32 / 8 heads, head_dim 128) in a 256-wide model: the attention and "
                         "cache host path at its real shapes, the CPU's matmuls small")
    ap.add_argument("--stubbed", action="store_true",
                    help="CPU: Triton's launches stubbed (host_step.install_stubs), so turbo runs the GPU host's "
                         "Python path (its kernels and launches aside) instead of the PyTorch reference")
    ap.add_argument("--out")
    ap.add_argument("--pstats", metavar="DIR", help="also write each config's two step profiles there (pstats files)")
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.stubbed:
        if dev == "cuda":
            raise SystemExit("first_step_probe: --stubbed is for a CPU run (it replaces Triton's launches)")
        from eval.experiments.host_step import install_stubs

        install_stubs()
    shape = TOY if args.tiny else LLAMA3_8B
    if args.narrow:
        shape = dict(LLAMA3_8B, hidden_size=256, intermediate_size=256, vocab_size=256)
    model = build_model(args.layers, shape, dev, torch.bfloat16)
    (b, T), = parse_shapes(args.shape)
    ids = torch.randint(0, shape["vocab_size"], (b, T), device=dev)
    mask = torch.ones_like(ids)
    rows = []
    for name in args.configs.split(","):
        row = probe(model, parse_config(name), ids, mask, args.new_tokens, args.rounds, args.later, args.pstats)
        rows.append(row)
        print(f"{row['config']}: first step {row['first_step_ms']:.2f} ms, step {args.later} "
              f"{row['later_step_ms']:.2f} ms; gc first {row['gc']['first']}, later {row['gc']['later']}")
        for k in sorted(set(row["cuda_api"]["first"]) | set(row["cuda_api"]["later"])):
            a, c = row["cuda_api"]["first"].get(k, {}), row["cuda_api"]["later"].get(k, {})
            print(f"    {k:32} first {a.get('count', 0):5} ({a.get('cpu_us', 0):8.1f} us)   later "
                  f"{c.get('count', 0):5} ({c.get('cpu_us', 0):8.1f} us)")
        for key, n_rows in (("cprofile_diff", 15), ("cprofile_own_diff", 20)):
            print(f"  {key}: cumulative us, own us, calls (first step - step {args.later})")
            for f, dcum, down, dn in row[key][:n_rows]:
                print(f"    {dcum:9.0f} {down:9.0f} {dn:6}  {f}")
    if args.out:
        from eval.bench_common import machine_info

        with open(args.out, "w") as fh:
            json.dump({"benchmark": "first_step_probe", "machine": machine_info(), "argv": sys.argv[1:],
                       "shape": args.shape, "layers": args.layers, "rows": rows}, fh, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
