"""An eager decode step's token stored by the step's decode launch (cache.DEFER_DECODE_STORE, decode.py STORE) ==
the store's own launch before attention (DEFER off), bit for bit: every step's attention output, the INT8 buffer,
the packed blocks and the non-finite count, rotated layers (``rotate_qk``) included. And a read of the buffers
between update and attention (crop, beam reorder, a direct read) stores the token first, so nothing sees a stale
buffer.

A new cache's first decode step prepared ahead (``TurboLayer.prepare_decode``, ``TurboCache._prepare_decode``: the
views and the decode entry bound from the call the same layer position made at the last cache's first decode step)
takes the bound entry (no ``decode_entry`` call) and gives the unprepared step's outputs bit for bit; a remembered
call that does not fit binds nothing.

CPU: the Triton interpreter (tests/conftest.py), d 64, block 16: block packs, sinks and recent blocks come at small T.
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


def _qkv(b, L, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HK * G, L, D, generator=g)
    k = torch.randn(b, HK, L, D, generator=g) * 2 + torch.randn(1, HK, 1, D, generator=g)
    v = torch.randn(b, HK, L, D, generator=g)
    return (x.to(torch.bfloat16) for x in (q, k, v))


def _steps(cfg, defer, prompt, steps, device, between=None, bad_step=None, prepare=None, b=2):
    """Prefill ``prompt`` tokens of ``b`` rows, then ``steps`` decode steps (update + attention); ``prepare(cache)``
    runs after the prefill, ``between(layer, step)`` between a step's update and its attention. -> (the layer, every
    step's attention output, whether each step's token was deferred)."""
    old = C.DEFER_DECODE_STORE
    C.DEFER_DECODE_STORE = defer
    try:
        q, k, v = (x.to(device) for x in _qkv(b, prompt + steps, seed=7))
        if bad_step is not None:
            k[1, 0, prompt + bad_step, 3] = float("inf")
        cache = TurboCache(cfg, layers=[C.TurboLayer(cfg, 0)])
        kk, vv = cache.update(k[:, :, :prompt], v[:, :, :prompt], 0)
        layer = cache.layers[0]
        layer.attention(q[:, :, :prompt], kk, vv)
        if prepare is not None:
            prepare(cache)
        outs, deferred = [], []
        for s in range(steps):
            t = prompt + s
            kk, vv = cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
            deferred.append("_pend" in layer.__dict__)
            if between is not None:
                between(layer, s)
            outs.append(layer.attention(q[:, :, t:t + 1], kk, vv))
            assert "_pend" not in layer.__dict__  # consumed by the step's launch (or stored by a read before it)
        return layer, outs, deferred
    finally:
        C.DEFER_DECODE_STORE = old


def _assert_same_layers(a, b):
    assert (a.n_blocks, a.n_tail) == (b.n_blocks, b.n_tail)
    n = a.n_tail
    assert torch.equal(a.k_tail[:, :, :n].cpu(), b.k_tail[:, :, :n].cpu())
    assert torch.equal(a.v_tail[:, :, :, :n].cpu(), b.v_tail[:, :, :, :n].cpu())
    for ga, gb in zip(a.groups, b.groups):
        for (name, ta), (_, tb) in zip(ga._tensors(), gb._tensors()):
            assert torch.equal(ta[:, :, :ga.n_blocks].cpu(), tb[:, :, :gb.n_blocks].cpu()), name
    assert a.nonfinite_tokens() == b.nonfinite_tokens()


@pytest.mark.parametrize("preset,rotate", [("int8", "none"), ("int4", "none"), ("mixed", "none"),
                                           ("int4", "hadamard"), ("int8", "smooth_hadamard"),
                                           ("mixed", "smooth_hadamard")])
def test_decode_launch_stores_the_step_token(preset, rotate, device):
    """Steps across a block pack (that step stores with its own launch), a token with an inf (counted). A rotated
    layer's token is rotated by the decode launch as by the store kernel (``rotate_qk``, with and without the K -> Q
    smoothing factors)."""
    if device.type != "cuda" and not C.use_triton(device):
        pytest.skip("the deferred store runs where the Triton kernels do")
    cfg = _cfg(preset, rotate_qk=rotate)
    prompt, steps = BS + 5, BS - 2
    a, out_a, deferred = _steps(cfg, True, prompt, steps, device, bad_step=4)
    b, out_b, kept = _steps(cfg, False, prompt, steps, device, bad_step=4)
    assert not any(kept) and 0 < sum(deferred) < steps  # the packing steps store themselves
    for s, (x, y) in enumerate(zip(out_a, out_b)):
        assert torch.equal(x, y), f"step {s}"
    _assert_same_layers(a, b)
    assert a.nonfinite_tokens() == 1


def test_a_deferred_step_is_one_launch(device):
    """update + attention of a decode step that packs no block: the decode launch alone; a read of the buffers in
    between: the store's own launch first."""
    if device.type != "cuda" and not C.use_triton(device):
        pytest.skip("the deferred store runs where the Triton kernels do")
    from eval.bench_store import count_launches

    cfg = _cfg("int4")
    q, k, v = (x.to(device) for x in _qkv(1, BS + 3, seed=3))
    cache = TurboCache(cfg, layers=[C.TurboLayer(cfg, 0)])
    layer = cache.layers[0]
    layer.attention(q[:, :, :BS], *cache.update(k[:, :, :BS], v[:, :, :BS], 0))

    def step(t, read=False):
        kk, vv = cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
        if read:
            layer.v_tail  # noqa: B018 - a read of the buffers before the decode launch
        layer.attention(q[:, :, t:t + 1], kk, vv)

    layer.attention(q[:, :, BS:BS + 1], *cache.update(k[:, :, BS:BS + 1], v[:, :, BS:BS + 1], 0))  # compiles
    assert count_launches(lambda: step(BS + 1))["total"] == 1
    assert count_launches(lambda: step(BS + 2, read=True))["total"] == 2


