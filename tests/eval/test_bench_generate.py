"""eval/bench_generate.py (issue 18's end-to-end benchmark): the CPU dry run end to end and the JSON it writes;
parsing, the static-TurboCache probe, the profile trace arithmetic, ratios, the time-budget estimate, the plot."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turbo_attn_hf.eval import bench_generate as bg

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_writes_rows(tmp_path):
    """`--dry-run`: 2-layer toy model on CPU, 1 x 16, sdpa_dynamic + turbo_int4_eager; every row timed; the
    alternating TTFT and decode rounds (`--ttft-rounds`, `--decode-rounds`); every decode step's time
    (`--step-times`)."""
    env = dict(os.environ, TRITON_INTERPRET="0")  # turbo on CPU: the PyTorch reference (the interpreter is slow)
    proc = subprocess.run([sys.executable, "-m", "eval.bench_generate", "--dry-run", "--ttft-rounds", "2",
                           "--decode-rounds", "2", "--step-times", "--out",
                           str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(tmp_path.glob("bench_generate_*_dryrun.json"))
    assert len(files) == 1, proc.stdout
    data = json.loads(files[0].read_text())
    for key in ("device", "torch", "transformers", "git_commit", "date_utc"):
        assert key in data["machine"]
    assert data["config"]["layers"] == 2 and data["config"]["new_tokens"] >= 1
    rows = data["rows"]
    assert [(r["config"], r["batch"], r["context"]) for r in rows] == [
        ("sdpa_dynamic", 1, 16), ("turbo_int4_eager", 1, 16)]
    for r in rows:
        assert set(bg.ROW_KEYS) <= set(r), r
        assert r.get("error") is None, r
        assert r["ttft_ms"] > 0 and r["decode_ms_per_step"] is not None and r["warmup_s"] > 0
        assert len(r["t1_s"]) == len(r["t1n_s"]) == data["config"]["reps"] >= 2
    assert rows[0]["cache"] == "DynamicCache" and rows[1]["cache"] == "TurboCache"
    assert "decode_vs_sdpa_dynamic" in rows[1] and "ttft_vs_sdpa_dynamic" in rows[1]
    for r in rows:  # --ttft-rounds 2: both configs took turns twice
        assert len(r["ttft_rounds_s"]) == 2 and r["ttft_rounds_ms"] > 0
    assert rows[1]["ttft_paired_vs_sdpa_dynamic"] > 0 and "ttft_paired_vs_sdpa_dynamic" not in rows[0]
    # --decode-rounds 2: each turn a generate(1) and a generate(1 + N). Measured, not signed: the dry run's step is a
    # difference t(1 + 4) - t(1) on a CPU toy, whose sign is timing noise (one CI run read -2.87 ms)
    for r in rows:
        assert len(r["decode_rounds_s"]) == 2 and math.isfinite(r["decode_rounds_ms"])
    assert math.isfinite(rows[1]["decode_paired_vs_sdpa_dynamic"]) and "decode_paired_vs_sdpa_dynamic" not in rows[0]
    for r in rows:  # the same calls' median decode step (a clock after every token): a step time, so positive
        assert len(r["decode_step_med_rounds_s"]) == 2 and r["decode_step_med_rounds_ms"] > 0
    assert rows[1]["decode_step_med_paired_vs_sdpa_dynamic"] > 0
    assert "decode_step_med_paired_vs_sdpa_dynamic" not in rows[0]
    for r in rows:  # every clocked step of the rounds, pooled: 2 rounds x N steps, and their 10th percentile
        assert len(r["decode_step_pool_s"]) == 2 * data["config"]["new_tokens"]
        assert r["decode_step_p10_ms"] == pytest.approx(bg.p10(r["decode_step_pool_s"]) * 1e3)
    assert rows[1]["decode_step_p10_vs_sdpa_dynamic"] == pytest.approx(
        rows[1]["decode_step_p10_ms"] / rows[0]["decode_step_p10_ms"])
    assert "decode_step_p10_vs_sdpa_dynamic" not in rows[0]
    for r in rows:  # --step-times: N decode steps of one more generate(1 + N), after the first token
        assert len(r["step_ms"]) == data["config"]["new_tokens"] and min(r["step_ms"]) > 0
        assert r["step_ms_max"] == max(r["step_ms"]) == r["step_ms"][r["step_ms_max_at"]]
    assert "config" in proc.stdout and "turbo_int4_eager" in proc.stdout  # the printed table


def test_dry_run_rounds_only(tmp_path):
    """`--decode-rounds 2 --rounds-only`: the eager configs' rounds without the rows' own reps, in a file beside the
    headline's; a compiled config takes no eager rounds (its own are ``--compiled-rounds``)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "eval.bench_generate", "--dry-run", "--configs",
                           "sdpa_dynamic,turbo_int4_eager,turbo_int4_compiled", "--decode-rounds", "2",
                           "--rounds-only", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(tmp_path.glob("bench_generate_*_dryrun_rounds.json"))
    assert len(files) == 1, proc.stdout
    rows = {r["config"]: r for r in json.loads(files[0].read_text())["rows"]}
    for name in ("sdpa_dynamic", "turbo_int4_eager"):
        assert len(rows[name]["decode_rounds_s"]) == 2 and rows[name]["error"] == bg.ROUNDS_ONLY
    assert math.isfinite(rows["turbo_int4_eager"]["decode_paired_vs_sdpa_dynamic"])  # a CPU toy's step: sign is noise
    assert "decode_rounds_s" not in rows["turbo_int4_compiled"] and rows["turbo_int4_compiled"]["ttft_ms"] is None
    assert "decode_paired_vs_sdpa_dynamic" in proc.stdout  # the rounds table


