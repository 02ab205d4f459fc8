"""Teacher-forced fidelity of an attention implementation to the fp32 eager model (DESIGN.md §6).

For each text (GSM8K question in the CoT prompt + the gold answer written in the prompt's style) the
reference is the fp32 eager model's next-token distribution p at every position; an implementation
gives q. Reported per implementation:

- ``kl``: mean next-token KL(p ‖ q) in nats, ``top1``: fraction of positions where argmax p == argmax q,
  ``ppl``: perplexity of the gold answer tokens under q (``ppl_ref`` under p, ``dppl`` the relative change),
  all over the answer positions (the answer fed teacher-forced);
- two paths: ``prefill`` = one full forward over prompt + answer (no cache: the prefill kernel), and
  ``decode`` = prompt prefilled into a cache, then the answer fed through it ``chunk`` tokens at a time
  (``TurboCache`` for turbo presets, where INT4/INT2 block storage matters; ``DynamicCache`` for sdpa);
  ``prefill_all`` also averages the prefill path over every position of the text.

``sdpa-bf16`` against eager-fp32 is the floor (DESIGN §6 measured KL 1.25e-3, top-1 97.9 % on
SmolLM2-135M-Instruct); presets are reported next to it and as a multiple of it.

Per-layer diagnostic (``layer_diagnostic``, ``--layer-diag N``; issue 23): one prefill forward per text in which
every attention layer computes the turbo output and fp32 exact attention on the same Q/K/V and passes the exact
one on (errors do not compound): relative RMS error per layer of turbo and of bf16 sdpa vs fp32, and Q/K
channel-outlier statistics (per-token max/mean of |x| over the head dim, unrotated and Hadamard-rotated).

``--rotate-qk both`` adds a ``rotate_qk=hadamard`` twin of every preset (same as ``int8:rotate_qk=hadamard``);
``--max-tokens N`` keeps the last N tokens of each text (answer intact, the few-shot prefix cut from the left).

Greedy answer agreement (``greedy_generate`` + ``answer_agreement``): free greedy CoT generation
compared by extracted final answer; its floor is eager-fp32 vs sdpa-bf16 (~50 % on a 135M model).

    python -m eval.fidelity --model DIR --gguf-file F.gguf --presets int8,int4,mixed --limit 100 \\
        [--shots 8] [--chunk 1] [--answers 200] --data-dir ../shared/data --out eval/results/fidelity_smollm2
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from turbo_attn_hf.generation import cache_arg, output_cache
from turbo_attn_hf.loading import LOAD_KWARGS

from . import data as edata
from .bench_common import split_presets, write_report

REF = "eager-fp32"
FLOOR = "sdpa-bf16"
MODES = ("prefill", "decode")


# ================================================================================ texts
@dataclass
class Example:
    """One teacher-forced text: ``ids`` = prompt + answer (1-D LongTensor); the answer starts at ``prompt_len``."""

    ids: torch.Tensor
    prompt_len: int


def gsm8k_examples(tokenizer, rows: Sequence[dict], shots: int = 8, data_dir=None) -> list[Example]:
    """Question in the CoT prompt (8-shot prefix when ``shots`` = 8, none when 0) + gold CoT answer."""
    if shots not in (0, 8):
        raise ValueError(f"shots={shots} is not supported; use 0 or 8 (the GSM8K CoT prompt file has 8 exemplars)")
    prefix = edata.read_prompt("gsm8k", data_dir) if shots else ""
    out = []
    for r in rows:
        prompt = edata.gsm8k_prompt(r["question"], prefix)
        if not shots:
            prompt = prompt.lstrip("\n")
        p = tokenizer(prompt).input_ids
        a = tokenizer(edata.gsm8k_gold_cot(r["answer"]), add_special_tokens=False).input_ids
        out.append(Example(torch.tensor(p + a, dtype=torch.long), len(p)))
    return out


#: plain English of common words: a sound subword tokenizer takes ~1.2 tokens a word (SmolLM2's, Gemma-3's on
#: transformers 5.23); transformers 5.17's GGUF conversion of Gemma-3's tokenizer took 2.1 (words cut into letter
#: pairs), texts the model never saw, and every Gemma-3 reading made with it was skewed (eval/PERF_NOTES.md session 28)
PROBE_SENTENCE = "Natalia sold clips to her friends in April, and then she sold half as many clips in May."
MAX_TOKENS_PER_WORD = 1.6


def tokenizer_probe(tokenizer) -> dict:
    """Tokens a word of :data:`PROBE_SENTENCE`, recorded with every result; above :data:`MAX_TOKENS_PER_WORD` the
    probe carries a ``warning`` (also printed): the readings are over texts the model was not trained on."""
    n = len(tokenizer(PROBE_SENTENCE, add_special_tokens=False)["input_ids"])
    per_word = n / len(PROBE_SENTENCE.split())
    probe = {"sentence": PROBE_SENTENCE, "tokens": n, "tokens_per_word": round(per_word, 3)}
    if per_word > MAX_TOKENS_PER_WORD:
        probe["warning"] = (f"the tokenizer splits plain English into {per_word:.2f} tokens a word (more than "
                            f"{MAX_TOKENS_PER_WORD}): a broken conversion (transformers 5.17's GGUF Gemma-3 tokenizer "
                            "does this); use a transformers release that converts this model's tokenizer properly")
        print(f"fidelity: warning: {probe['warning']}", file=sys.stderr)
    return probe


def truncate_examples(examples: Sequence[Example], max_tokens: int) -> list[Example]:
    """Keep the last ``max_tokens`` tokens of each text (CPU-sized runs); the answer stays whole, so texts whose
    answer alone is longer keep just one prompt token."""
    out = []
    for ex in examples:
        cut = max(0, min(len(ex.ids) - max_tokens, ex.prompt_len - 1))
        out.append(Example(ex.ids[cut:], ex.prompt_len - cut))
    return out


# ================================================================================ implementations
@dataclass
class Impl:
    """How to run the model: attention implementation, weight dtype and (turbo) config."""

    name: str
    attn: str  # "eager" | "sdpa" | "turbo_int8"
    dtype: torch.dtype = torch.bfloat16
    turbo_config: Optional[object] = None  # TurboConfig for turbo_int8

    def new_cache(self, model):
        if self.attn == "turbo_int8":
            import turbo_attn_hf

            return turbo_attn_hf.TurboCache(self.turbo_config, config=model.config)
        from transformers import DynamicCache

        return DynamicCache(config=model.config)


def with_rotation(presets: Iterable[str], rotate_qk: str) -> list[str]:
    """``rotate_qk`` = ``none`` (presets as given), ``hadamard`` (each preset rotated) or ``both`` (each preset,
    then its ``rotate_qk=hadamard`` twin)."""
    if rotate_qk not in ("none", "hadamard", "both"):
        raise ValueError(f"rotate_qk={rotate_qk!r} must be none, hadamard or both")
    out = []
    for p in presets:
        rot = p + ("," if ":" in p else ":") + "rotate_qk=hadamard"
        out += {"none": [p], "hadamard": [rot], "both": [p, rot]}[rotate_qk]
    return out


def impls_for(presets: Iterable[str]) -> list[Impl]:
    """The floor (sdpa-bf16) followed by one turbo_int8 Impl per preset name / YAML path, optionally with
    field overrides for ablations: ``int4:sink_blocks=0,recent_blocks=0`` (``TurboConfig.from_spec``)."""
    from turbo_attn_hf.config import TurboConfig

    out = [Impl(FLOOR, "sdpa")]
    for spec in presets:
        p, _, over = spec.partition(":")
        cfg = TurboConfig.from_spec(spec)
        name = Path(p).stem if p.endswith((".yaml", ".yml")) else p
        if over:
            name += f"[{over}]"
        out.append(Impl(f"turbo-{name}", "turbo_int8", torch.bfloat16, cfg))
    return out


def prepare(model, impl: Impl):
    """Switch ``model`` (already in ``impl.dtype``) to the implementation, in place."""
    if model.config._attn_implementation != impl.attn:
        model.set_attn_implementation(impl.attn)
    if impl.attn == "turbo_int8":
        import turbo_attn_hf

        turbo_attn_hf.set_turbo_config(model, impl.turbo_config)
    return model


# ================================================================================ log-probs
@torch.no_grad()
def next_token_logprobs(
    model, ids: torch.Tensor, *, mode: str = "prefill", prompt_len: int = 0, chunk: int = 1,
    cache_factory: Optional[Callable[[], object]] = None,
) -> torch.Tensor:
    """log-softmax of the next-token logits, fp32, ``[T - 1, V]`` (row t predicts ``ids[t + 1]``).

    Args:
        ids: ``[T]`` token ids.
        mode: ``prefill``: one forward over all T tokens without a cache. ``decode``: the first
            ``prompt_len`` tokens prefilled into ``cache_factory()``, the rest fed ``chunk`` at a time.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    dev = next(model.parameters()).device
    x = ids.to(dev)[None]
    T = x.shape[1]
    if mode == "prefill":
        logits = model(x, use_cache=False).logits[0, :-1]
        return F.log_softmax(logits.float(), dim=-1)
    if not 0 < prompt_len < T:
        raise ValueError(f"decode mode needs 0 < prompt_len < T; got prompt_len={prompt_len}, T={T}")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    cache = cache_factory() if cache_factory is not None else None
    out = model(x[:, :prompt_len], **cache_arg(cache), use_cache=True)
    cache = output_cache(out)
    parts = [F.log_softmax(out.logits[0].float(), dim=-1)]
    for s in range(prompt_len, T - 1, chunk):
        e = min(s + chunk, T - 1)
        out = model(x[:, s:e], **cache_arg(cache), use_cache=True)
        cache = output_cache(out)
        parts.append(F.log_softmax(out.logits[0].float(), dim=-1))
    return torch.cat(parts, 0)


