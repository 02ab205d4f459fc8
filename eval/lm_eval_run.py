"""Chain-of-thought accuracy of the sdpa baseline and each turbo preset through lm-eval, one table.

    python -m eval.lm_eval_run --model DIR [--gguf-file F.gguf] --presets sdpa,int8,int4,mixed \\
        --tasks gsm8k_cot,aqua_cot,bbh_cot --limit N [--limit-bbh 40] --batch-size 16 \\
        --data-dir ../shared/data --out eval/results/cot_smollm2 [--floor]

The model is loaded once (bf16); each preset switches its attention implementation in place and runs
the tasks with lm-eval (model class ``turbo-hf``, generation through ``TurboCache``). ``sdpa`` is the
baseline, ``--floor`` adds an eager-fp32 run: free greedy generation of a small model is chaotic, so the
answer agreement of sdpa-bf16 with eager-fp32 is the floor that the presets' agreement is read against.
Presets are names (``int8``, ``int4``, ``mixed``) or YAML paths (calibrated configs).

Tasks: ours (``gsm8k_cot``, ``aqua_cot``, ``bbh_cot`` from ``eval/tasks``) or lm-eval's built-ins; for
built-ins whose data has an offline copy (gsm8k, bbh) the built-in YAML is included and only its data
files are pointed at ``--data-dir`` (``builtin_offline_include``).

Writes ``<out>/results.json`` (table, device, versions, date, arguments, wall times), ``<out>/results.md``
and ``<out>/samples_<run>.jsonl`` (task, doc_id, extracted answer, correct, generation) after EVERY finished
task of every run (atomically), so a call killed by a time limit keeps what it finished; a run cut short is
marked ``"complete": false`` with the tasks it did. Wall time per task and per run is printed and recorded.

The full runs split over several calls (each with its own ``--out``), then one table:

    python -m eval.lm_eval_run --model DIR --presets sdpa --floor ... --out eval/results/cot/a
    python -m eval.lm_eval_run --model DIR --presets int8,int4 ...   --out eval/results/cot/b
    python -m eval.lm_eval_run --merge eval/results/cot/a eval/results/cot/b ... --out eval/results/cot_smollm2

``--merge`` reads each directory's results.json + samples_*.jsonl, takes every run (the same run split by task
over several calls is united; otherwise a complete run wins over a partial one of the same name, else the later
directory), recomputes accuracy and answer agreement vs sdpa and vs eager-fp32 from the samples, and writes results.json / results.md / samples_<run>.jsonl to ``--out``
with the source directories, devices, dates and commands. ``python -m eval.cot_table`` joins that with the
teacher-forced fidelity JSON (eval/fidelity.py) into the README table.

Batching (lm-eval 0.4.13): one ``simple_evaluate(tasks=["bbh_cot"])`` hands the requests of all 27 BBH
subtasks to ONE ``generate_until`` call (evaluator.py: requests of every task are pooled per request type),
and since all subtasks share the template's generation_kwargs they form one gen_kwargs group there
(models/huggingface.py: ``Collator(group_by="gen_kwargs")``): batches mix subtasks, sorted by prompt length.
GSM8K/AQuA stop at "\\nQuestion:" and BBH at "\\n\\nQ:"/"\\nQ:", so one call over all three tasks would still
batch BBH apart: at the full sizes and batch 128 that is 11 + 2 + 9 = 22 batches either way, so the runner
keeps one call per task (BBH gets its own limit, and every finished task is saved).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from turbo_attn_hf.loading import LOAD_KWARGS

from .data import find_data_dir

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
OUR_GROUPS = ("gsm8k_cot", "aqua_cot", "bbh_cot")
BASELINES = ("sdpa", "eager")  # preset names that mean "no turbo"


# ================================================================================ built-in tasks offline
def _offline_files(dataset_path: str, dataset_name: Optional[str], d: Path, task: str) -> dict:
    if dataset_path in ("openai/gsm8k", "gsm8k"):
        f = str(d / "gsm8k" / "test.jsonl")
        # only the test split exists offline: few-shot examples are then drawn from it as well
        return {"data_files": {"train": f, "test": f}}
    if dataset_path in ("SaylorTwift/bbh", "lukaemon/bbh"):
        return {"data_files": {"test": str(d / "bbh" / f"{dataset_name}.json")}, "field": "examples"}
    raise ValueError(
        f"task {task!r} reads dataset {dataset_path!r}, which has no offline copy in {d}; "
        f"offline runs support lm-eval's gsm8k* and bbh* tasks"
    )


def builtin_offline_include(names: list[str], data_dir, out_dir) -> Path:
    """Write YAMLs to ``out_dir`` that include lm-eval's built-in task YAMLs of ``names`` (tasks or
    groups, e.g. ``gsm8k``, ``bbh``) and override only their data source with local JSON files under
    ``data_dir``. Returns ``out_dir`` for ``TaskManager(include_path=...)``."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    d, out = Path(data_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = TaskManager().task_index

    def visit(name: str) -> None:
        e = index.get(name)
        if e is None:
            raise ValueError(f"{name!r} is not an lm-eval task or group")
        if e.kind == Kind.GROUP:
            (out / f"_group_{name}.yaml").write_text(yaml.safe_dump(dict(e.cfg), sort_keys=False))
            for sub in e.cfg.get("task", []):
                visit(sub if isinstance(sub, str) else sub["task"])
            return
        if e.kind == Kind.TAG:
            for sub in sorted(k for k, v in index.items() if name in (v.tags or ()) and v.kind != Kind.TAG):
                visit(sub)
            return
        cfg = load_yaml(e.yaml_path, resolve_func=False, recursive=True)
        over = {
            "include": str(Path(e.yaml_path).resolve()),
            "task": name,
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": _offline_files(cfg.get("dataset_path"), cfg.get("dataset_name"), d, name),
        }
        (out / f"{name}.yaml").write_text(yaml.safe_dump(over, sort_keys=False))

    for n in names:
        visit(n)
    return out


