"""Evaluation data: GSM8K, AQuA-RAT, BIG-Bench Hard and their chain-of-thought prompt files.

Where the data comes from, first match wins:
  1. an explicit ``data_dir`` (``--data-dir`` on every CLI),
  2. the environment variable ``TURBO_ATTN_DATA``,
  3. ``<repo root>/../shared/data`` when it exists (CI and the team's machines; read-only, never copied),
  4. online: the Hugging Face Hub datasets (``openai/gsm8k``, ``deepmind/aqua_rat``, ``lukaemon/bbh``)
     and the upstream prompt files (URLs below).

The offline layout (``../shared/data/README.md``)::

    gsm8k/test.jsonl                 question, answer ("... #### N")
    aqua/test.json                   one JSON object per line: question, options ["A)..", ...], rationale, correct
    bbh/<task>.json                  {"examples": [{"input", "target"}]}
    prompts/gsm8k_cot_8shot.txt      8 exemplars "Question: ... / Let's think step by step / ... The answer is N."
    prompts/aqua_cot_8shot.txt       8 exemplars with "Option:" lines
    prompts/bbh/<task>.txt           3-shot CoT prompt of each BBH task

Prompt shapes (the TurboAttention paper's harness, chain-of-thought-hub / GEAR)::

    gsm8k: <prefix>\\nQuestion: {question}\\nLet's think step by step\\n
    aqua:  <prefix>\\nQuestion: {question}\\nOption:\\n{A)..\\nB)..}\\nLet's think step by step\\n
    bbh:   <prefix>\\n\\nQ: {input}\\nA: Let's think step by step.\\n
"""

from __future__ import annotations

import json
import os
import urllib.request
from functools import lru_cache
from pathlib import Path
from typing import Optional

ENV_VAR = "TURBO_ATTN_DATA"

BBH_TASKS = (
    "boolean_expressions", "causal_judgement", "date_understanding", "disambiguation_qa",
    "dyck_languages", "formal_fallacies", "geometric_shapes", "hyperbaton",
    "logical_deduction_five_objects", "logical_deduction_seven_objects",
    "logical_deduction_three_objects", "movie_recommendation", "multistep_arithmetic_two",
    "navigate", "object_counting", "penguins_in_a_table", "reasoning_about_colored_objects",
    "ruin_names", "salient_translation_error_detection", "snarks", "sports_understanding",
    "temporal_sequences", "tracking_shuffled_objects_five_objects",
    "tracking_shuffled_objects_seven_objects", "tracking_shuffled_objects_three_objects",
    "web_of_lies", "word_sorting",
)

# Online sources (used only when no local data directory is found).
HUB_IDS = {
    "gsm8k": ("openai/gsm8k", "main"),
    "aqua": ("deepmind/aqua_rat", "raw"),
    "bbh": ("lukaemon/bbh", None),  # config name = task
}
PROMPT_URLS = {
    "gsm8k_cot_8shot.txt": (
        "https://raw.githubusercontent.com/FranxYao/chain-of-thought-hub/main/gsm8k/lib_prompt/"
        "prompt_original.txt"
    ),
    "bbh/{task}.txt": "https://raw.githubusercontent.com/suzgunmirac/BIG-Bench-Hard/main/cot-prompts/{task}.txt",
}


class DataNotFoundError(FileNotFoundError):
    """A data file is missing; the message names the path and how to point the project at the data."""


def repo_root() -> Path:
    """The checkout root (``eval/`` lives directly under it, also when installed editable)."""
    return Path(__file__).resolve().parents[1]


def find_data_dir(data_dir: Optional[str | os.PathLike] = None) -> Optional[Path]:
    """Local data directory: ``data_dir`` > ``$TURBO_ATTN_DATA`` > ``<repo>/../shared/data``; None = online.

    An explicitly given directory (argument or env var) must exist, else DataNotFoundError.
    """
    for src, cand in (("data_dir", data_dir), (ENV_VAR, os.environ.get(ENV_VAR))):
        if cand:
            p = Path(cand).expanduser().resolve()
            if not p.is_dir():
                raise DataNotFoundError(
                    f"{src}={str(cand)!r} is not a directory; point it at a copy of shared/data "
                    f"(with gsm8k/, aqua/, bbh/, prompts/) or unset it to use the Hugging Face Hub"
                )
            return p
    p = (repo_root().parent / "shared" / "data").resolve()
    return p if p.is_dir() else None


