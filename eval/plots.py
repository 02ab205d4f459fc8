"""PNG plots made from the benchmark JSON files (the JSON is the source of truth; plots are derived).

    python -m eval.plots [eval/results/bench_prefill.json ...]     # default: every known result file there

Each ``plot_*`` takes the JSON path, writes ``<same name>.png`` beside it and returns that path, or None
(with a message) when matplotlib is missing — the GPU image has it; ``pip install matplotlib`` elsewhere.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional

from .bench_common import RESULTS_DIR


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("plots: matplotlib is not installed; skipping PNG (pip install matplotlib)", file=sys.stderr)
        return None


def _load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _title(data: dict, what: str) -> str:
    m = data.get("machine", {})
    return f"{what} — {m.get('device', '?')}, torch {m.get('torch', '?')}, triton {m.get('triton', '?')}, {m.get('date_utc', '')[:10]}"


def _save(fig, path: Path) -> Path:
    png = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def plot_prefill(path) -> Optional[Path]:
    """TFLOP/s vs sequence length, one panel per (head_dim, causal), one line per provider."""
    plt = _plt()
    if plt is None:
        return None
    path = Path(path)
    data = _load(path)
    rows = [r for r in data["rows"] if r.get("tflops") is not None]
    dims = sorted({r["d"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    if not dims:
        return None
    fig, axes = plt.subplots(len(causals), len(dims), figsize=(4.2 * len(dims), 3.4 * len(causals)), squeeze=False)
    # one colour per provider in every panel (a panel without some provider must not shift the others' colours)
    colour = {prov: f"C{i}" for i, prov in enumerate(sorted({r["provider"] for r in rows}))}
    handles = {}
    for i, causal in enumerate(causals):
        for j, d in enumerate(dims):
            ax = axes[i][j]
            lines = defaultdict(list)
            for r in rows:
                if (r["d"], r["causal"]) == (d, causal):
                    lines[r["provider"]].append((r["L"], r["tflops"]))
            for prov, pts in sorted(lines.items()):
                pts.sort()
                dash = "--" if prov.startswith(("sdpa", "sage")) else "-"
                handles[prov], = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=prov,
                                         color=colour[prov], linestyle=dash)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length L")
            ax.set_ylabel("TFLOP/s (4·b·h·L²·d, ½ causal)")
            ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}")
            ax.grid(alpha=0.3)
    axes[0][-1].legend([handles[p] for p in sorted(handles)], sorted(handles), fontsize=7)
    fig.suptitle(_title(data, "prefill attention"), fontsize=9)
    return _save(fig, path)


def plot_decode(path) -> Optional[Path]:
    """Time per decode step vs batch, one panel per context, one line per provider; plus GB/s."""
    plt = _plt()
    if plt is None:
        return None
    path = Path(path)
    data = _load(path)
    rows = [r for r in data["rows"] if r.get("ms") is not None and r.get("provider") not in ("all", "setup")]
    ctxs = sorted({r["context"] for r in rows})
    if not ctxs:
        return None
    fig, axes = plt.subplots(2, len(ctxs), figsize=(4.2 * len(ctxs), 6.4), squeeze=False)
    ceil = (data.get("copy_ceiling") or {}).get("GBps_read_plus_write")
    for j, T in enumerate(ctxs):
        lines = defaultdict(list)
        for r in rows:
            if r["context"] == T:
                if r.get("ms_graph"):  # GPU time without launch overhead, when measured
                    lines[r["provider"]].append((r["batch"], r["ms_graph"], r.get("GBps_graph")))
                else:
                    lines[r["provider"]].append((r["batch"], r["ms"], r.get("GBps")))
        for prov, pts in sorted(lines.items()):
            pts.sort()
            style = "--" if prov.startswith(("sdpa", "dequant")) else "-"
            axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle=style, label=prov)
            axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", linestyle=style, label=prov)
        for i, ylabel in enumerate(("ms per decode step, 1 layer (CUDA graph)", "effective GB/s (bytes read / time)")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][j].set_yscale("log")
        axes[0][j].set_title(f"context {T}")
        if ceil:
            axes[1][j].axhline(ceil, color="k", linewidth=0.8, linestyle=":", label="copy ceiling")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(_title(data, "decode attention, GQA 32/8, d 128"), fontsize=9)
    return _save(fig, path)


def plot_e2e(path) -> Optional[Path]:
    """Prefill latency and decode tokens/s per configuration (sdpa vs presets), per context."""
    plt = _plt()
    if plt is None:
        return None
    path = Path(path)
    data = _load(path)
    pre = [r for r in data.get("prefill", []) if r.get("ms") is not None]
    dec = [r for r in data.get("decode", []) if r.get("tokens_per_s") is not None]
    if not pre and not dec:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    impls = sorted({r["impl"] for r in pre + dec}, key=lambda s: (s != "sdpa", s))
    ctxs = sorted({r["context"] for r in pre})
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        ys = [next((r["ms"] for r in pre if r["impl"] == impl and r["context"] == c), 0) for c in ctxs]
        axes[0].bar([x + i * width for x in range(len(ctxs))], ys, width, label=impl)
    axes[0].set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(ctxs))], [str(c) for c in ctxs])
    axes[0].set_xlabel("prompt tokens (batch 1)")
    axes[0].set_ylabel("prefill latency, ms")
    axes[0].legend(fontsize=7)
    keys = sorted({(r["context"], r["batch"]) for r in dec})
    for i, impl in enumerate(impls):
        ys = [next((r["tokens_per_s"] for r in dec if r["impl"] == impl and (r["context"], r["batch"]) == kb), 0)
              for kb in keys]
        axes[1].bar([x + i * width for x in range(len(keys))], ys, width, label=impl)
    axes[1].set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(keys))],
                       [f"{c // 1024}k×{b}" for c, b in keys], fontsize=7)
    axes[1].set_xlabel("context × batch")
    axes[1].set_ylabel("decode tokens/s (all sequences)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    cfg = data.get("config", {})
    fig.suptitle(_title(data, f"end to end, Llama-3-8B-shaped ({cfg.get('layers', '?')} layers)"), fontsize=9)
    return _save(fig, path)


def plot_generate(path) -> Optional[Path]:
    """bench_generate: decode ms per step and time to first token per shape (batch x context), one bar per config;
    rows without a number are marked at the axis (OOM, n/i = not implemented, skip = time budget)."""
    plt = _plt()
    if plt is None:
        return None
    path = Path(path)
    data = _load(path)
    rows = data.get("rows", [])
    if not rows:
        return None
    order = ["sdpa_dynamic", "sdpa_static", "sdpa_compiled"] + [f"turbo_{p}_{m}" for p in ("int8", "int4", "mixed")
                                                                for m in ("eager", "compiled")]
    colors = {"sdpa_dynamic": "#a0a0a0", "sdpa_static": "#6a9fcf", "sdpa_compiled": "#1f4e79",
              "int8": "tab:green", "int4": "tab:purple", "mixed": "tab:orange"}
    configs = sorted({r["config"] for r in rows}, key=lambda c: (order.index(c) if c in order else len(order), c))
    shapes = sorted({(r["batch"], r["context"]) for r in rows}, key=lambda s: (s[0] * s[1], s[0]))
    by = {(r["config"], r["batch"], r["context"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.9 * len(shapes) + 4), 4.2))
    width = 0.8 / max(len(configs), 1)
    # a --rounds-only file has rows without the rows' own numbers: its bars are the rounds' medians
    rounds = not any(r.get("decode_ms_per_step") or r.get("ttft_ms") for r in rows)
    dec_keys = ("decode_step_med_rounds_ms", "decode_rounds_ms") if rounds else ("decode_ms_per_step",)
    panels = ((axes[0], dec_keys, "decode ms per step (lower is better)" + (f"\n{dec_keys[0]}, else {dec_keys[1]}"
                                                                              if rounds else "")),
              (axes[1], ("ttft_rounds_ms",) if rounds else ("ttft_ms",),
               "time to first token, ms" + (" (ttft_rounds_ms)" if rounds else "")))
    for ax, keys, ylabel in panels:
        drawn = False
        for i, cfg in enumerate(configs):
            xs = [x + i * width for x in range(len(shapes))]
            ys = [next((v for v in ((by.get((cfg, b, t)) or {}).get(k) for k in keys) if v), None) for b, t in shapes]
            drawn = drawn or any(ys)
            style = dict(hatch="//", edgecolor="white") if cfg.endswith("_compiled") else {}
            color = colors.get(cfg) or colors.get(cfg.split("_")[1] if cfg.startswith("turbo_") else "", None)
            ax.bar([x for x, y in zip(xs, ys) if y], [y for y in ys if y], width, color=color, **style,
                   label=cfg if any(ys) else f"{cfg} (no data)")
            for x, (b, t) in zip(xs, shapes):
                r = by.get((cfg, b, t))
                if r and not rounds and r.get(keys[0]) is None and r.get("error"):
                    err = r["error"]
                    mark = "OOM" if err == "OOM" else "n/i" if err.startswith("not implemented") else \
                        "skip" if err.startswith("skipped") else "err"
                    ax.text(x, 0.02, mark, rotation=90, fontsize=6, ha="center", va="bottom",
                            transform=ax.get_xaxis_transform())
        ax.set_xticks([x + width * (len(configs) - 1) / 2 for x in range(len(shapes))],
                      [f"{b}×{t // 1024}k" if t % 1024 == 0 else f"{b}×{t}" for b, t in shapes], fontsize=8)
        ax.set_xlabel("batch × context")
        ax.set_ylabel(ylabel)
        if drawn and not rounds:  # log of nothing is an error; the rounds' bars are of one size: linear
            ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    axes[1].legend(*axes[0].get_legend_handles_labels(), fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    cfg = data.get("config", {})
    fig.suptitle(_title(data, f"model.generate(), Llama-3-8B-shaped ({cfg.get('layers', '?')} layers), "
                              f"N = {cfg.get('new_tokens', '?')}"), fontsize=9)
    return _save(fig, path)


#: issue 18's bars on turbo's decode step, by (compiled?, batch, context): eager steps <= sdpa + DynamicCache's
#: everywhere; compiled <= 1.05x sdpa compiled's at 1 x 1k / 1 x 4k, 1/1.5 at 1 x 32k, 1/1.8 at 4 x 8k
GENERATE_BARS = {(False, None): 1.0, (True, (1, 1024)): 1.05, (True, (1, 4096)): 1.05, (True, (1, 32768)): 1 / 1.5,
                 (True, (4, 8192)): 1 / 1.8}

#: the ratio keys a row may carry, per estimator, the paired rounds first; a plain row's ratio only for compiled steps
#: (an eager row timed a minute after sdpa's reads another host mode: 0.9-1.8x in one process, PERF_NOTES s32-s35)
_BAR_KEYS = {False: (("paired rounds", "decode_paired_vs_sdpa_dynamic"),
                     ("median step, paired", "decode_step_med_paired_vs_sdpa_dynamic"),
                     ("p10 step, pooled", "decode_step_p10_vs_sdpa_dynamic")),
             True: (("paired rounds", "compiled_paired_vs_sdpa_compiled"),
                    ("median step, paired", "compiled_step_med_paired_vs_sdpa_compiled"),
                    ("p10 step, pooled", "compiled_step_p10_vs_sdpa_compiled"),
                    ("one row", "decode_vs_sdpa_compiled"))}


def plot_generate_bars(paths, out) -> Optional[Path]:
    """Issue 18's bars from several bench_generate files (rounds files or plain rows): per shape and preset, turbo's
    decode step over sdpa's (eager over sdpa + DynamicCache, compiled over sdpa compiled), one marker per estimator
    the file carries, and the bar as a line. A shape where sdpa ran out of memory and turbo ran is marked "sdpa OOM".
    A path written ``FILE:compiled`` gives its compiled rows only (a file whose eager rows another run replaced)."""
    plt = _plt()
    if plt is None:
        return None
    points, oom, machines = [], set(), set()
    for path in paths:
        path, _, only = str(path).partition(":")  # "FILE:compiled": that file's compiled rows only
        data = _load(path)
        m = (data.get("runs") or [{}])[0].get("machine") or data.get("machine") or {}
        machines.add(f"{m.get('device', '?')} @ {str(m.get('git_commit', '?'))[:7]}")
        rows = data.get("rows", [])
        base_oom = {(r["config"], r["batch"], r["context"]) for r in rows if r.get("error") == "OOM"}
        for r in rows:
            cfg = r["config"]
            if not cfg.startswith("turbo_") or cfg.endswith("_hfrope"):  # an A/B config, not a preset's row
                continue
            compiled = cfg.endswith("_compiled")
            if only == "compiled" and not compiled:
                continue
            shape = (r["batch"], r["context"])
            base = "sdpa_compiled" if compiled else "sdpa_dynamic"
            if (base, *shape) in base_oom and r.get("decode_ms_per_step"):
                oom.add((compiled, shape, cfg.split("_")[1]))
            for label, key in _BAR_KEYS[compiled]:
                if r.get(key):
                    points.append((compiled, shape, cfg.split("_")[1], label, float(r[key])))
    if not points and not oom:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    markers = {"paired rounds": "o", "median step, paired": "s", "p10 step, pooled": "^", "one row": "D"}
    colors = {"int8": "tab:green", "int4": "tab:purple", "mixed": "tab:orange"}
    presets = ("int8", "int4", "mixed")
    for ax, compiled in zip(axes, (False, True)):
        shapes = sorted({p[1] for p in points if p[0] == compiled} | {s for c, s, _ in oom if c == compiled},
                        key=lambda s: (s[0] * s[1], s[0]))
        for xi, shape in enumerate(shapes):
            bar = GENERATE_BARS.get((compiled, shape), GENERATE_BARS.get((compiled, None)))
            if bar is not None:
                ax.hlines(bar, xi - 0.4, xi + 0.4, colors="k", linestyles="--", linewidth=1)
            for pi, preset in enumerate(presets):
                x = xi + (pi - 1) * 0.22
                for c, s, pr, label, y in points:
                    if (c, s, pr) == (compiled, shape, preset):
                        ax.plot(x, y, markers[label], color=colors[preset], markersize=5, alpha=0.85)
                if (compiled, shape, preset) in oom:
                    ax.text(x, 0.03, f"{preset}: sdpa OOM", rotation=90, fontsize=6, ha="center", va="bottom",
                            transform=ax.get_xaxis_transform())
        ax.set_xticks(range(len(shapes)), [f"{b}×{t // 1024}k" for b, t in shapes], fontsize=8)
        ax.set_xlabel("batch × context")
        ax.set_ylabel("turbo step / " + ("sdpa compiled's" if compiled else "sdpa + DynamicCache's") +
                      " (lower is better)")
        ax.set_title(("compiled (static cache, CUDA graphs)" if compiled else "eager (dynamic cache)") +
                     ": -- = issue 18's bar", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    handles = [plt.Line2D([], [], color=colors[p], marker="o", linestyle="") for p in presets]
    handles += [plt.Line2D([], [], color="gray", marker=mk, linestyle="") for mk in markers.values()]
    axes[1].legend(handles, list(presets) + list(markers), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("model.generate(), Llama-3-8B-shaped, 32 layers: " + "; ".join(sorted(machines)), fontsize=8)
    return _save(fig, Path(out))


def plot_rotation_cost(paths, out) -> Optional[Path]:
    """Issue 23's speed bar per prompt forward and decode step (``eval.experiments.first_prefill_rotation`` files):
    each rotate_qk row's extra kernel time over its shape's ``none`` row, in %, with the 3 % bar."""
    plt = _plt()
    if plt is None:
        return None
    rows = {"forward": [], "decode": []}
    for p in paths:
        data = _load(p)
        for sec in rows:
            rows[sec] += [r for r in data.get(sec, []) if r.get("total_pct") is not None]
    def case(r):  # a prompt forward's length, or a decode step's context x batch
        return r["shape"], r.get("L") or f'{r["context"] // 1024}k x{r["batch"]}'

    rows = {sec: rs for sec, rs in rows.items() if rs}  # a panel only for what the files hold
    if not rows:
        return None
    width_in = max(6.5, 0.75 * max(len({case(r) for r in rs}) for rs in rows.values()))  # ~0.75 in a case
    fig, axes = plt.subplots(1, len(rows), figsize=(width_in * len(rows), 4.8), squeeze=False)
    for ax, (sec, rs) in zip(axes[0], rows.items()):
        cases = sorted({case(r) for r in rs}, key=lambda c: (c[0], str(c[1]).zfill(8)))
        modes = sorted({r["rotate_qk"] for r in rs})
        width = 0.8 / max(len(modes), 1)
        for i, mode in enumerate(modes):
            by = {case(r): r["total_pct"] for r in rs if r["rotate_qk"] == mode}
            ax.bar([j + i * width for j in range(len(cases))], [by.get(c, 0.0) for c in cases], width, label=mode)
        ax.axhline(3.0, color="k", linestyle="--", linewidth=0.8, label="3 % bar")
        ax.set_ylim(top=max(3.5, 0.5 + max(r["total_pct"] for r in rs)))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"{a}\n{b}" for a, b in cases], fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("extra kernel time over rotate_qk none, %")
        ax.set_title("prompt forward (first prefill)" if sec == "forward" else "decode step")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle("rotate_qk's cost per forward, int4, random weights: " + _title(_load(paths[0]), "")[3:], fontsize=8)
    return _save(fig, Path(out))


PLOTTERS = {"bench_prefill": plot_prefill, "bench_decode": plot_decode, "bench_e2e": plot_e2e,
            "bench_generate": plot_generate}


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="turbo-attn plots", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="result JSON files (default: eval/results/bench_{prefill,decode,e2e}.json)")
    ap.add_argument("--bars", metavar="OUT_PNG", help="one plot of issue 18's bars over all the given bench_generate "
                                                      "files (plot_generate_bars; FILE:compiled for a file's compiled "
                                                      "rows only) instead of one plot per file")
    ap.add_argument("--rotation", metavar="OUT_PNG", help="one plot of rotate_qk's cost per forward over the given "
                                                          "first_prefill_rotation files (plot_rotation_cost)")
    args = ap.parse_args(argv)
    if args.rotation:
        png = plot_rotation_cost(args.paths, args.rotation)
        print(f"wrote {png}" if png else "plots: nothing to plot")
        return 0
    if args.bars:
        png = plot_generate_bars(args.paths, args.bars)
        print(f"wrote {png}" if png else "plots: no ratios to plot")
        return 0
    paths = [Path(p) for p in args.paths] or [RESULTS_DIR / f"{n}.json" for n in PLOTTERS]
    for p in paths:
        if not p.is_file():
            print(f"plots: {p} not found, skipped")
            continue
        key = next((k for k in PLOTTERS if p.stem.startswith(k)), None)
        if key is None:
            print(f"plots: no plot for {p.name}")
            continue
        png = PLOTTERS[key](p)
        if png:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