# ================================================================================ one run
def _versions() -> dict:
    import torch
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for mod in ("triton", "lm_eval", "datasets"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            v[mod] = None
    try:
        import turbo_attn_hf

        v["turbo_attn_hf"] = turbo_attn_hf.__version__
    except Exception:  # noqa: BLE001
        pass
    return v


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def run_name(preset: str) -> str:
    return Path(preset).stem if preset.endswith((".yaml", ".yml")) else preset


def collect(res: dict) -> tuple[dict, dict]:
    """From lm-eval's result dict: ({task: accuracy, n}, {task: {doc_id: (answer, correct, text)}})."""
    from .tasks import utils as tu

    answers = {}
    for task, samples in res.get("samples", {}).items():
        per = {}
        for s in samples:
            if s["doc_id"] in per:  # built-in tasks log one sample per filter: keep the first
                continue
            text = s["resps"][0][0] if s["resps"] and s["resps"][0] else ""
            if task.startswith(OUR_GROUPS):
                ans = tu.extract(task, text, s["doc"])
                ok = bool(tu.score(task, text, s["doc"]))
            else:
                fr = s.get("filtered_resps") or [""]
                ans = fr[0] if isinstance(fr[0], str) else str(fr[0])
                ok = bool(max((v for k, v in s.items() if k in ("exact_match", "acc")), default=0))
            per[s["doc_id"]] = (ans, ok, text)
        answers[task] = per
    return accuracy(answers), answers


def accuracy(answers: dict) -> dict:
    """{task: {acc, n}} from {task: {doc_id: (answer, correct, text)}}, plus our groups (gsm8k_cot, aqua_cot,
    bbh_cot) as the mean over all their examples (bbh_cot weights its subtasks by size)."""
    acc = {t: {"acc": sum(bool(v[1]) for v in per.values()) / max(len(per), 1), "n": len(per)}
           for t, per in answers.items()}
    for g in OUR_GROUPS:
        subs = [t for t in answers if t == g or t.startswith(g + "_")]
        if subs and g not in answers:
            n = sum(acc[t]["n"] for t in subs)
            acc[g] = {"acc": sum(acc[t]["acc"] * acc[t]["n"] for t in subs) / max(n, 1), "n": n, "tasks": len(subs)}
    return acc


def agreement(a: dict, b: dict, tasks: list[str]) -> dict:
    """Fraction of prompts whose extracted answers are equal, per task (groups pooled over subtasks)."""
    out = {}
    for t in tasks:
        subs = [s for s in a if (s == t or s.startswith(t + "_")) and s in b]
        same = tot = 0
        for s in subs:
            for doc_id, (ans, _, _) in a[s].items():
                if doc_id in b[s]:
                    tot += 1
                    same += ans == b[s][doc_id][0]
        out[t] = {"agree": same / tot if tot else None, "n": tot}
    return out


def add_agreements(table: dict, answers: dict, tasks: list[str]) -> None:
    """(Re)compute each run's answer agreement vs ``sdpa`` and vs ``eager-fp32`` from the samples."""
    for name, r in table.items():
        r.pop("agree_vs_sdpa", None)
        r.pop("agree_vs_eager_fp32", None)
        if name not in answers:
            continue
        if "sdpa" in answers and name != "sdpa":
            r["agree_vs_sdpa"] = agreement(answers[name], answers["sdpa"], tasks)
        if "eager-fp32" in answers and name != "eager-fp32":
            r["agree_vs_eager_fp32"] = agreement(answers[name], answers["eager-fp32"], tasks)


# ================================================================================ files
def _atomic_write(path: Path, text: str) -> None:
    """Write via a temporary file + rename: a call killed mid-write leaves the previous file intact."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def samples_text(per_task: dict) -> str:
    lines = []
    for t, per in per_task.items():
        for doc_id, (a_, ok, text) in sorted(per.items()):
            lines.append(json.dumps(
                {"task": t, "doc_id": doc_id, "answer": a_, "correct": bool(ok), "generation": text}))
    return "".join(line + "\n" for line in lines)


def read_samples(path) -> dict:
    """samples_<run>.jsonl -> {task: {doc_id: (answer, correct, generation)}} (the shape ``collect`` returns)."""
    out: dict = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.setdefault(r["task"], {})[r["doc_id"]] = (r["answer"], bool(r["correct"]), r.get("generation", ""))
    return out


def write_results(out: Path, result: dict, answers: dict, runs: Optional[list[str]] = None) -> str:
    """samples_<run>.jsonl of ``runs`` (default: all), then results.json and results.md; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (result["runs"] if runs is None else runs):
        if name in answers:
            _atomic_write(out / f"samples_{name}.jsonl", samples_text(answers[name]))
    _atomic_write(out / "results.json", json.dumps(result, indent=2))
    md = to_markdown(result)
    _atomic_write(out / "results.md", md)
    return md


# ================================================================================ merge
def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def load_dir(d) -> tuple[dict, dict]:
    """A result directory -> (results.json, {run: answers from samples_<run>.jsonl}) (runs without samples: {})."""
    d = Path(d)
    f = d / "results.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} does not exist: not an lm_eval_run output directory")
    result = json.loads(f.read_text())
    answers = {}
    for name in result.get("runs", {}):
        p = d / f"samples_{name}.jsonl"
        if p.is_file():
            answers[name] = read_samples(p)
        else:
            print(f"warning: {p} is missing; run {name!r} keeps its accuracy but has no answer agreement", flush=True)
    return result, answers


