"""Long-context fidelity of each KV-cache method on one model, side by side with HF's QuantizedCache (issue 21).

For every method (``--methods``):

(a) passkey retrieval at 2k / 4k / 8k tokens (``eval/tasks/passkey.py``: local noise haystack, passkey at
    several depths, greedy digits scored by exact match), the prompt prefilled into the method's cache and the
    answer decoded through it;
(b) perplexity over a ``--window``-token window of a long local text (``--text``), fed through the cache in
    chunks (``--prefill`` tokens first, then ``--chunk`` at a time), so later tokens attend to quantized history;
(c) teacher-forced KL(eager-fp32 || method) and top-1 agreement on the same feed, per position bucket
    (``--buckets``, default 0-2k / 2k-4k / 4k-8k: how the error grows with distance from the prefill that fixed
    the scales). The reference is eager fp32 fed the same way through a DynamicCache (exact arithmetic);
(d) decode ms/step (greedy single-token steps after a ``window - steps``-token context, host clock around each
    synchronized step: median and mean, the mean counting the periodic re-quantization of QuantizedCache) and
    KV bytes/token measured on the cache after the feed (all tensors it holds / tokens stored: packed data,
    scales, zero points, INT8 tail or bf16 residual; TurboCache reports its own ``memory_bytes()``).

Methods: ``eager-fp32`` (reference), ``sdpa-bf16`` (floor, DynamicCache), ``turbo-<preset>`` (``turbo_int8`` with
an explicit ``TurboCache(preset)``), ``hf-quanto-int4``/``-int2``, ``hf-hqq-int4``/``-int2`` (transformers'
``QuantizedCache(backend, nbits=...)`` with its defaults: per-channel groups of 64 on axis 0, a bf16 residual of
128 tokens re-quantized with the whole history when full; sdpa attention over the dequantized cache) and
``hf-fp8`` (transformers >= 5.23). A method whose backend does not import or run is recorded under
``unavailable`` with the error, and the run goes on.

    python -m eval.long_context --out eval/results              # SmolLM2-135M-Instruct (embedded GGUF), all methods
    python -m eval.long_context --quick --out /tmp/lc           # CPU smoke: tiny lengths, sdpa-bf16 + turbo-int4

Writes ``<out>/long_context_<tag>.json`` (every number, per-depth passkey accuracy, device, versions, commit,
date, arguments) and ``.md`` (one row per method).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import hashlib
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from turbo_attn_hf.generation import cache_arg, output_cache
from turbo_attn_hf.loading import LOAD_KWARGS

from . import data as edata
from .bench_common import _git_commit, write_report
from .fidelity import Impl, Stats, prepare
from .tasks import passkey as pk

REF = "eager-fp32"
FLOOR = "sdpa-bf16"
ALL_METHODS = ("eager-fp32", "sdpa-bf16", "turbo-int8", "turbo-int4", "turbo-mixed", "hf-quanto-int4",
               "hf-quanto-int2", "hf-hqq-int4", "hf-hqq-int2", "hf-fp8")
QUICK_METHODS = ("sdpa-bf16", "turbo-int4")


# ================================================================================ methods
@dataclass
class Method:
    """A model set-up (attention implementation, dtype) and the cache that every pass of it gets."""

    name: str
    attn: str
    dtype: torch.dtype
    preset: Optional[str] = None  # turbo preset
    backend: Optional[str] = None  # QuantizedCache backend
    nbits: Optional[int] = None

    @property
    def impl(self) -> Impl:
        cfg = None
        if self.preset:  # a preset name / YAML path, optionally with overrides: int8:k_scale_range=rope_pair
            from .fidelity import impls_for

            cfg = impls_for([self.preset])[1].turbo_config
        return Impl(self.name, self.attn, self.dtype, cfg)

    def new_cache(self, model):
        if self.backend:
            from transformers.cache_utils import QuantizedCache

            kw = {} if self.backend == "fp8" else {"nbits": self.nbits}
            return QuantizedCache(self.backend, model.config, **kw)
        return self.impl.new_cache(model)

    @property
    def bits(self):
        """KV storage bits as a table label: 32 / 16, the backend's nbits, or the turbo preset's name."""
        if self.backend:
            return self.nbits
        if self.preset:
            return {"int8": 8, "int4": 4, "int2": 2}.get(self.preset, self.preset)
        return 32 if self.dtype == torch.float32 else 16

    def describe(self) -> dict:
        d = {"attn": self.attn, "dtype": str(self.dtype).replace("torch.", "")}
        if self.preset:
            d["turbo_config"] = self.impl.turbo_config.to_dict()
        if self.backend:
            d.update(cache="transformers.QuantizedCache", backend=self.backend, nbits=self.nbits)
            if self.backend != "fp8":
                d.update(axis_key=0, axis_value=0, q_group_size=64, residual_length=128)  # QuantizedCache defaults
            if self.backend == "quanto" and _QUANTO_STATE.get("patched"):  # CUDA runs
                d["quanto_unpack"] = "cuda-extension" if _QUANTO_STATE.get("cuda_ext") else "pytorch (quanto_torch_unpack)"
        return d


def method(name: str) -> Method:
    """``eager-fp32``, ``sdpa-bf16``, ``turbo-<preset>``, ``hf-<quanto|hqq>-int<4|2>``, ``hf-fp8``."""
    if name == REF:
        return Method(name, "eager", torch.float32)
    if name == FLOOR:
        return Method(name, "sdpa", torch.bfloat16)
    if name.startswith("turbo-"):
        return Method(name, "turbo_int8", torch.bfloat16, preset=name[len("turbo-"):])
    if name == "hf-fp8":
        return Method(name, "sdpa", torch.bfloat16, backend="fp8", nbits=8)
    parts = name.split("-")
    if len(parts) == 3 and parts[0] == "hf" and parts[1] in ("quanto", "hqq") and parts[2] in ("int4", "int2"):
        return Method(name, "sdpa", torch.bfloat16, backend=parts[1], nbits=int(parts[2][3:]))
    raise ValueError(f"unknown method {name!r}; known: {', '.join(ALL_METHODS)} (turbo-<preset> for any preset)")


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """optimum-quanto's ``quanto::unpack`` in plain PyTorch (the same loop as its "default" implementation, which
    cannot be imported: its ``torch.library.impl`` decorator leaves the module attribute None): value i of each
    byte is ``(byte >> bits*i) & mask``, the i-th values of all bytes concatenated along dim 0."""
    values_per_item = 8 // bits
    return torch.cat([(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(values_per_item)]).to(torch.uint8)


def quanto_torch_unpack() -> None:
    """Run optimum-quanto's ``quanto::unpack`` on CUDA in PyTorch (``unpack_bits``) instead of its CUDA extension,
    which is JIT-compiled with nvcc (unpack + AWQ + Marlin sources) on first use: minutes of a GPU lease. The
    unpacked integers are identical; only quanto's dequantize speed can differ (torch ops, no fused kernel)."""
    torch.library.impl("quanto::unpack", ["CUDA"])(unpack_bits)


