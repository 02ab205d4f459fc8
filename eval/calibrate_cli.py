"""Calibrate the per-layer 2-bit KV heads of a model and write ``configs/<name>.yaml``.

    python -m eval.calibrate_cli --model DIR [--gguf-file F.gguf] --dataset gsm8k --n 64 \\
        --base mixed --name smollm2_mixed [--data-dir ../shared/data] [--out-dir configs]

Prompts are the task's chain-of-thought prompts (few-shot prefix + question) of the first ``--n``
test rows after ``--skip`` (use rows you do not evaluate on, e.g. ``--skip 1000`` for GSM8K, or another
dataset). The written YAML is a full TurboConfig (``head_bits`` map + the base preset's settings), usable
as ``--presets configs/<name>.yaml`` in the runners or ``set_turbo_config(model, path)``.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Optional

from turbo_attn_hf.loading import LOAD_KWARGS

from . import data as edata

DATASETS = ("gsm8k", "aqua", "bbh")


def calibration_prompts(dataset: str, n: int, skip: int = 0, data_dir=None, shots: bool = True) -> list[str]:
    """``n`` CoT prompts of ``dataset`` (BBH: round-robin over the 27 tasks)."""
    if dataset == "gsm8k":
        prefix = edata.read_prompt("gsm8k", data_dir) if shots else ""
        rows = edata.load_gsm8k(data_dir)[skip: skip + n]
        return [edata.gsm8k_prompt(r["question"], prefix).lstrip("\n") for r in rows]
    if dataset == "aqua":
        prefix = edata.read_prompt("aqua", data_dir) if shots else ""
        rows = edata.load_aqua(data_dir)[skip: skip + n]
        return [edata.aqua_prompt(r["question"], r["options"], prefix).lstrip("\n") for r in rows]
    if dataset == "bbh":
        out, i = [], 0
        while len(out) < n:
            t = edata.BBH_TASKS[i % len(edata.BBH_TASKS)]
            rows = edata.load_bbh(t, data_dir)
            j = skip + i // len(edata.BBH_TASKS)
            if j < len(rows):
                prefix = edata.read_prompt(f"bbh/{t}", data_dir) if shots else ""
                out.append(edata.bbh_prompt(rows[j]["input"], prefix).lstrip("\n"))
            i += 1
            if i > 50 * (n + skip + len(edata.BBH_TASKS)):
                break
        return out
    raise ValueError(f"dataset={dataset!r} must be one of {DATASETS}")


def main(argv: Optional[list[str]] = None) -> Path:
    ap = argparse.ArgumentParser(prog="turbo-attn calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--dataset", default="gsm8k", choices=DATASETS)
    ap.add_argument("--n", type=int, default=64, help="number of calibration prompts")
    ap.add_argument("--skip", type=int, default=0, help="skip this many rows first")
    ap.add_argument("--no-shots", action="store_true", help="question only, without the few-shot prefix")
    ap.add_argument("--base", default="mixed", help="preset / YAML giving bits, block size and the 2-bit fraction")
    ap.add_argument("--n-2bit-heads", type=int, default=None)
    ap.add_argument("--use", default="kv", choices=("k", "v", "kv"))
    ap.add_argument("--name", default=None, help="config name (default: <model>_<base>_calibrated)")
    ap.add_argument("--out-dir", default=str(edata.repo_root() / "configs"))
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turbo_attn_hf.calibrate import calibrate, write_config

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(args.model, **kw)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa", **kw, **LOAD_KWARGS
    ).to(device).eval()
    prompts = calibration_prompts(args.dataset, args.n, args.skip, args.data_dir, shots=not args.no_shots)
    model_tag = Path(args.gguf_file or args.model).stem.split(".")[0].lower().replace("-", "_")
    name = args.name or f"{model_tag}_{Path(args.base).stem}_calibrated"
    cfg = calibrate(model, prompts, tokenizer=tok, base=args.base, n_2bit_heads=args.n_2bit_heads,
                    use=args.use, name=name, progress=True)
    c = cfg.calibration
    header = (
        f"{name}: head-wise 2-bit map from turbo_attn_hf.calibrate (gap x std, {c['use']}), base preset {args.base}\n"
        f"model {args.gguf_file or args.model}; {c['n_prompts']} {args.dataset} prompts (rows {args.skip}.."
        f"{args.skip + args.n - 1}), {c['n_tokens']} tokens, {c['n_blocks']} blocks; "
        f"{datetime.datetime.now(datetime.timezone.utc).date()}\n"
        f"command: python -m eval.calibrate_cli {' '.join(argv) if argv is not None else ' '.join(__import__('sys').argv[1:])}"
    )
    path = write_config(cfg, Path(args.out_dir) / f"{name}.yaml", header=header)
    n2 = [row.count(2) for row in cfg.head_bits]
    print(f"wrote {path}: {len(cfg.head_bits)} layers, 2-bit heads per layer {sorted(set(n2))}")
    return path


if __name__ == "__main__":
    main()