@dataclass
class Stats:
    """Running sums over scored positions."""

    kl: float = 0.0
    top1: int = 0
    nll: float = 0.0
    nll_ref: float = 0.0
    n: int = 0
    kl_max: float = 0.0

    def add(self, ref: torch.Tensor, q: torch.Tensor, targets: torch.Tensor) -> None:
        """ref, q: ``[N, V]`` log-probs; targets: ``[N]`` the tokens that follow."""
        ref, q, targets = ref.float(), q.float().to(ref.device), targets.to(ref.device)
        kl = (ref.exp() * (ref - q)).sum(-1).clamp_min(0)
        self.kl += float(kl.double().sum())
        self.kl_max = max(self.kl_max, float(kl.max())) if kl.numel() else self.kl_max
        self.top1 += int((ref.argmax(-1) == q.argmax(-1)).sum())
        self.nll -= float(q.gather(-1, targets[:, None]).double().sum())
        self.nll_ref -= float(ref.gather(-1, targets[:, None]).double().sum())
        self.n += int(targets.numel())

    def summary(self) -> dict:
        n = max(self.n, 1)
        ppl, ppl_ref = math.exp(self.nll / n), math.exp(self.nll_ref / n)
        return {
            "kl": self.kl / n, "kl_max": self.kl_max, "top1": self.top1 / n, "ppl": ppl, "ppl_ref": ppl_ref,
            "dppl": ppl / ppl_ref - 1.0, "n_tokens": self.n,
        }


