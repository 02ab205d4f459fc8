"""turbo_attn_hf.first_prefill: a first store recorded by one layer and replayed by the next layers of its shape.

Triton's interpreter never memoises a launch, so on CPU the replay only runs with the launches stubbed
(``eval.experiments.host_step.install_stubs``: every kernel a no-op), which patches Triton for the whole process:
that part runs in a subprocess. It checks the plumbing — the pointers each replayed launch gets and the views its
layer makes on first use equal those of the general path for the same layer. The numbers (codes, scales, head
choice bit for bit the PyTorch path's, replayed layers included) are ``test_store_fused.
test_layers_of_one_shape_replay_the_first_layers_plan`` on the GPU.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turbo_attn_hf.kernels.arena import lazy_view, make_views, stacked_views, view_spec

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r'''
import torch
from eval.experiments.host_step import install_stubs, _model_config
install_stubs()
from turbo_attn_hf import first_prefill as FP
from turbo_attn_hf.cache import TurboCache
from turbo_attn_hf.config import TurboConfig
from turbo_attn_hf.kernels.arena import view_spec
from turbo_attn_hf.kernels.launch import LeanLaunch

calls = []
orig = LeanLaunch.relaunch
LeanLaunch.relaunch = staticmethod(lambda hit, grid, call: (calls.append((tuple(grid), list(call))),
                                                             orig(hit, grid, call)))
cfg = _model_config(4, 8, 4, 64)
g = torch.Generator().manual_seed(0)
kvs = [tuple(torch.randn(1, 700, 4, 64, generator=g).to(torch.bfloat16).transpose(1, 2) for _ in "kv")
       for _ in range(4)]

def run(preset, replay):
    saved = FP.replay
    if not replay:
        FP.replay = lambda *a: None
    try:
        c = TurboCache(TurboConfig.from_spec(preset), config=cfg)
        out = []
        for i, (k, v) in enumerate(kvs):
            n = len(calls)
            c.update(k, v, i)
            lay = c.layers[i]
            replayed = "_lazy" in lay.__dict__
            bufs = [lay._flat] + [grp.flat for grp in lay.groups]
            def rel(x):
                for j, b in enumerate(bufs):
                    if b.data_ptr() <= x < b.data_ptr() + b.numel():
                        return ("buf", j, x - b.data_ptr())
                f = lay.qk_smooth.data_ptr() if lay.qk_smooth is not None else None
                return {k.data_ptr(): "k", v.data_ptr(): "v", f: "f"}.get(x, x)
            launched = [(grid, [rel(x) for x in call]) for grid, call in calls[n:]]
            views = {name: view_spec(getattr(lay, name), bufs) for name in FP.LAYER_VIEWS}
            for j, grp in enumerate(lay.groups):
                views.update({(j, name): view_spec(getattr(grp, name), bufs) for name in grp.TENSORS + ("heads",)})
            out.append((replayed, launched, views, lay.n_tail, lay.n_blocks, [b.numel() for b in bufs]))
        return out
    finally:
        FP.replay = saved

for preset in ("int8", "int4", "mixed", "int4:rotate_qk=smooth_hadamard", "mixed:rotate_qk=smooth_hadamard"):
    FP.PLANS.clear()
    new, old = run(preset, True), run(preset, False)
    assert [r[0] for r in new] == [False, True, True, True], (preset, [r[0] for r in new])
    assert not any(r[0] for r in old)
    smooth = "smooth" in preset  # the layer's own factors launch (memoised), then the replay's two
    for i in (1, 2, 3):
        a, b = new[i], old[i]
        assert len(a[1]) == 2 + smooth and a[1] == b[1], (preset, i, a[1], b[1])
        assert a[2:] == b[2:], (preset, i)
        if smooth:
            assert sum(x == "f" for _, call in a[1] for x in call) == 3, (preset, i)  # factors: out, stats and store in
print("OK")
'''


def test_replayed_layers_launch_with_the_general_paths_pointers_and_views():
    """Plain and smooth_hadamard layers (their factors an input of the replay, made by the layer's own launch)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the stubs replace the interpreter
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]


class _Holder:
    def __getattr__(self, name):
        return lazy_view(self, name)


