"""How far issue 20's prefill bars sit from what the tensor cores allow, from a ``bench_prefill`` result (issue 20).

    python -m eval.experiments.prefill_ceiling eval/results/bench_prefill_hopper_s49_h200.json [--out FILE.json]

Per row (head_dim, L, causal), from the measured times of SDPA-cuDNN, the kernel alone and turbo (passes included):
the tensor efficiency of each, i.e. its floor over its time, where cuDNN's floor is every FLOP at the dense BF16 peak
and the kernel's is Q.K^T at the INT8 peak plus P.V at the BF16 peak (0.75 of cuDNN's tensor time); the passes' share
(turbo minus the kernel, over cuDNN's time); and the kernel time, and so the tensor efficiency, that the bar (turbo
at ``bar`` x cuDNN) needs with today's passes and with none. Nothing is timed here: every input is the JSON's.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

#: dense tensor-core peaks of an H100 / H200 SXM (NVIDIA's datasheet; the two share SMs and clocks), FLOP/s
PEAK_BF16 = 989.4e12
PEAK_INT8 = 1978.9e12
#: issue 20's bars: turbo / cuDNN time at head_dim 128, and at the other head dims
BARS = {128: 1.2}
BAR_OTHER = 1.0


def ceiling_rows(rows: list) -> list:
    """One dict per (d, L, causal) of ``bench_prefill``'s rows that has all three providers."""
    by = {}
    for r in rows:
        by.setdefault((r["d"], r["L"], r["causal"], r["batch"], r["heads"]), {})[r["provider"]] = r["ms"]
    out = []
    for (d, length, causal, batch, heads), ms in sorted(by.items()):
        if not {"sdpa_cudnn", "kernel_hopper", "turbo_hopper"} <= set(ms):
            continue
        flops = 4 * batch * heads * length * length * d * (0.5 if causal else 1.0)
        t_c, t_k, t_t = ms["sdpa_cudnn"], ms["kernel_hopper"], ms["turbo_hopper"]
        floor_c = flops / PEAK_BF16 * 1e3
        floor_k = (flops / 2 / PEAK_INT8 + flops / 2 / PEAK_BF16) * 1e3
        bar = BARS.get(d, BAR_OTHER)
        need = t_c / bar  # turbo's time the bar allows
        passes = t_t - t_k
        out.append(dict(
            d=d, L=length, causal=causal, bar=bar, cudnn_ms=t_c, kernel_ms=t_k, turbo_ms=t_t,
            x_cudnn=t_c / t_t, eff_cudnn=floor_c / t_c, eff_kernel=floor_k / t_k, passes_ms=passes,
            passes_of_cudnn=passes / t_c,
            need_kernel_ms=need - passes, need_eff=floor_k / (need - passes) if need > passes else float("inf"),
            need_kernel_ms_no_passes=need, need_eff_no_passes=floor_k / need))
    return out


def table(out: list) -> str:
    lines = ["| d, L | bar | now x cuDNN | tensor eff. cuDNN / kernel | passes / cuDNN | eff. the bar needs: "
             "with today's passes / none |", "|---|---|---|---|---|---|"]
    for r in out:
        lines.append(f"| {r['d']}, {r['L'] // 1024}k {'causal' if r['causal'] else 'full'} | {r['bar']:.1f} | "
                     f"{r['x_cudnn']:.2f} | {r['eff_cudnn']:.2f} / {r['eff_kernel']:.2f} | "
                     f"{r['passes_of_cudnn']:.2f} | {r['need_eff']:.2f} / {r['need_eff_no_passes']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=Path, help="a bench_prefill JSON with sdpa_cudnn, kernel_hopper and turbo_hopper")
    ap.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    src = json.loads(args.bench.read_text())
    out = ceiling_rows(src["rows"])
    if not out:
        raise SystemExit(f"error: {args.bench} has no row with sdpa_cudnn, kernel_hopper and turbo_hopper; run "
                         "eval.bench_prefill with --providers sdpa_cudnn,turbo_hopper,kernel_hopper")
    print(table(out))
    if args.out:
        args.out.write_text(json.dumps(dict(source=str(args.bench), source_tree=src.get("tree"),
                                            peaks=dict(bf16=PEAK_BF16, int8=PEAK_INT8), rows=out), indent=1) + "\n")


if __name__ == "__main__":
    main()