COMPARABLE_ARGS = ("model", "gguf_file", "tasks", "limit", "limit_bbh", "max_gen_toks", "dtype")


def merge(dirs, command: Optional[str] = None) -> tuple[dict, dict]:
    """Combine the runs of several result directories into one result (see the module docstring)."""
    runs: dict = {}
    answers: dict = {}
    tasks: list[str] = []
    sources, notes = [], []
    for d in dirs:
        res, ans = load_dir(d)
        for t in res.get("tasks", []):
            if t not in tasks:
                tasks.append(t)
        src = {"dir": str(d), "device": res.get("device"), "date": res.get("date"), "command": res.get("command")}
        sources.append({**src, "versions": res.get("versions"), "args": res.get("args"),
                        "runs": list(res.get("runs", {})),
                        "merged_from": res.get("merged_from")})
        for name, r in res.get("runs", {}).items():
            r = dict(r)
            r.setdefault("source", src)  # a merged directory keeps each run's original source
            if name in runs and name in ans and name in answers and not set(ans[name]) & set(answers[name]):
                # the same run split over calls by task (e.g. GSM8K in one, AQuA + BBH in another): union
                old = runs[name]
                notes.append(f"{name}: tasks {sorted(ans[name])} from {d} added to {sorted(answers[name])}")
                answers[name] = {**answers[name], **ans[name]}
                r["sources"] = old.get("sources", [old["source"]]) + [r["source"]]
                r["tasks_done"] = list(old.get("tasks_done", [])) + list(r.get("tasks_done", []))
                r["task_wall_s"] = {**old.get("task_wall_s", {}), **r.get("task_wall_s", {})}
                r["complete"] = old.get("complete", True) and r.get("complete", True)
                r["acc"] = accuracy(answers[name])
                runs[name] = r
                continue
            if name in runs:
                old_complete = runs[name].get("complete", True)
                if old_complete and not r.get("complete", True):
                    notes.append(f"{name}: kept {runs[name]['source']['dir']} (complete) over {d} (partial)")
                    continue
                notes.append(f"{name}: {d} replaces {runs[name]['source']['dir']}")
            runs[name] = r
            if name in ans:
                answers[name] = ans[name]
                r["acc"] = accuracy(ans[name])
            else:
                answers.pop(name, None)
    # runs are only comparable under the same settings: say so when the calls differed
    for key in COMPARABLE_ARGS:
        seen = {str((src.get("args") or {}).get(key)) for src in sources if src.get("args") is not None}
        if len(seen) > 1:
            notes.append(f"the calls differ in --{key.replace('_', '-')}: {sorted(seen)}")
    for n in notes:
        print("merge:", n, flush=True)
    add_agreements(runs, answers, tasks)
    devices = sorted({str(r["source"].get("device")) for r in runs.values()})
    result = {
        "what": "chain-of-thought accuracy through lm-eval (turbo-hf), answer agreement vs sdpa-bf16 / eager-fp32; "
                "merged from several calls",
        "date": _now(),
        "device": " / ".join(devices),
        "command": command or "merge",
        "tasks": tasks,
        "runs": runs,
        "merged_from": sources,
        "merge_notes": notes,
    }
    if len(devices) > 1:
        print(f"warning: merged runs come from different devices: {devices}", flush=True)
    return result, answers


