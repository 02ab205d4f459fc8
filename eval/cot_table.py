"""One table for the README: lm-eval chain-of-thought accuracy + answer agreement, and teacher-forced fidelity.

    python -m eval.cot_table --lm-eval eval/results/cot_smollm2 \\
        --fidelity eval/results/fidelity_smollm2/fidelity.json --out eval/results/cot_table_smollm2

``--lm-eval``: a directory written by ``python -m eval.lm_eval_run`` (results.json + samples_<run>.jsonl),
usually its ``--merge`` of several calls; several directories are merged here the same way
(``lm_eval_run.merge``; accuracy and agreement are always recomputed from the samples).
``--fidelity``: the fidelity.json of ``python -m eval.fidelity``.

One row per run: eager-fp32, sdpa, int8, int4, mixed (then any other run, e.g. a calibrated YAML), columns

- GSM8K / AQuA / BBH accuracy % with n (lm-eval, greedy, 256 new tokens);
- answer agreement vs eager-fp32 per task (% of prompts whose extracted answers are equal; the sdpa row is
  the floor: free greedy generation of a small model is chaotic);
- teacher-forced next-token KL(eager-fp32 ‖ run) on the ``--path`` (default ``decode``: prompt prefilled into
  the cache, answer fed through it, where the INT4/INT2 blocks matter), as a multiple of the sdpa-bf16 floor,
  top-1 agreement % and the perplexity change % of the gold answer tokens.

lm-eval run names map to fidelity implementations: ``sdpa`` -> ``sdpa-bf16``, ``eager-fp32`` -> the reference
itself ("ref"), any preset ``X`` -> ``turbo-X``. Anything missing shows as "–".
Writes ``<out>/cot_table.json`` and ``<out>/cot_table.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

from . import lm_eval_run
from .bench_common import write_report

RUNS = ("eager-fp32", "sdpa", "int8", "int4", "mixed")
REF = "eager-fp32"
FLOOR_IMPL = "sdpa-bf16"
# column label -> result keys tried in order (ours first, then lm-eval's built-in names)
TASKS = (("GSM8K", ("gsm8k_cot", "gsm8k")), ("AQuA", ("aqua_cot", "aqua")), ("BBH", ("bbh_cot", "bbh")))
DASH = "–"
GSM8K_ALL = 1319


def fidelity_impl(run: str) -> Optional[str]:
    """lm-eval run name -> eval/fidelity.py implementation name (None: the reference itself)."""
    if run == REF:
        return None
    if run == "sdpa":
        return FLOOR_IMPL
    return f"turbo-{run}"


def run_of_impl(impl: str) -> Optional[str]:
    """The inverse of ``fidelity_impl`` (None for the reference)."""
    if impl == REF:
        return None
    if impl == FLOOR_IMPL:
        return "sdpa"
    return impl[len("turbo-"):] if impl.startswith("turbo-") else impl


def _task_value(per_task: dict, keys) -> Optional[dict]:
    for k in keys:
        if per_task and per_task.get(k) is not None:
            return per_task[k]
    return None


def _sources(lm: dict) -> list[dict]:
    """Where the runs came from: one entry per source directory (a run's ``source``, set by the merge)."""
    out: dict = {}
    for name, r in lm.get("runs", {}).items():
        src = r.get("source") or {"dir": None, "device": lm.get("device"), "date": lm.get("date"),
                                  "command": lm.get("command")}
        e = out.setdefault(str(src.get("dir")),
                           {k: src.get(k) for k in ("dir", "device", "date", "command")} | {"runs": []})
        e["runs"].append(name)
    return list(out.values())


#: the per-task line lm_eval_run prints and logs: "[int8] gsm8k_cot: 213.5 s for 1319 prompts, acc 2.7 %"
LOG_LINE = re.compile(r"^\[(?P<run>[^\]]+)\] (?P<task>\S+): [\d.]+ s for (?P<n>\d+) prompts, acc (?P<acc>[\d.]+) %")


def accuracy_from_logs(paths) -> dict:
    """{run: {task: [{"acc", "n", "log"}, ...]}} from lm_eval_run logs (runs whose samples were not kept,
    e.g. the full-size calls of a device session that returned only its logs)."""
    out: dict = {}
    for p in paths:
        for line in Path(p).read_text(errors="replace").splitlines():
            m = LOG_LINE.match(line.strip())
            if m:
                out.setdefault(m["run"], {}).setdefault(m["task"], []).append(
                    {"acc": float(m["acc"]) / 100, "n": int(m["n"]), "log": str(p)})
    return out


def build(lm: Optional[dict], fid: Optional[dict], path: str = "decode", logs: Optional[dict] = None) -> dict:
    """The combined table (JSON-ready) from an lm_eval_run result dict and a fidelity.json dict (either may
    be None); ``logs`` (``accuracy_from_logs``) adds the accuracy of every logged full-size GSM8K run."""
    lm_runs = (lm or {}).get("runs", {})
    tf = (fid or {}).get("teacher_forced", {})
    floor = tf.get(FLOOR_IMPL, {}).get(path, {}).get("kl")

    names = list(RUNS)
    names += [n for n in lm_runs if n not in names]
    names += [r for r in (run_of_impl(i) for i in tf) if r is not None and r not in names]

    rows = []
    for name in names:
        r = lm_runs.get(name, {})
        row: dict = {"run": name, "fidelity_impl": fidelity_impl(name) or REF + " (reference)",
                     "lm_eval_complete": r.get("complete", True) if r else None}
        row["acc"] = {}
        row["agree_vs_eager_fp32"] = {}
        row["agree_vs_sdpa"] = {}
        for label, keys in TASKS:
            a = _task_value(r.get("acc", {}), keys)
            row["acc"][label] = None if a is None else {"acc": a.get("acc"), "n": a.get("n")}
            for key in ("agree_vs_eager_fp32", "agree_vs_sdpa"):
                g = _task_value(r.get(key, {}), keys)
                row[key][label] = None if g is None or g.get("agree") is None else {"agree": g["agree"], "n": g["n"]}
        impl = fidelity_impl(name)
        s = tf.get(impl, {}).get(path) if impl else None
        row["reference"] = impl is None
        row["teacher_forced"] = None if not s else {
            "kl": s.get("kl"), "kl_x_floor": (s["kl"] / floor) if (floor and s.get("kl") is not None) else None,
            "top1": s.get("top1"), "dppl": s.get("dppl"), "ppl": s.get("ppl"), "n_tokens": s.get("n_tokens"),
        }
        full = [e for e in (logs or {}).get(name, {}).get("gsm8k_cot", []) if e["n"] == GSM8K_ALL]
        row["gsm8k_all_logged"] = full
        rows.append(row)

    return {
        "what": "CoT accuracy (lm-eval) + answer agreement vs eager-fp32, and teacher-forced fidelity vs eager-fp32",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "path": path,
        "rows": rows,
        "lm_eval": None if lm is None else {
            "device": lm.get("device"), "date": lm.get("date"), "command": lm.get("command"), "tasks": lm.get("tasks"),
            "sources": _sources(lm),
            "runs": {n: {"device": (v.get("source") or {}).get("device", lm.get("device")),
                         "date": (v.get("source") or {}).get("date", lm.get("date")),
                         "complete": v.get("complete", True), "wall_s": v.get("wall_s")} for n, v in lm_runs.items()},
        },
        "fidelity": None if fid is None else {
            k: fid.get(k) for k in ("device", "date", "command", "n_texts", "shots", "chunk", "mean_prompt_tokens",
                                    "mean_answer_tokens", "versions")
        } | {"floor_kl": floor, "greedy_answers": fid.get("answers")},
    }


# ================================================================================ Markdown
def _pct(x, digits: int = 1) -> str:
    return DASH if x is None else f"{100 * x:.{digits}f}"


def _ratio(x) -> str:
    if x is None:
        return DASH
    return f"{x:.2f}×" if x < 10 else (f"{x:.1f}×" if x < 100 else f"{x:.0f}×")


def to_markdown(table: dict) -> str:
    logged = any(row.get("gsm8k_all_logged") for row in table["rows"])
    head = ["run"] + [f"{t} acc % (n)" for t, _ in TASKS] + ([f"GSM8K all {GSM8K_ALL} acc % (logs)"] if logged else [])
    head += [f"{t} agree % vs fp32 / sdpa" for t, _ in TASKS]
    head += [f"KL ({table['path']}, nats)", "KL / sdpa floor", "top-1 %", "Δppl %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["rows"]:
        name = row["run"] + (" (floor)" if row["run"] == "sdpa" else "")
        if row.get("lm_eval_complete") is False:
            name += " (partial)"
        cells = [name]
        for label, _ in TASKS:
            a = row["acc"].get(label)
            cells.append(DASH if a is None or a.get("acc") is None else f"{_pct(a['acc'])} ({a['n']})")
        full = row.get("gsm8k_all_logged") or []
        if logged:
            cells.append(" / ".join(_pct(e["acc"]) for e in full) if full else DASH)
        for label, _ in TASKS:
            if row["reference"]:
                cells.append("ref")
                continue
            g, h = row["agree_vs_eager_fp32"].get(label), row["agree_vs_sdpa"].get(label)
            vs_sdpa = "ref" if row["run"] == "sdpa" else (DASH if h is None else _pct(h["agree"]))
            cells.append(f"{DASH if g is None else _pct(g['agree'])} / {vs_sdpa}")
        s = row["teacher_forced"]
        if row["reference"]:
            cells += ["ref"] * 4
        elif s is None:
            cells += [DASH] * 4
        else:
            cells += [
                DASH if s.get("kl") is None else f"{s['kl']:.2e}",
                _ratio(s.get("kl_x_floor")),
                _pct(s.get("top1"), 2),
                DASH if s.get("dppl") is None else f"{100 * s['dppl']:+.2f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")

    notes = ["", "Accuracy: lm-eval, greedy chain of thought (GSM8K 8-shot, AQuA 8-shot, BBH 3-shot, 256 new tokens), "
             "n = prompts. Agreement: % of prompts whose extracted final answer equals eager-fp32's; the sdpa "
             "(bf16) row is the floor — free greedy generation of a small model is chaotic."]
    lm = table.get("lm_eval")
    if lm:
        srcs = lm.get("sources") or []
        where = "; ".join(f"{', '.join(s.get('runs') or [])}: {s.get('device')}, {s.get('date')}" for s in srcs) \
            if srcs else f"{lm.get('device')}, {lm.get('date')}"
        notes.append(f"lm-eval runs: {where}.")
    fid = table.get("fidelity")
    if fid:
        notes.append(
            f"Teacher-forced (eval/fidelity.py, vs eager-fp32, {table['path']} path, chunk {fid.get('chunk')}): "
            f"{fid.get('n_texts')} GSM8K texts ({fid.get('shots')}-shot prompt + gold answer), "
            f"{fid.get('device')}, {fid.get('date')}; KL / floor = KL over sdpa-bf16's KL on the same path; "
            f"Δppl = perplexity change of the gold answer tokens."
        )
    notes.append(f"{DASH}: not measured.")
    return "\n".join(lines + notes) + "\n"


# ================================================================================ CLI
def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", nargs="+", default=None, metavar="DIR",
                    help="lm_eval_run output dir (several: merged as by `lm_eval_run --merge`)")
    ap.add_argument("--fidelity", default=None, metavar="FILE", help="fidelity.json of eval/fidelity.py")
    ap.add_argument("--path", default="decode", choices=("decode", "prefill", "prefill_all"),
                    help="teacher-forced path for the KL / top-1 / Δppl columns")
    ap.add_argument("--logs", nargs="*", default=(), metavar="LOG",
                    help="lm_eval_run logs: adds the accuracy of each full GSM8K run they record")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not args.lm_eval and not args.fidelity:
        ap.error("give --lm-eval DIR and/or --fidelity FILE")
    command = " ".join([os.path.basename(sys.executable), "-m", "eval.cot_table"]
                       + list(sys.argv[1:] if argv is None else argv))

    lm = lm_eval_run.merge(args.lm_eval, command=command)[0] if args.lm_eval else None
    fid = json.loads(Path(args.fidelity).read_text()) if args.fidelity else None

    table = build(lm, fid, path=args.path, logs=accuracy_from_logs(args.logs) if args.logs else None)
    table["command"] = command
    table["inputs"] = {"lm_eval": args.lm_eval, "fidelity": args.fidelity, "logs": list(args.logs)}
    write_report(args.out, "cot_table", table, to_markdown(table))
    return table


if __name__ == "__main__":
    main()