def test_lazy_views_are_made_on_first_use_and_keep_later_assignments():
    buf = torch.arange(256, dtype=torch.uint8)
    a = buf[128:].view(torch.int32).view(4, 8)
    h = _Holder()
    h._lazy = ([buf], {"a": view_spec(a, [buf]), "none": ("none",), "b": view_spec(buf[:16], [buf])})
    h.b = "kept"
    assert torch.equal(h.a, a) and h.a.data_ptr() == a.data_ptr() and h.a.stride() == a.stride()
    assert h.none is None and h.b == "kept" and "_lazy" not in h.__dict__
    with pytest.raises(AttributeError):
        h.missing
    assert view_spec(torch.zeros(2), [buf]) is None


def test_stacked_views_are_each_layers_own_views():
    """``stacked_views`` (a flush's layers' views at once) gives what ``make_views`` gives each layer at its byte
    bases: the same addresses, shapes, strides and dtypes; layers apart by a partial element are refused."""
    bufs = [torch.zeros(3 * 96, dtype=torch.uint8), torch.zeros(3 * 64, dtype=torch.uint8)]
    specs = {"a": (0, (2, 4), (1, 2), torch.float32, 4), "b": (1, (8,), (2,), torch.int16, 0), "c": ("none",)}
    stacked = stacked_views(bufs, specs, (96, 64), 3)
    for j in range(3):
        own = make_views(bufs, list(specs.values()), (96 * j, 64 * j))
        for t, o in zip((stacked[a][j] for a in specs), own):
            assert (t is None and o is None) or (t.data_ptr(), t.shape, t.stride(), t.dtype) == \
                (o.data_ptr(), o.shape, o.stride(), o.dtype)
    with pytest.raises(ValueError, match="whole"):
        stacked_views(bufs, specs, (98, 64), 3)


def test_layer_format_ids_follow_the_format_not_the_objects():
    """A first store's plan is keyed by ``TurboLayer._layer_format``'s id: equal for the same layer of two caches
    (and for an equal config object), different where the format differs (preset, RoPE layout, head count)."""
    import dataclasses

    from transformers import LlamaConfig

    from turbo_attn_hf.cache import TurboCache
    from turbo_attn_hf.config import TurboConfig

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=2, intermediate_size=32, vocab_size=32)
    int4 = TurboConfig.preset("int4")

    def fmt(tc, i=0, hk=2, rope=None):
        lay = TurboCache(tc, config=cfg).layers[i]
        if rope is not None:
            lay.rope_dims = rope
        return lay._layer_format(hk, 64)

    bits, fid = fmt(int4)
    assert bits == (4, 4) and fmt(int4) == (bits, fid) and fmt(int4, 1) == (bits, fid)
    assert fmt(dataclasses.replace(int4))[1] == fid  # another object, the same format
    assert fmt(TurboConfig.preset("int8"))[1] != fid
    assert fmt(TurboConfig.preset("mixed"))[1] != fid
    assert fmt(int4, hk=1)[1] != fid
    assert fmt(dataclasses.replace(int4, packed_k_bits=8))[1] != fid  # INT8 K blocks: another storage layout
    assert fmt(dataclasses.replace(int4, k_scale_range="rope_pair"), rope=64)[1] != \
        fmt(dataclasses.replace(int4, k_scale_range="rope_pair"), rope=0)[1]


# ----------------------------------------------------------- a forward's first stores, queued (first_prefill.Batch)
def _tiny_turbo(preset="int4", layers=4, device="cpu"):
    import dataclasses

    from transformers import LlamaConfig, LlamaForCausalLM

    import turbo_attn_hf
    from turbo_attn_hf.config import TurboConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    m = LlamaForCausalLM(cfg).eval().to(device)
    m.set_attn_implementation(turbo_attn_hf.ATTN_NAME)
    tc = dataclasses.replace(TurboConfig.from_spec(preset), block_size=16, sink_blocks=1, recent_blocks=1,
                             prefill_attention="exact")  # the prompt's attention reads no cache: stores queue
    turbo_attn_hf.set_turbo_config(m, tc)
    return m, tc


