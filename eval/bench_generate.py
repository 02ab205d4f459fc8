"""The headline end-to-end benchmark: plain ``model.generate()`` of a Llama-3-8B-shaped model (issue 18, item 4).

    python -m eval.bench_generate [--quick] [--layers N] [--shapes 1x1k,4x8k] [--configs sdpa_dynamic,...]
                                  [--new-tokens 128] [--reps 3] [--max-seconds 540] [--ttft-rounds R]
                                  [--decode-rounds R] [--rounds-only]
                                  [--profile-step] [--step-times] [--merge]
    python -m eval.bench_generate --dry-run      # CPU: a 2-layer toy model, 1 x 16 tokens, checks the set-up
                                                 # (turbo: PyTorch reference; TRITON_INTERPRET=1: the kernels)

Model: bench_e2e's builder: ``LlamaConfig`` with 32 layers (``--layers N`` to shrink), hidden 4096, 32 query /
8 KV heads (head_dim 128), intermediate 14336, vocab 128256, random bf16 weights. One model load; every config
switches the same weights with ``model.set_attn_implementation`` (+ ``turbo_attn_hf.set_turbo_config``).

Configs (``--configs``):
  sdpa_dynamic          sdpa + the default DynamicCache
  sdpa_static           sdpa + ``cache_implementation="static"``, ``disable_compile=True`` (no auto-compile)
  sdpa_compiled         sdpa + ``cache_implementation="static"`` with HF's automatic compile of the decode step
                        (``CompileConfig()`` default: inductor, reduce-overhead = CUDA graphs); compiled afresh
                        per shape (``torch._dynamo.reset()``), the warm-up run's seconds are recorded (``warmup_s``)
  turbo_<p>_eager       turbo_int8 with preset p (int8, int4, mixed); plain ``generate()`` picks the TurboCache
  turbo_<p>_compiled    turbo_int8 + ``cache_implementation="static"``: the static TurboCache, HF's auto-compile
                        of the decode step as for sdpa_compiled. Timed only when generate returns a compileable
                        TurboCache (a probe first; else the row says ``error: "not implemented: ..."``).
  turbo_<p>_<m>_hfrope  the same with HF's rotary ops instead of the fused rotary kernel (``TURBO_ATTN_FUSED_ROPE=0``
                        during its runs): the A/B of ``turbo_attn_hf.rotary``

Measured per (config, batch x context), random input ids, greedy, ``min_new_tokens = max_new_tokens`` and no EOS,
so every run generates exactly the asked number of tokens (checked):
  ttft_ms              median wall time of ``generate(max_new_tokens=1)`` (CUDA synchronised)
  decode_ms_per_step   (median t(1 + N new) - median t(1 new)) / N, N = ``--new-tokens`` >= 32
  tokens_per_s         batch * 1000 / decode_ms_per_step
  peak_gib             torch.cuda.max_memory_allocated() over the timed runs (reset after the warm-up)
One warm-up (a 1 + N run; *_compiled: two), then ``--reps`` (>= 2) runs of each. OOM is caught per row (the row
says ``error: "OOM"``) and the run goes on; memory and compiled graphs are freed between rows.
``--max-seconds`` (default 540, under the device's 10-minute limit per command) skips the rows that would not fit
(``error: "skipped: time budget"``). Rows are written shape by shape, all configs of a shape in this process;
``--merge`` keeps the other shapes' rows of an earlier result file (split a long sweep into several commands).
``--profile-step``: one torch.profiler trace of generate(1) and of generate(1 + P) per config at the first
shape (``--profile-shape``); the difference / P gives one decode step: kernel launches (per layer), CUDA graph
launches, GPU kernels, host ms (wall - time blocked in CUDA syncs) — the ``profile`` key. The generate(1)
trace alone gives the same for the prefill (time to first token).
``--ttft-rounds R`` (issue 19's bar, e.g. 11): per shape, before its rows, R rounds in which the configs without a
static cache take turns, one generate(max_new_tokens=1) each: ``ttft_rounds_ms`` (median) and
``ttft_paired_vs_sdpa_dynamic`` (median of each round's ratio) — the host of the GPU machine changes speed for
minutes at a time, and a row's own reps take whatever mode it is in (eval/PERF_NOTES.md, session 20); skipped where
the rounds would not fit the time budget.
``--decode-rounds R`` (issue 18's eager bar): the same rounds, each turn a generate(1) and a generate(1 + N):
``decode_rounds_ms`` and ``decode_paired_vs_sdpa_dynamic`` (median of each round's step ratio); with ``--step-times``
the same calls also carry a clock after every token: ``decode_step_med_rounds_ms`` /
``decode_step_med_paired_vs_sdpa_dynamic``, each round's median decode step instead of its mean, which a slow spell of
the host within a call does not move. And ``decode_step_p10_ms`` / ``decode_step_p10_vs_sdpa_dynamic``: the 10th
percentile of each config's clocked steps pooled over all rounds, and their ratio, unpaired: the host runs in two
speed states (24 / 48 ms a 32-layer step, session 35), and a round's two turns may fall into different ones, which no
pairing cancels (:func:`p10`); the same for the compiled rounds (``compiled_step_p10_*``).
``--compiled-rounds R`` (issue 18's compiled bar): the same rounds over the shape's compiled configs, each config on
its own model over the same weights (:func:`sibling_model`: its own compiled forward, CUDA graphs and static cache,
so a turn replays what the config's warm-up recorded; one model switching configs re-recorded its graphs every turn,
eval/PERF_NOTES.md session 23): ``compiled_rounds_ms``, ``compiled_step_med_rounds_ms``, ``compiled_ttft_rounds_ms``
and their ``*_paired_vs_sdpa_compiled``; ``compiled_rounds_captures`` counts graphs recorded during the rounds (0
expected). A compiled step at 1 x 1k is ~3 ms of host after ~6 ms of GPU work (session 34's profile), so rows
timed minutes apart differ by the host's mode more than by the attention.
``--rounds-only``: the rounds without the rows' own reps (``..._rounds.json``, beside the headline file).
``--step-times``: one more generate(1 + N) per row with a clock in its stopping criteria (CUDA synchronised after
every token): ``step_ms``, each decode step's wall time, so a step-time gap between configs can be placed — every
step, a few slow steps (a block packed, a buffer grown) or the first one.
``--quick``: 8 layers, 1x1k / 1x4k / 4x8k, N 32, 2 reps, sdpa_dynamic, sdpa_compiled, turbo_int4_eager and the
three turbo compiled configs, time budget 330 s. The full sweep (32 layers, 6 shapes, 9 configs) does not fit one 10-minute command:
run it shape group by shape group with ``--merge`` (same file; every shape's configs share one process).
Output: eval/results/bench_generate_<gpu>.json (+ .png; --quick: ..._<gpu>_quick.json), a table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from .bench_common import RESULTS_DIR, free_gpu_memory, gib, is_oom, machine_info, machine_line, parse_int_list, \
    print_table, require_cuda, save_results, write_json
from .bench_e2e import LLAMA3_8B, PRESETS, TOY, alternating, build_model, set_impl

SDPA_CONFIGS = ("sdpa_dynamic", "sdpa_static", "sdpa_compiled")
ALL_CONFIGS = SDPA_CONFIGS + tuple(f"turbo_{p}_{m}" for p in PRESETS for m in ("eager", "compiled"))
DEFAULT_SHAPES = "1x1k,1x4k,1x32k,4x8k,8x16k,8x32k"
QUICK = dict(layers=8, shapes="1x1k,1x4k,4x8k", new_tokens=32, reps=2, max_seconds=330.0,
             configs="sdpa_dynamic,sdpa_compiled,turbo_int4_eager,turbo_int4_compiled,turbo_mixed_compiled,"
                     "turbo_int8_compiled")
DRY = dict(layers=2, shapes="1x16", new_tokens=4, reps=2, max_seconds=0.0, configs="sdpa_dynamic,turbo_int4_eager")
NOT_IMPLEMENTED = "not implemented: generate(cache_implementation='static') did not build a compileable TurboCache"
SKIPPED = "skipped: time budget"
ROUNDS_ONLY = "rows not run (--rounds-only): see the *_rounds keys"
OOM = "OOM"
ROUND_KEYS = ("ttft_rounds_ms", "decode_rounds_ms", "decode_step_med_rounds_ms", "compiled_ttft_rounds_ms",
              "compiled_rounds_ms", "compiled_step_med_rounds_ms")  # printed per row when present
ROW_KEYS = ("config", "batch", "context", "ttft_ms", "decode_ms_per_step", "tokens_per_s", "peak_gib")
FORMULAS = {
    "ttft_ms": "median wall time of model.generate(ids, max_new_tokens=1), torch.cuda.synchronize() before/after",
    "decode_ms_per_step": "(median t(max_new_tokens=1+N) - median t(max_new_tokens=1)) / N, N = new_tokens",
    "tokens_per_s": "batch * 1000 / decode_ms_per_step",
    "peak_gib": "torch.cuda.max_memory_allocated() / 2**30 over the timed runs (stats reset after the warm-up; "
                "weights included)",
    "warmup_s": "wall time of the first generate(1+N) of the row (compile + CUDA-graph capture for *_compiled)",
    "decode_vs_sdpa_compiled": "decode_ms_per_step / sdpa_compiled's at the same shape (issue 18: <= 1.05 at 1k/4k)",
    "decode_vs_sdpa_dynamic": "decode_ms_per_step / sdpa_dynamic's at the same shape (issue 18: turbo eager <= 1)",
    "ttft_vs_sdpa_dynamic": "ttft_ms / sdpa_dynamic's at the same shape (issue 19: <= 1.10 at 1 x 1k / 1 x 4k)",
    "ttft_rounds_ms": "--ttft-rounds R: median of R rounds in which the shape's configs without a static cache take "
                      "turns, one generate(max_new_tokens=1) each (after two warm-up calls each); per-round seconds "
                      "in ttft_rounds_s",
    "ttft_paired_vs_sdpa_dynamic": "median over those rounds of ttft / sdpa_dynamic's ttft in the same round",
    "decode_rounds_ms": "--decode-rounds R: as ttft_rounds_ms, each config's turn a generate(1) then a generate(1+N): "
                        "the round's step (t(1+N) - t(1)) / N; median of the R rounds, per-round seconds in "
                        "decode_rounds_s",
    "decode_paired_vs_sdpa_dynamic": "median over those rounds of the step / sdpa_dynamic's step in the same round "
                                     "(issue 18's eager bar: <= 1)",
    "decode_step_med_rounds_ms": "--decode-rounds R with --step-times: per round, the median of the wall times of the generate(1+N)'s "
                                 "own N decode steps (a StoppingCriteria clock, CUDA synchronised after every "
                                 "token, as step_ms); median of the R rounds, per-round seconds in "
                                 "decode_step_med_rounds_s. A slow spell of the host shorter than half a call does "
                                 "not move it; the clock's sync adds the same to every config",
    "decode_step_med_paired_vs_sdpa_dynamic": "median over those rounds of that step median / sdpa_dynamic's in the "
                                              "same round",
    "decode_step_p10_ms": "--decode-rounds R with --step-times: the 10th percentile of all the rounds' clocked decode "
                          "steps of the config (each in decode_step_pool_s); the host's fast state's step (p10())",
    "decode_step_p10_vs_sdpa_dynamic": "decode_step_p10_ms / sdpa_dynamic's (unpaired: a round's turns may fall into "
                                       "different host states, which pairing does not cancel)",
    "compiled_step_p10_ms": "--compiled-rounds R: as decode_step_p10_ms over the compiled turns' clocked steps",
    "compiled_step_p10_vs_sdpa_compiled": "compiled_step_p10_ms / sdpa_compiled's",
    "compiled_rounds_ms": "--compiled-rounds R: as decode_rounds_ms over the shape's *_compiled configs, each on its "
                          "own model over the same weights (its graphs recorded in two warm-up calls, then replayed); "
                          "per-round seconds in compiled_rounds_s",
    "compiled_paired_vs_sdpa_compiled": "median over those rounds of the step / sdpa_compiled's step in the same round "
                                        "(issue 18's compiled bar: <= 1.05 at 1k / 4k)",
    "compiled_step_med_rounds_ms": "--compiled-rounds R: per round, the median of the generate(1+N)'s own decode steps "
                                   "(a clock after every token, as decode_step_med_rounds_ms)",
    "compiled_step_med_paired_vs_sdpa_compiled": "median over the rounds of that step median / sdpa_compiled's",
    "compiled_ttft_rounds_ms": "--compiled-rounds R: the rounds' generate(1) (the static cache's first prefill)",
    "compiled_ttft_paired_vs_sdpa_compiled": "median over the rounds of that TTFT / sdpa_compiled's",
    "compiled_rounds_captures": "CUDA-graph captures during the compiled rounds, all configs (0 = every turn replayed)",
    "compiled_turn_captures": "CUDA-graph captures in each of the config's turns (which turns recorded a graph again)",
    "graph_breaks": "*_compiled: dynamo graph breaks counted over the row's compiles (0 = the decode step is one "
                    "graph, replayed as one CUDA graph)",
    "captures": "*_compiled: CUDA-graph captures during the row's timed reps (0 = the step's graph only replays)",
    "step_ms": "--step-times: wall ms of each decode step of one more generate(1+N), from a StoppingCriteria that "
               "synchronises and reads the clock after every token (step i = clock(i) - clock(i - 1)); "
               "step_ms_med / step_ms_max / step_ms_max_at summarise it",
    "profile": "per step = (trace of generate(1+P) - trace of generate(1)) / P; launches = cudaLaunchKernel(ExC) + "
               "cuLaunchKernel(Ex) calls, graph_launches = cudaGraphLaunch, kernels = GPU kernel executions; "
               "host_ms = wall - time in cuda*Synchronize / blocking cudaMemcpy (profiler overhead included); "
               "per_layer = per step / layers (lm_head, sampling and generate's own ops included)",
}


# ----------------------------------------------------------------------------------------------------- parsing
def parse_shapes(s: str) -> list[tuple[int, int]]:
    """'1x1k,4x8k' -> [(1, 1024), (4, 8192)] (batch x context)."""
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        if not part:
            continue
        b, _, t = part.partition("x")
        if not t:
            raise argparse.ArgumentTypeError(f"shape {part!r}: expected BATCHxCONTEXT, e.g. 4x8k")
        out.append((int(b), parse_int_list(t)[0]))
    return out


def shape_name(b: int, T: int) -> str:
    return f"{b}x{T // 1024}k" if T % 1024 == 0 else f"{b}x{T}"


def parse_config(name: str) -> dict:
    """'sdpa_compiled' -> {impl: 'sdpa', static: True, compile: True}; 'turbo_int4_eager' -> impl 'int4', ..."""
    if name == "sdpa_dynamic":
        return {"name": name, "impl": "sdpa", "static": False, "compile": False}
    if name == "sdpa_static":
        return {"name": name, "impl": "sdpa", "static": True, "compile": False}
    if name == "sdpa_compiled":
        return {"name": name, "impl": "sdpa", "static": True, "compile": True}
    m = re.fullmatch(r"turbo_(\w+?)_(eager|compiled)(_hfrope)?", name)
    if m and m.group(1) in PRESETS:
        compiled = m.group(2) == "compiled"
        return {"name": name, "impl": m.group(1), "static": compiled, "compile": compiled,
                "hf_rope": bool(m.group(3))}
    raise SystemExit(f"bench_generate: unknown config {name!r}; known: {', '.join(ALL_CONFIGS)}")


#: the caller's rotary switch (``turbo_attn_hf.rotary``), restored for every config but the ``_hfrope`` ones
_ROPE_ENV = "TURBO_ATTN_FUSED_ROPE"
_CALLER_ROPE = os.environ.get(_ROPE_ENV)


def rope_switch(spec: dict) -> None:
    """HF's rotary ops during an ``_hfrope`` config's runs (read at each forward), the caller's setting otherwise."""
    if spec.get("hf_rope"):
        os.environ[_ROPE_ENV] = "0"
    elif _CALLER_ROPE is None:
        os.environ.pop(_ROPE_ENV, None)
    else:
        os.environ[_ROPE_ENV] = _CALLER_ROPE


