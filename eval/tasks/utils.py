"""lm-eval glue for the chain-of-thought tasks ``gsm8k_cot``, ``aqua_cot`` and ``bbh_cot`` (27 tasks).

Protocol (TurboAttention Table 2 via chain-of-thought-hub / GEAR; ``shared/data/README.md``): 8-shot
GSM8K, 8-shot AQuA, 3-shot BBH prompt files, 256 greedy new tokens, answers extracted from the text.

Loaded by lm-eval from the YAMLs beside this file (``!function utils.xxx``), so it imports the
project's data module by file path rather than as a package: it works from ``--include_path
eval/tasks`` of a checkout and from the installed ``turbo_attn_hf/eval/tasks``.

Data: ``custom_dataset`` loaders take lm-eval's task metadata; ``data_dir`` there (``--metadata
'{"data_dir": ...}'`` or ``TaskManager(metadata=...)``) wins, then ``$TURBO_ATTN_DATA``, then
``<repo>/../shared/data``, else the Hugging Face Hub (see ``eval/data.py``).

Each loader adds a ``prompt`` column holding the complete few-shot prompt, so ``num_fewshot`` is 0
and the logged samples show exactly what the model read.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Optional


def _data_module():
    name = "_turbo_attn_eval_data"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "data.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


data = _data_module()

STOP_QUESTION = "\nQuestion:"

# ================================================================================ answer extraction
_NUM_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _to_number(s: str) -> Optional[str]:
    """Normalise a numeric string: drop commas / trailing dot, '18.00' -> '18'. None if not a number."""
    s = s.replace(",", "").rstrip(".")
    try:
        x = float(s)
    except ValueError:
        return None
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


def extract_gsm8k(text: str) -> str:
    """The number after the first ``The answer is`` (else the last number in the text), normalised;
    '' when the text holds no number. The text is first cut at the next ``\\nQuestion:``."""
    text = text.split(STOP_QUESTION)[0]
    m = re.search(r"the answer is", text, flags=re.IGNORECASE)
    if m:
        after = _NUM_RE.search(text[m.end():].replace("$", ""))
        if after:
            return _to_number(after.group(0)) or ""
    nums = _NUM_RE.findall(text.replace("$", ""))
    for n in reversed(nums):
        v = _to_number(n)
        if v is not None:
            return v
    return ""


def gsm8k_gold(doc: dict) -> str:
    return _to_number(data.gsm8k_target(doc["answer"])) or data.gsm8k_target(doc["answer"])


def extract_aqua(text: str) -> str:
    """The text after the first ``answer is`` (case-insensitive), cut at ``\\nQuestion:`` and at the end
    of that line; '' when there is no ``answer is``."""
    text = text.split(STOP_QUESTION)[0]
    m = re.search(r"answer is", text, flags=re.IGNORECASE)
    if not m:
        return ""
    return text[m.end():].strip().split("\n")[0].strip()


def _compact(s: str) -> str:
    return re.sub(r"\s+", "", s).lower()


def aqua_correct(pred: str, options: list[str], correct: str) -> bool:
    """AQuA scoring (GEAR style): right when the extracted prediction names the gold option — its letter
    marker (``C)`` / ``(C)``) or its full ``C)text`` / text — and does not name every option (a model
    that lists all options is not credited)."""
    if not pred:
        return False
    named = set()
    p = _compact(pred)
    for opt in options:
        letter, _, body = opt.partition(")")
        letter = letter.strip().upper()
        marker = re.search(rf"(?<![A-Za-z]){letter}\)", pred, flags=re.IGNORECASE) is not None
        text_hit = len(_compact(body)) > 0 and _compact(body) == p.rstrip(".")
        full_hit = _compact(opt) in p
        if marker or text_hit or full_hit:
            named.add(letter)
    return correct.strip().upper() in named and len(named) < len(options)


_MC_RE = re.compile(r"\([A-R]\)")


def extract_bbh(text: str, target: Optional[str] = None) -> str:
    """What follows the first ``the answer is`` (case-insensitive) up to the end of its line, stripped of
    a trailing period. For multiple-choice targets (``(B)``) the first option marker found in that span
    is the prediction (chain-of-thought-hub's rule), so ``(B) 12/14/1950.`` scores as ``(B)``."""
    m = re.search(r"the answer is", text, flags=re.IGNORECASE)
    if not m:
        return ""
    ans = text[m.end():].strip().split("\n")[0].strip()
    if target is not None and _MC_RE.fullmatch(target.strip()):
        mc = _MC_RE.search(ans)
        if mc:
            return mc.group(0)
    return ans[:-1].rstrip() if ans.endswith(".") else ans


def extract(task: str, text: str, doc: dict) -> str:
    """Extracted answer of one generation; ``task`` is ``gsm8k_cot``, ``aqua_cot`` or ``bbh_cot_<name>``."""
    if task.startswith("gsm8k"):
        return extract_gsm8k(text)
    if task.startswith("aqua"):
        return extract_aqua(text)
    if task.startswith("bbh"):
        return extract_bbh(text, doc.get("target"))
    raise ValueError(f"no answer extraction for task {task!r}; expected gsm8k_cot, aqua_cot or bbh_cot_*")


def score(task: str, text: str, doc: dict) -> bool:
    """Is the generation right?"""
    pred = extract(task, text, doc)
    if task.startswith("gsm8k"):
        return pred != "" and pred == gsm8k_gold(doc)
    if task.startswith("aqua"):
        return aqua_correct(pred, list(doc["options"]), doc["correct"])
    return pred == doc["target"].strip()


# ================================================================================ lm-eval hooks
def _dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def _data_dir(kwargs: dict) -> Optional[str]:
    return kwargs.get("data_dir") or None


def load_gsm8k_cot(**kwargs):
    """custom_dataset for ``gsm8k_cot``: GSM8K test rows + ``prompt`` (8-shot CoT)."""
    d = _data_dir(kwargs)
    prefix = data.read_prompt("gsm8k", d)
    rows = data.load_gsm8k(d)
    return _dataset([{**r, "prompt": data.gsm8k_prompt(r["question"], prefix)} for r in rows])


def load_aqua_cot(**kwargs):
    """custom_dataset for ``aqua_cot``: AQuA test rows + ``prompt`` (8-shot CoT)."""
    d = _data_dir(kwargs)
    prefix = data.read_prompt("aqua", d)
    rows = data.load_aqua(d)
    keep = ("question", "options", "rationale", "correct")
    return _dataset(
        [{**{k: r[k] for k in keep}, "prompt": data.aqua_prompt(r["question"], r["options"], prefix)} for r in rows]
    )


def load_bbh_cot(bbh_task: str, **kwargs):
    """custom_dataset for ``bbh_cot_<task>``: rows + ``prompt`` (3-shot CoT); ``bbh_task`` comes from the
    YAML's ``dataset_kwargs``."""
    d = _data_dir(kwargs)
    prefix = data.read_prompt(f"bbh/{bbh_task}", d)
    rows = data.load_bbh(bbh_task, d)
    return _dataset([{**r, "prompt": data.bbh_prompt(r["input"], prefix)} for r in rows])


def doc_to_text(doc: dict) -> str:
    return doc["prompt"]


def process_gsm8k(doc: dict, results: list[str]) -> dict:
    return {"exact_match": float(score("gsm8k_cot", results[0], doc))}


def process_aqua(doc: dict, results: list[str]) -> dict:
    return {"exact_match": float(score("aqua_cot", results[0], doc))}


def process_bbh(doc: dict, results: list[str]) -> dict:
    return {"exact_match": float(score("bbh_cot", results[0], doc))}