def _storage(layers):
    out = []
    for lay in layers:
        n = lay.n_tail
        groups = [(g.bits, g.heads, g.n_blocks, [t[:, :, :g.n_blocks] for _, t in g._tensors()]) for g in lay.groups]
        out.append((n, lay.k_scale, lay.v_scale, lay.k_tail[:, :, :n], lay.v_tail[:, :, :, :n], groups, lay.qk_smooth))
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("preset", ["int8", "int4", "mixed", "mixed:packed_k_bits=8", "int4:rotate_qk=smooth_hadamard"])
def test_generate_with_queued_first_stores_equals_the_layer_by_layer_store(preset, device, monkeypatch):
    """generate() on a turbo model whose prompt attention is exact: every layer but the first queues its first store
    and the last layer's update launches the queue (one flush per prompt); tokens and every stored byte equal the
    layer-by-layer store's (``BATCH_BYTES = 0``: on the GPU the per-layer replay, on CPU the general path), through
    a second turn on the filled cache (a second prefill); smooth_hadamard's factors too, the queued layers' made
    together by the flush."""
    from turbo_attn_hf import first_prefill as FP
    from turbo_attn_hf.cache import TurboCache

    m, tc = _tiny_turbo(preset, device=device)
    g = torch.Generator().manual_seed(1)
    turn1 = torch.randint(0, 96, (1, 90), generator=g).to(device)
    turn2 = torch.randint(0, 96, (1, 40), generator=g).to(device)
    flushes = []
    flush = FP.Batch.flush
    monkeypatch.setattr(FP.Batch, "flush", lambda self: (flushes.append(len(self.items)), flush(self)))

    def chat(batch_bytes):
        monkeypatch.setattr(FP, "BATCH_BYTES", batch_bytes)
        FP.PLANS.clear()
        cache = TurboCache(tc, config=m.config)
        with torch.no_grad():
            a = m.generate(turn1, past_key_values=cache, max_new_tokens=5, do_sample=False)
            b = m.generate(torch.cat([a, turn2], 1), past_key_values=cache, max_new_tokens=5, do_sample=False)
        return b, _storage(cache.layers)

    from turbo_attn_hf.kernels import smooth_factors as SF

    made = []
    layered = SF.smooth_factors_layers
    monkeypatch.setattr(SF, "smooth_factors_layers", lambda keys: (made.append(len(keys)), layered(keys))[1])
    toks, stored = chat(FP.BATCH_BYTES)
    assert [n for n in flushes if n] == [3]  # layers 1-3 of the first prompt, at layer 3's update
    # smooth_hadamard: the queued layers' factors in one launch at the flush (layer 0 made its own, recording)
    assert made == ([3] if "smooth" in preset else [])
    toks0, stored0 = chat(0)
    assert torch.equal(toks, toks0)
    assert _same(stored, stored0)


def test_a_plan_with_one_queued_smooth_layer(device, monkeypatch):
    """Gemma-3's layout (sliding layers and one full layer: two plans) with smooth_hadamard: a second cache replays
    the full layer's plan with that layer alone in its flush, so the flush makes one layer's factors ([b, Hk, d],
    batch 3 with one KV head); every stored byte and the next decode step equal the layer-by-layer store's."""
    import dataclasses

    import transformers

    import turbo_attn_hf
    from turbo_attn_hf import first_prefill as FP
    from turbo_attn_hf.cache import TurboCache
    from turbo_attn_hf.config import TurboConfig

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                        max_position_embeddings=512, sliding_window=32,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    m = transformers.Gemma3ForCausalLM(cfg).eval().to(device)
    m.set_attn_implementation(turbo_attn_hf.ATTN_NAME)
    tc = dataclasses.replace(TurboConfig.from_spec("int4:rotate_qk=smooth_hadamard"), block_size=16, sink_blocks=1,
                             recent_blocks=1, prefill_attention="exact")
    turbo_attn_hf.set_turbo_config(m, tc)
    ids = torch.randint(0, 96, (3, 90), generator=torch.Generator().manual_seed(4)).to(device)

    def second_cache(batch_bytes):
        monkeypatch.setattr(FP, "BATCH_BYTES", batch_bytes)
        FP.PLANS.clear()
        with torch.no_grad():
            for _ in range(2):  # the first cache records both plans; the second replays them
                cache = TurboCache(tc, config=m.config)
                m(ids, past_key_values=cache, logits_to_keep=1, use_cache=True)
            logits = m(ids[:, :1], past_key_values=cache, use_cache=True).logits
        return logits, _storage(cache.layers)

    logits, stored = second_cache(FP.BATCH_BYTES)
    logits0, stored0 = second_cache(0)
    assert [s[-1].shape for s in stored] == [(3, 1, 64)] * 3
    assert torch.equal(logits, logits0) and _same(stored, stored0)


