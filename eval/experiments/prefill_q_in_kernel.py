"""Q quantized inside the prefill's attention kernel (``prefill.Q_RAW``) against the Q+K pass (issue 20 item 2; issue 23
item 5: the rotated query by one tensor-core dot per tile instead of the pass's butterfly). GPU, CUDA-graph medians.

Per shape (a Llama-3-8B layer: 32 / 8 heads, head_dim 128; a Gemma-3-270M layer: 4 / 1, 256), length and rotation
(none / hadamard / smooth_hadamard), ``turbo_attention`` of one layer's bf16 Q, K, V (causal, K's mean from the call)
with ``prefill._Q_IN_KERNEL`` on and off, each captured as a CUDA graph of 20 calls, the graphs taking turns for
``--rounds`` rounds; medians, µs a call. Checks: the two settings' outputs are equal bit for bit without rotation and
within the reference tolerance with it. ``--profile``: each kernel's device µs (torch profiler) of both settings.

    python -m eval.experiments.prefill_q_in_kernel --out eval/results/prefill_q_in_kernel_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

N_CALLS = 20
SHAPES = (("llama3-8b", 32, 8, 128), ("gemma3-270m", 4, 1, 256))
MODES = ("none", "hadamard", "smooth_hadamard")


def _graph_timer(fn):
    """``fn`` captured ``N_CALLS`` times in one CUDA graph: each call of the returned timer replays it, µs a call."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(N_CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()

    def timed():
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) * 1e3 / N_CALLS
    return timed


def _kernel_us(fn) -> dict:
    """Device µs per call of each kernel ``fn`` launches (torch profiler, 20 calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(N_CALLS):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            out[e.key[:60]] = round(e.device_time_total / N_CALLS, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    import triton

    from turbo_attn_hf.kernels import prefill
    from turbo_attn_hf.kernels.rotation import smooth_scales

    rows = []
    for name, hq, hk, d in (s for s in SHAPES if s[0] in a.shapes.split(",")):
        for L in (int(x) for x in a.lens.split(",")):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(1, h, L, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hk, hk))
            for mode in MODES:
                s = smooth_scales(k) if mode == "smooth_hadamard" else None
                kw = dict(causal=True, rotate_qk=mode != "none", qk_smooth=s)
                calls, outs = {}, {}
                for on in (True, False):
                    def call(on=on):
                        prefill._Q_IN_KERNEL[0] = on
                        return prefill.turbo_attention(q, k, v, **kw)
                    outs[on] = call().float()
                    calls["q_in_kernel" if on else "q_pass"] = call
                diff = (outs[True] - outs[False]).abs()
                rel = (diff.pow(2).mean().sqrt() / outs[False].pow(2).mean().sqrt()).item()
                row = dict(shape=name, hq=hq, hk=hk, d=d, L=L, rotate_qk=mode, bit_equal=bool(diff.max() == 0),
                           rms_rel_diff=rel, max_abs_diff=diff.max().item())
                timers = {key: _graph_timer(fn) for key, fn in calls.items()}
                samples = {key: [] for key in timers}
                for _ in range(a.rounds):
                    for key, t in timers.items():
                        samples[key].append(t())
                row["us"] = {key: round(statistics.median(v_), 2) for key, v_ in samples.items()}
                row["q_in_kernel_over_pass"] = round(row["us"]["q_in_kernel"] / row["us"]["q_pass"], 4)
                if a.profile:
                    row["kernels_us"] = {key: _kernel_us(fn) for key, fn in calls.items()}
                rows.append(row)
                print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "kernels_us"}), flush=True)
    prefill._Q_IN_KERNEL[0] = True
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                note="turbo_attention of one layer (bf16, causal), Q quantized in the attention kernel vs by the Q+K "
                     "pass; us: CUDA graph of 20 calls, median of rounds")
    with open(a.out, "w") as fh:
        json.dump(dict(meta, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
