"""Shared pieces of the GPU measurement scripts (bench_prefill, bench_decode, bench_e2e, kernel_accuracy).

* :func:`machine_info` — the machine line (GPU | CUDA | torch | triton | transformers | date) stored in
  every result file, FLA style;
* :func:`require_cuda` — GPU-only paths stop with a clear message on a CPU machine;
* :func:`bench_ms` — ``triton.testing.do_bench`` median (and 20/80 % quantiles) in milliseconds;
* :func:`copy_ceiling` — measured device-to-device copy bandwidth (bytes read + written / time);
* :func:`write_json`, :func:`print_table` — the result file (source of truth) and a compact table.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class GPURequired(SystemExit):
    """Raised (exit code 2) when a GPU-only measurement is started without CUDA."""


def require_cuda(what: str) -> None:
    """Stop with a clear message when CUDA is missing (the benchmarks time real kernels, not the interpreter)."""
    import torch

    if not torch.cuda.is_available():
        msg = (f"{what} needs a CUDA GPU: torch {torch.__version__} sees none. Run it on the GPU machine "
               f"(eval/gpu_suite.sh), or use --dry-run here to check the set-up on tiny shapes.")
        print(f"error: {msg}", file=sys.stderr)
        raise GPURequired(2)


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git on the GPU machine copy is fine
        return None


def machine_info() -> dict:
    """Device name, versions and date, for the result files and the first printed line."""
    import torch
    import triton

    try:
        import transformers

        tv = transformers.__version__
    except ImportError:
        tv = None
    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": tv,
        "cuda": torch.version.cuda,
        "git_commit": os.environ.get("TURBO_GIT_COMMIT") or _git_commit(),  # set where the tree has no .git of its own
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), sm_count=p.multi_processor_count,
                    gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                    cudnn=torch.backends.cudnn.version())
    else:
        info.update(device=f"cpu ({platform.processor() or platform.machine()})")
    return info


def machine_line(info: dict) -> str:
    return (f"{info['device']} | CUDA {info['cuda']} | torch {info['torch']} | triton {info['triton']} | "
            f"transformers {info['transformers']} | {info['date_utc']}")


def bench_ms(fn: Callable[[], Any], *, warmup: int = 25, rep: int = 100) -> dict:
    """Median and 20/80 % quantiles of ``fn()`` in ms (``triton.testing.do_bench``; on CPU: wall clock)."""
    import torch

    if torch.cuda.is_available():
        from triton.testing import do_bench

        med, lo, hi = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
        return {"ms": float(med), "ms_p20": float(lo), "ms_p80": float(hi)}
    import time

    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return {"ms": ts[1], "ms_p20": ts[0], "ms_p80": ts[2]}


def bench_graph_ms(fn: Callable[[], Any], *, rep: int = 50) -> dict:
    """Median ms of ``fn()`` replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``): the GPU time
    without Python launch overhead. Returns ``{"ms_graph": ...}`` or ``{"graph_error": ...}`` when ``fn``
    cannot be captured."""
    import torch

    if not torch.cuda.is_available():
        return {}
    from triton.testing import do_bench_cudagraph

    try:
        fn()
        torch.cuda.synchronize()
        med = do_bench_cudagraph(fn, rep=rep, quantiles=[0.5])
        med = med[0] if isinstance(med, (list, tuple)) else med
        return {"ms_graph": float(med)}
    except Exception as e:  # noqa: BLE001 - not capturable (host sync, allocation pattern ...)
        torch.cuda.synchronize()
        return {"graph_error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}


def copy_ceiling(n_bytes: int = 2 << 30) -> dict:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read + written (the bandwidth
    ceiling a memory-bound kernel is compared with)."""
    import torch

    require_cuda("copy_ceiling")
    n = n_bytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    t = bench_ms(lambda: dst.copy_(src), warmup=5, rep=50)
    gbs = 2 * n * 2 / (t["ms"] * 1e-3) / 1e9
    src = dst = None  # noqa: F841 - release the 2 GiB before the benchmarks
    torch.cuda.empty_cache()
    return {"bytes_copied": n * 2, "ms": t["ms"], "GBps_read_plus_write": gbs}


