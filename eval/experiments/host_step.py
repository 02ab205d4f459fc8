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

Numbers: median over ``--reps`` of (loop time / (layers x steps)), in microseconds per layer call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
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


def install_stubs() -> None:
    """No-op every Triton launch; run the GPU host paths on CPU tensors."""
    import triton.runtime.jit as jit

    def run(self, *args, grid=None, warmup=False, **kwargs):
        return _STUB

    jit.JITFunction.run = run
    from turbo_attn_hf.kernels import interpreter, launch

    class _Active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device=None):
            return 0

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
               d: int, padded: bool, profile: bool = False, sdpa: bool = False) -> dict:
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
    scaling = d ** -0.5
    from transformers.masking_utils import causal_mask_function

    if sdpa:
        from transformers import DynamicCache
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        def new_cache():
            return DynamicCache()

        attn_fn = sdpa_attention_forward
    else:
        def new_cache():
            return TurboCache(preset, config=cfg)

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

    def decode(cache, n):
        for s in range(n):
            past = context + s
            m = mask_for(1, past)
            for i in range(layers):
                k, v = cache.update(k1, v1, i)
                attn_fn(mods[i], q1, k, v, m, scaling=scaling, dropout=0.0)

    # warm: compile-once caches (LeanLaunch keys, _DecodeStatic entries, plans)
    c = new_cache()
    prefill(c)
    decode(c, steps)
    pre, dec = [], []
    for _ in range(reps):
        c = new_cache()
        t0 = time.perf_counter()
        prefill(c)
        t1 = time.perf_counter()
        decode(c, steps)
        t2 = time.perf_counter()
        pre.append((t1 - t0) / layers * 1e6)
        dec.append((t2 - t1) / (layers * steps) * 1e6)
    out = dict(preset="sdpa" if sdpa else preset, prefill_us_per_layer=round(statistics.median(pre), 1),
               decode_us_per_layer=round(statistics.median(dec), 1), decode_min=round(min(dec), 1))
    if profile:
        c = new_cache()
        prefill(c)
        decode(c, 2)  # this cache's launcher entries exist (as after a generate()'s first steps)
        pr = cProfile.Profile()
        pr.enable()
        decode(c, steps)
        pr.disable()
        for order in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(order).print_stats(30)
            print(s.getvalue())
        c = new_cache()
        pr = cProfile.Profile()
        pr.enable()
        prefill(c)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="int8,int4,mixed")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=33)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hk,head_dim (Llama-3-8B)")
    ap.add_argument("--padded", action="store_true", help="left-pad row 0 (a key_valid mask every step)")
    ap.add_argument("--sdpa", action="store_true", help="also time DynamicCache + sdpa_attention_forward")
    ap.add_argument("--profile", default=None, help="cProfile this preset's decode loop and prefill")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    install_stubs()
    hq, hk, d = map(int, a.heads.split(","))
    kw = dict(batch=a.batch, context=a.context, steps=a.steps, reps=a.reps, layers=a.layers, hq=hq, hk=hk, d=d,
              padded=a.padded)
    rows = []
    if a.sdpa:
        rows.append(run_config("sdpa", sdpa=True, **kw))
        print(json.dumps(rows[-1]), flush=True)
    for p in a.presets.split(","):
        rows.append(run_config(p, profile=(p == a.profile), **kw))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
