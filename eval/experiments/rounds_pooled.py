"""Issue 18's eager bar over several bench_generate rounds files pooled: per preset, every round's ratio of turbo's
step to sdpa + DynamicCache's step in the same round (the round's own step and the median of its clocked steps), their
median and geometric mean with bootstrap intervals, the same per round from the clocked steps split into the first
step and the later ones (``step_ratios``), and each config's first decode step against its later ones.

    python -m eval.experiments.rounds_pooled [--out eval/results/eager_rounds_pooled_s36_h200.json] FILE...

Why pooled: one shape's 12 rounds cannot tell a 1 % difference on a host whose step moves 23 <-> 40 ms between turns
(eval/PERF_NOTES.md session 35); all the shapes' rounds together can bound it.
"""
import argparse
import json
import math
import random
import statistics
import sys

#: a later step this much over its round's median counts as slow (``first_step``: the host's noise, per config)
SLOW_STEP = 1.1

#: a round's step (the issue's (t(1 + N) - t(1)) / N) and the median of its clocked steps (--step-times)
ROUND_KEYS = ("decode_rounds_s", "decode_step_med_rounds_s")


def bootstrap(values: list[float], stat, n: int = 4000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat(values)`` (``n`` resamples with replacement, fixed seed)."""
    rng = random.Random(seed)
    draws = sorted(stat(rng.choices(values, k=len(values))) for _ in range(n))
    lo = int((1 - level) / 2 * n)
    return draws[lo], draws[n - 1 - lo]


def gmean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def first_step(row: dict) -> dict:
    """The first decode step after the prompt against the later ones: medians over the rounds of the clocked steps
    (``decode_step_pool_s`` holds each round's N steps in order), ms."""
    rounds = _rounds_of(row)
    if not rounds:
        return {}
    slow = [x > SLOW_STEP * statistics.median(r[1:]) for r in rounds for x in r[1:]]
    return {"first_step_ms": statistics.median(r[0] for r in rounds) * 1e3,
            "later_steps_ms": statistics.median(x for r in rounds for x in r[1:]) * 1e3,
            "slow_later_steps": sum(slow) / len(slow)}


def _rounds_of(row: dict) -> list:
    """A row's clocked steps per round (``decode_step_pool_s`` in round order), [] without them."""
    pool, rounds = row.get("decode_step_pool_s"), len(row.get("decode_step_med_rounds_s") or [])
    if not pool or not rounds or len(pool) % rounds:
        return []
    n = len(pool) // rounds
    return [pool[j * n:(j + 1) * n] for j in range(rounds)]


def step_ratios(row: dict, base: dict) -> dict:
    """Per round, turbo's clocked steps over the base's in the same round, four ways: the mean of all N steps (what
    the issue's estimator measures), the mean and the median of the later N - 1, and the mean of all N with turbo's
    first step costing its later median times the base's own first-step factor (what a first step no dearer than
    the base's would read). Separates the first step's share of a round's ratio from the later steps'."""
    mine, theirs = _rounds_of(row), _rounds_of(base)
    out: dict = {}
    for a, b in zip(mine, theirs):
        if len(a) != len(b) or len(a) < 2:
            continue
        n, a_med, b_med = len(a), statistics.median(a[1:]), statistics.median(b[1:])
        first_as_base = a_med * b[0] / b_med
        for key, v in (("steps_mean", statistics.fmean(a) / statistics.fmean(b)),
                       ("later_steps_mean", statistics.fmean(a[1:]) / statistics.fmean(b[1:])),
                       ("later_steps_median", a_med / b_med),
                       ("steps_mean_first_as_base", (first_as_base + sum(a[1:])) / n / statistics.fmean(b))):
            out.setdefault(key, []).append(v)
    return out


def pooled(paths: list[str], base: str = "sdpa_dynamic") -> dict:
    ratios: dict = {}
    firsts = []
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["rows"]
        by = {(r["config"], r["batch"], r["context"]): r for r in rows}
        for r in rows:
            fs = first_step(r)
            if fs:
                firsts.append({"file": path, "config": r["config"], "batch": r["batch"], "context": r["context"], **fs})
            b = by.get((base, r["batch"], r["context"]))
            if r["config"] == base or b is None:
                continue
            for key in ROUND_KEYS:
                if r.get(key) and b.get(key):
                    ratios.setdefault(r["config"], {}).setdefault(key, []).extend(
                        x / y for x, y in zip(r[key], b[key]))
            for key, vals in step_ratios(r, b).items():
                ratios.setdefault(r["config"], {}).setdefault(key, []).extend(vals)
    out = {}
    for cfg, per in sorted(ratios.items()):
        for key, vals in per.items():
            out.setdefault(cfg, {})[key] = {
                "rounds": len(vals), "median": statistics.median(vals), "median_ci95": bootstrap(vals, statistics.median),
                "gmean": gmean(vals), "gmean_ci95": bootstrap(vals, gmean), "frac_le_1": sum(v <= 1 for v in vals) / len(vals)}
    return {"base": base, "files": paths, "ratios": out, "first_steps": firsts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rounds_pooled", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res = pooled(args.files)
    for cfg, per in res["ratios"].items():
        for key, s in per.items():
            print(f"{cfg:18} {key:26} n={s['rounds']:3}  median {s['median']:.3f} [{s['median_ci95'][0]:.3f}, "
                  f"{s['median_ci95'][1]:.3f}]  gmean {s['gmean']:.3f} [{s['gmean_ci95'][0]:.3f}, "
                  f"{s['gmean_ci95'][1]:.3f}]  <=1: {s['frac_le_1']:.2f}")
    for f in res["first_steps"]:
        print(f"{f['config']:18} {f['batch']}x{f['context']}: first step {f['first_step_ms']:.1f} ms, later "
              f"{f['later_steps_ms']:.2f} ms, {100 * f['slow_later_steps']:.1f} % of them > {SLOW_STEP}x their "
              f"round's median ({f['file'].rsplit('/', 1)[-1]})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