def check_available(m: Method, model) -> Optional[str]:
    """None when the method's cache builds and stores a few tokens on the model's device, else the error text
    (a missing optimum-quanto / hqq, fp8 on transformers < 5.23, ...)."""
    if not m.backend:
        return None
    try:
        if m.backend == "quanto" and _device(model).type == "cuda" and not _QUANTO_STATE.get("patched"):
            if not _QUANTO_STATE.get("cuda_ext"):
                import optimum.quanto  # noqa: F401  (registers its CUDA kernels first, then we override unpack)

                quanto_torch_unpack()
            _QUANTO_STATE["patched"] = True
        cache = m.new_cache(model)
        cfg = model.config
        hk = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dev = next(model.parameters()).device
        x = torch.randn(1, hk, 8, d, device=dev, dtype=m.dtype)
        cache.update(x, x, 0)
        cache.update(x[:, :, :1], x[:, :, :1], 0)
        return None
    except Exception as e:  # noqa: BLE001 - recorded in the result file
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


_QUANTO_STATE: dict = {}


# ================================================================================ cache bytes
def _tensor_bytes(obj, seen: set) -> int:
    """Bytes of every tensor reachable from ``obj`` (tensor subclasses such as quanto's QTensor through their
    inner tensors; dicts, lists, tuples and object attributes recursively), each storage counted once."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), seen) for n in names)
        key = (obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes()) if obj.numel() else None
        if key is None or key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)) and type(obj).__module__ != "builtins":
        return sum(_tensor_bytes(v, seen) for k, v in vars(obj).items() if k not in ("quantizer", "optimizer"))
    return 0


def cache_bytes(cache) -> int:
    """Bytes the cache holds: ``memory_bytes()`` where the cache counts itself (TurboCache: valid packed blocks,
    INT8 tail buffers, universal scales), else every tensor reachable from its layers."""
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    seen: set = set()
    return sum(_tensor_bytes(layer, seen) for layer in cache.layers)


# ================================================================================ model passes
def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def greedy_passkey(model, tok, m: Method, samples: Sequence[pk.Sample], gen_tokens: int = pk.GEN_TOKENS,
                   progress: bool = True) -> list[str]:
    """Greedy continuation of each sample (batch 1): the prompt prefilled into a fresh cache of the method,
    then one token per step until the digits end or ``gen_tokens`` tokens."""
    dev = _device(model)
    outs = []
    for i, s in enumerate(samples):
        ids = tok(s.text, return_tensors="pt", add_special_tokens=False).input_ids.to(dev)
        cache = m.new_cache(model)
        out = model(ids, **cache_arg(cache), use_cache=True)
        gen: list[int] = []
        for _ in range(gen_tokens):
            nxt = int(out.logits[0, -1].argmax())
            gen.append(nxt)
            text = tok.decode(gen)
            if pk.extract(text) and not text.rstrip()[-1:].isdigit():  # the number is complete
                break
            out = model(torch.tensor([[nxt]], device=dev), **cache_arg(output_cache(out)), use_cache=True)
        outs.append(tok.decode(gen))
        del cache, out
        if progress:
            print(f"  [{m.name}] passkey {i + 1}/{len(samples)} L={s.length} depth={s.depth:g} "
                  f"key={s.passkey} got={outs[-1]!r}", flush=True)
    return outs


@torch.no_grad()
def chunked_logprobs(model, m: Method, ids: torch.Tensor, prefill: int, chunk: int):
    """Yield ``(start, log-probs [n, V] fp32)`` of the next-token distributions of ``ids[start:start + n]``: the
    first ``prefill`` tokens in one forward into a fresh cache, then ``chunk`` tokens per forward. Returns the
    cache at the end (``StopIteration.value``)."""
    dev = _device(model)
    x = ids.to(dev)[None]
    T = x.shape[1]
    cache = m.new_cache(model)
    for s in [0] + list(range(prefill, T - 1, chunk)):
        e = prefill if s == 0 else min(s + chunk, T - 1)
        out = model(x[:, s:e], **cache_arg(cache), use_cache=True)
        cache = output_cache(out)
        yield s, F.log_softmax(out.logits[0].float(), dim=-1)
        del out
    return cache


def bucket_of(pos: torch.Tensor, edges: Sequence[int]) -> torch.Tensor:
    """Index of the bucket [edges[i], edges[i+1]) of each position (positions past the last edge fall in the last)."""
    b = torch.bucketize(pos, torch.tensor(edges[1:-1], device=pos.device), right=True)
    return b.clamp_(0, len(edges) - 2)


def perplexity_and_kl(model, m: Method, ids: torch.Tensor, ref: Optional[torch.Tensor], *, prefill: int, chunk: int,
                      edges: Sequence[int]) -> tuple[dict, torch.Tensor, object]:
    """Stats (``fidelity.Stats``: KL to ``ref``, top-1, perplexity) over all positions and per bucket of the query
    position; returns ``(summary, log-probs [T-1, V] when ref is None else None, cache after the feed)``."""
    T = ids.numel()
    tgt = ids[1:].to(_device(model))
    stats = {"all": Stats(), **{f"{a}-{b}": Stats() for a, b in zip(edges[:-1], edges[1:])}}
    names = list(stats)[1:]
    keep = [] if ref is None else None
    gen = chunked_logprobs(model, m, ids, prefill, chunk)
    cache = None
    while True:
        try:
            s, lp = next(gen)
        except StopIteration as stop:
            cache = stop.value
            break
        n = lp.shape[0]
        r = lp if ref is None else ref[s:s + n].to(lp.device)
        stats["all"].add(r, lp, tgt[s:s + n])
        b = bucket_of(torch.arange(s, s + n, device=lp.device), edges)
        for k in b.unique().tolist():
            sel = b == k
            stats[names[k]].add(r[sel], lp[sel], tgt[s:s + n][sel])
        if keep is not None:
            keep.append(lp)
    assert sum(st.n for st in stats.values()) == 2 * (T - 1)  # every position scored once, in one bucket
    out = {k: v.summary() for k, v in stats.items() if v.n}
    return out, (torch.cat(keep) if keep is not None else None), cache


@torch.no_grad()
def decode_timing(model, m: Method, ids: torch.Tensor, steps: int, warmup: int = 3) -> dict:
    """ms per greedy single-token step after prefilling ``ids`` into a fresh cache (host clock around each step,
    synchronized): median and mean over ``steps`` steps after ``warmup``."""
    dev = _device(model)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cache = m.new_cache(model)
    out = model(ids.to(dev)[None], **cache_arg(cache), use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    ts = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        out = model(nxt, **cache_arg(output_cache(out)), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        sync()
        if i >= warmup:
            ts.append((time.perf_counter() - t0) * 1e3)
    return {"ms_median": statistics.median(ts), "ms_mean": statistics.fmean(ts), "steps": steps,
            "context": ids.numel()}


# ================================================================================ text
def long_text(tok, source: str, n_tokens: int, data_dir=None) -> tuple[torch.Tensor, dict]:
    """The first ``n_tokens`` tokens of the long local text ``source``:

    * ``gsm8k``: the GSM8K test set in file order, ``Question: ...\\nAnswer: ...`` per item (English prose and
      arithmetic; items are independent, so long-range structure is weak);
    * ``file:PATH``: any text file (e.g. a Python stdlib module's source).
    """
    if source == "gsm8k":
        rows = edata.load_gsm8k(data_dir)
        parts, total = [], 0
        for r in rows:  # only as many rows as the window needs (tokenizing all 1319 costs seconds)
            parts.append(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n")
            total += len(parts[-1]) // 3  # > tokens: about 4 characters per token
            if total > n_tokens:
                break
        text = "".join(parts)
    elif source.startswith("file:"):
        text = Path(source[5:]).read_text()
    else:
        raise ValueError(f"--text {source!r}: use gsm8k or file:PATH")
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() < n_tokens:
        raise ValueError(f"--text {source}: {ids.numel()} tokens, fewer than the window of {n_tokens}")
    ids = ids[:n_tokens]
    return ids, {"source": source, "tokens": n_tokens,
                 "sha256_ids": hashlib.sha256(ids.numpy().astype("int64").tobytes()).hexdigest()[:16]}


def tiny_model(vocab_size: int):
    """A random 2-layer Llama (GQA 4/2, head_dim 64) over the real tokenizer's vocabulary: exercises every code
    path in seconds on a CPU (its accuracy numbers mean nothing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg)


# ================================================================================ report
def _meta(device: torch.device) -> dict:
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for mod in ("triton", "optimum.quanto", "hqq"):
        try:
            v[mod] = __import__(mod, fromlist=["x"]).__version__
        except Exception:  # noqa: BLE001
            try:
                import importlib.metadata as md

                v[mod] = md.version({"optimum.quanto": "optimum-quanto"}.get(mod, mod))
            except Exception:  # noqa: BLE001
                v[mod] = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return {"device": name, "versions": v, "git_commit": os.environ.get("TURBO_GIT_COMMIT") or _git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _len_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}"


def to_markdown(res: dict) -> str:
    lengths = [str(L) for L in res["passkey"]["lengths"]]
    buckets = [b for b in res["buckets"]]
    head = (["method", "bits"] + [f"passkey {_len_label(int(L))} %" for L in lengths] + ["ppl", "Δppl %"]
            + [f"KL {b}" for b in buckets] + [f"top-1 {b} %" for b in buckets] + ["KV B/token", "decode ms/step"])
    lines = [
        f"Long-context fidelity, {res['model']} on {res['device']}, {res['date']} (commit {res['git_commit']}, "
        f"transformers {res['versions']['transformers']}, torch {res['versions']['torch']}).",
        "",
        f"Passkey: {res['passkey']['per_length']} prompts per length ({len(res['passkey']['depths'])} depths "
        f"{', '.join(f'{d:g}' for d in res['passkey']['depths'])}), exact match of the greedy digits. "
        f"Perplexity / KL(eager-fp32 ‖ method) / top-1 vs eager-fp32: {res['text']['tokens']} tokens of "
        f"`{res['text']['source']}` fed through each cache ({res['feed']['prefill']}-token prefill, then "
        f"{res['feed']['chunk']}-token chunks), buckets by query position. KV bytes/token measured on the cache after "
        f"the feed; decode ms/step: median of {res['decode']['steps']} greedy steps at a "
        f"{res['decode']['context']}-token context. `{res['command']}`",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    ref_ppl = res.get("reference_ppl", {}).get("all", {}).get("ppl")
    for name, r in res["methods"].items():
        p = r.get("passkey", {})
        pp = r.get("ppl", {})
        ppl = pp.get("all", {}).get("ppl")
        cells = [name, str(r.get("bits", "–"))] + [_pct(p.get(L)) for L in lengths]
        cells += ["–" if ppl is None else f"{ppl:.3f}",
                  "–" if ppl is None or not ref_ppl else f"{100 * (ppl / ref_ppl - 1):+.2f}"]
        cells += ["–" if b not in pp else f"{pp[b]['kl']:.2e}" for b in buckets]
        cells += ["–" if b not in pp else f"{100 * pp[b]['top1']:.1f}" for b in buckets]
        kv = r.get("kv_bytes_per_token")
        dec = r.get("decode", {}).get("ms_median")
        cells += ["–" if kv is None else f"{kv:.0f}", "–" if dec is None else f"{dec:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if res.get("unavailable"):
        lines += ["", "Not run (backend missing or failing on this machine):", ""]
        lines += [f"- {k}: {v}" for k, v in res["unavailable"].items()]
    return "\n".join(lines) + "\n"


# ================================================================================ CLI
def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import turbo_attn_hf  # noqa: F401  (registers turbo_int8)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.model:
        path, gguf = args.model, args.gguf_file
        model_name = Path(args.gguf_file or args.model).name
    else:
        from turbo_attn_hf.chat import EMBEDDED_NAME, embedded_model

        path, gguf = embedded_model()
        model_name = EMBEDDED_NAME
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(path, **kw)
    if args.tiny:
        ref, model_name = tiny_model(len(tok)), "tiny random Llama (2 layers, smoke test) + " + model_name
    else:
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kw,
                                                   **LOAD_KWARGS)
    ref = ref.to(device).eval()
    low = copy.deepcopy(ref).to(torch.bfloat16)
    low.set_attn_implementation("sdpa")

    _QUANTO_STATE["cuda_ext"] = args.quanto_cuda_ext
    methods = [method(n) for n in args.methods.split(",") if n]
    if methods[0].name != REF:  # the KL reference is computed first, with the eager-fp32 model
        methods = [method(REF)] + methods
        report_ref = False
    else:
        report_ref = True

    ids, text_info = long_text(tok, args.text, args.window, args.data_dir)
    edges = [0] + [int(e) for e in args.buckets.split(",")]
    if edges[-1] < args.window:
        edges.append(args.window)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    samples = pk.make_samples(tok, lengths, depths, per_depth=args.per_depth, seed=args.seed)
    ctx = args.window - args.decode_steps - 8

    res = {
        "what": "passkey accuracy, chunked perplexity, KL/top-1 vs eager-fp32 by position, decode ms/step, KV bytes/token",
        "model": model_name, **_meta(device),
        "command": " ".join(["python", "-m", "eval.long_context"] + sys.argv[1:]) if args.argv is None
        else " ".join(["python", "-m", "eval.long_context"] + args.argv),
        "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "text": text_info, "feed": {"prefill": args.prefill, "chunk": args.chunk},
        "buckets": [f"{a}-{b}" for a, b in zip(edges[:-1], edges[1:])],
        "passkey": {"lengths": lengths, "depths": depths, "per_length": len(depths) * args.per_depth,
                    "seed": args.seed, "gen_tokens": pk.GEN_TOKENS},
        "decode": {"steps": args.decode_steps, "context": ctx},
        "methods": {}, "unavailable": {}, "wall_s": {},
    }
    ref_lp = None
    for m in methods:
        t0 = time.time()
        model = ref if m.attn == "eager" else low
        if m.attn != "eager":
            prepare(model, m.impl)
        err = check_available(m, model)
        if err:
            print(f"== {m.name}: NOT AVAILABLE: {err}", flush=True)
            res["unavailable"][m.name] = err
            continue
        print(f"== {m.name}", flush=True)
        r: dict = {"spec": m.describe(), "bits": m.bits}
        try:
            is_ref = m.name == REF and ref_lp is None
            ppl, lp, cache = perplexity_and_kl(model, m, ids, None if is_ref else ref_lp, prefill=args.prefill,
                                               chunk=args.chunk, edges=edges)
            if is_ref:
                ref_lp = lp
                res["reference_ppl"] = ppl
            r["ppl"] = ppl
            n_stored = cache.get_seq_length()
            r["kv_bytes"] = cache_bytes(cache)
            r["kv_tokens"] = n_stored
            r["kv_bytes_per_token"] = r["kv_bytes"] / max(n_stored, 1)
            if hasattr(cache, "bytes_per_token"):
                r["kv_bytes_per_token_nominal"] = float(cache.bytes_per_token())
            del cache, lp
            if is_ref and not report_ref:
                res["wall_s"][m.name] = time.time() - t0
                continue
            outs = greedy_passkey(model, tok, m, samples, progress=args.verbose)
            ok = [pk.score(o, s.passkey) for o, s in zip(outs, samples)]
            r["passkey"] = pk.summarize(samples, ok, lengths)
            r["passkey_outputs"] = outs
            if args.decode_steps:
                r["decode"] = decode_timing(model, m, ids[:ctx], args.decode_steps)
        except Exception as e:  # noqa: BLE001 - one failing backend must not lose the others' numbers
            import traceback

            traceback.print_exc()
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if m.name == REF:
                raise
        res["methods"][m.name] = r
        res["wall_s"][m.name] = time.time() - t0
        p = r.get("passkey", {})
        print(f"   {m.name}: passkey {[p.get(str(L)) for L in lengths]}, ppl {r.get('ppl', {}).get('all', {}).get('ppl')}, "
              f"KV B/token {r.get('kv_bytes_per_token')}, decode {r.get('decode', {}).get('ms_median')} ms "
              f"({res['wall_s'][m.name]:.0f}s)", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:  # rewrite after every method: a run cut short keeps what it measured
            write_report(args.out, f"long_context_{args.tag}", res, to_markdown(res) if res["methods"] else "")
    return res


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m eval.long_context", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--methods", default=",".join(ALL_METHODS))
    ap.add_argument("--lengths", default="2048,4096,8192", help="passkey prompt lengths (prompt + generated tokens)")
    ap.add_argument("--depths", default=",".join(f"{d:g}" for d in pk.DEPTHS))
    ap.add_argument("--per-depth", type=int, default=4, help="passkey samples per (length, depth)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default="gsm8k", help="long text for perplexity/KL: gsm8k or file:PATH")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--window", type=int, default=8192)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--buckets", default="2048,4096", help="inner bucket edges of the query position")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke: lengths 256,512, 2 depths x 1 sample, window 512 (prefill 128, chunk 64), "
                         "buckets at 256, 2 decode steps, methods sdpa-bf16,turbo-int4 (unless given)")
    ap.add_argument("--quanto-cuda-ext", action="store_true",
                    help="let optimum-quanto JIT-compile its CUDA extension (minutes of nvcc) instead of unpacking "
                         "with its PyTorch implementation")
    ap.add_argument("--tiny", action="store_true",
                    help="a random 2-layer model with the model's tokenizer instead of its weights (CI smoke test)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tag", default="smollm2")
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--verbose", action="store_true", help="print every passkey answer")
    args = ap.parse_args(argv)
    args.argv = argv
    if args.quick:
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        quick = {"--methods": ("methods", ",".join(QUICK_METHODS)), "--lengths": ("lengths", "256,512"),
                 "--depths": ("depths", "0.25,0.75"), "--per-depth": ("per_depth", 1), "--window": ("window", 512),
                 "--prefill": ("prefill", 128), "--chunk": ("chunk", 64), "--buckets": ("buckets", "256"),
                 "--decode-steps": ("decode_steps", 2), "--tag": ("tag", "quick")}
        for flag, (attr, val) in quick.items():
            if flag not in given:
                setattr(args, attr, val)
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
