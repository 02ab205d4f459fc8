"""TurboCache: storage across block boundaries == the reference packed state, HF cache API on packed storage.

CPU: Triton interpreter (pack + decode kernels), d 32, block 64 (the presets' block), small batch.
"""
import dataclasses

import pytest
import torch

from turbo_attn_hf.cache import TurboCache, TurboLayer, TurboSlidingWindowLayer
from turbo_attn_hf.config import TurboConfig, TurboConfigError
from turbo_attn_hf.generation import cache_arg, output_cache
from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.decode import group_splits
from turbo_attn_hf.kernels.pack import kv_bytes_per_token

# layer.attention (kernel) vs reference on the same packed state, CPU interpreter: measured max |diff| 9e-8.
ATOL = 1e-5
# On a GPU the kernel's exp2 (ex2.approx) differs from torch's in the last bits and flips an occasional
# p8 = round(127 p) by one (tests/kernels/test_decode_gpu.py: max-abs 1.8e-3..3.9e-3 on the H100, bound 2e-2);
# measured here on the H100: max 4.2e-4 (sink + recent layout, block 16), the other cases <= 1e-5.
ATOL_GPU = 2e-2
# int8 generate() vs the bf16 DynamicCache path, tiny llama (bf16 weights, logit rms 1.14), per-step max
# |logit diff| over 100 steps: measured max 0.160, mean 0.080 (auto headroom 1.86; 0.180 / 0.086 at 2; with headroom 1 the
# 20-token prompt's scales clamp later tokens: max 1.12, mean 0.66) -> bounds 0.3 and 0.15.
MAX_STEP_DIFF = 0.3
MEAN_STEP_DIFF = 0.15
BS = 64


def _kv(b, hk, L, d, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hk, L, d, generator=g) + 0.5 * torch.randn(1, hk, 1, d, generator=g)
    v = torch.randn(b, hk, L, d, generator=g)
    return k.to(device), v.to(device)


def _ref(q, k, v, n_prefill, layer, **kw):
    """Reference attention of q over the packed state of all of k, v (scales from the first n_prefill)."""
    cfg = layer.turbo_config
    bs = cfg.block_size
    groups, kt, vt, nt, ks, vs, mu = R.build_packed_cache_ref(
        k.cpu(), v.cpu(), n_prefill, layer.head_bits, bs, headroom=layer.headroom, sink_blocks=cfg.sink_blocks,
        recent_blocks=cfg.recent_blocks, int8_k=cfg.packed_k_bits == 8)
    assert kt.shape == layer.k_tail.shape and torch.equal(kt[:, :, :nt], layer.k_tail[:, :, :nt].cpu())
    return _ref_on(q, (groups, kt, vt, nt, ks, vs, mu), layer, **kw)