def test_compiled_row_counters(monkeypatch):
    """What a compiled row records besides its times: dynamo's graph breaks since the shape's reset (a break splits
    the decode step into several CUDA graphs) and the CUDA-graph captures during its timed reps."""
    import torch
    import torch._dynamo

    bg.reset_compile(object())

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    torch.compile(broken, backend="eager")(torch.ones(2))
    assert bg.graph_breaks() == 1
    bg.reset_compile(object())
    assert bg.graph_breaks() == 0

    class Graph:  # torch.cuda.CUDAGraph's capture_end, as the CPU build has no capture
        def capture_end(self):
            return "ended"

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    with bg.graph_captures() as n:
        assert Graph().capture_end() == "ended" and Graph().capture_end() == "ended"
    assert n == [2] and Graph.capture_end(Graph()) == "ended"  # unwrapped again after the block


def test_parse_shapes_configs_slug():
    assert bg.parse_shapes("1x1k, 4x8k,8x32k") == [(1, 1024), (4, 8192), (8, 32768)]
    assert bg.shape_name(8, 32768) == "8x32k" and bg.shape_name(1, 16) == "1x16"
    assert bg.parse_config("sdpa_static") == {"name": "sdpa_static", "impl": "sdpa", "static": True, "compile": False}
    assert bg.parse_config("sdpa_compiled")["compile"] is True
    assert bg.parse_config("turbo_mixed_eager") == {"name": "turbo_mixed_eager", "impl": "mixed", "static": False,
                                                    "compile": False, "hf_rope": False}
    c = bg.parse_config("turbo_int4_eager_hfrope")  # the rotary A/B: HF's rotary ops during its runs
    assert (c["impl"], c["static"], c["hf_rope"]) == ("int4", False, True)
    c = bg.parse_config("turbo_int4_compiled")
    assert (c["impl"], c["static"], c["compile"]) == ("int4", True, True)
    assert len(bg.ALL_CONFIGS) == 9
    with pytest.raises(SystemExit):
        bg.parse_config("turbo_int3_eager")
    assert bg.gpu_slug({"device": "NVIDIA H100 80GB HBM3"}) == "h100"
    assert bg.gpu_slug({"device": "NVIDIA H200"}) == "h200"
    assert bg.gpu_slug({"device": "cpu (x86_64)"}) == "cpu"