def _need(path: Path) -> Path:
    if not path.is_file():
        raise DataNotFoundError(
            f"{path} not found; --data-dir / ${ENV_VAR} must point at a directory laid out like "
            f"shared/data (see eval/data.py)"
        )
    return path


# ---------------------------------------------------------------------------------------------- rows
def _hub_rows(name: str, config: Optional[str]) -> list[dict]:
    import datasets  # optional dependency (pip install turbo-attn-hf[eval])

    hub_id, default_cfg = HUB_IDS[name]
    ds = datasets.load_dataset(hub_id, config or default_cfg, split="test")
    return [dict(r) for r in ds]


def load_gsm8k(data_dir: Optional[str | os.PathLike] = None) -> list[dict]:
    """GSM8K test rows ``{"question", "answer"}`` (1319)."""
    d = find_data_dir(data_dir)
    if d is None:
        return _hub_rows("gsm8k", None)
    with open(_need(d / "gsm8k" / "test.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_aqua(data_dir: Optional[str | os.PathLike] = None) -> list[dict]:
    """AQuA-RAT test rows ``{"question", "options", "rationale", "correct"}`` (254)."""
    d = find_data_dir(data_dir)
    if d is None:
        return _hub_rows("aqua", None)
    with open(_need(d / "aqua" / "test.json")) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_bbh(task: str, data_dir: Optional[str | os.PathLike] = None) -> list[dict]:
    """Rows ``{"input", "target"}`` of one BBH task."""
    if task not in BBH_TASKS:
        raise ValueError(f"unknown BBH task {task!r}; the 27 tasks are {list(BBH_TASKS)}")
    d = find_data_dir(data_dir)
    if d is None:
        return _hub_rows("bbh", task)
    with open(_need(d / "bbh" / f"{task}.json")) as f:
        return [{"input": e["input"], "target": e["target"]} for e in json.load(f)["examples"]]


@lru_cache(maxsize=64)
def _read_prompt(rel: str, data_dir: Optional[str]) -> str:
    d = find_data_dir(data_dir)
    if d is not None:
        return _need(d / "prompts" / rel).read_text()
    key = "bbh/{task}.txt" if rel.startswith("bbh/") else rel
    if key not in PROMPT_URLS:
        raise DataNotFoundError(
            f"prompt file {rel} has no online source; pass --data-dir (or set ${ENV_VAR}) to a directory "
            f"laid out like shared/data"
        )
    url = PROMPT_URLS[key].format(task=Path(rel).stem)
    with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 (fixed https URL)
        return r.read().decode()


def read_prompt(name: str, data_dir: Optional[str | os.PathLike] = None) -> str:
    """Few-shot prefix: ``gsm8k``, ``aqua`` or ``bbh/<task>``."""
    rel = {"gsm8k": "gsm8k_cot_8shot.txt", "aqua": "aqua_cot_8shot.txt"}.get(name, f"{name}.txt")
    return _read_prompt(rel, None if data_dir is None else str(data_dir))


# ---------------------------------------------------------------------------------------------- prompts
def gsm8k_prompt(question: str, prefix: str) -> str:
    return f"{prefix}\nQuestion: {question}\nLet's think step by step\n"


def aqua_prompt(question: str, options: list[str], prefix: str) -> str:
    opts = "\n".join(options)
    return f"{prefix}\nQuestion: {question}\nOption:\n{opts}\nLet's think step by step\n"


def bbh_prompt(inp: str, prefix: str) -> str:
    return f"{prefix}\n\nQ: {inp}\nA: Let's think step by step.\n"


def gsm8k_target(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer, commas removed."""
    return answer.split("####")[-1].strip().replace(",", "")


def gsm8k_gold_cot(answer: str) -> str:
    """A GSM8K gold answer in the CoT prompt's style: rationale lines without the ``<<a*b=c>>``
    calculator annotations, then ``The answer is N.`` (teacher-forced text for fidelity metrics)."""
    import re

    rationale, _, _ = answer.partition("####")
    rationale = re.sub(r"<<[^>]*>>", "", rationale).strip()
    return f"{rationale}\nThe answer is {gsm8k_target(answer)}.\n"
