"""Device time of the rotated decode kernel against the plain one (issue 23 item 5), and of two copies of
``kernels/decode.py`` against each other: one query token over a filled TurboLayer per preset, the Llama-3-8B and
Gemma-3-270M heads, 4k / 32k × batch 1 / 8, plain and with smooth_hadamard factors. Each call is timed as a CUDA
graph of 20 calls (no host in the timing: rotation_cost's ``do_bench`` of one call can be host-bound at batch 1),
the graphs taking turns for ``--rounds`` rounds; medians. ``--baseline MODULE``: an earlier copy of the decode module
placed in the kernel package (``git show REV:kernels/decode.py > kernels/_decode_head.py``, then ``--baseline
turbo_attn_hf.kernels._decode_head``); its outputs must equal the tree's bit for bit (asserted).

    python -m eval.experiments.decode_rotation_ab --presets int4,int8 --out eval/results/decode_rot_ab_h200.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time

import torch

N_CALLS = 20


def _graph_timer(fn):
    """A timer of ``fn`` captured ``N_CALLS`` times in one CUDA graph: each call of it replays once, µs a call."""
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="int4")
    ap.add_argument("--baseline", default="", help="module path of an earlier decode.py copy (see the module doc)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from turbo_attn_hf.cache import TurboLayer
    from turbo_attn_hf.config import TurboConfig
    from turbo_attn_hf.kernels import decode as tree
    from turbo_attn_hf.kernels.rotation import smooth_scales

    mods = [("tree", tree)] + ([("base", importlib.import_module(a.baseline))] if a.baseline else [])
    rows = []
    for preset in a.presets.split(","):
        cfg = TurboConfig.preset(preset)
        for name, hq, hk, d in (("gemma3-270m", 4, 1, 256), ("llama3-8b", 32, 8, 128)):
            for ctx in (4096, 32768):
                for b in (1, 8):
                    gen = torch.Generator(device="cuda").manual_seed(0)
                    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
                    k, v, q1, k1 = rnd(b, hk, ctx, d), rnd(b, hk, ctx, d), rnd(b, hq, 1, d), rnd(b, hk, 1, d)
                    layer = TurboLayer(cfg)
                    layer.update(k, v)
                    layer.update(k1, k1)
                    args, kw = layer.decode_inputs()
                    factors = smooth_scales(k)
                    timers, outs = {}, {}
                    for tag, mod in mods:
                        for rot in (False, True):
                            extra = dict(rotate=True, qk_smooth=factors) if rot else {}
                            def f(mod=mod, extra=extra):
                                return mod.turbo_decode_attention(q1, *args, **kw, **extra)
                            outs[(tag, rot)] = f()
                            timers[(tag, rot)] = _graph_timer(f)
                    if a.baseline:
                        for rot in (False, True):
                            assert torch.equal(outs[("tree", rot)], outs[("base", rot)]), (name, ctx, b, rot)
                    times = {key: [] for key in timers}
                    for _ in range(a.rounds):
                        for key, t in timers.items():
                            times[key].append(t())
                    med = {key: statistics.median(x) for key, x in times.items()}
                    row = dict(preset=preset, shape=name, ctx=ctx, batch=b)
                    for tag, _ in mods:
                        row[f"{tag}_plain_us"] = round(med[(tag, False)], 2)
                        row[f"{tag}_rot_us"] = round(med[(tag, True)], 2)
                        row[f"{tag}_rot_pct"] = round(100 * (med[(tag, True)] / med[(tag, False)] - 1), 2)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    del layer, k, v
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                git=os.environ.get("TURBO_GIT_COMMIT", ""), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                baseline=a.baseline, n_calls=N_CALLS, rounds=a.rounds,
                method="CUDA graph of 20 calls, replay time / 20, median of rounds")
    with open(a.out, "w") as fh:
        json.dump(dict(meta, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
