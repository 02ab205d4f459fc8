"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", §4.2) with a locally generated haystack.

A five-digit passkey is hidden at a chosen depth of a noise haystack (the repeated "The grass is green ..."
lines of the original task; RULER calls this the "noise"/"repeat" haystack), and the prompt ends asking for it::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz
    you about the important information there. <noise ...> The pass key is 68220. Remember it. 68220 is the
    pass key. <noise ...> What is the pass key? The pass key is

Everything is deterministic from ``seed`` (passkey of sample i at length L, depth d: ``random.Random`` seeded
with a string of the four, which Python hashes with SHA-512, so it is stable across runs and machines); nothing
is downloaded. ``length`` is the prompt plus ``gen_tokens`` generated tokens, measured with the model's own
tokenizer, so a sample of length 8192 fits an 8k context window.

Scoring: exact match of the first run of digits in the generated text with the passkey.

Used by ``eval/long_context.py`` (``make_samples``, ``score``) and by lm-eval through ``passkey.yaml`` beside
this file (task ``passkey_local``; ``lm_eval_dataset``, ``process_results``; the tokenizer comes from ``--model_args pretrained=...``
and, for a GGUF model, ``gguf_file=...``).
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple, Optional, Sequence

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"

LENGTHS = (2048, 4096, 8192)
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
#: new tokens generated per sample: SmolLM2's tokenizer writes each digit as one token, plus a leading space
GEN_TOKENS = 8
DIGITS = 5


class Sample(NamedTuple):
    """One prompt: ``text`` has ``n_tokens`` tokens (``n_tokens + gen_tokens <= length``); the needle starts
    after ``needle_token`` of them (``needle_token / n_tokens`` is the realised depth). A NamedTuple,
    not a dataclass: lm-eval executes this file without registering it in ``sys.modules``, which dataclasses need."""

    text: str
    passkey: str
    length: int
    depth: float
    index: int
    n_tokens: int
    needle_token: int


def passkey_for(seed: int, length: int, depth: float, index: int) -> str:
    rng = random.Random(f"passkey-{seed}-{length}-{depth:.4f}-{index}")
    return str(rng.randint(10 ** (DIGITS - 1), 10**DIGITS - 1))


def _join(n_before: int, n_after: int, key: str) -> tuple[str, str]:
    """(text up to the needle, full prompt text) with ``n_before`` / ``n_after`` noise lines around it."""
    before = " ".join([INTRO] + [NOISE] * n_before)
    full = " ".join([before, NEEDLE.format(key=key)] + [NOISE] * n_after + [QUESTION])
    return before, full


def build(tokenizer, length: int, depth: float, key: str, *, gen_tokens: int = GEN_TOKENS,
          index: int = 0) -> Sample:
    """The longest prompt with ``n_tokens + gen_tokens <= length`` and the needle after ``round(depth * n)`` of
    its ``n`` noise lines."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    budget = length - gen_tokens
    fixed = count(_join(0, 0, key)[1])
    per_line = max(1, count(" ".join([NOISE] * 8)) // 8)
    n = max(0, (budget - fixed) // per_line + 2)  # a little over, then shrink to fit (BPE is not exactly additive)
    while True:
        n_before = round(depth * n)
        before, text = _join(n_before, n - n_before, key)
        n_tok = count(text)
        if n_tok <= budget or n == 0:
            break
        n -= max(1, (n_tok - budget) // per_line)
    if n_tok > budget:
        raise ValueError(f"length={length} is too short for a passkey prompt ({n_tok} tokens + {gen_tokens} generated)")
    return Sample(text, key, length, depth, index, n_tok, count(before))


def make_samples(tokenizer, lengths: Sequence[int] = LENGTHS, depths: Sequence[float] = DEPTHS, per_depth: int = 4,
                 seed: int = 0, gen_tokens: int = GEN_TOKENS) -> list[Sample]:
    """``per_depth`` samples at every (length, depth), in that order; deterministic from ``seed``."""
    out = []
    for L in lengths:
        for d in depths:
            for i in range(per_depth):
                out.append(build(tokenizer, L, d, passkey_for(seed, L, d, i), gen_tokens=gen_tokens, index=i))
    return out


def extract(generation: str) -> str:
    """The first run of digits in the generated text ("" when there is none)."""
    m = re.search(r"\d+", generation)
    return m.group(0) if m else ""


def score(generation: str, passkey: str) -> bool:
    return extract(generation) == passkey


# ---------------------------------------------------------------------------------------------- lm-eval glue
def _tokenizer(kw: dict):
    from transformers import AutoTokenizer

    name = kw.get("tokenizer") or kw.get("pretrained")
    if not name:
        raise ValueError("passkey needs a tokenizer to size its prompts: pass --model_args pretrained=DIR "
                         "(and gguf_file=F.gguf for a GGUF model) or --metadata '{\"tokenizer\": DIR}'")
    extra = {"gguf_file": kw["gguf_file"]} if kw.get("gguf_file") else {}
    return AutoTokenizer.from_pretrained(name, **extra)


def lm_eval_dataset(**kw) -> dict:
    """lm-eval ``custom_dataset``: metadata keys ``lengths`` (default 2048, 4096, 8192), ``depths``, ``per_depth``
    (4), ``seed`` (0), plus the tokenizer (``tokenizer`` or ``pretrained``, ``gguf_file``)."""
    import datasets

    samples = make_samples(_tokenizer(kw), lengths=kw.get("lengths", LENGTHS), depths=kw.get("depths", DEPTHS),
                           per_depth=int(kw.get("per_depth", 4)), seed=int(kw.get("seed", 0)))
    return {"test": datasets.Dataset.from_list([s._asdict() for s in samples])}


def process_results(doc: dict, results: list) -> dict:
    """``acc`` over every sample, and one metric per length (other lengths' samples are -1, skipped by
    ``mean_present``)."""
    ok = float(score(results[0], doc["passkey"]))
    return {"acc": ok, **{str(L): (ok if doc["length"] == L else -1.0) for L in LENGTHS}}


def mean_present(values: list) -> float:
    vals = [v for v in values if v >= 0]
    return sum(vals) / len(vals) if vals else -1.0


def summarize(samples: Sequence[Sample], correct: Sequence[bool], lengths: Optional[Sequence[int]] = None) -> dict:
    """``{str(length): accuracy}`` plus ``{"by_depth": {str(length): {str(depth): accuracy}}}`` and ``all``."""
    if len(samples) != len(correct):
        raise ValueError(f"{len(samples)} samples but {len(correct)} scores")
    lengths = lengths or sorted({s.length for s in samples})
    out: dict = {"by_depth": {}}
    for L in lengths:
        rows = [(s, c) for s, c in zip(samples, correct) if s.length == L]
        out[str(L)] = sum(c for _, c in rows) / len(rows) if rows else None
        depths = sorted({s.depth for s, _ in rows})
        out["by_depth"][str(L)] = {
            f"{d:g}": sum(c for s, c in rows if s.depth == d) / sum(1 for s, _ in rows if s.depth == d) for d in depths}
    out["all"] = sum(correct) / len(correct) if correct else None
    out["n"] = len(correct)
    return out