def test_resolve_quick_and_limits():
    opt = bg._resolve(bg.build_parser().parse_args(["--quick"]))
    assert opt["layers"] == 8 and opt["new_tokens"] >= 32 and opt["reps"] >= 2 and 0 < opt["max_seconds"] <= 360
    assert opt["shapes"] == [(1, 1024), (1, 4096), (4, 8192)]
    assert [s["name"] for s in opt["specs"]] == ["sdpa_dynamic", "sdpa_compiled", "turbo_int4_eager",
                                                 "turbo_int4_compiled", "turbo_mixed_compiled", "turbo_int8_compiled"]
    full = bg._resolve(bg.build_parser().parse_args([]))
    assert full["layers"] == 32 and len(full["shapes"]) == 6 and len(full["specs"]) == 9
    assert 0 < full["max_seconds"] < 600  # one command stays under the device's 10-minute limit
    with pytest.raises(SystemExit):
        bg._resolve(bg.build_parser().parse_args(["--new-tokens", "8"]))
    with pytest.raises(SystemExit):
        bg._resolve(bg.build_parser().parse_args(["--reps", "1"]))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the message shown on a machine without CUDA")
def test_refuses_cpu_with_a_clear_message(capsys):
    with pytest.raises(SystemExit) as e:
        bg.main(["--quick"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--dry-run" in err
    assert "python -m eval.bench_generate" in bg.__doc__


def test_static_turbo_probe():
    """generate(cache_implementation="static") of a turbo model builds the static, compileable TurboCache (the probe
    finds no problem); a row whose generate() used another cache says so."""
    import torch

    from turbo_attn_hf.eval.bench_e2e import TOY, build_model

    model = build_model(2, TOY, "cpu", torch.bfloat16)
    model.generation_config.eos_token_id = None
    assert bg.probe_static_turbo(model, "int4") is None
    assert not hasattr(model, "_previous_max_cache_length")
    spec = bg.parse_config("turbo_int4_compiled")
    assert bg.cache_problem(spec, None, model)
    assert bg.cache_problem(bg.parse_config("sdpa_dynamic"), __import__("transformers").DynamicCache(), model) is None


def test_trace_stats_and_profile_arithmetic(tmp_path):
    ev = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 5},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "dur": 2000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "dur": 3},
        {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 1500},
        {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 500},
        {"ph": "i", "cat": "kernel", "name": "marker"},
    ]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    st = bg.trace_stats(p)
    assert (st["launches"], st["graph_launches"], st["copies"], st["kernels"]) == (2, 1, 1, 2)
    assert st["gpu_kernel_ms"] == pytest.approx(2.0) and st["sync_ms"] == pytest.approx(2.0)
    assert st["kernel_names"]["gemm"] == 2


def test_ratios_and_budget_estimate():
    rows = [
        {"config": "sdpa_dynamic", "batch": 1, "context": 1024, "decode_ms_per_step": 40.0, "ttft_ms": 50.0},
        {"config": "sdpa_compiled", "batch": 1, "context": 1024, "decode_ms_per_step": 10.0, "ttft_ms": 60.0},
        {"config": "turbo_int4_eager", "batch": 1, "context": 1024, "decode_ms_per_step": 20.0, "ttft_ms": 100.0},
        {"config": "turbo_int4_compiled", "batch": 1, "context": 1024, "error": bg.NOT_IMPLEMENTED,
         "decode_ms_per_step": None, "ttft_ms": None},
    ]
    bg.add_ratios(rows)
    t = rows[2]
    assert t["decode_vs_sdpa_compiled"] == 2.0 and t["decode_vs_sdpa_dynamic"] == 0.5
    assert t["ttft_vs_sdpa_dynamic"] == 2.0
    assert "decode_vs_sdpa_dynamic" not in rows[0] and "decode_vs_sdpa_compiled" not in rows[3]
    eager, comp = bg.parse_config("sdpa_dynamic"), bg.parse_config("sdpa_compiled")
    assert bg.estimate_s(eager, 1, 1024, {}, 32) == 0.0 and bg.estimate_s(comp, 1, 1024, {}, 32) > 60
    done = {"sdpa_dynamic": (10.0, 2.0, 1024), "sdpa_compiled": (50.0, 45.0, 1024)}
    assert bg.estimate_s(eager, 4, 1024, done, 32) == 40.0
    assert bg.estimate_s(comp, 4, 1024, done, 32) == 45.0 + 5.0 * 4