# ================================================================================ model loading (tests replace these)
def _from_pretrained(args, dtype, attn: str, device):
    from transformers import AutoModelForCausalLM

    load_kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, attn_implementation=attn, **load_kw, **LOAD_KWARGS).to(device).eval()


def _load_model(args, device):
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model, **({"gguf_file": args.gguf_file} if args.gguf_file else {}))
    return tok, _from_pretrained(args, getattr(torch, args.dtype), "sdpa", device)


def _make_lm(preset: str, args, tok, model, device):
    """The lm-eval model of one run; eager-fp32 loads its own fp32 copy of the weights."""
    import torch

    from turbo_attn_hf.lm_eval_model import TurboHFLM

    if preset == "eager-fp32":
        m = _from_pretrained(args, torch.float32, "eager", device)
        return TurboHFLM(pretrained=m, tokenizer=tok, attn_implementation="eager", batch_size=args.batch_size)
    if preset in BASELINES:
        return TurboHFLM(pretrained=model, tokenizer=tok, attn_implementation=preset, batch_size=args.batch_size)
    return TurboHFLM(pretrained=model, tokenizer=tok, preset=preset, batch_size=args.batch_size)


def _task_manager(include: list[str], data_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, metadata={"data_dir": str(data_dir)} if data_dir else None)


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ================================================================================ CLI
def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(prog="turbo-attn lm-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir/id (with --gguf-file: the dir holding it)")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--presets", default="sdpa,int8,int4,mixed", help="comma list: sdpa, int8, int4, mixed, YAML paths")
    ap.add_argument("--tasks", default="gsm8k_cot,aqua_cot,bbh_cot")
    ap.add_argument("--limit", type=int, default=None, help="examples per task (default: all)")
    ap.add_argument("--limit-bbh", type=int, default=None, help="examples per BBH task (default: --limit)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-gen-toks", type=int, default=None, help="override the tasks' 256 new tokens")
    ap.add_argument("--data-dir", default=None, help="offline data (default: $TURBO_ATTN_DATA, ../shared/data, Hub)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--floor", action="store_true", help="also run eager fp32 (the answer-agreement floor), first")
    ap.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                    help="no model: merge these result directories into --out (results.json + samples_*.jsonl)")
    ap.add_argument("--out", default="eval/results/lm_eval")
    args = ap.parse_args(argv)
    command = " ".join([os.path.basename(sys.executable), "-m", "eval.lm_eval_run"]
                       + list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)

    if args.merge:
        result, answers = merge(args.merge, command=command)
        md = write_results(out, result, answers)
        print(md)
        return result
    if not args.model:
        ap.error("--model is required (unless --merge)")

    import lm_eval
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out.mkdir(parents=True, exist_ok=True)
    data_dir = find_data_dir(args.data_dir)
    tasks = [t for t in args.tasks.split(",") if t]
    builtin = [t for t in tasks if not t.startswith(OUR_GROUPS)]
    include = [str(TASKS_DIR)]
    if builtin and data_dir is not None:
        include.append(str(builtin_offline_include(builtin, data_dir, out / "_builtin_tasks")))
    tm = _task_manager(include, data_dir)
    tok, model = _load_model(args, device)

    runs = [p for p in args.presets.split(",") if p]
    if args.floor:
        runs = ["eager-fp32"] + runs
    limit_for = lambda t: args.limit_bbh if (t.startswith("bbh") and args.limit_bbh) else args.limit  # noqa: E731
    gen_kwargs = {"max_gen_toks": args.max_gen_toks} if args.max_gen_toks else None

    table, answers = {}, {}
    result = {
        "what": "chain-of-thought accuracy through lm-eval (turbo-hf), answer agreement vs sdpa-bf16 / eager-fp32",
        "date": _now(),
        "device": _device_name(device),
        "versions": _versions(),
        "args": vars(args),
        "command": command,
        "tasks": tasks,
        "planned_runs": [run_name(p) for p in runs],
        "runs": table,
    }
    t_call = time.perf_counter()
    for k, preset in enumerate(runs):
        name = run_name(preset)
        print(f"=== run {k + 1}/{len(runs)}: {name}", flush=True)
        t_run = time.perf_counter()
        lm = _make_lm(preset, args, tok, model, device)
        entry = table[name] = {
            "acc": {}, "cache": {}, "complete": False, "tasks_done": [], "task_wall_s": {}, "wall_s": None,
            "turbo_config": None if lm.turbo_config is None else lm.turbo_config.to_dict(),
        }
        answers[name] = {}
        # one simple_evaluate per task: BBH gets its own limit, and every finished task is saved at once
        # (one call over all three tasks would not batch better: see the module docstring)
        for t in tasks:
            t0 = time.perf_counter()
            res = lm_eval.simple_evaluate(
                model=lm, tasks=[t], limit=limit_for(t), task_manager=tm, gen_kwargs=gen_kwargs,
                log_samples=True, bootstrap_iters=0,
            )
            a, s = collect(res)
            dt = time.perf_counter() - t0
            entry["acc"].update(a)
            answers[name].update(s)
            entry["tasks_done"].append(t)
            entry["task_wall_s"][t] = round(dt, 2)
            entry["cache"] = dict(lm.cache_types)
            entry["wall_s"] = round(time.perf_counter() - t_run, 2)
            n = a.get(t, {}).get("n", sum(len(v) for v in s.values()))
            print(f"[{name}] {t}: {dt:.1f} s for {n} prompts, acc {100 * a.get(t, {}).get('acc', float('nan')):.1f} %",
                  flush=True)
            add_agreements(table, answers, tasks)
            write_results(out, result, answers, runs=[name])
        entry["complete"] = True
        entry["wall_s"] = round(time.perf_counter() - t_run, 2)
        result["wall_s"] = round(time.perf_counter() - t_call, 2)
        write_results(out, result, answers, runs=[name])
        print(f"=== run {name}: {entry['wall_s']:.1f} s (" + ", ".join(
            f"{t} {v:.1f} s" for t, v in entry["task_wall_s"].items()) + f"); saved to {out}", flush=True)
        del lm
        if preset == "eager-fp32":
            _free(device)

    result["wall_s"] = round(time.perf_counter() - t_call, 2)
    md = write_results(out, result, answers, runs=[])
    print(md)
    return result