def test_a_queued_layer_reset_or_read_before_the_launch(device):
    """A read of a queued layer's storage launches the queue (its views then resolve); a layer reset while queued
    stays reset (the launch writes buffers it no longer holds)."""
    import dataclasses

    from turbo_attn_hf import first_prefill as FP
    from turbo_attn_hf.cache import TurboCache
    from turbo_attn_hf.config import TurboConfig

    m, tc = _tiny_turbo("int4", layers=5)
    g = torch.Generator().manual_seed(2)
    kvs = [tuple(torch.randn(1, 2, 90, 64, generator=g).to(device, torch.bfloat16) for _ in "kv") for _ in range(5)]
    FP.PLANS.clear()
    ref = TurboCache(dataclasses.replace(tc, prefill_attention="int8"), config=m.config)  # nothing queued
    for i, (k, v) in enumerate(kvs):
        ref.update(k, v, i)
    cache = TurboCache(tc, config=m.config)
    for i, (k, v) in enumerate(kvs[:4]):
        cache.update(k, v, i)
    assert len(cache._first_stores.items) == 4  # ref's layer 0 recorded the plan: every layer replays it
    cache.layers[2].reset()
    assert torch.equal(cache.layers[1].k_scale, ref.layers[1].k_scale)  # a read: the queue launched
    assert not cache._first_stores.items and not cache.layers[2].is_initialized
    assert cache.layers[2].k_scale is None and cache.layers[2].groups == []
    cache.update(*kvs[4], 4)  # queued alone, launched at the last layer
    assert not cache._first_stores.items
    for i in (0, 1, 3, 4):
        assert _same(_storage([cache.layers[i]]), _storage([ref.layers[i]])), i


def test_a_queue_whose_launch_failed_says_so(monkeypatch):
    """A launch that raised (out of memory) leaves its layers unresolvable: a clear error, never unwritten views."""
    from turbo_attn_hf import first_prefill as FP

    def oom(items):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(FP, "launch_layers", oom)
    batch = FP.Batch()
    batch.gen.items.append(("replay", None, None, "factors"))  # factors given: nothing for the flush to make first
    queued = FP.Queued(batch.gen, 0, None)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        queued.resolve()
    with pytest.raises(RuntimeError, match="failed to launch"):
        queued.resolve()


@pytest.mark.parametrize("preset", ["int4", "mixed"])
def test_generate_with_a_prepared_first_decode_step(preset, device, monkeypatch):
    """generate() whose first prefill finds the GPU behind (the middle layer's event not reached, forced here): the
    cache prepares every layer's first decode step at the last layer, after the queue's flush
    (``TurboCache._prepare_decode``), so the decode steps bind no entry of their own; the tokens are those of a
    generate() that prepares nothing."""
    from turbo_attn_hf import cache as C
    from turbo_attn_hf.cache import TurboCache

    if not C.use_triton(torch.device(device)):
        pytest.skip("the decode entries are the Triton kernels'")
    m, tc = _tiny_turbo(preset, device=device)
    ids = torch.randint(0, 96, (1, 90), generator=torch.Generator().manual_seed(2)).to(device)

    class Behind:  # a CUDA event the GPU has not reached
        def query(self):
            return False

    update = TurboCache.update

    def marked(self, k, v, layer_idx, *a, **kw):
        if layer_idx == len(self.layers) - 1 and k.shape[2] > 1 and self.behind:
            self._gpu_mark = Behind()
        return update(self, k, v, layer_idx, *a, **kw)

    monkeypatch.setattr(TurboCache, "update", marked)
    dec = C._kernels("decode")
    real, calls = dec.decode_entry, []
    monkeypatch.setattr(dec, "decode_entry", lambda *a, **kw: (calls.append(kw.get("rebind_only", False)),
                                                                 real(*a, **kw))[1])

    def run(behind):
        cache = TurboCache(tc, config=m.config)
        cache.behind = behind
        calls.clear()
        with torch.no_grad():
            out = m.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
        return out, list(calls)

    plain, _ = run(False)  # also the calls each layer remembers
    again, seen = run(False)
    prepared, seen_prepared = run(True)
    assert seen == [False] * len(m.model.layers)  # each layer binds at its first decode step
    assert seen_prepared == [True] * len(m.model.layers)  # bound at the prefill's last layer, none after
    assert torch.equal(prepared, plain) and torch.equal(again, plain)
