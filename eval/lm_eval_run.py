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

Writes ``<out>/results.json`` (table, device, versions, date, arguments), ``<out>/results.md`` and
``<out>/samples_<run>.jsonl`` (prompt id, generation, extracted answer, correct) per run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Optional

import yaml

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

    acc, answers = {}, {}
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
        acc[task] = {"acc": sum(v[1] for v in per.values()) / max(len(per), 1), "n": len(per)}
    # groups: mean over all their examples (bbh_cot weights by size)
    for g in OUR_GROUPS:
        subs = [t for t in answers if t == g or t.startswith(g + "_")]
        if subs and g not in answers:
            n = sum(acc[t]["n"] for t in subs)
            acc[g] = {"acc": sum(acc[t]["acc"] * acc[t]["n"] for t in subs) / max(n, 1), "n": n, "tasks": len(subs)}
    return acc, answers


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


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model dir/id (with --gguf-file: the dir holding it)")
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
    ap.add_argument("--floor", action="store_true", help="also run eager fp32 (the answer-agreement floor)")
    ap.add_argument("--out", default="eval/results/lm_eval")
    args = ap.parse_args(argv)

    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turbo_attn_hf.lm_eval_model import TurboHFLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = find_data_dir(args.data_dir)
    tasks = [t for t in args.tasks.split(",") if t]
    builtin = [t for t in tasks if not t.startswith(OUR_GROUPS)]
    include = [str(TASKS_DIR)]
    if builtin and data_dir is not None:
        include.append(str(builtin_offline_include(builtin, data_dir, out / "_builtin_tasks")))
    tm = TaskManager(include_path=include, metadata={"data_dir": str(data_dir)} if data_dir else None)

    load_kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(args.model, **load_kw)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa", **load_kw
    ).to(device).eval()

    runs = [p for p in args.presets.split(",") if p]
    if args.floor:
        runs = ["eager-fp32"] + runs
    limit_for = lambda t: args.limit_bbh if (t.startswith("bbh") and args.limit_bbh) else args.limit  # noqa: E731
    gen_kwargs = {"max_gen_toks": args.max_gen_toks} if args.max_gen_toks else None

    table, answers = {}, {}
    for preset in tqdm(runs, desc="runs", unit="run"):
        name = run_name(preset)
        if preset == "eager-fp32":
            m = AutoModelForCausalLM.from_pretrained(
                args.model, dtype=torch.float32, attn_implementation="eager", **load_kw
            ).to(device).eval()
            lm = TurboHFLM(pretrained=m, tokenizer=tok, attn_implementation="eager", batch_size=args.batch_size)
        elif preset in BASELINES:
            lm = TurboHFLM(pretrained=model, tokenizer=tok, attn_implementation=preset, batch_size=args.batch_size)
        else:
            lm = TurboHFLM(pretrained=model, tokenizer=tok, preset=preset, batch_size=args.batch_size)
        acc, ans = {}, {}
        # one simple_evaluate per task so that BBH can have its own limit
        for t in tasks:
            res = lm_eval.simple_evaluate(
                model=lm, tasks=[t], limit=limit_for(t), task_manager=tm, gen_kwargs=gen_kwargs,
                log_samples=True, bootstrap_iters=0,
            )
            a, s = collect(res)
            acc.update(a)
            ans.update(s)
        table[name] = {"acc": acc, "cache": dict(lm.cache_types),
                       "turbo_config": None if lm.turbo_config is None else lm.turbo_config.to_dict()}
        answers[name] = ans
        with open(out / f"samples_{name}.jsonl", "w") as f:
            for t, per in ans.items():
                for doc_id, (a_, ok, text) in sorted(per.items()):
                    f.write(json.dumps({"task": t, "doc_id": doc_id, "answer": a_, "correct": ok, "generation": text}) + "\n")
        if preset == "eager-fp32":
            del m, lm
            if device.startswith("cuda"):
                torch.cuda.empty_cache()

    for name in table:
        if "sdpa" in answers and name != "sdpa":
            table[name]["agree_vs_sdpa"] = agreement(answers[name], answers["sdpa"], tasks)
        if "eager-fp32" in answers and name != "eager-fp32":
            table[name]["agree_vs_eager_fp32"] = agreement(answers[name], answers["eager-fp32"], tasks)

    result = {
        "what": "chain-of-thought accuracy through lm-eval (turbo-hf), answer agreement vs sdpa-bf16 / eager-fp32",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_name(device),
        "versions": _versions(),
        "args": vars(args),
        "command": " ".join([os.path.basename(sys.executable), "-m", "eval.lm_eval_run"] + (argv or sys.argv[1:])),
        "tasks": tasks,
        "runs": table,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    md = to_markdown(result)
    (out / "results.md").write_text(md)
    print(md)
    return result


def to_markdown(result: dict) -> str:
    tasks = result["tasks"]
    head = ["run"] + [f"{t} acc" for t in tasks] + [f"{t} agree vs sdpa" for t in tasks]
    has_floor = any("agree_vs_eager_fp32" in r for r in result["runs"].values())
    if has_floor:
        head += [f"{t} agree vs eager-fp32" for t in tasks]
    lines = [
        f"Chain-of-thought accuracy (lm-eval, greedy) on {result['device']}, {result['date']}; "
        f"`{result['command']}`",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    pct = lambda x: "–" if x is None else f"{100 * x:.1f}"  # noqa: E731
    for name, r in result["runs"].items():
        row = [name]
        row += [f"{pct(r['acc'].get(t, {}).get('acc'))} (n={r['acc'].get(t, {}).get('n', 0)})" for t in tasks]
        row += [pct(r.get("agree_vs_sdpa", {}).get(t, {}).get("agree")) for t in tasks]
        if has_floor:
            row += [pct(r.get("agree_vs_eager_fp32", {}).get(t, {}).get("agree")) for t in tasks]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Accuracy in %, answer agreement = % of prompts whose extracted answers are equal. The sdpa "
              "row's agreement vs eager-fp32 is the floor: free greedy generation of a small model is chaotic."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