def test_merge_rows():
    def r(cfg, b, err=None, v=1.0):
        return {"config": cfg, "batch": b, "context": 1024, "error": err, "ttft_ms": v}

    old = [r("sdpa_dynamic", 1, v=5.0), r("sdpa_dynamic", 4, v=6.0), r("sdpa_compiled", 1, "OOM")]
    new = [r("sdpa_dynamic", 1, v=7.0), r("sdpa_dynamic", 4, bg.SKIPPED), r("sdpa_compiled", 1, v=8.0),
           r("sdpa_static", 1, bg.SKIPPED)]
    got = {(x["config"], x["batch"]): (x["error"], x["ttft_ms"]) for x in bg.merge_rows(old, new)}
    assert got == {("sdpa_dynamic", 1): (None, 7.0), ("sdpa_dynamic", 4): (None, 6.0),
                   ("sdpa_compiled", 1): (None, 8.0), ("sdpa_static", 1): (bg.SKIPPED, 1.0)}


def test_plot_generate(tmp_path):
    pytest.importorskip("matplotlib")
    from turbo_attn_hf.eval import plots

    rows = [{"config": c, "batch": b, "context": t, "decode_ms_per_step": 12.0, "ttft_ms": 80.0}
            for c in ("sdpa_dynamic", "turbo_int4_eager") for b, t in ((1, 1024), (4, 8192))]
    rows += [{"config": "sdpa_compiled", "batch": 4, "context": 8192, "error": "OOM", "decode_ms_per_step": None,
              "ttft_ms": None},
             {"config": "turbo_int4_compiled", "batch": 1, "context": 1024, "error": bg.NOT_IMPLEMENTED}]
    p = tmp_path / "bench_generate_h100.json"
    p.write_text(json.dumps({"machine": {"device": "NVIDIA H100"}, "config": {"layers": 8}, "rows": rows}))
    png = plots.plot_generate(p)
    assert png is not None and png.is_file() and png.stat().st_size > 1000
    assert plots.PLOTTERS["bench_generate"] is plots.plot_generate


def test_plot_generate_rounds_only(tmp_path):
    """A `--rounds-only` file (rows without their own numbers) plots its rounds' medians: on the GPU the plot of such a
    file raised (a log scale over no data) after its JSON was written."""
    pytest.importorskip("matplotlib")
    from turbo_attn_hf.eval import plots

    rows = [{"config": c, "batch": 1, "context": 32768, "decode_ms_per_step": None, "ttft_ms": None,
             "error": bg.ROUNDS_ONLY, "decode_rounds_ms": ms, "decode_step_med_rounds_ms": ms - 1}
            for c, ms in (("sdpa_dynamic", 41.2), ("turbo_int4_eager", 41.7))]
    p = tmp_path / "bench_generate_h200_rounds.json"
    p.write_text(json.dumps({"machine": {"device": "NVIDIA H200"}, "config": {"layers": 32}, "rows": rows}))
    png = plots.plot_generate(p)
    assert png is not None and png.is_file() and png.stat().st_size > 1000


def test_rounds_alternate_their_order():
    """``alternating(abba=True)``: every other round runs the configs in reverse, so a drift within rounds does not
    fall on a round's later configs (the eager rounds ran sdpa first and mixed last in every round until session 33)."""
    from eval.bench_e2e import alternating

    seen = []
    out = alternating(["sdpa", "int8", "mixed"], 4, lambda c: seen.append(c) or len(seen), warm=0, abba=True)
    assert seen == ["sdpa", "int8", "mixed", "mixed", "int8", "sdpa"] * 2
    assert [(r, c) for r, c, _ in out][:4] == [(0, "sdpa"), (0, "int8"), (0, "mixed"), (1, "mixed")]
    seen.clear()
    alternating(["a", "b"], 2, seen.append, warm=1)
    assert seen == ["a", "b", "a", "b", "a", "b"]  # default: fixed order (host_parts' rounds)
    left = iter([True, True, False])  # more(): asked before each round, False ends the rounds there
    out = alternating(["a", "b"], 5, lambda c: c, warm=0, abba=True, more=lambda: next(left))
    assert [(r, c) for r, c, _ in out] == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]