def use_spec(model, spec: dict) -> None:
    """``set_impl`` of the config and its rotary switch (:func:`rope_switch`)."""
    rope_switch(spec)
    set_impl(model, spec["impl"])


def gpu_slug(info: dict) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'cpu (x86_64)' -> 'cpu'."""
    dev = str(info.get("device", "cpu"))
    if dev.startswith("cpu"):
        return "cpu"
    m = re.search(r"\b(G?[A-Z]{1,2}\d{2,4}[A-Z]?)\b", dev.replace("NVIDIA", ""))
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", dev.lower()).strip("_") or "gpu"


# --------------------------------------------------------------------------------------------------- generate
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gen_kwargs(spec: dict, n: int) -> dict:
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
    if spec["static"]:
        kw["cache_implementation"] = "static"
        if not spec["compile"]:
            kw["disable_compile"] = True
    return kw


def _out_cache(out):
    """The cache generate() used, from a return_dict_in_generate output (``cache`` since transformers 5.24)."""
    for key in ("past_key_values", "cache"):
        c = getattr(out, key, None)
        if c is not None:
            return c
    return None


def step_clock(on_token=None):
    """A StoppingCriteria that never stops and keeps the wall time after each generated token (CUDA synchronised):
    ``clock.t``; its differences are the decode steps' times (``--step-times``). ``on_token(i)``: called after token
    ``i`` (the prompt's is token 0) is clocked, i.e. as decode step ``i`` begins and step ``i - 1`` ends."""
    import torch
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __init__(self):
            self.t: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            _sync()
            self.t.append(time.perf_counter())
            if on_token is not None:
                on_token(len(self.t) - 1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


def clocked_generate(model, ids, mask, spec: dict, n: int) -> tuple[float, list[float]]:
    """One generate(1 + n) with :func:`step_clock`: (its wall seconds, each decode step's seconds)."""
    from transformers import StoppingCriteriaList

    clock = step_clock()
    dt = generate_timed(model, ids, mask, spec, 1 + n, stopping=StoppingCriteriaList([clock]))[0]
    return dt, [b - a for a, b in zip(clock.t, clock.t[1:])]


def step_times(model, ids, mask, spec: dict, n: int) -> dict:
    """``--step-times``: each decode step's wall ms of one generate(1 + n) (:func:`step_clock`) and a summary."""
    steps = [round(x * 1e3, 3) for x in clocked_generate(model, ids, mask, spec, n)[1]]
    if not steps:
        return {}
    worst = max(range(len(steps)), key=steps.__getitem__)
    return {"step_ms": steps, "step_ms_med": statistics.median(steps),
            "step_ms_max": steps[worst], "step_ms_max_at": worst}


def generate_timed(model, ids, mask, spec: dict, n: int, return_out: bool = False, stopping=None):
    """(seconds, output) of one model.generate(...) producing exactly ``n`` new tokens (checked); ``stopping``: extra
    stopping criteria (a clock: they never stop)."""
    import torch

    kw = _gen_kwargs(spec, n)
    if stopping is not None:
        kw["stopping_criteria"] = stopping
    _sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=return_out, **kw)
    _sync()
    dt = time.perf_counter() - t0
    seq = out.sequences if return_out else out
    if not isinstance(seq, torch.Tensor) or seq.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"generate returned {tuple(getattr(seq, 'shape', ()))}, expected {ids.shape[1] + n} "
                           "tokens per sequence")
    return dt, (out if return_out else None)


