"""The first decode steps of a new TurboCache in the layer loop alone (issue 18's eager bar; PERF_NOTES session 37).

Every generate() makes a new cache, and its first decode step costs more host than the later ones: the first
prefill's storage views are made on first use, the layer's decode entry is rebound to the new storage, the step's
launch is looked up. This loop isolates that from HF's model code: ``--layers`` attention layers of one shape, a
first prefill through ``TurboCache.update`` + ``turbo_attention_forward``, then ``--steps`` decode steps, each timed
per layer and split into the cache's ``update`` and the attention call. A warm-up cache runs first (compiles, plans,
the layout's decode entry), then ``--reps`` new caches; the minimum over reps is printed per step. ``--profile``: a
cProfile of one new cache's step 0, per layer.

    python -m eval.experiments.first_step_layers --device cuda --preset int4           # the GPU host's own cost
    python -m eval.experiments.first_step_layers --preset int4 --context 512          # CPU, launches stubbed
"""

from __future__ import annotations

import argparse
import cProfile
import json
import sys
import time


def run(preset: str, device: str, layers: int, heads: tuple, context: int, steps: int, reps: int,
        profile: bool = False) -> dict:
    """``{"us_per_layer": [step 0, ...], "update_attention_us": [(update, attention) per step]}``: the minimum
    over ``reps`` new caches of each step's µs per layer, and that rep's split."""
    import torch
    from transformers.masking_utils import causal_mask_function

    from eval.experiments import host_step as hs
    from turbo_attn_hf.attention import turbo_attention_forward
    from turbo_attn_hf.cache import TurboCache
    from turbo_attn_hf.masks import turbo_mask

    hq, hk, d = heads
    batch = 1
    cfg = hs._model_config(layers, hq, hk, d)
    mods = [hs._Attn(cfg, i) for i in range(layers)]
    g = torch.Generator().manual_seed(0)
    kp, vp = (torch.randn(batch, hk, context, d, generator=g).to(torch.bfloat16) for _ in range(2))
    qp = torch.randn(batch, hq, context, d, generator=g).to(torch.bfloat16)
    q1 = torch.randn(batch, hq, 1, d, generator=g).to(torch.bfloat16)
    k1, v1 = (torch.randn(batch, hk, 1, d, generator=g).to(torch.bfloat16) for _ in range(2))
    am = torch.ones(batch, context + steps + 1, dtype=torch.long)
    kp, vp, qp, q1, k1, v1, am = (x.to(device) for x in (kp, vp, qp, q1, k1, v1, am))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    split = [0.0, 0.0]
    clock = time.perf_counter

    def mask_for(q_len, past):
        return turbo_mask(batch, q_len, q_len, past, past, causal_mask_function, am[:, :past + q_len], config=cfg)

    def prefill(c):
        m = mask_for(context, 0)
        for i in range(layers):
            k, v = c.update(kp, vp, i)
            turbo_attention_forward(mods[i], qp, k, v, m, scaling=d ** -0.5, dropout=0.0)

    def step(c, s):
        m = mask_for(1, context + s)
        for i in range(layers):
            t0 = clock()
            k, v = c.update(k1, v1, i)
            t1 = clock()
            turbo_attention_forward(mods[i], q1, k, v, m, scaling=d ** -0.5, dropout=0.0)
            split[0] += t1 - t0
            split[1] += clock() - t1

    c = TurboCache(preset, config=cfg)  # warm-up: compiles, plans, the layout's decode entry
    prefill(c)
    for s in range(steps):
        step(c, s)
    per_rep = []
    for _ in range(reps):
        c = TurboCache(preset, config=cfg)
        prefill(c)
        row = []
        for s in range(steps):
            split[:] = [0.0, 0.0]
            sync()
            t0 = clock()
            step(c, s)
            row.append(((clock() - t0) / layers * 1e6, tuple(round(x / layers * 1e6, 1) for x in split)))
        per_rep.append(row)
    best = [min(per_rep, key=lambda r: r[s][0])[s] for s in range(steps)]
    out = {"us_per_layer": [round(b[0], 1) for b in best], "update_attention_us": [b[1] for b in best]}
    if profile:
        c = TurboCache(preset, config=cfg)
        prefill(c)
        sync()
        pr = cProfile.Profile()
        pr.enable()
        step(c, 0)
        pr.disable()
        hs._print_per_layer(pr, layers, "step 0", top=28)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="first_step_layers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="int4")
    ap.add_argument("--device", default="cpu", help="cuda: real launches; cpu: Triton's launches stubbed")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        from eval.experiments.host_step import install_stubs

        install_stubs()
    heads = tuple(int(x) for x in args.heads.split(","))
    out = run(args.preset, args.device, args.layers, heads, args.context, args.steps, args.reps, args.profile)
    print(f"{args.preset}: us per layer, steps 0..{args.steps - 1} (min over {args.reps} new caches): "
          f"{out['us_per_layer']}")
    print(f"{args.preset}: (update, attention) us per layer: {out['update_attention_us']}")
    if args.json:
        from eval.bench_common import machine_info

        with open(args.json, "w") as fh:
            json.dump({"benchmark": "first_step_layers", "machine": machine_info(), "argv": sys.argv[1:], **out},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