def test_sibling_model_shares_weights_only():
    """``sibling_model``: the compiled rounds' second model holds the same weight tensors (no second copy of 16 GB)
    and its own config, so switching its attention leaves the first model's alone."""
    from eval.bench_e2e import TOY, build_model, set_impl

    model = build_model(2, TOY, "cpu", __import__("torch").bfloat16)
    sib = bg.sibling_model(model)
    assert sib is not model and sib.config is not model.config
    assert all(a is b for a, b in zip(model.parameters(), sib.parameters()))
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in sib.named_buffers()]
    set_impl(sib, "int4")
    assert sib.config._attn_implementation != model.config._attn_implementation == "sdpa"


def test_compiled_rounds_turns(monkeypatch):
    """``compiled_rounds``: each compiled config on its own sibling model (two warm-up calls each, then one untimed
    turn), the rounds in ABBA order, a turn's step (t(1 + N) - t(1)) / N and its steps' median; eager configs take no
    part, and a single compiled config takes no rounds."""
    import itertools

    from eval.bench_e2e import TOY, build_model

    model = build_model(2, TOY, "cpu", __import__("torch").bfloat16)
    calls, clock = [], itertools.count(1)

    def fake_generate(m, ids, mask, spec, n, **kw):
        calls.append((spec["name"], id(m), n))
        return (1.0 if n == 1 else 1.0 + (n - 1) * (2.0 if spec["impl"] == "sdpa" else 1.0)), None

    def fake_clocked(m, ids, mask, spec, n):
        calls.append((spec["name"], id(m), 1 + n))
        next(clock)
        return 1.0 + n * (2.0 if spec["impl"] == "sdpa" else 1.0), [0.5] * n

    monkeypatch.setattr(bg, "generate_timed", fake_generate)
    monkeypatch.setattr(bg, "clocked_generate", fake_clocked)
    monkeypatch.setattr(bg, "cache_problem", lambda spec, cache, m: None)
    specs = [bg.parse_config(c) for c in ("sdpa_dynamic", "sdpa_compiled", "turbo_int4_compiled")]
    out = bg.compiled_rounds(model, specs, 1, 16, 3, 4, 0.0)
    assert set(out["compiled"]) == {"sdpa_compiled", "turbo_int4_compiled"} and out["captures"] == 0
    assert out["compiled"]["sdpa_compiled"] == [2.0] * 3 and out["compiled"]["turbo_int4_compiled"] == [1.0] * 3
    assert out["compiled_step_med"]["sdpa_compiled"] == [0.5] * 3 and len(out["compiled_ttft"]["sdpa_compiled"]) == 3
    assert out["compiled_captures"]["turbo_int4_compiled"] == [0, 0, 0]  # per turn
    assert out["compiled_step_pool"]["sdpa_compiled"] == [0.5] * 12  # 3 turns x N = 4 clocked steps
    models = {name: {m for nm, m, _ in calls if nm == name} for name in out["compiled"]}
    assert all(len(v) == 1 for v in models.values()) and id(model) not in set().union(*models.values())
    assert len(set().union(*models.values())) == 2  # one sibling each
    timed = [nm for nm, _, n in calls if n == 5][6:]  # after the warm-up calls (2 each) and the untimed turns
    assert timed == ["sdpa_compiled", "turbo_int4_compiled"] + ["turbo_int4_compiled", "sdpa_compiled"] + [
        "sdpa_compiled", "turbo_int4_compiled"]
    rows = [{"config": c, "batch": 1, "context": 16, "compiled_rounds_s": out["compiled"][c]} for c in out["compiled"]]
    bg.add_ratios(rows)
    assert rows[1]["compiled_paired_vs_sdpa_compiled"] == 0.5 and "compiled_paired_vs_sdpa_compiled" not in rows[0]
    rows = [{"config": "sdpa_compiled", "batch": 1, "context": 16, "compiled_step_p10_ms": 8.0},
            {"config": "turbo_int4_compiled", "batch": 1, "context": 16, "compiled_step_p10_ms": 6.0}]
    bg.add_ratios(rows)
    assert rows[1]["compiled_step_p10_vs_sdpa_compiled"] == 0.75 and "compiled_step_p10_vs_sdpa_compiled" not in rows[0]
    assert bg.compiled_rounds(model, specs[:2], 1, 16, 3, 4, 0.0) == {}
    assert bg.compiled_rounds(model, specs, 1, 16, 3, 4, 1e-9) == {}  # past its deadline: no round, no result


