"""A new cache's first decode step prepared while the GPU still runs the prefill (``TurboLayer.prepare_decode``,
``TurboCache._prepare_decode``): the views and the decode entry bound ahead from the call the same layer position
made at the last cache's first decode step. The prepared step takes the bound entry (no ``decode_entry`` call) and
gives the unprepared step's outputs bit for bit; a remembered call that does not fit binds nothing.

CPU: the Triton interpreter (tests/conftest.py), d 64, block 16.
"""
import pytest
import torch

from turbo_attn_hf import cache as C
from turbo_attn_hf.cache import TurboCache
from turbo_attn_hf.config import TurboConfig

BS, D, HK, G = 16, 64, 2, 4


def _cfg(preset, **kw):
    base = dict(block_size=BS, softmax="exact", sink_blocks=1, recent_blocks=0)
    base.update({"int8": dict(bits=8), "int4": dict(bits=4),
                 "mixed": dict(bits=4, frac_2bit_heads=0.5, head_select="prompt")}[preset])
    base.update(kw)
    return TurboConfig(**base)


def _qkv(b, L, device, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HK * G, L, D, generator=g)
    k = torch.randn(b, HK, L, D, generator=g) * 2 + torch.randn(1, HK, 1, D, generator=g)
    v = torch.randn(b, HK, L, D, generator=g)
    return tuple(x.to(torch.bfloat16).to(device) for x in (q, k, v))


def _run(cfg, qkv, prompt, steps, prepare=None, counts=None):
    """Prefill, ``prepare(cache)`` if given, then ``steps`` decode steps -> (cache, outputs); ``counts``: the
    ``decode_entry`` calls of each step."""
    q, k, v = qkv
    cache = TurboCache(cfg, layers=[C.TurboLayer(cfg, 0)])
    layer = cache.layers[0]
    layer.attention(q[:, :, :prompt], *cache.update(k[:, :, :prompt], v[:, :, :prompt], 0))
    if prepare is not None:
        prepare(cache)
    outs = []
    for s in range(steps):
        t = prompt + s
        before = None if counts is None else counts[0]
        kk, vv = cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
        outs.append(layer.attention(q[:, :, t:t + 1], kk, vv))
        if counts is not None:
            counts.append(counts[0] - before)
    return cache, outs


@pytest.fixture
def entry_calls(monkeypatch):
    """``decode_entry`` calls counted in ``counts[0]``; the cache's own preparation off (on a GPU its event may
    find the GPU behind), so each test prepares where it says."""
    monkeypatch.setattr(TurboCache, "_prepare_decode", lambda self: setattr(self, "_gpu_mark", None))
    dec = C._kernels("decode")
    counts = [0]
    real = dec.decode_entry

    def counted(*a, **kw):
        counts[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(dec, "decode_entry", counted)
    return counts


@pytest.mark.parametrize("preset,rotate", [("int8", "none"), ("int4", "none"), ("mixed", "none"),
                                           ("int4", "smooth_hadamard")])
def test_a_prepared_first_step_takes_the_bound_entry_and_the_same_numbers(device, entry_calls, preset, rotate):
    if not C.use_triton(device):
        pytest.skip("the decode entries are the Triton kernels'")
    cfg = _cfg(preset, rotate_qk=rotate)
    prompt, steps = BS + 5, 3
    qkv = _qkv(2, prompt + steps, device)
    _, plain = _run(cfg, qkv, prompt, steps)  # also the remembered first call and the entry's layout
    counts = [0]
    entry_calls[0] = 0

    def prepare(cache):
        layer = cache.layers[0]
        assert layer._decode_entry is None
        layer.prepare_decode({})
        assert layer._decode_entry is not None and entry_calls[0] == 1  # bound ahead, by the layout's rebinding
        assert "k_tail" in layer.__dict__  # the views are made
        counts[0] = entry_calls[0]

    _, prepared = _run(cfg, qkv, prompt, steps, prepare=prepare, counts=None)
    assert entry_calls[0] == counts[0]  # no decode step looked an entry up
    for a, b in zip(plain, prepared):
        assert torch.equal(a, b)


def test_a_remembered_call_that_does_not_fit_binds_nothing(device, entry_calls):
    if not C.use_triton(device):
        pytest.skip("the decode entries are the Triton kernels'")
    cfg = _cfg("int4")
    prompt = BS + 5
    _run(cfg, _qkv(2, prompt + 1, device), prompt, 1)  # remembers a batch-2 call
    q, k, v = _qkv(1, prompt + 2, device)  # a batch-1 cache
    cache, outs = _run(cfg, (q, k, v), prompt, 2, prepare=lambda c: c.layers[0].prepare_decode({}))
    assert cache.layers[0]._decode_entry[0][0][0] == 1  # bound at its first step, for its own query
    _, again = _run(cfg, (q, k, v), prompt, 2)
    assert all(torch.equal(a, b) for a, b in zip(outs, again))


def test_the_cache_prepares_only_while_the_gpu_is_behind(device, monkeypatch):
    if not C.use_triton(device):
        pytest.skip("the decode entries are the Triton kernels'")
    cfg = _cfg("int8")
    prompt = BS + 5
    qkv = _qkv(2, prompt + 1, device)
    _run(cfg, qkv, prompt, 1)
    prepared = []
    monkeypatch.setattr(C.TurboLayer, "prepare_decode", lambda self, stand_ins: prepared.append(self.layer_idx))

    class Mark:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    for done, want in ((True, []), (False, [0])):
        cache, _ = _run(cfg, qkv, prompt, 0)
        prepared.clear()  # on a GPU the prefill's own event may have prepared already
        cache._gpu_mark = Mark(done)
        cache._prepare_decode()
        assert prepared == want and cache._gpu_mark is None
    if device.type != "cuda":
        assert _run(cfg, qkv, prompt, 0)[0]._gpu_mark is None  # no CUDA event off the GPU