def write_json(name: str, payload: dict, out_dir: Optional[Path] = None) -> Path:
    """Write ``payload`` as ``<out_dir>/<name>.json`` (default eval/results/); returns the path."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=_json_default)
        f.write("\n")
    return path


def print_row(row: dict, rows: list) -> None:
    """Keep an experiment's row and print it as one JSON line (a device call's output shows each as it comes)."""
    rows.append(row)
    print(json.dumps(row, default=_json_default), flush=True)


def write_rows(experiment: str, rows: list, path) -> None:
    """An experiment's rows with the machine line into the JSON file ``path``."""
    with open(path, "w") as f:
        json.dump({"experiment": experiment, "machine": machine_info(), "rows": rows}, f, indent=1,
                  default=_json_default)
    print("wrote", path)


def write_report(out_dir, name: str, payload: dict, markdown: str) -> None:
    """``<out_dir>/<name>.json`` + ``<name>.md`` (a table for the README), and the Markdown on stdout."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


def save_results(name: str, payload: dict, out_dir: Optional[Path], plot: Optional[str]) -> Path:
    """Write the result JSON and, when ``plot`` names a function of ``eval/plots.py``, its PNG beside it
    (matplotlib is imported only then)."""
    path = write_json(name, payload, out_dir)
    print(f"wrote {path}")
    if plot:
        from . import plots

        png = getattr(plots, plot)(path)
        if png:
            print(f"wrote {png}")
    return path


class RowLog:
    """The rows of a GPU experiment by section, its JSON rewritten after every row: a command cut by the device's
    time limit keeps what it measured (session 33 lost two sweeps' files that way)."""

    def __init__(self, path, head: dict):
        self.path, self.data = Path(path), dict(head)

    def add(self, section: str, row: dict) -> dict:
        self.data.setdefault(section, []).append(row)
        print(json.dumps(row, default=_json_default), flush=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=_json_default))
        return row


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def fmt(v: Any, width: int = 9) -> str:
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        if not math.isfinite(v):
            return "nan".rjust(width)
        a = abs(v)
        s = f"{v:.3g}" if a and (a < 1 or a >= 1e5) else f"{v:.2f}" if a < 100 else f"{v:.0f}"
        return s.rjust(width)
    return str(v).rjust(width)


def print_table(rows: Sequence[dict], columns: Sequence[str], widths: Optional[dict] = None,
                file=None) -> str:
    """Print ``rows`` (dicts) as a fixed-width table of ``columns``; returns the text."""
    widths = widths or {}
    w = {c: max(widths.get(c, 0), len(c), *(len(fmt(r.get(c), 0).strip()) for r in rows)) for c in columns}
    lines = [" ".join(c.rjust(w[c]) for c in columns), " ".join("-" * w[c] for c in columns)]
    for r in rows:
        lines.append(" ".join(fmt(r.get(c), w[c]) for c in columns))
    text = "\n".join(lines)
    print(text, file=file or sys.stdout, flush=True)
    return text


def split_presets(text: str) -> list[str]:
    """A benchmark's ``--presets``: ``"int8,int4:sink_blocks=0,recent_blocks=0"`` ->
    ``["int8", "int4:sink_blocks=0,recent_blocks=0"]``: a comma item that is a bare ``key=value`` continues the
    previous item's overrides (``TurboConfig.from_spec`` reads each)."""
    out: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if out and "=" in item and ":" not in item and ":" in out[-1]:
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def parse_int_list(s: str) -> list[int]:
    """'512,1k,16k' -> [512, 1024, 16384]."""
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * mult))
    return out


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def free_gpu_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def iter_product(*lists: Iterable) -> list[tuple]:
    import itertools

    return list(itertools.product(*lists))