def test_compiled_rounds_need_the_compiled_path(tmp_path):
    """On CPU HF compiles nothing (its auto-compile needs CUDA): the compiled rounds say so and take no rounds, rather
    than reporting an eager static step as the compiled one."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "eval.bench_generate", "--dry-run", "--configs",
                           "sdpa_compiled,turbo_int4_compiled", "--compiled-rounds", "2", "--rounds-only", "--out",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled rounds: sdpa_compiled: HF did not compile the decode step" in proc.stdout
    rows = json.loads(next(tmp_path.glob("bench_generate_*_rounds.json")).read_text())["rows"]
    assert all("compiled_rounds_s" not in r for r in rows)


def test_p10_reads_the_fast_state_of_a_two_state_host():
    """Steps from a host in two states (25 ms and 48 ms, the slow one 70 % of the time): the pooled p10 is the fast
    state's step, so two configs compare fast with fast whatever share of their turns fell into the slow state."""
    fast, slow = [0.025 + 1e-4 * i for i in range(30)], [0.048] * 70
    assert 0.025 <= bg.p10(fast + slow) < 0.0285
    assert bg.p10([0.03]) == 0.03


def test_plot_generate_bars(tmp_path):
    """Issue 18's bar plot over several files: a rounds file's estimators, a plain file's compiled ratios and a shape
    where sdpa ran out of memory; the eager plain row's ratio is left out (host modes, not the bar)."""
    pytest.importorskip("matplotlib")
    from turbo_attn_hf.eval import plots

    rounds = [{"config": "sdpa_dynamic", "batch": 1, "context": 4096, "error": bg.ROUNDS_ONLY},
              {"config": "turbo_int4_eager", "batch": 1, "context": 4096, "error": bg.ROUNDS_ONLY,
               "decode_paired_vs_sdpa_dynamic": 1.01, "decode_step_p10_vs_sdpa_dynamic": 0.99}]
    plain = [{"config": "sdpa_compiled", "batch": 8, "context": 32768, "error": "OOM", "decode_ms_per_step": None},
             {"config": "turbo_int4_compiled", "batch": 8, "context": 32768, "decode_ms_per_step": 9.7},
             {"config": "turbo_mixed_compiled", "batch": 4, "context": 8192, "decode_ms_per_step": 8.5,
              "decode_vs_sdpa_compiled": 0.47},
             {"config": "turbo_int8_eager", "batch": 4, "context": 8192, "decode_vs_sdpa_dynamic": 1.8}]
    files = []
    for name, rows in (("a_rounds.json", rounds), ("b.json", plain)):
        (tmp_path / name).write_text(json.dumps({"runs": [{"machine": {"device": "H200", "git_commit": "abc"}}],
                                                 "rows": rows}))
        files.append(tmp_path / name)
    png = plots.plot_generate_bars(files, tmp_path / "bars.png")
    assert png is not None and png.is_file() and png.stat().st_size > 1000
    assert plots.plot_generate_bars([f"{files[0]}:compiled"], tmp_path / "c.png") is None  # its eager rows left out
    assert plots.plot_generate_bars([tmp_path / "a_rounds.json"][:0], tmp_path / "none.png") is None
    assert plots.GENERATE_BARS[(True, (4, 8192))] == pytest.approx(1 / 1.8)


def test_the_rotary_switch_of_a_config_keeps_the_callers_setting(monkeypatch):
    monkeypatch.setenv("TURBO_ATTN_FUSED_ROPE", "1")
    monkeypatch.setattr(bg, "_CALLER_ROPE", "0")  # the benchmark was started with the fused rotary off
    bg.rope_switch(bg.parse_config("turbo_int4_eager_hfrope"))
    assert bg.os.environ["TURBO_ATTN_FUSED_ROPE"] == "0"
    bg.rope_switch(bg.parse_config("turbo_int4_eager"))
    assert bg.os.environ["TURBO_ATTN_FUSED_ROPE"] == "0"  # not turned on behind the caller's back
    monkeypatch.setattr(bg, "_CALLER_ROPE", None)
    bg.rope_switch(bg.parse_config("sdpa_dynamic"))
    assert "TURBO_ATTN_FUSED_ROPE" not in bg.os.environ
