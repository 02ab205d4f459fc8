"""Host (Python) time per layer of turbo_int8's eager decode step and first prefill, on CPU, kernels stubbed.

What plain ``generate()`` runs per layer and step — ``TurboCache.update`` (HF's ``Cache.update`` -> the
layer's store) then ``turbo_attention_forward`` (mask conversion, module checks -> ``layer.attention`` ->
``turbo_decode_attention``'s launcher) — with every Triton launch replaced by a no-op: ``use_triton`` is
forced on for CPU tensors, Triton's ``JITFunction.run`` returns a stub compiled kernel whose ``run`` does
nothing, and ``LeanLaunch``'s driver is a stub (current device 0, stream 0). So the Python/PyTorch host path
is timed as on the GPU machine (LeanLaunch's facts, the relaunch argument tuple, the launcher's plan and
allocations), minus the CUDA driver's own launch cost (~2-5 us per launch, the same before/after a change)
and minus GPU-side PyTorch op dispatch differences (CPU ops are run for real: ``torch.empty``, ``mean``).

Baseline for comparison: the same loop with ``DynamicCache`` + transformers' ``sdpa_attention_forward``
(real CPU attention of one query over the context: its host cost on CPU includes the SDPA math, so it is an
upper bound of sdpa's host time; see ``--sdpa``).

    python -m eval.experiments.host_step                 # int8/int4/mixed, 1 x 1k, decode + first prefill
    python -m eval.experiments.host_step --profile int4  # cProfile of the decode loop (tottime top 25)
    # each step of new caches alone, split into update / attention (a generate()'s first decode step):
    python -m eval.experiments.host_step --device cuda --presets int4 --context 4096 --steps 4 --reps 5 --per-step
    # Gemma-3's rotated layers, their token stored by its own launch vs by the decode launch (alternating rounds):
    python -m eval.experiments.host_step --presets int4 --heads 4,1,256 --rotate-qk smooth_hadamard --ab-rotated-store 5

Numbers: median over ``--reps`` of (loop time / (layers x steps)), in microseconds per layer call.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
import types

import torch


class _StubKernel:
    """What LeanLaunch keeps from a first launch: ``run`` is the launcher (a no-op here)."""

    function = None
    packed_metadata = None

    def run(self, *args, **kwargs):
        return None

    def launch_metadata(self, *args, **kwargs):
        return None

    def __getitem__(self, grid):  # `jit_fn.warmup(...)[grid]` style callers
        return self.run


_STUB = _StubKernel()


def install_stubs(binder: bool = True) -> None:
    """No-op every Triton launch; run the GPU host paths on CPU tensors.

    ``binder`` (default): keep Triton's own per-call path (``JITFunction.run``: the argument binder and its C++
    specialisation, the cache key, ``launch_metadata``) for a fake sm_90 device, and stub only the compile
    (each key gets the no-op kernel) and the launcher — so a launch through ``fn[grid](...)`` costs here what
    it costs on the GPU host minus the CUDA driver. Without it (``--no-binder``, the earlier mode),
    ``JITFunction.run`` itself returns the no-op kernel: Triton's binder is not timed at all."""
    import triton.runtime.jit as jit
    from triton.backends.compiler import GPUTarget

    class _Active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device=None):
            return 0

        @staticmethod
        def get_current_target():
            return GPUTarget("cuda", 90, 128)

    if binder:
        jit.driver = types.SimpleNamespace(active=_Active())

        def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
            self.device_caches[device][0][key] = _STUB
            return _STUB

        jit.JITFunction._do_compile = _do_compile
    else:
        def run(self, *args, grid=None, warmup=False, **kwargs):
            return _STUB

        jit.JITFunction.run = run
    from turbo_attn_hf.kernels import interpreter, launch

    launch.driver = types.SimpleNamespace(active=_Active())
    always = lambda device: True  # noqa: E731
    interpreter.use_triton = always
    import turbo_attn_hf.cache as cache_mod

    cache_mod.use_triton = always
    for name in ("turbo_attn_hf.kernels.store", "turbo_attn_hf.kernels.decode", "turbo_attn_hf.kernels.prefill",
                 "turbo_attn_hf.kernels.quant", "turbo_attn_hf.kernels.pack"):
        mod = sys.modules.get(name) or __import__(name, fromlist=["_"])
        if hasattr(mod, "use_triton"):
            mod.use_triton = always
        if hasattr(mod, "_check_device"):
            mod._check_device = lambda *a, **k: None