def teacher_forced(
    ref_model, model, examples: Sequence[Example], impls: Sequence[Impl], *, modes: Sequence[str] = MODES,
    chunk: int = 1, progress: bool = True,
) -> dict:
    """Fidelity of each implementation to ``ref_model`` (fp32 eager) on the examples.

    ``model`` is the copy that is switched between implementations (weights in bf16/fp16); the
    reference is computed once per example. Returns ``{impl: {mode: summary}}`` with the modes
    ``prefill``, ``prefill_all`` and ``decode`` (see the module docstring).
    """
    from tqdm.auto import tqdm

    stats = {i.name: {m: Stats() for m in (*modes, *(["prefill_all"] if "prefill" in modes else []))} for i in impls}
    bar = tqdm(examples, desc="teacher-forced", unit="text", disable=not progress)
    for ex in bar:
        ref = next_token_logprobs(ref_model, ex.ids)  # [T-1, V]
        tgt = ex.ids[1:]
        a0 = ex.prompt_len - 1  # first row that predicts an answer token
        for impl in impls:
            prepare(model, impl)
            for mode in modes:
                q = next_token_logprobs(
                    model, ex.ids, mode=mode, prompt_len=ex.prompt_len, chunk=chunk,
                    cache_factory=lambda: impl.new_cache(model),
                )
                stats[impl.name][mode].add(ref[a0:], q[a0:], tgt[a0:])
                if mode == "prefill":
                    stats[impl.name]["prefill_all"].add(ref, q, tgt)
                del q
        del ref
    return {name: {m: s.summary() for m, s in per.items()} for name, per in stats.items()}


