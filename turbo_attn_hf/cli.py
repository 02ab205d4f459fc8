"""``turbo-attn``: the console script of turbo-attn-hf.

    turbo-attn chat [...]           streaming chat demo, turbo_int8 vs sdpa (turbo_attn_hf/chat.py)
    turbo-attn info                 versions, device, presets and the capability table
    turbo-attn lm-eval [...]        lm-eval CoT runs, sdpa vs presets (eval/lm_eval_run.py)
    turbo-attn fidelity [...]       teacher-forced KL / top-1 / perplexity vs eager fp32 (eval/fidelity.py)
    turbo-attn calibrate [...]      per-layer 2-bit KV heads from gap x std, written as a config (eval/calibrate_cli.py)
    turbo-attn bench-prefill [...]  prefill kernel benchmark (GPU; eval/bench_prefill.py)
    turbo-attn bench-decode [...]   decode kernel benchmark (GPU; eval/bench_decode.py)
    turbo-attn bench-e2e [...]      end-to-end Llama-3-8B-shaped benchmark (GPU; eval/bench_e2e.py)
    turbo-attn bench-generate [...] headline generate() benchmark: TTFT, decode ms/step (GPU; eval/bench_generate.py)
    turbo-attn accuracy [...]       kernel accuracy vs fp64: MRE tables, FA3 outlier RMSE (eval/kernel_accuracy.py)
    turbo-attn plots [...]          PNG plots from the result JSON files (eval/plots.py)

Each subcommand is the ``main(argv)`` of one module, imported only when chosen (this file imports nothing
heavy, so ``--help`` is quick); ``turbo-attn CMD --help`` shows its options. A bad input (missing or invalid
config file, unknown preset, a path that is not a model) prints one ``error:`` line on stderr and exits 2.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

#: subcommand -> (module with its main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "chat": ("turbo_attn_hf.chat", "streaming chat demo: turbo_int8 vs sdpa tokens/s and KV memory"),
    "info": ("", "versions, device, presets and supported features"),
    "lm-eval": ("turbo_attn_hf.eval.lm_eval_run", "lm-eval chain-of-thought runs: sdpa vs presets"),
    "fidelity": ("turbo_attn_hf.eval.fidelity", "teacher-forced KL / top-1 agreement / perplexity vs eager fp32"),
    "calibrate": ("turbo_attn_hf.eval.calibrate_cli", "calibrate the per-layer 2-bit KV heads, write a config"),
    "bench-prefill": ("turbo_attn_hf.eval.bench_prefill", "prefill attention benchmark (GPU)"),
    "bench-decode": ("turbo_attn_hf.eval.bench_decode", "decode attention benchmark over a packed cache (GPU)"),
    "bench-e2e": ("turbo_attn_hf.eval.bench_e2e", "end-to-end benchmark of a Llama-3-8B-shaped model (GPU)"),
    "bench-generate": ("turbo_attn_hf.eval.bench_generate",
                       "headline generate() benchmark: TTFT, decode ms/step, sdpa vs turbo (GPU)"),
    "accuracy": ("turbo_attn_hf.eval.kernel_accuracy", "kernel accuracy vs fp64 (MRE, FA3 outlier RMSE)"),
    "plots": ("turbo_attn_hf.eval.plots", "PNG plots from eval/results/*.json"),
}
INFO_USAGE = "usage: turbo-attn info\n\nPrint versions, the device, the presets and the supported features."


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
    return f"usage: turbo-attn COMMAND [options]\n\ncommands:\n{rows}\n\n`turbo-attn COMMAND --help` for options."


def info() -> int:
    """Print versions, device, presets and the capability table."""
    import platform

    import torch
    import triton

    import turbo_attn_hf
    from turbo_attn_hf.capabilities import FEATURES, SUPPORTED_HEAD_DIMS
    from turbo_attn_hf.config import available_presets

    try:
        import transformers

        tv = transformers.__version__
    except ImportError:
        tv = "missing"
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU (CPU reference path)"
    print(f"turbo_attn_hf {turbo_attn_hf.__version__} | python {platform.python_version()} | torch {torch.__version__} "
          f"| triton {triton.__version__} | transformers {tv} | CUDA {torch.version.cuda}")
    print(f"device: {dev}")
    from turbo_attn_hf.config import (PREFILL_ATTENTION_BY_CAPABILITY, PREFILL_INT8_FROM_KEYS, TurboConfig,
                                      prefill_attention_path)

    here = prefill_attention_path(TurboConfig(), torch.device("cuda", 0) if torch.cuda.is_available()
                                  else torch.device("cpu"))
    table = ", ".join(f"sm_{k}x: {v}" for k, v in sorted(PREFILL_ATTENTION_BY_CAPABILITY.items()))
    longer = "; ".join(f"int8 from {n} keys at head_dim {d} on sm_{m}x" for (m, d), n in
                       sorted(PREFILL_INT8_FROM_KEYS.items()))
    print(f"prefill attention (auto): {here} here | {table} ({longer}: plain prompts, Gluon kernel) | other GPUs "
          "and CPU: int8")
    from turbo_attn_hf.kernels import prefill, prefill_hopper, reference

    try:  # an invalid setting is an error at the first prefill; here it is shown
        choice = prefill.kernel_choice()
        dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        here, here256 = ("hopper" if not why else f"portable ({why})" for why in (
            prefill.hopper_takes(dev, d, prefill_hopper.BLOCK_N, window=None, softcap=None, key_valid=None,
                                 softmax="exact", p_scale="block", pv_half=True) if choice != "portable"
            else "not chosen" for d in (128, 256)))
        pv = "16-bit (V itself)" if prefill.pv_dtype(dev, torch.bfloat16, 128) is not None else "INT8"
    except ValueError as e:
        choice, here, here256, pv = str(e), "-", "-", "-"
    print(f"INT8 prefill kernel: {choice} (TURBO_PREFILL_KERNEL: {', '.join(prefill.PREFILL_KERNELS)}; auto = hopper, "
          f"the Gluon kernel, on sm_90 with Triton {'/'.join(prefill_hopper.TESTED_TRITON)} for head_dim "
          f"{'/'.join(map(str, prefill_hopper.HEAD_DIMS))} (256: P.V on 16-bit V) without window, softcap, padding "
          "mask or SAS, portable "
          f"elsewhere); here at head_dim 128: {here}; at head_dim 256, bf16: {here256}")
    print(f"prefill P.V: INT8 Q.K^T with P.V on V itself in 16 bits where the Gluon kernel runs (bf16/fp16, per-block "
          f"V scales; SageAttention's split), INT8 P.V otherwise; here at head_dim 128, bf16: {pv}; the 16-bit P.V in "
          f"two CTAs an SM at head_dim {'/'.join(map(str, sorted(reference.PV_HALF_BLOCK_N)))} (KV blocks of "
          f"{'/'.join(str(reference.PV_HALF_BLOCK_N[d]) for d in sorted(reference.PV_HALF_BLOCK_N))} keys)")
    from turbo_attn_hf.config import QK_NORM_MODEL_TYPES

    print(f"packed K (packed_k_bits auto): INT8 K + packed V for q/k-norm families ({', '.join(QK_NORM_MODEL_TYPES)}), "
          "K packed like V otherwise")
    from turbo_attn_hf import rotary

    print(f"rotary embedding (eager forwards): {'one launch' if rotary.enabled() else 'HF ops'} "
          "(TURBO_ATTN_FUSED_ROPE=0: HF ops; rotate-half families, 16-bit dtypes, CUDA)")
    print(f"attn_implementation: {turbo_attn_hf.ATTN_NAME!r} registered: {turbo_attn_hf.REGISTERED}")
    print(f"head dims: {SUPPORTED_HEAD_DIMS}")
    print("presets: " + ", ".join(f"{k} ({v})" for k, v in sorted(available_presets().items())))
    print("features:")
    for name, (ok, note) in FEATURES.items():
        print(f"  [{'x' if ok else ' '}] {name}: {note}")
    return 0


def _user_error(exc: BaseException) -> Optional[str]:
    """The one-line message for an error caused by the user's input, or None for a bug (keep its traceback).

    Only looks at modules already imported by the subcommand, so this file stays free of heavy imports."""
    kinds = []
    for mod, name in (("turbo_attn_hf.config", "TurboConfigError"), ("turbo_attn_hf.chat", "ChatError")):
        cls = getattr(sys.modules.get(mod), name, None)
        if cls is not None:
            kinds.append(cls)
    if isinstance(exc, tuple(kinds) + (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"error: unknown command {cmd!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if cmd == "info":
        if any(a in ("-h", "--help") for a in rest):
            print(INFO_USAGE)
            return 0
        if rest:
            print(f"error: turbo-attn info takes no arguments (got {' '.join(rest)})", file=sys.stderr)
            return 2
        return info()
    try:
        mod = importlib.import_module(COMMANDS[cmd][0])
        rc = mod.main(rest)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - re-raised below unless it is a user-input error
        msg = _user_error(e)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0  # some mains return their results (dict / path)


if __name__ == "__main__":
    sys.exit(main())