def reset_static_len(model) -> None:
    """HF sizes a static cache by max(this call, every earlier call) (``_previous_max_cache_length``), so one
    32k row would make every later static row attend over 32k slots: forget it between rows."""
    if hasattr(model, "_previous_max_cache_length"):
        del model._previous_max_cache_length
    import turbo_attn_hf

    turbo_attn_hf.release_static_cache(model)  # the static TurboCache kept for the next call: not this row's memory


def reset_compile(model) -> None:
    """Drop HF's compiled forward and dynamo / CUDA-graph state (frees the graphs' memory pools)."""
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    try:
        import torch._dynamo

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()  # graph_breaks() counts this shape's compiles only
    except Exception:  # noqa: BLE001
        pass
    try:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
    except Exception:  # noqa: BLE001
        pass


def graph_breaks() -> int:
    """dynamo's graph breaks since the last :func:`reset_compile` (0: each compiled step is one graph, one CUDA graph
    replay; a break splits it into pieces replayed one by one)."""
    import torch._dynamo

    return sum(torch._dynamo.utils.counters["graph_break"].values())


def cache_problem(spec: dict, cache, model) -> Optional[str]:
    """None when generate() used the cache the config is about, else what it used instead."""
    name = type(cache).__name__ if cache is not None else "no cache"
    if spec["impl"] == "sdpa":
        want = "StaticCache" if spec["static"] else "DynamicCache"
        if name != want:
            return f"generate used {name}, expected {want}"
    else:
        from turbo_attn_hf import TurboCache

        if not isinstance(cache, TurboCache):
            return f"generate used {name}, not a TurboCache"
        if spec["static"] and not getattr(cache, "is_compileable", False):
            return f"generate used a {name} that is not compileable"
    if spec["compile"] and not hasattr(model, "_compiled_call"):
        return "HF did not compile the decode step (_valid_auto_compile_criteria was False)"
    return None