# ================================================================================ per-layer diagnostic
def outlier_ratio(x: torch.Tensor) -> tuple[float, float]:
    """Per-token max/mean of |x| over the head dim (``x [b, H, L, d]``): (mean over heads and tokens, max)."""
    a = x.float().abs()
    r = a.amax(-1) / a.mean(-1).clamp_min(1e-30)
    return float(r.mean()), float(r.max())


@torch.no_grad()
def layer_diagnostic(model, examples: Sequence[Example], impls: Sequence[Impl]) -> dict:
    """Per attention layer, for each turbo impl (prefill path, one forward per text, the model as ``prepare``
    leaves it): ``err`` = rel. RMS of turbo's output vs fp32 exact attention on the same Q/K/V, ``err_bf16`` =
    the same for bf16 unquantized attention (the floor), ``q_ratio``/``k_ratio`` = (mean, max) per-token
    max/mean |x| (``outlier_ratio``), ``*_rot`` after the Hadamard rotation. Each layer passes the exact
    output on, so a layer's error is its own. Returns ``{impl: [per-layer dict, text-averaged]}``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from turbo_attn_hf.attention import torch_attention, turbo_attention_forward
    from turbo_attn_hf.kernels.rotation import rotate

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))

    out: dict = {}
    dev = next(model.parameters()).device
    for impl in impls:
        if impl.attn != "turbo_int8":
            continue
        prepare(model, impl)
        rows: dict[int, list[dict]] = {}

        def capture(module, q, k, v, mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kw):
            o, _ = turbo_attention_forward(module, q, k, v, mask, scaling=scaling, dropout=dropout,
                                           sliding_window=sliding_window, softcap=softcap, **kw)
            causal = kw.get("is_causal")
            causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
            kv = mask if mask is not None and mask.dim() == 2 else None
            w = sliding_window if sliding_window and sliding_window > 0 else None
            akw = dict(scale=scaling, causal=causal, window=w, softcap=softcap, key_valid=kv)
            exact = torch_attention(q.float(), k.float(), v.float(), **akw)
            bf = torch_attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), **akw)
            qr, kr = outlier_ratio(q), outlier_ratio(k)
            qrr, krr = outlier_ratio(rotate(q)), outlier_ratio(rotate(k))
            rows.setdefault(int(getattr(module, "layer_idx", len(rows))), []).append(dict(
                sliding=w is not None, err=rel(o, exact), err_bf16=rel(bf, exact), q_ratio=qr, k_ratio=kr,
                q_ratio_rot=qrr, k_ratio_rot=krr))
            return exact.to(q.dtype), None

        ALL_ATTENTION_FUNCTIONS["turbo_int8"] = capture  # local override of the shared mapping, removed below
        try:
            for ex in examples:
                model(ex.ids.to(dev)[None], use_cache=False)
        finally:
            del ALL_ATTENTION_FUNCTIONS["turbo_int8"]

        def avg(vals):
            if isinstance(vals[0], (tuple, list)):
                return [sum(v[0] for v in vals) / len(vals), max(v[1] for v in vals)]
            if isinstance(vals[0], bool):
                return vals[0]
            return sum(vals) / len(vals)

        out[impl.name] = [
            {"layer": i, **{key: avg([r[key] for r in rs]) for key in rs[0]}} for i, rs in sorted(rows.items())
        ]
    return out


def diag_markdown(diag: dict) -> str:
    lines = []
    for name, layers in diag.items():
        errs = [l["err"] for l in layers]
        lines += ["", f"Per-layer attention error, {name} (prefill; rel. RMS vs fp32 exact on the same Q/K/V; "
                  f"mean {100 * sum(errs) / len(errs):.2f} %, max {100 * max(errs):.2f} %):", "",
                  "| layer | sliding | turbo err % | bf16 err % | Q max/mean (mean, max) | K max/mean | "
                  "Q rotated | K rotated |", "|---|---|---|---|---|---|---|---|"]
        for l in layers:
            f = lambda t: f"{t[0]:.1f}, {t[1]:.1f}"  # noqa: E731
            lines.append(f"| {l['layer']} | {'y' if l['sliding'] else 'n'} | {100 * l['err']:.2f} | "
                         f"{100 * l['err_bf16']:.3f} | {f(l['q_ratio'])} | {f(l['k_ratio'])} | "
                         f"{f(l['q_ratio_rot'])} | {f(l['k_ratio_rot'])} |")
    return "\n".join(lines) + "\n"


# ================================================================================ greedy answers
@torch.no_grad()
def greedy_generate(
    model, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 256, batch_size: int = 8,
    cache_factory: Optional[Callable[[], object]] = None, stop: Sequence[str] = ("\nQuestion:",),
    progress: bool = True,
) -> list[str]:
    """Greedy continuations (left-padded batches), cut at the first stop string."""
    from tqdm.auto import tqdm

    dev = next(model.parameters()).device
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    outs: list[str] = []
    try:
        for i in tqdm(range(0, len(prompts), batch_size), desc="greedy", unit="batch", disable=not progress):
            enc = tokenizer(list(prompts[i:i + batch_size]), return_tensors="pt", padding=True).to(dev)
            kw = {} if cache_factory is None else cache_arg(cache_factory())
            gen = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                stop_strings=list(stop) or None, tokenizer=tokenizer, **kw,
            )
            for row in gen[:, enc["input_ids"].shape[1]:]:
                text = tokenizer.decode(row, skip_special_tokens=True)
                for s in stop:
                    text = text.split(s)[0]
                outs.append(text)
    finally:
        tokenizer.padding_side = old_side
    return outs


def answer_agreement(a: Sequence[str], b: Sequence[str], extract: Optional[Callable[[str], str]] = None) -> float:
    """Fraction of generations whose extracted final answers are equal (GSM8K extraction by default)."""
    if len(a) != len(b):
        raise ValueError(f"answer lists differ in length: {len(a)} vs {len(b)}")
    if extract is None:
        from .tasks.utils import extract_gsm8k as extract
    return sum(extract(x) == extract(y) for x, y in zip(a, b)) / max(len(a), 1)


# ================================================================================ CLI
def _meta(device: torch.device) -> dict:
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        v["triton"] = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    from .bench_common import _git_commit

    return {"device": name, "versions": v, "threads": torch.get_num_threads(),
            "git_commit": os.environ.get("TURBO_GIT_COMMIT") or _git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def to_markdown(res: dict) -> str:
    tf = res["teacher_forced"]
    floor = tf.get(FLOOR, {})
    lines = [
        f"Teacher-forced fidelity vs {REF} on {res['device']}, {res['date']}: {res['n_texts']} GSM8K texts "
        f"({res['shots']}-shot CoT prompt + gold answer), decode chunk {res['chunk']}; `{res['command']}`",
        "",
        *([f"**Warning: {res['tokenizer_probe']['warning']}**", ""] if "warning" in res.get("tokenizer_probe", {})
          else []),
        "| impl | path | KL (nats) | KL / floor | top-1 % | ppl | Δppl % | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, per in tf.items():
        for mode, s in per.items():
            f = floor.get(mode, {}).get("kl")
            ratio = "–" if not f else f"{s['kl'] / f:.2f}×"
            lines.append(
                f"| {name} | {mode} | {s['kl']:.3e} | {ratio} | {100 * s['top1']:.2f} | {s['ppl']:.3f} | "
                f"{100 * s['dppl']:+.2f} | {s['n_tokens']} |"
            )
    if res.get("answers"):
        ans = res["answers"]
        lines += ["", f"Greedy GSM8K CoT answer agreement ({ans['n']} prompts, {ans['max_new_tokens']} new tokens):", "",
                  "| impl | agree vs sdpa-bf16 % | agree vs eager-fp32 % |", "|---|---|---|"]
        for name, r in ans["agreement"].items():
            vs_s = "–" if r.get("vs_sdpa") is None else f"{100 * r['vs_sdpa']:.1f}"
            vs_e = "–" if r.get("vs_eager") is None else f"{100 * r['vs_eager']:.1f}"
            lines.append(f"| {name} | {vs_s} | {vs_e} |")
        lines += ["", f"Floor: {FLOOR} vs {REF} (free greedy generation of a small model is chaotic)."]
    lines += ["", "Paths: prefill = one forward over prompt + answer (scored on answer tokens; prefill_all on every "
              "token); decode = prompt prefilled into the cache, answer fed through it."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(prog="turbo-attn fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--gguf-dense", action="store_true",
                    help="dequantize the GGUF weights once at load into plain Linear layers (transformers >= 5.23 "
                         "keeps them packed and unpacks them in every matmul: many times slower on a CPU)")
    ap.add_argument("--presets", default="int8,int4,mixed",
                    help="comma list of preset names / YAML paths, each with optional overrides, "
                         "e.g. int4:sink_blocks=0,recent_blocks=0")
    ap.add_argument("--rotate-qk", default="none", choices=("none", "hadamard", "both"),
                    help="Hadamard-rotate Q/K in every preset, or 'both': each preset and its rotated twin; 'none': "
                         "the presets as given (their rotate_qk, 'auto' by default: on for q/k-norm models)")
    ap.add_argument("--limit", type=int, default=100, help="GSM8K test texts for the teacher-forced metrics")
    ap.add_argument("--max-tokens", type=int, default=0, help="keep the last N tokens of each text (0: all)")
    ap.add_argument("--layer-diag", type=int, default=0,
                    help="per-layer attention error + Q/K outlier stats on the first N texts (prefill path)")
    ap.add_argument("--shots", type=int, default=8, choices=(0, 8))
    ap.add_argument("--chunk", type=int, default=1, help="answer tokens per decode step")
    ap.add_argument("--modes", default="prefill,decode")
    ap.add_argument("--answers", type=int, default=0, help="also greedy answer agreement on this many prompts")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="eval/results/fidelity")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import turbo_attn_hf  # noqa: F401  (registers turbo_int8)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(args.model, **kw)
    mkw = dict(kw)
    if args.gguf_file and args.gguf_dense:
        from transformers import GgufConfig

        mkw["quantization_config"] = GgufConfig(dequantize=True)
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager", **mkw,
                                               **LOAD_KWARGS)
    ref = ref.to(device).eval()
    model = copy.deepcopy(ref).to(getattr(torch, args.dtype))
    model.set_attn_implementation("sdpa")
    impls = impls_for(with_rotation(split_presets(args.presets), args.rotate_qk))

    rows = edata.load_gsm8k(args.data_dir)
    examples = gsm8k_examples(tok, rows[: args.limit], shots=args.shots, data_dir=args.data_dir)
    if args.max_tokens:
        examples = truncate_examples(examples, args.max_tokens)
    res = {
        "what": "teacher-forced next-token KL(eager-fp32 || impl), top-1 agreement, perplexity; greedy answer agreement",
        **_meta(device),
        "command": " ".join([os.path.basename(sys.executable), "-m", "eval.fidelity"] + (argv or sys.argv[1:])),
        "args": vars(args), "n_texts": len(examples), "shots": args.shots, "chunk": args.chunk,
        "mean_prompt_tokens": sum(e.prompt_len for e in examples) / max(len(examples), 1),
        "mean_answer_tokens": sum(len(e.ids) - e.prompt_len for e in examples) / max(len(examples), 1),
        "tokenizer_probe": tokenizer_probe(tok),
        "presets": {i.name: (None if i.turbo_config is None else i.turbo_config.to_dict()) for i in impls},
    }
    res["teacher_forced"] = teacher_forced(
        ref, model, examples, impls, modes=[m for m in args.modes.split(",") if m], chunk=args.chunk
    )
    md_extra = ""
    if args.layer_diag:
        res["layer_diag"] = layer_diagnostic(model, examples[: args.layer_diag], impls)
        res["layer_diag_texts"] = min(args.layer_diag, len(examples))
        md_extra = diag_markdown(res["layer_diag"])
    if args.answers:
        prefix = edata.read_prompt("gsm8k", args.data_dir)
        prompts = [edata.gsm8k_prompt(r["question"], prefix) for r in rows[: args.answers]]
        gens = {REF: greedy_generate(ref, tok, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)}
        for impl in impls:
            prepare(model, impl)
            factory = (lambda impl=impl: impl.new_cache(model)) if impl.attn == "turbo_int8" else None
            gens[impl.name] = greedy_generate(
                model, tok, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                cache_factory=factory,
            )
        from .tasks.utils import extract_gsm8k, gsm8k_gold

        res["answers"] = {
            "n": len(prompts), "max_new_tokens": args.max_new_tokens,
            "accuracy": {k: sum(extract_gsm8k(g) == gsm8k_gold(r) for g, r in zip(v, rows)) / len(v) for k, v in gens.items()},
            "agreement": {
                k: {"vs_eager": answer_agreement(v, gens[REF]),
                    "vs_sdpa": None if k == FLOOR else answer_agreement(v, gens[FLOOR])}
                for k, v in gens.items() if k != REF
            },
        }
    write_report(args.out, "fidelity", res, to_markdown(res) + md_extra)
    return res


if __name__ == "__main__":
    main()