def to_markdown(result: dict) -> str:
    tasks = result["tasks"]
    runs = result["runs"]
    head = ["run"] + [f"{t} acc" for t in tasks] + [f"{t} agree vs sdpa" for t in tasks]
    has_floor = any("agree_vs_eager_fp32" in r for r in runs.values())
    if has_floor:
        head += [f"{t} agree vs eager-fp32" for t in tasks]
    has_time = any(r.get("wall_s") is not None for r in runs.values())
    if has_time:
        head += ["wall s"]
    lines = [
        f"Chain-of-thought accuracy (lm-eval, greedy) on {result['device']}, {result['date']}; "
        f"`{result['command']}`",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    pct = lambda x: "–" if x is None else f"{100 * x:.1f}"  # noqa: E731
    for name, r in runs.items():
        done = ", ".join(r.get("tasks_done", [])) or "nothing"
        label = name if r.get("complete", True) else f"{name} (partial: {done})"
        row = [label]
        row += ["–" if t not in r["acc"] else f"{pct(r['acc'][t].get('acc'))} (n={r['acc'][t].get('n', 0)})"
                for t in tasks]
        row += [pct(r.get("agree_vs_sdpa", {}).get(t, {}).get("agree")) for t in tasks]
        if has_floor:
            row += [pct(r.get("agree_vs_eager_fp32", {}).get(t, {}).get("agree")) for t in tasks]
        if has_time:
            row += ["–" if r.get("wall_s") is None else f"{r['wall_s']:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Accuracy in %, answer agreement = % of prompts whose extracted answers are equal. The sdpa "
              "row's agreement vs eager-fp32 is the floor: free greedy generation of a small model is chaotic."]
    if result.get("merged_from"):
        lines += ["", "Merged from:", ""]
        for name, r in runs.items():
            src = r.get("source", {})
            lines.append(
                f"- {name}: `{src.get('dir')}`, {src.get('device')}, {src.get('date')}; `{src.get('command')}`")
        for n in result.get("merge_notes", []):
            lines.append(f"- note: {n}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