def _print_per_layer(pr: cProfile.Profile, n: int, what: str, top: int = 30) -> None:
    """cProfile rows as microseconds and calls per layer call (``n`` layer calls), by own time."""
    rows = sorted(pstats.Stats(pr).stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"{what}: per layer call (own us, cumulative us, calls)")
    for (path, line, name), (_, nc, tt, ct, _) in rows:
        print(f"{tt / n * 1e6:8.1f} {ct / n * 1e6:8.1f} {nc / n:6.1f}  {path.split('/')[-1]}:{line}({name})")


def time_components(preset: str, *, batch: int, context: int, layers: int, hq: int, hk: int, d: int,
                    reps: int, calls: int = 300) -> dict:
    """Min over ``reps`` of the mean over ``calls`` calls (us) of each host piece of a first prefill's layer:
    ``prefill`` (``kernels.prefill.turbo_attention`` with the store's K mean: operand quantization + the INT8
    kernel), ``kv_stats``, ``store_kv`` (the first prefill's plan), and ``layer`` (a fresh cache layer's
    ``update`` + ``attention``, the K mean's CPU work included)."""
    from turbo_attn_hf.cache import TurboCache
    from turbo_attn_hf.kernels.pack import PackedKV
    from turbo_attn_hf.kernels.prefill import turbo_attention
    from turbo_attn_hf.kernels.store import kv_stats, store_kv

    cfg = _model_config(layers, hq, hk, d)
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    kp = torch.randn(batch, hk, context, d, generator=g).to(dt)
    vp = torch.randn(batch, hk, context, d, generator=g).to(dt)
    qp = torch.randn(batch, hq, context, d, generator=g).to(dt)
    # HF hands q/k/v over as transposed views of [b, L, H, d] projections
    qp, kp, vp = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (qp, kp, vp))
    c = TurboCache(preset, config=cfg)
    k, v = c.update(kp, vp, 0)
    lay = c.layers[0]
    lay.attention(qp, k, v, scale=d ** -0.5)
    tc = lay.turbo_config
    bs, keep = tc.block_size, tc.recent_blocks * tc.block_size
    take = min(lay.n_sink, context)
    n = context - take
    n_pack = (n - keep) // bs * bs
    groups = [PackedKV.empty(gr.bits, gr.heads, batch, d, bs, kp.device, capacity=max(n_pack // bs, 1))
              for gr in lay.groups]
    select = None
    if len(groups) > 1 and lay._prompt_select():
        select = (groups[0].heads, groups[1].heads, groups[1].heads.shape[0])

    def one_layer():
        cc = TurboCache(preset, config=cfg)
        kk, vv = cc.update(kp, vp, 0)
        cc.layers[0].attention(qp, kk, vv, scale=d ** -0.5)

    pieces = {
        "prefill": lambda: turbo_attention(qp, k, v, scale=d ** -0.5, causal=True, k_mean=lay.k_mean),
        "kv_stats": lambda: kv_stats(kp, vp, lay.k_mean, bs, lay.headroom, lay.nonfinite, select),
        "store_kv": lambda: store_kv(kp, vp, lay.k_scale, lay.k_mean, lay.v_scale, lay.k_tail, lay.v_tail, groups,
                                     take=take, slot_sink=0, c=0, s0=lay.n_sink, n_pack=n_pack),
        "layer": one_layer,
    }
    out = {"preset": preset}
    for name, fn in pieces.items():
        fn()
        n_calls = calls if name != "layer" else max(calls // 10, 10)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n_calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / n_calls * 1e6)
        out[name + "_us"] = round(best, 1)
    return out


def _model_config(layers: int, hq: int, hk: int, d: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
                      num_hidden_layers=layers, intermediate_size=64, vocab_size=128)
    cfg._attn_implementation = "turbo_int8"
    return cfg


class _Attn(torch.nn.Module):
    """Stands in for a transformers attention module (what the attention fn reads: config, is_causal)."""

    def __init__(self, config, idx):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, idx, True
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads  # sdpa's repeat_kv


def run_config(preset: str, *, batch: int, context: int, steps: int, reps: int, layers: int, hq: int, hk: int,
               d: int, padded: bool, profile: bool = False, sdpa: bool = False, device: str = "cpu",
               prefill_attention: str = "", rotate_qk: str = "", per_step: bool = False) -> dict:
    from turbo_attn_hf.attention import turbo_attention_forward
    from turbo_attn_hf.cache import TurboCache
    from turbo_attn_hf.masks import turbo_mask

    cfg = _model_config(layers, hq, hk, d)
    mods = [_Attn(cfg, i) for i in range(layers)]
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    kp = torch.randn(batch, hk, context, d, generator=g).to(dt)
    vp = torch.randn(batch, hk, context, d, generator=g).to(dt)
    qp = torch.randn(batch, hq, context, d, generator=g).to(dt)
    q1 = torch.randn(batch, hq, 1, d, generator=g).to(dt)
    k1 = torch.randn(batch, hk, 1, d, generator=g).to(dt)
    v1 = torch.randn(batch, hk, 1, d, generator=g).to(dt)
    am = torch.ones(batch, context + steps + 1, dtype=torch.long)
    if padded:
        am[0, :3] = 0
    kp, vp, qp, q1, k1, v1, am = (x.to(device) for x in (kp, vp, qp, q1, k1, v1, am))
    # on a GPU: real launches, the queue drained before each timed loop (the loops do not wait for the GPU)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    scaling = d ** -0.5
    from transformers.masking_utils import causal_mask_function

    if sdpa:
        from transformers import DynamicCache
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        def new_cache():
            return DynamicCache()

        attn_fn = sdpa_attention_forward
    else:
        import dataclasses

        from turbo_attn_hf.config import TurboConfig

        tcfg = TurboConfig.preset(preset)
        if prefill_attention:
            tcfg = dataclasses.replace(tcfg, prefill_attention=prefill_attention)
        if rotate_qk:
            tcfg = dataclasses.replace(tcfg, rotate_qk=rotate_qk)

        def new_cache():
            return TurboCache(tcfg, config=cfg)

        attn_fn = turbo_attention_forward

    def mask_for(q_len, past):
        if sdpa:
            return None  # sdpa: is_causal path, no mask tensor at batch 1 without padding
        return turbo_mask(batch, q_len, q_len, past, past, causal_mask_function, am[:, :past + q_len], config=cfg)

    def prefill(cache):
        m = mask_for(context, 0)
        for i in range(layers):
            k, v = cache.update(kp, vp, i)
            attn_fn(mods[i], qp, k, v, m, scaling=scaling, dropout=0.0)

    def decode(cache, n, first=0, split=None):
        """Decode steps ``first .. first + n - 1``; ``split``: add each layer's update / attention seconds to it."""
        clock = time.perf_counter
        for s in range(first, first + n):
            past = context + s
            m = mask_for(1, past)
            for i in range(layers):
                if split is None:  # the timed loops: no clock reads inside
                    k, v = cache.update(k1, v1, i)
                    attn_fn(mods[i], q1, k, v, m, scaling=scaling, dropout=0.0)
                    continue
                t0 = clock()
                k, v = cache.update(k1, v1, i)
                t1 = clock()
                attn_fn(mods[i], q1, k, v, m, scaling=scaling, dropout=0.0)
                split[0] += t1 - t0
                split[1] += clock() - t1

    # warm: compile-once caches (LeanLaunch keys, _DecodeStatic entries, plans)
    c = new_cache()
    prefill(c)
    decode(c, steps)  # steps 0: the first prefill alone
    pre, dec = [], []
    for _ in range(reps):
        c = new_cache()
        sync()
        t0 = time.perf_counter()
        prefill(c)
        t1 = time.perf_counter()
        sync()
        t1s = time.perf_counter()
        decode(c, steps)
        t2 = time.perf_counter() - (t1s - t1)
        pre.append((t1 - t0) / layers * 1e6)
        dec.append((t2 - t1) / (layers * max(steps, 1)) * 1e6)
    out = dict(preset="sdpa" if sdpa else preset, prefill_us_per_layer=round(statistics.median(pre), 1),
               decode_us_per_layer=round(statistics.median(dec), 1), decode_min=round(min(dec), 1))
    if not sdpa:
        # the first prefill's one real CPU computation (the torch K mean over the prompt; on the GPU one launch):
        # timed alone on the same keys and taken out, leaving the host path (``prefill_host_us``)
        from turbo_attn_hf.kernels.reference import k_smooth_mean

        means = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            for _ in range(layers):
                k_smooth_mean(kp)
            means.append((time.perf_counter() - t0) / layers * 1e6)
        out.update(prefill_k_mean_us=round(statistics.median(means), 1),
                   prefill_host_us=round(statistics.median(pre) - statistics.median(means), 1),
                   prefill_min=round(min(pre), 1))
    if not steps:
        del out["decode_us_per_layer"], out["decode_min"]
    if per_step and steps:
        # each decode step of a new cache on its own: a generate()'s first one costs more host (the first prefill's
        # views made on first use, the layer's decode entry rebound; eval/PERF_NOTES.md session 37)
        per_rep = []
        for _ in range(reps):
            c = new_cache()
            prefill(c)
            row = []
            for s in range(steps):
                split = [0.0, 0.0]
                sync()
                t0 = time.perf_counter()
                decode(c, 1, s, split)
                row.append(((time.perf_counter() - t0) / layers * 1e6, [round(x / layers * 1e6, 1) for x in split]))
            per_rep.append(row)
        best = [min(per_rep, key=lambda r: r[s][0])[s] for s in range(steps)]  # the fastest new cache, per step
        out.update(step_us_per_layer=[round(t, 1) for t, _ in best],
                   step_update_attention_us=[sp for _, sp in best])
        if profile:
            c = new_cache()
            prefill(c)
            sync()
            pr = cProfile.Profile()
            pr.enable()
            decode(c, 1)
            pr.disable()
            _print_per_layer(pr, layers, "a new cache's first decode step")
    if profile and steps:
        c = new_cache()
        prefill(c)
        decode(c, 2)  # this cache's launcher entries exist (as after a generate()'s first steps)
        pr = cProfile.Profile()
        pr.enable()
        decode(c, steps)
        pr.disable()
        _print_per_layer(pr, steps * layers, "decode step", top=40)
    if profile:
        pr = cProfile.Profile()
        for _ in range(reps):
            c = new_cache()
            sync()
            pr.enable()
            prefill(c)
            pr.disable()
        _print_per_layer(pr, reps * layers, "first prefill")
    return out


def ab_rotated_store(presets: list, rounds: int, **kw) -> list:
    """Rotated layers' decode host, the store's own launch against the decode launch's (``DEFER_ROTATED_STORE``),
    alternating per round in this process (every other round reversed: ``bench_e2e.alternating``): one row per
    (preset, mode) with the median of the per-round minimums."""
    import turbo_attn_hf.cache as cache_mod

    from ..bench_e2e import alternating

    def run(cfg):
        p, cache_mod.DEFER_ROTATED_STORE = cfg
        return run_config(p, **dict(kw, reps=3))["decode_min"]

    mins: dict = {}
    try:
        for _, cfg, t in alternating([(p, d) for d in (False, True) for p in presets], rounds, run, warm=0, abba=True):
            mins.setdefault(cfg, []).append(t)
    finally:
        cache_mod.DEFER_ROTATED_STORE = True
    rows = [dict(preset=p, rotate_qk=kw["rotate_qk"], store="decode launch" if deferred else "own launch",
                 decode_us_per_layer=statistics.median(v), per_round_min=v) for (p, deferred), v in mins.items()]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="int8,int4,mixed")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=33, help="decode steps per rep (0: the first prefill alone)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hk,head_dim (Llama-3-8B)")
    ap.add_argument("--padded", action="store_true", help="left-pad row 0 (a key_valid mask every step)")
    ap.add_argument("--sdpa", action="store_true", help="also time DynamicCache + sdpa_attention_forward")
    ap.add_argument("--profile", default=None, help="cProfile this preset's decode loop and prefill")
    ap.add_argument("--components", action="store_true",
                    help="time the first prefill's host pieces alone (prefill, kv_stats, store_kv, one layer)")
    ap.add_argument("--no-binder", action="store_true",
                    help="stub Triton's JITFunction.run itself (its binder untimed; the mode before the binder stub)")
    ap.add_argument("--device", default="cpu",
                    help="cuda: real tensors and launches on the GPU, no stubs (the GPU host's own cost)")
    ap.add_argument("--prefill-attention", default="",
                    help="the presets' prefill_attention (exact: the H100 default, profiled on CPU)")
    ap.add_argument("--store-launch", action="store_true",
                    help="cache.DEFER_DECODE_STORE off: the decode step's store in its own launch (before session 22)")
    ap.add_argument("--rotate-qk", default="", help="the presets' rotate_qk (hadamard, smooth_hadamard: Gemma-3's "
                                                    "layers with --heads 4,1,256)")
    ap.add_argument("--ab-rotated-store", type=int, default=0, metavar="R",
                    help="R alternating rounds per preset, cache.DEFER_ROTATED_STORE off (the store's own launch) "
                         "and on (the decode launch stores the rotated token): medians of the per-round minimums")
    ap.add_argument("--per-step", action="store_true",
                    help="also each decode step of new caches on its own (min over reps) and its update / attention "
                         "split: the first step after a prompt against the later ones")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.store_launch:
        import turbo_attn_hf.cache as cache_mod

        cache_mod.DEFER_DECODE_STORE = False
    if a.device == "cpu":
        install_stubs(binder=not a.no_binder)
    hq, hk, d = map(int, a.heads.split(","))
    kw = dict(batch=a.batch, context=a.context, steps=a.steps, reps=a.reps, layers=a.layers, hq=hq, hk=hk, d=d,
              padded=a.padded, device=a.device)
    rows = []
    if a.components:
        for p in a.presets.split(","):
            rows.append(time_components(p, batch=a.batch, context=a.context, layers=a.layers, hq=hq, hk=hk, d=d,
                                        reps=a.reps))
            print(json.dumps(rows[-1]), flush=True)
        a.presets = ""
    if a.sdpa:
        rows.append(run_config("sdpa", sdpa=True, profile=(a.profile == "sdpa"), **kw))
        print(json.dumps(rows[-1]), flush=True)
    if a.ab_rotated_store:
        rows += ab_rotated_store(a.presets.split(","), a.ab_rotated_store, rotate_qk=a.rotate_qk or "hadamard", **kw)
        a.presets = ""
    for p in filter(None, a.presets.split(",")):
        rows.append(run_config(p, profile=(p == a.profile), prefill_attention=a.prefill_attention,
                               rotate_qk=a.rotate_qk, per_step=a.per_step, **kw))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
