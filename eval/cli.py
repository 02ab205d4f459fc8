"""``turbo-attn``: the console script of turbo-attn-hf.

    turbo-attn chat [...]           streaming chat demo, turbo_int8 vs sdpa (eval/chat.py)
    turbo-attn info                 versions, device, presets and the capability table
    turbo-attn lm-eval [...]        lm-eval CoT runs, sdpa vs presets (eval/lm_eval_run.py)
    turbo-attn fidelity [...]       teacher-forced KL / top-1 / perplexity vs eager fp32 (eval/fidelity.py)
    turbo-attn calibrate [...]      per-layer 2-bit KV heads from gap x std, written as a config (eval/calibrate_cli.py)
    turbo-attn bench-prefill [...]  prefill kernel benchmark (GPU; eval/bench_prefill.py)
    turbo-attn bench-decode [...]   decode kernel benchmark (GPU; eval/bench_decode.py)
    turbo-attn bench-e2e [...]      end-to-end Llama-3-8B-shaped benchmark (GPU; eval/bench_e2e.py)
    turbo-attn accuracy [...]       kernel accuracy vs fp64: MRE tables, FA3 outlier RMSE (eval/kernel_accuracy.py)
    turbo-attn plots [...]          PNG plots from the result JSON files (eval/plots.py)

Each subcommand is the ``main(argv)`` of one module, imported only when chosen; ``turbo-attn CMD --help``
shows its options.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

#: subcommand -> (module inside turbo_attn_hf.eval, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "chat": ("chat", "streaming chat demo: turbo_int8 vs sdpa tokens/s and KV memory"),
    "info": ("", "versions, device, presets and supported features"),
    "lm-eval": ("lm_eval_run", "lm-eval chain-of-thought runs: sdpa vs presets"),
    "fidelity": ("fidelity", "teacher-forced KL / top-1 agreement / perplexity vs eager fp32"),
    "calibrate": ("calibrate_cli", "calibrate the per-layer 2-bit KV heads, write a config"),
    "bench-prefill": ("bench_prefill", "prefill attention benchmark (GPU)"),
    "bench-decode": ("bench_decode", "decode attention benchmark over a packed cache (GPU)"),
    "bench-e2e": ("bench_e2e", "end-to-end benchmark of a Llama-3-8B-shaped model (GPU)"),
    "accuracy": ("kernel_accuracy", "kernel accuracy vs fp64 (MRE, FA3 outlier RMSE)"),
    "plots": ("plots", "PNG plots from eval/results/*.json"),
}


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
    print(f"attn_implementation: {turbo_attn_hf.ATTN_NAME!r} registered: {turbo_attn_hf.REGISTERED}")
    print(f"head dims: {SUPPORTED_HEAD_DIMS}")
    print("presets: " + ", ".join(f"{k} ({v})" for k, v in sorted(available_presets().items())))
    print("features:")
    for name, (ok, note) in FEATURES.items():
        print(f"  [{'x' if ok else ' '}] {name}: {note}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"turbo-attn: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if cmd == "info":
        return info()
    mod = importlib.import_module(f"{__package__ or 'turbo_attn_hf.eval'}.{COMMANDS[cmd][0]}")
    rc = mod.main(rest)
    return rc if isinstance(rc, int) else 0  # some mains return their results (dict / path)


if __name__ == "__main__":
    sys.exit(main())