@pytest.mark.parametrize("what", ["read", "crop", "reorder", "read-rotated"])
def test_a_read_before_attention_stores_the_token_first(what, device):
    """Whatever reads the buffers between update and attention finds the token stored (the store's own launch; a
    rotated layer's raw token rotated by it)."""
    if device.type != "cuda" and not C.use_triton(device):
        pytest.skip("the deferred store runs where the Triton kernels do")
    cfg = _cfg("int4", rotate_qk="smooth_hadamard" if what.endswith("rotated") else "none")
    prompt, steps = BS + 3, 4
    seen = []

    def between(layer, s):
        if s != 2:
            return
        if what.startswith("read"):
            seen.append(layer.k_tail[:, :, layer.n_tail - 1].clone())
        elif what == "crop":
            layer.crop(layer.get_seq_length())  # keeps every token, through the crop path
        else:
            layer.reorder_cache(torch.tensor([1, 0], device=device))
            layer.reorder_cache(torch.tensor([1, 0], device=device))

    a, out_a, deferred = _steps(cfg, True, prompt, steps, device, between=between)
    b, out_b, _ = _steps(cfg, False, prompt, steps, device)
    assert deferred[2]
    for x, y in zip(out_a, out_b):
        assert torch.equal(x, y)
    _assert_same_layers(a, b)
    if what.startswith("read"):
        assert torch.equal(seen[0].cpu(), b.k_tail[:, :, prompt + 2].cpu())


def test_which_calls_store_in_the_launch():
    """One rule for the layer's choice and the kernel's check: one query token, its G rows in one M tile."""
    from turbo_attn_hf.kernels.decode import MAX_BLOCK_M, stores_in_launch

    assert stores_in_launch(1, 8 * MAX_BLOCK_M, 8)
    assert not stores_in_launch(1, 8 * MAX_BLOCK_M + 8, 8)  # G = 65: two M tiles, the store's own launch
    assert not stores_in_launch(2, 8, 8)  # two query tokens (a chunk) store in update


def test_the_kernel_refuses_a_store_it_cannot_take(device):
    """store= with two query tokens is a named ValueError, not a token written at the wrong slot."""
    from turbo_attn_hf.kernels.decode import turbo_decode_attention

    cfg = _cfg("int8")
    layer, _, _ = _steps(cfg, True, prompt=20, steps=1, device=device)
    q, k, v = (x.to(device) for x in _qkv(2, 2, seed=3))
    with pytest.raises(ValueError, match="one query token"):
        turbo_decode_attention(q, layer.groups, layer.k_tail, layer.v_tail, layer.n_tail, layer.k_scale,
                               layer.v_scale, layer.k_mean, n_sink=BS, softmax="exact",
                               store=(k[:, :, :1], v[:, :, :1], layer.nonfinite))