def _ref_on(q, state, layer, **kw):
    """Reference attention of q over a given packed state, split as the kernel splits it."""
    groups, kt, vt, nt, ks, vs, mu = state
    n_tiles = groups[0].n_blocks + -(-nt // layer.turbo_config.block_size)
    b, hq, lq, _ = q.shape
    n_m = -(-(hq // kt.shape[1] * lq) // 64)
    splits = group_splits(n_tiles, groups, b, n_m, q.device)
    return R.turbo_decode_ref(q.cpu(), groups, kt, vt, nt, ks, vs, mu, n_splits=splits, n_sink=layer.n_sink, **kw)


def _close(a, b, atol=None):
    if atol is None:
        atol = ATOL_GPU if a.is_cuda else ATOL
    d = (a.float().cpu() - b.float().cpu()).abs().max()
    assert d <= atol, f"max |diff| {d:.3g}"


def _cfg(**kw):
    """int4 + one 2-bit head (the last one); the plain TurboAttention layout (no sink / recent blocks) unless
    overridden."""
    base = dict(bits=4, n_2bit_heads=1, block_size=BS, softmax="exact", sink_blocks=0, recent_blocks=0,
                head_select="last")
    base.update(kw)
    return TurboConfig(**base)


@pytest.mark.parametrize("k_bits", ["head", 8])
def test_sequence_across_block_boundaries(k_bits, device):
    """prefill 70, 1-token updates to 131, then a 5-token chunk: every stored token equals the reference
    (``packed_k_bits`` 8: the packed blocks keep K's INT8 codes)."""
    b, hk, G, d = 2, 2, 2, 32
    L = 136
    k, v = _kv(b, hk, L, d, device=device)
    q = torch.randn(b, hk * G, L, d, generator=torch.Generator().manual_seed(1)).to(device)
    cache = TurboCache(_cfg(packed_k_bits=k_bits))
    steps = [70] + [1] * (131 - 70) + [5]
    pos = 0
    for T in steps:
        assert cache.get_seq_length() == pos
        assert cache.get_mask_sizes(T, 0) == ((pos + T, 0) if pos else (T, 0))
        kk, vv = cache.update(k[:, :, pos:pos + T], v[:, :, pos:pos + T], 0)
        pos += T
        layer = cache.layers[0]
        assert kk.turbo_cache_layer is layer and vv.turbo_cache_layer is layer
        assert kk.shape == (b, hk, pos if pos > T else T, d)
        if pos == T:  # first prefill: the real tensors come back
            assert kk.data_ptr() == k[:, :, :T].data_ptr() or torch.equal(kk, k[:, :, :T])
            continue
        assert kk.stride() == (0, 0, 0, 0)  # zero-memory placeholder
        if T == 1 and pos not in (71, 127, 128, 129, 131):
            continue
        out = layer.attention(q[:, :, pos - T:pos], kk, vv)
        _close(out, _ref(q[:, :, pos - T:pos], k[:, :, :pos], v[:, :, :pos], 70, layer))
    layer = cache.layers[0]
    assert (layer.n_blocks, layer.n_tail) == (2, 8)
    assert cache.get_seq_length() == 136
    assert [g.k.dtype for g in layer.groups] == [torch.int8 if k_bits == 8 else torch.uint8] * 2


@pytest.mark.parametrize("sink,recent", [(1, 2), (2, 0), (0, 1)])
def test_sink_and_recent_blocks_across_updates(sink, recent, device):
    """Block 16: prefill 20, 1-token steps to 120, a 7-token chunk, one 60-token chunk: the INT8 buffer and
    the packed blocks hold what ``reference.int8_buffer_layout`` says, and attention equals the reference."""
    b, hk, G, d, bs = 2, 2, 2, 32, 16
    L = 187
    k, v = _kv(b, hk, L, d, seed=3, device=device)
    q = torch.randn(b, hk * G, L, d, generator=torch.Generator().manual_seed(4)).to(device)
    cache = TurboCache(_cfg(block_size=bs, sink_blocks=sink, recent_blocks=recent))
    pos = 0
    for T in [20] + [1] * 100 + [7, 60]:
        kk, vv = cache.update(k[:, :, pos:pos + T], v[:, :, pos:pos + T], 0)
        pos += T
        layer = cache.layers[0]
        nb, ranges = R.int8_buffer_layout(pos, bs, sink, recent)
        assert (layer.n_blocks, layer.n_tail) == (nb, sum(t1 - t0 for t0, t1 in ranges)), pos
        assert cache.get_seq_length() == pos
        if pos == T or (T == 1 and pos % 13):
            continue
        out = layer.attention(q[:, :, pos - T:pos], kk, vv)
        _close(out, _ref(q[:, :, pos - T:pos], k[:, :, :pos], v[:, :, :pos], 20, layer))
    bulk = TurboCache(_cfg(block_size=bs, sink_blocks=sink, recent_blocks=recent))
    bulk.update(k[:, :, :20], v[:, :, :20], 0)
    bulk.update(k[:, :, 20:], v[:, :, 20:], 0)  # one chunk: the same layout as token by token
    a, c = cache.layers[0], bulk.layers[0]
    assert (a.n_blocks, a.n_tail) == (c.n_blocks, c.n_tail)
    assert torch.equal(a.k_tail[:, :, :a.n_tail], c.k_tail[:, :, :c.n_tail])
    for ga, gc in zip(a.groups, c.groups):
        assert torch.equal(ga.k[:, :, :ga.n_blocks], gc.k[:, :, :gc.n_blocks])
        assert torch.equal(ga.v_scale[:, :, :ga.n_blocks], gc.v_scale[:, :, :gc.n_blocks])


@pytest.mark.parametrize("window,left_pad", [(None, 0), (37, 0), (None, 21)])
def test_sink_and_recent_blocks_with_masks(window, left_pad, device):
    """Sliding window (packed blocks outside it skipped, the sink tile masked) and left padding over the
    sink slots: attention over the sink + recent layout equals the reference."""
    b, hk, G, d, bs, L = 2, 2, 2, 32, 16, 150
    k, v = _kv(b, hk, L, d, seed=8, device=device)
    cache = TurboCache(_cfg(block_size=bs, sink_blocks=1, recent_blocks=2))
    cache.update(k[:, :, :100], v[:, :, :100], 0)
    kk, vv = cache.update(k[:, :, 100:], v[:, :, 100:], 0)
    layer = cache.layers[0]
    assert layer.n_blocks == (150 - 16 - 32) // 16
    q = _query(b, hk * G, 2, d, device)
    kw = {}
    if window:
        kw["window"] = window
    if left_pad:
        kv = torch.ones(b, L + 0, dtype=torch.bool)
        kv[1, :left_pad] = False
        kw["key_valid"] = kv
    dkw = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in kw.items()}
    _close(layer.attention(q, kk, vv, **dkw), _ref(q, k, v, 100, layer, **kw))


def test_crop_with_sink_and_recent_blocks(device):
    """Crop into the recent window, into a packed block and into the sink; each time the buffer and the
    blocks are those of a cache that stored the kept tokens (up to the second rounding of an unpacked block)."""
    b, hk, d, bs = 1, 2, 32, 16
    k, v = _kv(b, hk, 160, d, seed=2, device=device)
    cache = TurboCache(_cfg(block_size=bs, sink_blocks=1, recent_blocks=2))
    cache.update(k[:, :, :40], v[:, :, :40], 0)
    cache.update(k[:, :, 40:], v[:, :, 40:], 0)
    layer = cache.layers[0]
    assert (layer.n_blocks, layer.n_tail) == (7, 48)  # 16 sink + 7 blocks + 32 recent = 160
    q = _query(b, hk * 2, 1, d, device)
    state = list(R.build_packed_cache_ref(k.cpu(), v.cpu(), 40, layer.head_bits, bs, headroom=layer.headroom,
                                          sink_blocks=1, recent_blocks=2))
    cache.crop(-20)  # 160 -> 140: into the recent window (the blocks stay; 20 fewer INT8 tokens)
    assert (layer.n_blocks, layer.n_tail) == (7, 28)
    state[3] -= 20
    kk, vv = layer._placeholders(140)
    _close(layer.attention(q, kk, vv), _ref_on(q, state, layer))
    cache.crop(-40)  # 140 -> 100: into packed block 5 (positions 96..111), 4 tokens back into the buffer
    assert (layer.n_blocks, layer.n_tail) == (5, 20) and cache.get_seq_length() == 100
    kk, vv = cache.update(k[:, :, 100:160], v[:, :, 100:160], 0)
    assert cache.get_seq_length() == 160 and (layer.n_blocks, layer.n_tail) == (7, 48)
    out = layer.attention(q, kk, vv)
    f = R.attention_fp64(q.cpu(), k.cpu(), v.cpu()).float()
    assert torch.isfinite(out).all() and ((out.cpu().float() - f).norm() / f.norm()) < 1.1
    cache.crop(10)  # into the sink: no packed block is left
    assert (layer.n_blocks, layer.n_tail) == (0, 10) and cache.get_seq_length() == 10
    state = list(R.build_packed_cache_ref(k[:, :, :40].cpu(), v[:, :, :40].cpu(), 40, layer.head_bits, bs,
                                          headroom=layer.headroom, sink_blocks=1, recent_blocks=2))
    state[3] = 10  # 40 tokens fit the INT8 buffer; keep the first 10
    kk, vv = layer._placeholders(10)
    _close(layer.attention(q, kk, vv), _ref_on(q, state, layer))


def _filled(b=3, hk=2, d=32, L=131, cfg=None, device="cpu", seed=0):
    k, v = _kv(b, hk, L, d, seed=seed, device=device)
    cache = TurboCache(cfg or _cfg())
    cache.update(k[:, :, :70], v[:, :, :70], 0)
    cache.update(k[:, :, 70:L], v[:, :, 70:L], 0)
    return cache, k, v


def _query(b, hq, lq, d, device, seed=5):
    return torch.randn(b, hq, lq, d, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("op,k_bits", [("reorder", "head"), ("select", "head"), ("select_bool", "head"),
                                       ("repeat", "head"), ("reorder", 8)])
def test_batch_ops_on_packed_storage(op, k_bits, device):
    cache, k, v = _filled(cfg=_cfg(packed_k_bits=k_bits), device=device)
    if op == "reorder":
        idx = torch.tensor([2, 0, 0])
        cache.reorder_cache(idx.to(device))
    elif op == "select":
        idx = torch.tensor([2, 0])
        cache.batch_select_indices(idx.to(device))
    elif op == "select_bool":
        idx = torch.tensor([0, 2])
        cache.batch_select_indices(torch.tensor([True, False, True], device=device))
    else:
        idx = torch.arange(3).repeat_interleave(2)
        cache.batch_repeat_interleave(2)
    layer = cache.layers[0]
    n = len(idx)
    q = _query(n, 4, 1, 32, device)
    kk, vv = cache.update(k[idx, :, 130:131], v[idx, :, 130:131], 0)  # one more token per row
    assert kk.shape[0] == n and cache.get_seq_length() == 132
    out = layer.attention(q, kk, vv)
    ks = torch.cat([k[idx, :, :131], k[idx, :, 130:131]], 2)
    vs = torch.cat([v[idx, :, :131], v[idx, :, 130:131]], 2)
    _close(out, _ref(q, ks, vs, 70, layer))


@pytest.mark.parametrize("k_bits", ["head", 8])
def test_crop_within_tail_and_into_packed_block(k_bits, device):
    cache, k, v = _filled(b=2, cfg=_cfg(packed_k_bits=k_bits), device=device)
    layer = cache.layers[0]
    q = _query(2, 4, 1, 32, device)
    cache.crop(0)  # "remove 0 tokens" (assisted decoding when every candidate matched): a no-op
    assert cache.get_seq_length() == 131 and (layer.n_blocks, layer.n_tail) == (2, 3)
    cache.crop(torch.tensor(-2))  # 131 -> 129: tail only (transformers 5.17 passes a 0-d tensor)
    assert cache.get_seq_length() == 129 and (layer.n_blocks, layer.n_tail) == (2, 1)
    kk, vv = layer._placeholders(129)
    _close(layer.attention(q, kk, vv), _ref(q, k[:, :, :129], v[:, :, :129], 70, layer))

    cache.crop(-8)  # 129 -> 121: into block 1, whose first 57 tokens return to the tail as their INT8 values
    assert cache.get_seq_length() == 121 and (layer.n_blocks, layer.n_tail) == (1, 57)
    groups, kt, vt, nt, ks, vs, mu = R.build_packed_cache_ref(k.cpu(), v.cpu(), 70, layer.head_bits, BS,
                                                              headroom=layer.headroom, int8_k=k_bits == 8)
    kt, vt = torch.zeros_like(kt), torch.zeros_like(vt)
    for g in groups:  # the reference of "unpack block 1 into the tail"
        h = g.heads.long()
        bh = g.k.shape[0] * len(h)
        k8 = g.k[:, :, 1] if g.k_bits == 8 else R.unpack_blocks_ref(
            g.k[:, :, 1].reshape(bh, BS, -1), g.k_scale[:, :, 1].reshape(bh, -1), g.k_zero[:, :, 1].reshape(bh, -1),
            g.k_bits, 0).view(-1, len(h), BS, 32)
        if g.bits == 8:
            v8t = g.v[:, :, 1]
        else:
            v8t = R.unpack_blocks_ref(g.v[:, :, 1].reshape(bh, 32, -1), g.v_scale[:, :, 1].reshape(bh, -1),
                                      g.v_zero[:, :, 1].reshape(bh, -1), g.bits, 0).view(-1, len(h), 32, BS)
        kt[:, h, :57] = k8[:, :, :57]
        vt[:, h, :, :57] = v8t[:, :, :, :57]
        g.n_blocks = 1
    assert torch.equal(layer.k_tail[:, :, :57].cpu(), kt[:, :, :57])
    assert torch.equal(layer.v_tail[:, :, :, :57].cpu(), vt[:, :, :, :57])
    kk, vv = layer._placeholders(121)
    ref = R.turbo_decode_ref(q.cpu(), groups, kt, vt, 57, ks, vs, mu,
                             n_splits=group_splits(2, groups, 2, 1, q.device))
    _close(layer.attention(q, kk, vv), ref)

    kk, vv = cache.update(k[:, :, 121:131], v[:, :, 121:131], 0)  # grows again across the boundary
    assert cache.get_seq_length() == 131 and (layer.n_blocks, layer.n_tail) == (2, 3)
    out = layer.attention(q, kk, vv)
    f = R.attention_fp64(q.cpu(), k[:, :, :131].cpu(), v[:, :, :131].cpu()).float()
    assert torch.isfinite(out).all() and ((out.cpu().float() - f).norm() / f.norm()) < 1.1

    cache.crop(50)  # positive: the older "max_length" meaning
    assert cache.get_seq_length() == 50 and layer.n_blocks == 0
    cache.crop(-50)
    assert cache.get_seq_length() == 0 and not layer.is_initialized


def test_reset_makes_next_update_a_first_prefill(device):
    cache, k, v = _filled(b=1, device=device)
    cache.reset()
    assert cache.get_seq_length() == 0
    kk, _ = cache.update(k[:, :, :10], v[:, :, :10], 0)
    assert kk.stride(-1) == 1 and torch.equal(kk, k[:, :, :10]) and cache.layers[0].n_tail == 10
    assert cache.get_seq_length() == 10


@pytest.mark.parametrize("k_bits", ["head", 8])
def test_memory_bytes_equals_format_arithmetic(k_bits, device):
    b, hk, d = 3, 2, 32
    cache, _, _ = _filled(b=b, hk=hk, d=d, L=131, cfg=_cfg(packed_k_bits=k_bits), device=device)
    layer = cache.layers[0]
    assert layer.head_bits == [4, 2]
    kb = {"head": (4, 2), 8: (8, 8)}[k_bits]
    per_token = kv_bytes_per_token(d, 4, BS, kb[0]) + kv_bytes_per_token(d, 2, BS, kb[1])
    if k_bits == 8:  # K: d bytes, no K scale/zero; V: d·bits/8 + its per-token scale and zero
        assert per_token == (d + d * 4 / 8 + 2) + (d + d * 2 / 8 + 2)
    assert layer.bytes_per_token() == per_token == cache.bytes_per_token()
    tail = 2 * b * hk * BS * d  # INT8 K and V tail buffers (full capacity)
    scales = 3 * b * hk * d * 4  # fp32 k_mean, k_scale, v_scale
    assert cache.memory_bytes() == b * 2 * BS * per_token + tail + scales
    assert cache.memory_bytes(allocated=True) >= cache.memory_bytes()


@pytest.mark.parametrize("preset,limit,k_bits", [("int4", 0.3, "head"), ("mixed", 0.22, "head"), ("int8", 0.51, "head"),
                                                ("int4", 0.38, 8)])
def test_bytes_per_token_targets(preset, limit, k_bits):
    # Llama-3-8B shape: 8 KV heads, head_dim 128; bf16 = 2 (K, V) * 8 * 128 * 2 bytes. INT8 K + INT4 V: 0.375x
    layer = TurboLayer(dataclasses.replace(TurboConfig.preset(preset), packed_k_bits=k_bits), 0, 32)
    layer.lazy_initialization(torch.zeros(1, 8, 0, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 0, 128))
    ratio = layer.bytes_per_token() / (2 * 8 * 128 * 2)
    assert ratio <= limit, f"{preset}: {ratio:.3f}x of bf16"


def test_bad_configs_raise_named_errors():
    with pytest.raises(TurboConfigError, match="bits=3"):
        TurboConfig(bits=3)
    with pytest.raises(TurboConfigError, match="block_size=48"):
        TurboConfig(block_size=48)
    with pytest.raises(TurboConfigError, match="sink_blocks=-1"):
        TurboConfig(sink_blocks=-1)
    with pytest.raises(TurboConfigError, match="recent_blocks=1.5"):
        TurboConfig(recent_blocks=1.5)
    with pytest.raises(TurboConfigError, match="head_select='first'"):
        TurboConfig(head_select="first")
    with pytest.raises(TurboConfigError, match="scale_headroom='big'"):
        TurboConfig(scale_headroom="big")
    # head map with 3 heads for a layer that has 2 KV heads: raises at the first update
    cache = TurboCache(TurboConfig(head_bits=[[4, 2, 2]], block_size=BS))
    k = torch.zeros(1, 2, 4, 32)
    with pytest.raises(TurboConfigError, match="3 heads but the model has 2 KV heads"):
        cache.update(k, k, 0)
    cache = TurboCache(TurboConfig(head_bits=[[4, 2]], block_size=BS))
    cache.update(k, k, 0)
    with pytest.raises(TurboConfigError, match="head_bits has 1 layers"):
        cache.update(k, k, 1)
    with pytest.raises(TurboConfigError, match="unknown preset"):
        TurboCache("int3")


def _tiny_config(kind):
    from transformers import LlamaConfig, Qwen2Config

    if kind == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                           num_hidden_layers=2, vocab_size=32)
    return Qwen2Config(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                       num_hidden_layers=3, vocab_size=32, use_sliding_window=True, sliding_window=8,
                       max_window_layers=1)


@pytest.mark.parametrize("max_cache_len", [None, 16], ids=["dynamic", "static"])
def test_past_recording_takes_transformers_keywords(max_cache_len):
    """transformers >= 5.25 passes ``recurrent_states_to_keep=`` through Cache.activate_past_recording to every
    layer that has the method (assisted decoding): the sliding-window layers take and ignore it."""
    c = TurboCache("int4", config=_tiny_config("qwen2"), max_cache_len=max_cache_len)
    sliding = [l for l in c.layers if l.is_sliding]
    assert sliding
    for layer in sliding:
        layer.activate_past_recording(recurrent_states_to_keep=4)
        assert layer.record_past


def test_construction_from_model_config_and_template():
    from transformers import DynamicCache

    cfg = TurboConfig.preset("int4")
    c = TurboCache(cfg, config=_tiny_config("llama"))
    assert [type(l) for l in c.layers] == [TurboLayer, TurboLayer]
    qcfg = _tiny_config("qwen2")
    c = TurboCache("mixed", config=qcfg)
    kinds = [type(l) for l in c.layers]
    assert kinds.count(TurboSlidingWindowLayer) == qcfg.layer_types.count("sliding_attention")
    t = TurboCache.from_template(DynamicCache(config=qcfg), cfg, qcfg)
    # the given config with rotate_qk and packed_k_bits 'auto' decided for the model (qwen2: none, K packed as V)
    assert [type(l) for l in t.layers] == kinds and t.turbo_config == dataclasses.replace(
        cfg, rotate_qk="none", packed_k_bits="head")
    assert all(l.sliding_window == 8 for l in t.layers if isinstance(l, TurboSlidingWindowLayer))
    # a template layer that already holds tokens is quantized into its twin
    dc = DynamicCache()
    k, v = _kv(1, 1, 20, 64)
    dc.update(k, v, 0)
    t = TurboCache.from_template(dc, cfg, _tiny_config("llama"))
    assert t.get_seq_length() == 20 and isinstance(t.layers[0], TurboLayer)
    # layers are created on first use without a model config
    c = TurboCache(cfg)
    c.update(k, v, 1)
    assert len(c.layers) == 2 and c.get_seq_length(1) == 20 and c.get_seq_length(0) == 0


def test_int8_generate_logits_track_dynamic_cache(tm, pytorch_reference_kernels):
    """int8 preset, 100 greedy tokens (block 64: the 20-token prompt + decoding cross a block boundary):
    the logits of every step stay close to turbo_int8 over a bf16 DynamicCache fed the same tokens."""
    import turbo_attn_hf
    from transformers import DynamicCache

    model = tm.make_model("llama", attn="turbo_int8")
    turbo_attn_hf.set_turbo_config(model, "int8")
    ids = tm.token_ids(1, 20)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=100, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        cache = output_cache(out)
        assert isinstance(cache, TurboCache) and cache.get_seq_length() == 119
        assert cache.layers[0].n_blocks == 1
        turbo = torch.stack(out.logits, 1).float()[0]  # [100, V]
        dc = DynamicCache()
        ref = [model(ids, **cache_arg(dc)).logits[0, -1]]
        for i in range(99):
            ref.append(model(out.sequences[:, 20 + i:21 + i], **cache_arg(dc)).logits[0, -1])
        ref = torch.stack(ref).float()
    diff = (turbo - ref).abs().amax(-1)
    print(f"\n[int8 generate] per-step max |logit diff|: max {diff.max():.3f} mean {diff.mean():.3f} "
          f"(logit rms {ref.pow(2).mean().sqrt():.2f})")
    assert diff[0] == 0  # the first step is the same prefill
    assert diff.max() < MAX_STEP_DIFF and diff.mean() < MEAN_STEP_DIFF


@pytest.mark.parametrize("select,expected", [("prompt", [4, 2, 4]), ("last", [4, 4, 2])])
def test_head_select_from_the_prompt(select, expected, device):
    """head_select "prompt": the 2-bit head is the one whose channel ranges are narrowest and most uniform
    (calibration's gap x std, on the first prefill); attention over the chosen layout equals the reference."""
    b, hk, d = 2, 3, 32
    k, v = _kv(b, hk, 150, d, seed=4)
    k[:, 1] *= 0.1  # head 1: small, uniform ranges -> lowest priority
    v[:, 1] *= 0.1
    k, v = k.to(device), v.to(device)
    cache = TurboCache(_cfg(head_select=select))
    cache.update(k[:, :, :140], v[:, :, :140], 0)
    kk, vv = cache.update(k[:, :, 140:], v[:, :, 140:], 0)
    layer = cache.layers[0]
    assert layer.head_bits == expected
    assert [g.heads.tolist() for g in layer.groups] == [[h for h in range(3) if expected[h] == 4], [expected.index(2)]]
    q = _query(b, hk * 2, 1, d, device)
    _close(layer.attention(q, kk, vv), _ref(q, k, v, 140, layer))


def test_auto_headroom_follows_the_prompt_length(device):
    from turbo_attn_hf.cache import auto_headroom

    assert auto_headroom(1) == 2.0 and auto_headroom(900) == 1.25  # clamped at both ends
    assert 1.85 < auto_headroom(20) < 1.87 and 1.49 < auto_headroom(100) < 1.52  # sqrt(ln 32768 / ln n)
    k, v = _kv(1, 2, 20, 32, device=device)
    cache = TurboCache(_cfg(scale_headroom="auto"))
    cache.update(k, v, 0)
    layer = cache.layers[0]
    assert layer.headroom == auto_headroom(20)
    assert torch.allclose(layer.v_scale, v.float().abs().amax(2) * auto_headroom(20) / 127)


def _scale_inputs(b, hk, T, d, dtype, case, seed=0):
    """K, V [b, hk, T, d] in HF's transposed layout, with adversarial channels for ``case``."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(b, T, hk, d, generator=g) * 3 + torch.randn(1, 1, hk, d, generator=g) * 8).transpose(1, 2)
    v = (torch.randn(b, T, hk, d, generator=g) * 2).transpose(1, 2)
    if case == "adversarial":
        for x in (k, v):
            x[:, :, :, 0] = 0.0  # all-zero channel (scale 1)
            x[:, :, :, 1] = -0.0
            x[:, :, :, 2] = 1.75  # constant channel: K - mean is 0 (scale 1 with smoothing)
            x[:, :, :, 3] = -x[:, :, :, 3].abs() - 5  # negative-only channels
            x[:, :, :, 4] = -x[:, :, :, 4].abs()
            x[:, :, :, 5] = x[:, :, :, 5].abs()  # positive-only
            x[:, :, ::2, 6], x[:, :, 1::2, 6] = 3.0, -3.0  # symmetric: max and min equally far from the mean
            x[:, :, 0, 7] = 1e4  # one outlier
    elif case == "nonfinite":
        for x in (k, v):
            x[:, :, 0, 0], x[:, :, 1, 1], x[:, :, 2, 2] = float("inf"), float("-inf"), float("nan")
            x[:, :, 0, 3], x[:, :, 1, 3] = float("inf"), float("-inf")
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("smooth_k", [True, False], ids=["smooth", "plain"])
@pytest.mark.parametrize("rope", [0, 1.0, 0.5], ids=["channel", "rope_pair", "rope_pair_partial"])
@pytest.mark.parametrize("case,b,hk,T,d", [
    ("random", 2, 3, 150, 32), ("adversarial", 2, 3, 151, 64), ("nonfinite", 1, 2, 40, 32),
    ("random", 1, 8, 4096 + 5, 128),
    pytest.param("random", 1, 8, 32768, 128, marks=pytest.mark.gpu, id="real"),
])
def test_fix_scales_equal_the_fp32_formula(dtype, smooth_k, rope, case, b, hk, T, d, device):
    """_fix_scales (K's mean as an exact fp64 sum, aminmax of K and V) == the fp32 formula it replaced, bit for bit:
    (1) the mean of 16-bit K does not depend on the order of its tokens, (2) the layer's scales equal
    reference.kv_universal_scales_ref's. ``rope``: ``k_scale_range:
    rope_pair`` on that fraction of the channels (RoPE-pair norms, mean 0 there)."""
    k, v = (t.to(device) for t in _scale_inputs(b, hk, T, d, dtype, case, seed=T))
    bits = lambda t: t.view(torch.int32)  # noqa: E731  (distinguishes -0.0 and NaN payloads)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(1)).to(k.device)
    if dtype != torch.float32:  # the fp64 sum of 16-bit keys is exact: the mean does not depend on the token order
        assert torch.equal(bits(R.k_smooth_mean(k)), bits(R.k_smooth_mean(k[:, :, perm])))
    rot = int(d * rope)
    layer = TurboLayer(_cfg(smooth_k=smooth_k, scale_headroom="auto", k_scale_range="rope_pair" if rot else "channel"))
    layer.rope_dims = rot
    layer._fix_scales(k, v)
    mean, ks, vs = R.kv_universal_scales_ref(k, v, smooth_k, layer.headroom, rot)
    assert (layer.k_mean is None) == (mean is None)
    if mean is not None:
        assert torch.equal(bits(layer.k_mean), bits(mean))
    assert torch.equal(bits(layer.k_scale), bits(ks)) and torch.equal(bits(layer.v_scale), bits(vs))
    if case == "adversarial" and not rot:  # the zero / constant channels took scale 1
        assert bool((ks[..., :2] == 1).all() and (vs[..., :2] == 1).all())
        assert bool((ks[..., 2] == 1).all()) == smooth_k
    if rot and case != "nonfinite":  # the pair norm, from an fp64 formula
        kd = k.double()[..., :rot]
        pair = (kd[..., :rot // 2] ** 2 + kd[..., rot // 2:] ** 2).sqrt().amax(2).repeat(1, 1, 2)
        want = torch.where(pair > 0, pair * layer.headroom / 127, torch.ones_like(pair))
        torch.testing.assert_close(ks[..., :rot].double(), want, rtol=1e-6, atol=0)
        assert (mean is None) == (smooth_k is False or rot == d)
        if mean is not None:
            assert bool((mean[..., :rot] == 0).all())
            assert torch.equal(bits(layer.prefill_k_mean), bits(R.kv_finite_mean_ref(k, R.k_smooth_mean(k))))


def _rope(x: torch.Tensor, theta: float = 1e4) -> torch.Tensor:
    """HF's rotate_half RoPE of ``x [b, H, T, d]`` at positions 0..T-1."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(x.shape[2], dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    xd = x.double()
    return (xd * cos + torch.cat([-xd[..., d // 2:], xd[..., :d // 2]], -1) * sin).to(x.dtype)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pytorch"])
def test_rope_pair_scales_cover_a_long_feed_after_a_short_prefill(fused, device, monkeypatch):
    """Issue 21: RoPE-rotated K with a fixed per-head bias (the slow pairs turn a fraction of a turn over the
    prompt): after a 128-token prefill, the per-channel scales clamp later tokens of a 4k feed; rope_pair scales
    (the model config's pairs: a Llama config) clamp none."""
    from transformers import LlamaConfig

    from turbo_attn_hf import cache as C

    monkeypatch.setattr(C, "FUSED_STORE", fused)
    b, hk, T, d, P = 1, 2, 4096, 32, 128
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(b, hk, T, d, generator=g) * 0.5 + torch.randn(1, hk, 1, d, generator=g) * 3
    k = _rope(pre).to(torch.bfloat16).to(device)
    v = torch.randn(b, hk, T, d, generator=g).to(torch.bfloat16).to(device)
    mc = LlamaConfig(hidden_size=d * 4, num_attention_heads=4, num_key_value_heads=hk, num_hidden_layers=1,
                     head_dim=d)
    out = {}
    for mode in ("channel", "rope_pair"):
        cache = TurboCache(_cfg(bits=8, n_2bit_heads=0, k_scale_range=mode), config=mc)
        cache.update(k[:, :, :P], v[:, :, :P], 0)
        layer = cache.layers[0]
        assert layer.rope_dims == d
        km = layer.k_mean if layer.k_mean is not None else torch.zeros_like(layer.k_scale)
        code = (k[:, :, P:].float() - km[:, :, None]) / layer.k_scale[:, :, None]
        out[mode] = (code.abs() > 127.5).float().mean().item()
    assert out["channel"] > 0.1  # measured 0.197 (CPU; rope_pair: max |code| 112.8)
    assert out["rope_pair"] == 0.0


def test_rope_dims_from_the_model_config():
    """rotate_half pairs from the config (partial_rotary_factor, SmolLM3's no-RoPE layers); a model type not known
    to use rotate_half, a cache without a config and rotate_qk keep per-channel K scales."""
    from transformers import CohereConfig, LlamaConfig, PhiConfig, SmolLM3Config

    from turbo_attn_hf.cache import rope_dims

    assert rope_dims(LlamaConfig(head_dim=64), 0) == 64
    assert rope_dims(PhiConfig(hidden_size=256, num_attention_heads=4, partial_rotary_factor=0.5), 0) == 32
    assert [rope_dims(SmolLM3Config(num_hidden_layers=4, no_rope_layer_interval=4), i) for i in range(4)] == \
        [128, 128, 128, 0]
    assert rope_dims(CohereConfig(), 0) == 0 and rope_dims(None, 0) == 0
    cache = TurboCache(_cfg(k_scale_range="rope_pair"))
    cache.update(*_kv(1, 2, 20, 32), 0)
    assert cache.layers[0].rope_dims == 0 and cache.layers[0].k_mean is not None  # no model config: per-channel
    for rot, want in (("none", 32), ("hadamard", 0)):
        layer = TurboLayer(_cfg(k_scale_range="rope_pair", rotate_qk=rot))
        layer.rope_dims = 32
        assert layer._k_rope_dims(32) == want
    layer = TurboLayer(_cfg())
    layer.rope_dims = 32
    assert layer._k_rope_dims(32) == 0  # k_scale_range: channel


def test_update_launches_on_the_layers_device(monkeypatch):
    """The store kernels run in update(), outside attention: update() makes the keys' device current."""
    import contextlib

    from turbo_attn_hf import cache as C

    seen = []

    @contextlib.contextmanager
    def record(t):
        seen.append(t.device)
        yield

    monkeypatch.setattr(C, "on_tensor_device", record)
    cache = C.TurboCache("int8")
    k = torch.randn(1, 2, 5, 64, dtype=torch.bfloat16)
    cache.update(k, k.clone(), 0)
    assert seen == [k.device]


def test_tensor_parallel_ranks_take_their_slice_of_the_head_map(monkeypatch):
    """Under tensor parallelism a layer sees its rank's KV heads: an explicit (calibrated) map is sliced, a
    computed one spreads the layer's 2-bit heads over the ranks (the shares add up to the model's)."""
    import torch.distributed as dist

    from turbo_attn_hf import cache as C
    from turbo_attn_hf.config import TurboConfig

    explicit = TurboConfig(bits=4, head_bits=[[4, 2, 4, 4, 2, 2, 4, 4]], name="map")
    assert explicit.layer_head_bits(0, 1, 4, shard=(1, 2)) == [2, 2, 4, 4]
    mixed = TurboConfig(bits=4, frac_2bit_heads=0.5, name="half")
    shares = [mixed.layer_head_bits(0, 1, 2, shard=(r, 4)).count(2) for r in range(4)]
    assert shares == [1, 1, 1, 1]
    three = TurboConfig(bits=4, n_2bit_heads=3, name="three")
    assert [three.layer_head_bits(0, 1, 4, shard=(r, 2)).count(2) for r in range(2)] == [2, 1]

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    layer = C.TurboLayer(explicit, 0, 1)
    layer.n_kv_heads_total = 8
    k = torch.randn(1, 4, 5, 64, dtype=torch.bfloat16)
    layer.update(k, k.clone())
    assert layer.head_bits == [2, 2, 4, 4]
    assert C.tp_shard(4, 8) == (1, 2)
    with pytest.raises(TurboConfigError, match="evenly"):
        C.tp_shard(3, 8)


def test_first_prefill_exact_attention_stores_the_same_cache():
    """``prefill_attention: exact``: the first prefill attends with SDPA over the prompt's own K/V, and the cache
    holds exactly what the INT8 path stores (the store does not depend on the prefill's attention), so the decode
    steps after it are identical too."""
    import dataclasses

    from turbo_attn_hf.attention import exact_attention

    g = torch.Generator().manual_seed(3)
    b, hq, hk, T, d = 2, 4, 2, 150, 64
    q = torch.randn(b, hq, T, d, generator=g).bfloat16()
    k = torch.randn(b, hk, T, d, generator=g).bfloat16()
    v = torch.randn(b, hk, T, d, generator=g).bfloat16()
    kv = torch.ones(b, T, dtype=torch.bool)
    kv[0, :5] = False
    q1, k1, v1 = (torch.randn(b, h, 1, d, generator=g).bfloat16() for h in (hq, hk, hk))
    outs, caches = {}, {}
    for path in ("int8", "exact"):
        cfg = dataclasses.replace(TurboConfig.preset("int4"), prefill_attention=path, block_size=16)
        cache = TurboCache(cfg)
        kk, vv = cache.update(k, v, 0)
        outs[path] = cache.layers[0].attention(q, kk, vv, scale=0.125, key_valid=kv)
        kk, vv = cache.update(k1, v1, 0)
        outs[path + "_step"] = cache.layers[0].attention(q1, kk, vv, scale=0.125,
                                                         key_valid=torch.cat([kv, kv[:, :1]], 1))
        caches[path] = cache
    assert torch.equal(outs["exact"], exact_attention(q, k, v, scale=0.125, key_valid=kv))
    diff = (outs["int8"].double() - outs["exact"].double()).norm() / outs["exact"].double().norm()
    assert diff < 0.05  # the INT8 prefill's own quantization error
    la, lb = caches["int8"].layers[0], caches["exact"].layers[0]
    assert la.n_tail == lb.n_tail and la.n_blocks == lb.n_blocks > 0
    n = la.n_tail  # slots past n_tail are never written (nor read)
    assert torch.equal(la.k_tail[:, :, :n], lb.k_tail[:, :, :n]) and torch.equal(la.v_tail[..., :n], lb.v_tail[..., :n])
    for name in ("k_scale", "v_scale", "k_mean"):
        assert torch.equal(getattr(la, name), getattr(lb, name)), name
    for ga, gb in zip(la.groups, lb.groups):
        for (n, ta), (_, tb) in zip(ga._tensors(), gb._tensors()):
            assert torch.equal(ta[:, :, : ga.n_blocks], tb[:, :, : gb.n_blocks]), n
    assert torch.equal(outs["int8_step"], outs["exact_step"])