def probe_static_turbo(model, preset: str) -> Optional[str]:
    """None when generate(cache_implementation="static") of a turbo model builds a compileable TurboCache,
    else what it did (a 1 x 16 prompt, 2 tokens, compile disabled: nothing is compiled for the probe)."""
    import torch

    set_impl(model, preset)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=g).to(model.device)
    spec = {"impl": preset, "static": True, "compile": False}
    try:
        _, out = generate_timed(model, ids, torch.ones_like(ids), spec, 2, return_out=True)
        problem = cache_problem(spec, _out_cache(out), model)
    except Exception as e:  # noqa: BLE001
        problem = f"generate(cache_implementation='static') raised {type(e).__name__}: {str(e)[:160]}"
    out = None  # noqa: F841
    reset_static_len(model)
    free_gpu_memory()
    return problem


# ---------------------------------------------------------------------------------------------------- profile
_LAUNCH = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
           "cudaLaunchCooperativeKernel"}
_GRAPH = {"cudaGraphLaunch", "cuGraphLaunch"}
_SYNC = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
         "cuCtxSynchronize", "cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyDtoH"}


def trace_stats(trace_path) -> dict:
    """Launch / kernel counts and times from a torch.profiler chrome trace."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    st = {"launches": 0, "graph_launches": 0, "copies": 0, "kernels": 0, "gpu_kernel_ms": 0.0, "sync_ms": 0.0}
    names: Counter = Counter()
    names_ms: Counter = Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name, dur = e.get("cat", ""), e.get("name", ""), float(e.get("dur", 0.0))
        if cat in ("cuda_runtime", "cuda_driver"):
            if name in _LAUNCH:
                st["launches"] += 1
            elif name in _GRAPH:
                st["graph_launches"] += 1
            elif name.startswith(("cudaMemcpy", "cudaMemset", "cuMemcpy", "cuMemset")):
                st["copies"] += 1
            if name in _SYNC:
                st["sync_ms"] += dur / 1e3
        elif cat == "kernel":
            st["kernels"] += 1
            st["gpu_kernel_ms"] += dur / 1e3
            names[name[:90]] += 1
            names_ms[name[:90]] += dur / 1e3
    st["kernel_names"], st["kernel_ms"] = names, names_ms
    return st


def profile_generate(model, ids, mask, spec: dict, n: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with profile(activities=acts) as prof:
            dt, _ = generate_timed(model, ids, mask, spec, n)
        prof.export_chrome_trace(path)
        st = trace_stats(path)
    st["wall_ms"] = dt * 1e3
    st["host_ms"] = st["wall_ms"] - st["sync_ms"]
    return st


def profile_row(model, ids, mask, spec: dict, steps: int, layers: int) -> dict:
    """One decode step (difference of generate(1+P) and generate(1) traces / P) and the prefill (generate(1))."""
    short = profile_generate(model, ids, mask, spec, 1)
    long = profile_generate(model, ids, mask, spec, 1 + steps)
    keys = ("launches", "graph_launches", "copies", "kernels", "gpu_kernel_ms", "wall_ms", "host_ms", "sync_ms")
    step = {k: (long[k] - short[k]) / steps for k in keys}
    step["launches_per_layer"] = step["launches"] / layers
    step["kernels_per_layer"] = step["kernels"] / layers
    diff = long["kernel_names"].copy()
    diff.subtract(short["kernel_names"])
    step["top_kernels"] = {k: v / steps for k, v in diff.most_common(15) if v > 0}
    diff_ms = long["kernel_ms"].copy()
    diff_ms.subtract(short["kernel_ms"])
    step["top_kernels_ms"] = {k: round(v / steps, 4) for k, v in diff_ms.most_common(8) if v > 0}
    pre = {k: short[k] for k in keys}
    pre["launches_per_layer"] = short["launches"] / layers
    pre["kernels_per_layer"] = short["kernels"] / layers
    return {"profile_steps": steps, "decode_step": step, "prefill": pre}


# ------------------------------------------------------------------------------------------------------- rows
def measure(model, spec: dict, b: int, T: int, n: int, reps: int, layers: int, profile_steps: int = 0,
            steps: bool = False) -> dict:
    import torch

    reset_static_len(model)
    if spec["compile"]:
        reset_compile(model)
    g = torch.Generator().manual_seed(1000 * b + T)
    ids = torch.randint(0, model.config.vocab_size, (b, T), generator=g).to(model.device)
    mask = torch.ones_like(ids)
    row: dict = {}
    # warm-up: the long run first, so a static cache is sized for T + N by every later run of the row
    warm, out = generate_timed(model, ids, mask, spec, 1 + n, return_out=True)
    cache = _out_cache(out)
    row["warmup_s"] = warm
    row["cache"] = type(cache).__name__ if cache is not None else None
    problem = cache_problem(spec, cache, model)
    out = cache = None  # noqa: F841
    if problem:
        return {**row, "error": f"wrong path: {problem}"}
    if spec["compile"]:  # a second run with a fresh cache: any CUDA-graph re-recording happens here, not below
        row["warmup2_s"] = generate_timed(model, ids, mask, spec, 1 + n)[0]
        row["graph_breaks"] = graph_breaks()
    gc.collect()  # no empty_cache(): the allocator keeps handing the cache the same blocks (graph addresses)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t1, tn = [], []
    with graph_captures() as captured:
        for _ in range(reps):
            t1.append(generate_timed(model, ids, mask, spec, 1)[0])
            tn.append(generate_timed(model, ids, mask, spec, 1 + n)[0])
    if spec["compile"]:
        row["captures"] = captured[0]
    peak = gib(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
    m1, mn = statistics.median(t1), statistics.median(tn)
    decode_ms = (mn - m1) / n * 1e3
    row.update(ttft_ms=m1 * 1e3, decode_ms_per_step=decode_ms,
               tokens_per_s=b * 1000.0 / decode_ms if decode_ms > 0 else None, peak_gib=peak,
               t1_s=t1, t1n_s=tn)
    if steps:
        row.update(step_times(model, ids, mask, spec, n))
    if profile_steps:
        try:
            row["_profile"] = profile_row(model, ids, mask, spec, profile_steps, layers)
        except Exception as e:  # noqa: BLE001 - the timings stand without the profile
            row["_profile"] = {"error": "OOM" if is_oom(e) else f"{type(e).__name__}: {str(e)[:200]}"}
    return row


def eager_rounds(model, specs: list[dict], b: int, T: int, rounds: int, seconds_left: float, n: int = 0,
                 step_meds: Optional[dict] = None, step_pool: Optional[dict] = None) -> dict:
    """``--ttft-rounds`` (``n`` 0) / ``--decode-rounds`` (``n`` = N): the shape's configs without a static cache take
    turns (every other round in reverse order: ``alternating(abba=True)``), per round one
    ``generate(max_new_tokens=1)`` each (with ``n``: then a ``generate(1 + n)``, the round's step
    ``(t(1 + n) - t(1)) / n``), after two warm-up calls each: ``{config: [seconds per round]}`` (TTFTs, or steps), the
    host's drift falling on every config alike (a row's own reps take whatever mode the host is in then). ``{}`` when
    the rounds would not fit ``seconds_left`` (judged from the warm-up calls) or a call fails (OOM).
    ``step_meds`` (with ``n``): filled with ``{config: [seconds per round]}``, the median of the generate(1 + n)'s own
    decode steps (:func:`step_clock`): a slow spell of the host shorter than half the call leaves it alone.
    ``step_pool`` (with ``step_meds``): filled with ``{config: [every clocked step of the rounds]}`` (:func:`p10`)."""
    import torch

    specs = [s for s in specs if not s["static"]]
    if not rounds or not specs:
        return {}
    g = torch.Generator().manual_seed(1000 * b + T)
    ids = torch.randint(0, model.config.vocab_size, (b, T), generator=g).to(model.device)
    mask = torch.ones_like(ids)

    def call(spec: dict) -> float:
        use_spec(model, spec)
        t1 = generate_timed(model, ids, mask, spec, 1)[0]
        if not n:
            return t1
        if step_meds is None:
            return (generate_timed(model, ids, mask, spec, 1 + n)[0] - t1) / n
        tn, steps = clocked_generate(model, ids, mask, spec, n)
        step_meds.setdefault(spec["name"], []).append(statistics.median(steps))
        if step_pool is not None:
            step_pool.setdefault(spec["name"], []).extend(steps)
        return (tn - t1) / n

    def time_call(spec: dict) -> float:  # a warm-up call's wall seconds
        call(spec)
        t0 = time.perf_counter()
        call(spec)
        return time.perf_counter() - t0

    times: dict = {s["name"]: [] for s in specs}
    try:
        per_round = sum(time_call(s) for s in specs)  # the warm-up calls, the second one timed
        if seconds_left and rounds * per_round > seconds_left:
            return {}
        if step_meds is not None:
            step_meds.clear()  # the warm-up calls' steps
        if step_pool is not None:
            step_pool.clear()
        for _, spec, t in alternating(specs, rounds, call, warm=0, abba=True):
            times[spec["name"]].append(t)
    except Exception as e:  # noqa: BLE001 - the rows stand without the rounds
        if not is_oom(e):
            raise
        return {}
    finally:
        free_gpu_memory()
    return times


def sibling_model(model):
    """A second model over the same weight tensors: its own modules, config, generation config, HF compile state and
    static cache (``copy.deepcopy`` with the parameters memoised as themselves). Built before the model's first
    generate(), as nothing of a run is meant to be copied."""
    import copy

    return copy.deepcopy(model, {id(p): p for p in model.parameters()})


def compiled_rounds(model, specs: list[dict], b: int, T: int, rounds: int, n: int, seconds_left: float) -> dict:
    """``--compiled-rounds``: the shape's compiled configs take turns as :func:`eager_rounds`' do (ABBA order), each
    on its own :func:`sibling_model` (set up before any of the shape's rows), after two warm-up generate(1 + N)
    calls each (compile, CUDA-graph recording). A turn: generate(1), then a clocked generate(1 + N).
    ``{"compiled_ttft": {config: [s]}, "compiled": {...}, "compiled_step_med": {...}, "compiled_step_pool": {config:
    [every clocked step]}, "compiled_captures": {config: [graphs recorded in each turn]}, "captures": int}``, or ``{}``
    when fewer than two compiled configs, a config's warm-up did not take the compiled path (:func:`cache_problem`),
    fewer than two rounds fit ``seconds_left`` (counted from the call; rounds run while the next one fits) or a call
    runs out of memory."""
    import torch

    specs = [s for s in specs if s["compile"]]
    if not rounds or len(specs) < 2:
        return {}
    g = torch.Generator().manual_seed(1000 * b + T)
    ids = torch.randint(0, model.config.vocab_size, (b, T), generator=g).to(model.device)
    mask = torch.ones_like(ids)
    models = {}
    out: dict = {"compiled_ttft": {}, "compiled": {}, "compiled_step_med": {}, "compiled_step_pool": {},
                 "compiled_captures": {}}

    def call(spec: dict) -> None:
        m = models[spec["name"]]
        rope_switch(spec)  # its eager prefill's rotary
        with graph_captures() as turn:
            t1 = generate_timed(m, ids, mask, spec, 1)[0]
            tn, steps = clocked_generate(m, ids, mask, spec, n)
        for what, v in (("compiled_ttft", t1), ("compiled", (tn - t1) / n),
                        ("compiled_step_med", statistics.median(steps)), ("compiled_captures", turn[0])):
            out[what].setdefault(spec["name"], []).append(v)
        out["compiled_step_pool"].setdefault(spec["name"], []).extend(steps)

    reset_compile(model)
    try:
        t0 = time.perf_counter()
        for spec in specs:
            models[spec["name"]] = m = sibling_model(model)
            use_spec(m, spec)
            problem = cache_problem(spec, _out_cache(generate_timed(m, ids, mask, spec, 1 + n, return_out=True)[1]), m)
            if problem:  # e.g. no CUDA: HF compiles nothing, and the rounds would not be the compiled path's
                print(f"compiled rounds: {spec['name']}: {problem}; no rounds", flush=True)
                return {}
            generate_timed(m, ids, mask, spec, 1 + n)
        t_warm = time.perf_counter()
        for spec in specs:  # a turn each: the rounds' cost, not counted
            call(spec)
        print(f"compiled rounds: warm-up {t_warm - t0:.0f} s, a first turn each {time.perf_counter() - t_warm:.1f} s "
              f"({sum(sum(c) for c in out['compiled_captures'].values())} graphs recorded in it)", flush=True)
        for v in out.values():
            v.clear()
        deadline = t0 + seconds_left if seconds_left else float("inf")
        clock = [time.perf_counter(), 0.0]  # the last round's start and length

        def more() -> bool:  # the next round fits the deadline: a first turn that records graphs says little
            now = time.perf_counter()
            clock[:] = now, now - clock[0]
            return now + 1.2 * clock[1] < deadline

        done = len(alternating(specs, rounds, call, warm=0, abba=True, more=more)) // len(specs)
        out["captures"] = sum(sum(c) for c in out["compiled_captures"].values())
        print(f"compiled rounds: {done} of {rounds} rounds, the last {clock[1]:.1f} s", flush=True)
        if done < 2:
            return {}
    except Exception as e:  # noqa: BLE001 - the rows stand without the rounds
        if not is_oom(e):
            raise
        print("compiled rounds: out of memory; no rounds", flush=True)
        return {}
    finally:
        for m in models.values():
            reset_static_len(m)
            reset_compile(m)
        models.clear()
        free_gpu_memory()
    return out


@contextlib.contextmanager
def graph_captures():
    """Counts CUDA-graph captures (``torch.cuda.CUDAGraph.capture_end`` calls) inside the block: ``[count]``. A
    replayed decode step captures nothing; a count > 0 in timed rounds means a graph was recorded again."""
    import torch

    count = [0]
    cls = getattr(torch.cuda, "CUDAGraph", None)
    orig = getattr(cls, "capture_end", None)
    if orig is None:
        yield count
        return

    def capture_end(self, *a, **kw):
        count[0] += 1
        return orig(self, *a, **kw)

    own = "capture_end" in cls.__dict__  # else inherited (the C base): restored by removing the wrapper
    cls.capture_end = capture_end
    try:
        yield count
    finally:
        if own:
            cls.capture_end = orig
        else:
            del cls.capture_end


PAIRED = (("ttft", "sdpa_dynamic"), ("decode", "sdpa_dynamic"), ("decode_step_med", "sdpa_dynamic"),
          ("compiled_ttft", "sdpa_compiled"), ("compiled", "sdpa_compiled"), ("compiled_step_med", "sdpa_compiled"))


#: (pooled steps, base config): the ratio of the 10th percentiles of all the rounds' clocked steps
POOLED = (("decode_step", "sdpa_dynamic"), ("compiled_step", "sdpa_compiled"))


def p10(steps: list[float]) -> float:
    """The 10th percentile of a config's clocked decode steps over all its rounds. Why: the GPU machine's host runs
    in two speed states for seconds to minutes (HF's decode step is host-bound, 24 against 48 ms at 32 layers), and a
    round's two turns, seconds apart, may fall into different ones, which no pairing of rounds cancels. While each
    config spends over a tenth of its steps in the fast state, the p10s compare fast state with fast state."""
    return statistics.quantiles(steps, n=10)[0] if len(steps) > 1 else steps[0]


def add_ratios(rows: list[dict]) -> None:
    by = {(r["config"], r["batch"], r["context"]): r for r in rows}
    for r in rows:
        for key, base_cfg, val in (("decode_vs_sdpa_compiled", "sdpa_compiled", "decode_ms_per_step"),
                                   ("decode_vs_sdpa_dynamic", "sdpa_dynamic", "decode_ms_per_step"),
                                   ("ttft_vs_sdpa_dynamic", "sdpa_dynamic", "ttft_ms")):
            base = by.get((base_cfg, r["batch"], r["context"]), {})
            r.pop(key, None)
            if r.get(val) and base.get(val) and r["config"] != base_cfg:
                r[key] = r[val] / base[val]
        for what, base_cfg in PAIRED:
            base = by.get((base_cfg, r["batch"], r["context"]), {})
            key = f"{what}_paired_vs_{base_cfg}"
            r.pop(key, None)
            if r.get(f"{what}_rounds_s") and base.get(f"{what}_rounds_s") and r["config"] != base_cfg:
                r[key] = statistics.median(x / y for x, y in zip(r[f"{what}_rounds_s"], base[f"{what}_rounds_s"]))
        for what, base_cfg in POOLED:
            base = by.get((base_cfg, r["batch"], r["context"]), {})
            key = f"{what}_p10_vs_{base_cfg}"
            r.pop(key, None)
            if r.get(f"{what}_p10_ms") and base.get(f"{what}_p10_ms") and r["config"] != base_cfg:
                r[key] = r[f"{what}_p10_ms"] / base[f"{what}_p10_ms"]


def merge_rows(old_rows: list[dict], rows: list[dict]) -> list[dict]:
    """This run's rows, and (--merge) the earlier file's rows this run has not measured; a row this run skipped
    for time does not replace an earlier one."""
    def key(r: dict) -> tuple:
        return r["config"], r["batch"], r["context"]

    old = {key(r) for r in old_rows}
    new = [r for r in rows if not (r.get("error") == SKIPPED and key(r) in old)]
    new_keys = {key(r) for r in new}
    return [r for r in old_rows if key(r) not in new_keys] + new


def estimate_s(spec: dict, b: int, T: int, done: dict, layers: int) -> float:
    """Rough seconds a row will take: the config's last row scaled by batch x context (a compiled row's
    warm-up, mostly compilation, unscaled), or a guess for a first compile."""
    prev = done.get(spec["name"])
    if prev:
        secs, warm, tokens = prev
        scale = max(1.0, b * T / tokens)
        return (warm + (secs - warm) * scale) if spec["compile"] else secs * scale
    return 30.0 + 2.5 * layers if spec["compile"] else 0.0


# ------------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turbo-attn bench-generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"layers {QUICK['layers']}, shapes {QUICK['shapes']}, N {QUICK['new_tokens']}, "
                         f"{QUICK['reps']} reps, configs {QUICK['configs']} (< 6 min on an H100)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 32 = Llama-3-8B)")
    ap.add_argument("--shapes", default=None, help=f"batch x context list (default {DEFAULT_SHAPES})")
    ap.add_argument("--configs", default=None, help=f"default: all of {','.join(ALL_CONFIGS)}")
    ap.add_argument("--new-tokens", type=int, default=None, help="N decode steps timed (>= 32; default 128: TTFT noise / N stays below 1 %% of a step)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per row after the warm-up (>= 2; default 3)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="skip rows that would end past this many seconds from the start (0 = no limit; "
                         "default 540, --quick 330)")
    ap.add_argument("--ttft-rounds", type=int, default=0,
                    help="per shape, R rounds of generate(max_new_tokens=1) alternating over the configs without a "
                         "static cache before the rows (ttft_rounds_ms, ttft_paired_vs_sdpa_dynamic; default 0: off)")
    ap.add_argument("--decode-rounds", type=int, default=0,
                    help="per shape, R rounds of generate(1) + generate(1+N) alternating over the configs without a "
                         "static cache before the rows (decode_rounds_ms, decode_paired_vs_sdpa_dynamic; default 0)")
    ap.add_argument("--compiled-rounds", type=int, default=0,
                    help="per shape, R rounds of generate(1) + generate(1+N) alternating over the *_compiled configs, "
                         "each on its own model over the same weights (compiled_rounds_ms, "
                         "compiled_paired_vs_sdpa_compiled; default 0)")
    ap.add_argument("--rounds-only", action="store_true",
                    help="only the rounds: the rows keep the rounds' keys, their own timed reps are not run")
    ap.add_argument("--profile-step", action="store_true", help="torch.profiler of one decode step per config")
    ap.add_argument("--step-times", action="store_true",
                    help="one more generate(1+N) per row timing every decode step (step_ms); the decode rounds' "
                         "calls clock every step too (decode_step_med_rounds_ms)")
    ap.add_argument("--profile-shape", default=None, help="shape to profile (default: the first shape)")
    ap.add_argument("--profile-steps", type=int, default=4, help="decode steps in the profiled run (P)")
    ap.add_argument("--merge", action="store_true",
                    help="keep rows of other shapes / configs from an existing result file of the same model")
    ap.add_argument("--out", default=None, help="result folder (default eval/results)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run", action="store_true",
                    help=f"CPU: 2-layer toy model, shape {DRY['shapes']}, configs {DRY['configs']}, "
                         f"N {DRY['new_tokens']}")
    return ap


def _resolve(args) -> dict:
    base = DRY if args.dry_run else QUICK if args.quick else dict(layers=32, shapes=DEFAULT_SHAPES, new_tokens=128,
                                                                    reps=3, max_seconds=540.0,
                                                                    configs=",".join(ALL_CONFIGS))
    opt = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    if not args.dry_run and opt["new_tokens"] < 32:
        raise SystemExit("bench_generate: --new-tokens must be >= 32 (issue 18)")
    if opt["reps"] < 2:
        raise SystemExit("bench_generate: --reps must be >= 2")
    opt["shapes"] = parse_shapes(opt["shapes"])
    opt["specs"] = [parse_config(c.strip()) for c in opt["configs"].split(",") if c.strip()]
    return opt


def _load_merge(path: Path, cfg: dict) -> tuple[list[dict], list[dict], list[dict]]:
    if not path.is_file():
        return [], [], []
    old = json.loads(path.read_text())
    oc = old.get("config", {})
    if (oc.get("layers"), oc.get("new_tokens"), oc.get("model")) != (cfg["layers"], cfg["new_tokens"], cfg["model"]):
        print(f"--merge: {path} was measured with another model / N; not merged", flush=True)
        return [], [], []
    return old.get("rows", []), old.get("profile", []), old.get("runs", [])


def main(argv: Optional[list[str]] = None) -> int:
    t_start = time.perf_counter()
    args = build_parser().parse_args(argv)
    opt = _resolve(args)
    import torch

    if args.dry_run:  # on CPU, turbo runs the PyTorch reference, or the Triton interpreter with TRITON_INTERPRET=1
        device, shape = ("cuda" if torch.cuda.is_available() else "cpu"), TOY
    else:
        require_cuda("bench_generate")
        device, shape = "cuda", LLAMA3_8B
    layers, n, reps, specs, shapes = opt["layers"], opt["new_tokens"], opt["reps"], opt["specs"], opt["shapes"]
    prof_shape = None
    if args.profile_step:
        prof_shape = parse_shapes(args.profile_shape)[0] if args.profile_shape else shapes[0]
    info = machine_info()
    print(machine_line(info), flush=True)
    t0 = time.perf_counter()
    model = build_model(layers, shape, device, torch.bfloat16)
    gen_cfg = model.generation_config  # random weights: no EOS / pad, so every run generates exactly N tokens
    gen_cfg.eos_token_id = None
    gen_cfg.pad_token_id = None
    gen_cfg.cache_implementation = None
    n_params = sum(p.numel() for p in model.parameters())
    what = "toy (dry run)" if args.dry_run else "Llama-3-8B-shaped"
    print(f"model: {what}, {layers} layers, {n_params / 1e9:.2f} B params, bf16, built in "
          f"{time.perf_counter() - t0:.1f} s; N = {n}, reps = {reps}", flush=True)

    from transformers import CompileConfig

    # the headline file is the full model's; --quick (8 layers) and --dry-run write beside it, never over it
    name = f"bench_generate_{gpu_slug(info)}" + ("_dryrun" if args.dry_run else "_quick" if args.quick else "") + (
        "_rounds" if args.rounds_only else "")
    out_dir = Path(args.out) if args.out else RESULTS_DIR
    config = {"model": "LlamaConfig, Llama-3-8B shape" if not args.dry_run else "toy", "layers": layers, **shape,
              "params": n_params, "dtype": "bfloat16", "weights": "random N(0, 0.02)", "new_tokens": n, "reps": reps,
              "warmup": "one generate(1+N) per row (*_compiled: two, the second = warmup2_s)",
              "input": "random ids, attention_mask ones",
              "shapes": [shape_name(b, T) for b, T in shapes], "configs": [s["name"] for s in specs],
              "compile_config": {k: str(v) for k, v in CompileConfig().to_dict().items()},
              "compile_scope": "fresh per shape: torch._dynamo.reset() before each *_compiled row",
              "max_seconds": opt["max_seconds"],
              "rounds_order": "the configs' listed order in even rounds, reversed in odd ones (since session 33)"}
    old_rows, old_prof, runs = _load_merge(out_dir / f"{name}.json", config) if args.merge else ([], [], [])
    this_run = {"machine": info, "argv": sys.argv[1:] if argv is None else list(argv),
                "shapes": config["shapes"], "configs": config["configs"]}
    runs = runs + [this_run]
    rows: list[dict] = []
    profiles: list[dict] = []

    def payload() -> dict:
        all_rows, all_prof = merge_rows(old_rows, rows), merge_rows(old_prof, profiles)
        add_ratios(all_rows)
        return {"benchmark": "generate", "machine": info, "dry_run": args.dry_run, "quick": args.quick,
                "config": config, "formulas": FORMULAS, "runs": runs, "rows": all_rows, "profile": all_prof}

    static_turbo: dict[str, Optional[str]] = {}
    done: dict[str, tuple[float, int]] = {}
    for b, T in shapes:
        left = opt["max_seconds"] - (time.perf_counter() - t_start) if opt["max_seconds"] else 0.0
        alt = eager_rounds(model, specs, b, T, args.ttft_rounds, max(left, 1e-9) if opt["max_seconds"] else 0.0)
        left = opt["max_seconds"] - (time.perf_counter() - t_start) if opt["max_seconds"] else 0.0
        step_meds = {} if args.step_times else None  # the rounds' calls stay plain generate() without --step-times
        step_pool: dict = {}
        alt_dec = eager_rounds(model, specs, b, T, args.decode_rounds, max(left, 1e-9) if opt["max_seconds"] else 0.0,
                               n, step_meds, step_pool)
        left = opt["max_seconds"] - (time.perf_counter() - t_start) if opt["max_seconds"] else 0.0
        alt_comp = compiled_rounds(model, specs, b, T, args.compiled_rounds, n,
                                   max(left, 1e-9) if opt["max_seconds"] else 0.0)
        for spec in specs:
            row: dict = {"config": spec["name"], "batch": b, "context": T}
            for what, times in (("ttft", alt), ("decode", alt_dec),
                                ("decode_step_med", step_meds if alt_dec and step_meds else {}),
                                *((w, alt_comp.get(w, {})) for w in ("compiled_ttft", "compiled", "compiled_step_med"))):
                if times.get(spec["name"]):
                    row.update({f"{what}_rounds_ms": statistics.median(times[spec["name"]]) * 1e3,
                                f"{what}_rounds_s": times[spec["name"]]})
            for what, pool in (("decode_step", step_pool if alt_dec else {}),
                               ("compiled_step", alt_comp.get("compiled_step_pool", {}))):
                if pool.get(spec["name"]):
                    row.update({f"{what}_p10_ms": p10(pool[spec["name"]]) * 1e3,
                                f"{what}_pool_s": pool[spec["name"]]})
            if spec["compile"] and "captures" in alt_comp:
                row["compiled_rounds_captures"] = alt_comp["captures"]
                row["compiled_turn_captures"] = alt_comp["compiled_captures"].get(spec["name"])
            if args.rounds_only:
                row["error"] = ROUNDS_ONLY
            elapsed = time.perf_counter() - t_start
            if "error" not in row and spec["impl"] != "sdpa" and spec["static"]:
                if spec["impl"] not in static_turbo:
                    static_turbo[spec["impl"]] = probe_static_turbo(model, spec["impl"])
                if static_turbo[spec["impl"]]:
                    row.update(error=NOT_IMPLEMENTED, detail=static_turbo[spec["impl"]])
            budget = opt["max_seconds"]
            if "error" not in row and budget and elapsed + estimate_s(spec, b, T, done, layers) > budget:
                row["error"] = SKIPPED
            if "error" not in row:
                use_spec(model, spec)
                t_row = time.perf_counter()
                try:
                    row.update(measure(model, spec, b, T, n, reps, layers,
                                       args.profile_steps if (b, T) == prof_shape else 0, args.step_times))
                except Exception as e:  # noqa: BLE001 - OOM (or anything else) ends this row only
                    row["error"] = OOM if is_oom(e) else f"{type(e).__name__}: {str(e)[:200]}"
                    e = None  # noqa: F841
                row["row_s"] = time.perf_counter() - t_row
                done[spec["name"]] = (row["row_s"], row.get("warmup_s") or 0.0, b * T)
            # outside the except block, so the traceback's frames (and their tensors) are gone
            reset_static_len(model)
            if spec["compile"]:
                reset_compile(model)
            free_gpu_memory()
            prof = row.pop("_profile", None)
            if prof:
                profiles.append({"config": spec["name"], "batch": b, "context": T, "layers": layers, **prof})
            for k in ROW_KEYS:
                row.setdefault(k, None)
            rows.append(row)
            print(f"  {spec['name']:>20} {shape_name(b, T):>6}: " + (
                f"ttft {row['ttft_ms']:.1f} ms, decode {row['decode_ms_per_step']:.2f} ms/step, "
                f"peak {row['peak_gib'] or 0:.1f} GiB, warm-up {row.get('warmup_s', 0):.1f} s" + (
                    f", steps med {row['step_ms_med']:.2f} max {row['step_ms_max']:.2f} ms (step "
                    f"{row['step_ms_max_at']})" if row.get("step_ms_med") is not None else "")
                if row.get("decode_ms_per_step") is not None else f"{row.get('error')}") + "".join(
                f", {k} {row[k]:.2f}" for k in ROUND_KEYS if row.get(k)),
                flush=True)
            write_json(name, payload(), out_dir)  # partial results survive a timeout

    data = payload()
    print()
    print_table(data["rows"], ["config", "batch", "context", "ttft_ms", "decode_ms_per_step", "tokens_per_s",
                               "peak_gib", "warmup_s", "decode_vs_sdpa_compiled", "decode_vs_sdpa_dynamic",
                               "ttft_vs_sdpa_dynamic", "error"])
    if any(r.get(k) for r in data["rows"] for k in ROUND_KEYS[:3]):
        print("\nrounds (ms; paired = median of the per-round ratios):")
        print_table(data["rows"], ["config", "batch", "context", "ttft_rounds_ms", "ttft_paired_vs_sdpa_dynamic",
                                   "decode_rounds_ms", "decode_paired_vs_sdpa_dynamic", "decode_step_med_rounds_ms",
                                   "decode_step_med_paired_vs_sdpa_dynamic", "decode_step_p10_ms",
                                   "decode_step_p10_vs_sdpa_dynamic"])
    if any(r.get("compiled_rounds_ms") for r in data["rows"]):
        print("\ncompiled rounds (ms; paired = median of the per-round ratios to sdpa_compiled):")
        print_table(data["rows"], ["config", "batch", "context", "compiled_ttft_rounds_ms",
                                   "compiled_ttft_paired_vs_sdpa_compiled", "compiled_rounds_ms",
                                   "compiled_paired_vs_sdpa_compiled", "compiled_step_med_rounds_ms",
                                   "compiled_step_med_paired_vs_sdpa_compiled", "compiled_step_p10_ms",
                                   "compiled_step_p10_vs_sdpa_compiled", "compiled_rounds_captures"])
    profs = [p for p in data["profile"] if "decode_step" in p]
    if profs:
        print("\nprofile (one decode step; prefill = generate(1)):")
        prow = [{"config": p["config"], "shape": shape_name(p["batch"], p["context"]),
                 "launch/layer": p["decode_step"]["launches_per_layer"],
                 "graphs": p["decode_step"]["graph_launches"], "kern/layer": p["decode_step"]["kernels_per_layer"],
                 "host_ms": p["decode_step"]["host_ms"], "gpu_ms": p["decode_step"]["gpu_kernel_ms"],
                 "wall_ms": p["decode_step"]["wall_ms"],
                 "pre_launch/layer": p["prefill"]["launches_per_layer"], "pre_host_ms": p["prefill"]["host_ms"]}
                for p in profs]
        print_table(prow, list(prow[0]))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    save_results(name, data, out_dir, None if args.no_plot or args.dry_run else "plot_generate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