def test_steady_steps_skip_the_layers_update(device, monkeypatch):
    """From a dynamic layer's first decode token on (the first prefill's checks of batch and heads are the token's),
    ``TurboCache.update`` hands a token of that shape to ``defer_token`` (no first-prefill, shape or rotation
    checks); a packing step, another batch and a reset go back through the layer's ``update``. The outputs are
    test_decode_launch_stores_the_step_token's (the same path)."""
    if device.type != "cuda" and not C.use_triton(device):
        pytest.skip("the deferred store runs where the Triton kernels do")
    seen = []
    update = C.TurboLayer.update

    def counted(self, k, v, *a, **kw):
        seen.append(k.shape[2])
        return update(self, k, v, *a, **kw)

    monkeypatch.setattr(C.TurboLayer, "update", counted)
    prompt, steps = BS + 5, BS - 2
    layer, _, deferred = _steps(_cfg("int4"), True, prompt, steps, device)
    packs = deferred.count(False)
    assert packs >= 1 and seen == [prompt] + [1] * packs  # the prompt, each pack
    assert layer._token_shape == (2, HK, 1, D)
    layer.batch_select_indices(torch.tensor([0], device=device))
    assert layer._token_shape is None
    layer.reset()
    assert layer._token_shape is None


def test_rotated_layers_defer_unless_switched_off(device, monkeypatch):
    """``DEFER_ROTATED_STORE`` (the GPU A/B of session 32's rotated store) keeps a rotated layer's store in its own
    launch and leaves unrotated layers deferring."""
    if device.type != "cuda" and not C.use_triton(device):
        pytest.skip("the deferred store runs where the Triton kernels do")
    monkeypatch.setattr(C, "DEFER_ROTATED_STORE", False)
    for rotate, defers in (("hadamard", False), ("none", True)):
        _, _, deferred = _steps(_cfg("int4", rotate_qk=rotate), True, BS + 3, 2, device)
        assert all(deferred) == defers and any(deferred) == defers, rotate


# ----------------------------------------------------------- the first decode step prepared ahead (prepare_decode)
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
    _, plain, _ = _steps(cfg, True, prompt, steps, device)  # also the remembered first call and the entry's layout
    bound = []

    def prepare(cache):
        layer = cache.layers[0]
        assert layer._decode_entry is None
        before = entry_calls[0]
        layer.prepare_decode({})
        assert layer._decode_entry is not None and entry_calls[0] == before + 1  # bound ahead, by the rebinding
        assert "k_tail" in layer.__dict__  # the views are made
        bound.append(entry_calls[0])

    _, prepared, _ = _steps(cfg, True, prompt, steps, device, prepare=prepare)
    assert entry_calls[0] == bound[0]  # no decode step looked an entry up
    for a, b in zip(plain, prepared):
        assert torch.equal(a, b)


def test_a_remembered_call_that_does_not_fit_binds_nothing(device, entry_calls):
    if not C.use_triton(device):
        pytest.skip("the decode entries are the Triton kernels'")
    cfg = _cfg("int4")
    prompt = BS + 5
    _steps(cfg, True, prompt, 1, device)  # remembers a batch-2 call
    prepare = lambda cache: cache.layers[0].prepare_decode({})  # noqa: E731
    layer, outs, _ = _steps(cfg, True, prompt, 2, device, prepare=prepare, b=1)
    assert layer._decode_entry[0][0][0] == 1  # bound at its first step, for its own query
    _, again, _ = _steps(cfg, True, prompt, 2, device, b=1)
    assert all(torch.equal(a, b) for a, b in zip(outs, again))


def test_the_cache_prepares_only_while_the_gpu_is_behind(device, monkeypatch):
    if not C.use_triton(device):
        pytest.skip("the decode entries are the Triton kernels'")
    cfg = _cfg("int8")
    prompt = BS + 5
    _steps(cfg, True, prompt, 1, device)
    prepared = []
    monkeypatch.setattr(C.TurboLayer, "prepare_decode", lambda self, stand_ins: prepared.append(self.layer_idx))

    class Mark:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    for done, want in ((True, []), (False, [0])):
        caches = []
        _steps(cfg, True, prompt, 0, device, prepare=caches.append)
        prepared.clear()  # on a GPU the prefill's own event may have prepared already
        caches[0]._gpu_mark = Mark(done)
        caches[0]._prepare_decode()
        assert prepared == want and caches[0]._gpu_mark is None
    if device.type != "cuda":
        caches = []
        _steps(cfg, True, prompt, 0, device, prepare=caches.append)
        assert caches[0]._gpu_mark is None  # no CUDA event off the GPU
