"""The static TurboCache (issue 18): storage for ``max_cache_len`` tokens, lengths on the device, a decode step of
two custom ops that torch.compile traces whole.

It must store exactly what the dynamic TurboCache stores (bit for bit: the same codes, scales and packed blocks)
and attend the same way (the decode kernel's device-side shares only regroup fp32 partial sums), so greedy
tokens are compared for equality against the dynamic cache, and the storage byte for byte.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import turbo_attn_hf
from turbo_attn_hf import TurboConfig
from turbo_attn_hf.cache import TurboCache, TurboCacheFullError, TurboLayer, TurboStaticLayer
from turbo_attn_hf.generation import cache_kwarg

#: block 16, one sink block, one recent block: a 37-token prompt packs a block, and every 16 decode steps pack
#: another (the step kernel's pack-and-shift path)
INT4_B16 = TurboConfig(bits=4, block_size=16, sink_blocks=1, recent_blocks=1, name="int4-b16")
MIXED_B16 = TurboConfig(bits=4, block_size=16, sink_blocks=1, recent_blocks=1, n_2bit_heads=2, name="mixed-b16")
MIXED1_B16 = TurboConfig(bits=4, block_size=16, sink_blocks=1, recent_blocks=1, n_2bit_heads=1, name="mixed1-b16")
#: packed blocks that keep K's INT8 codes (issue 23's format for q/k-norm families)
MIXED_K8_B16 = dataclasses.replace(MIXED_B16, packed_k_bits=8, name="mixed-k8-b16")


def _greedy(model, ids, mask, cache, n):
    """Manual greedy loop over ``cache``: the last-position logits of the prefill and of each step."""
    out = []
    with torch.no_grad():
        o = model(ids, attention_mask=mask, **{cache_kwarg(): cache}, use_cache=True)
        for _ in range(n):
            tok = o.logits[:, -1:].argmax(-1)
            out.append(o.logits[:, -1].float())
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            o = model(tok, attention_mask=mask, **{cache_kwarg(): cache}, use_cache=True)
        out.append(o.logits[:, -1].float())
    return torch.stack(out, 1)


def _padded(tm, b=2, n=37):
    ids = tm.token_ids(b, n)
    mask = torch.ones_like(ids)
    mask[-1, :5] = 0
    return ids, mask


@pytest.mark.parametrize("cfg", [INT4_B16, MIXED_B16, MIXED_K8_B16], ids=["int4", "mixed", "mixed-k8"])
def test_step_store_matches_the_dynamic_store(cfg, device):
    """Token by token through ``turbo_attn::store_step`` (the Triton step kernel; interpreter on CPU): the same
    INT8 buffer, packed blocks and lengths as the dynamic layer's host-planned store, bit for bit, across 3
    packs."""
    g = torch.Generator().manual_seed(0)
    b, hk, d, T0, n = 2, 4, 64, 37, 50
    k = (torch.randn(b, hk, T0 + n, d, generator=g) + 0.5).to(device, torch.bfloat16)
    v = torch.randn(b, hk, T0 + n, d, generator=g).to(device, torch.bfloat16)
    dyn, sta = TurboLayer(cfg, 0, 1), TurboStaticLayer(cfg, 0, 1, max_cache_len=T0 + n)
    for layer in (dyn, sta):
        layer.update(k[:, :, :T0], v[:, :, :T0])
        # the dynamic layer's next token of this shape defers its store; a static layer never defers
        assert layer._token_shape == (None if layer is sta else (b, hk, 1, d))
        for t in range(T0, T0 + n):
            layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert sta.lens.tolist() == [dyn.n_blocks, dyn.n_tail] == [sta.n_blocks, sta.n_tail]
    assert dyn.n_blocks == 3 and sta.counters.tolist() == [0, 0]  # all three packed by decode steps
    _assert_same_storage(sta, dyn)


def _assert_same_storage(layer, want):
    """``layer`` holds ``want``'s INT8 buffer (its valid slots), head maps and packed blocks, bit for bit."""
    nt = want.n_tail
    assert torch.equal(layer.k_tail[:, :, :nt], want.k_tail[:, :, :nt])
    assert torch.equal(layer.v_tail[:, :, :, :nt], want.v_tail[:, :, :, :nt])
    for gl, gw in zip(layer.groups, want.groups):
        assert torch.equal(gl.heads, gw.heads)
        for (name, tl_), (_, tw) in zip(gl._tensors(), gw._tensors()):
            assert torch.equal(tl_[:, :, :want.n_blocks], tw[:, :, :want.n_blocks]), name


@pytest.mark.parametrize("arch,cfg", [("llama", INT4_B16), ("mistral", MIXED_B16), ("gemma2", INT4_B16),
                                      ("mistral", dataclasses.replace(MIXED_B16, prefill_attention="exact")),
                                      ("gemma3", INT4_B16)],
                         ids=["llama-int4", "mistral-mixed", "gemma2-int4", "mistral-mixed-exact-prefill",
                              "gemma3-int4"])
def test_static_decode_matches_dynamic(arch, cfg, tm, pytorch_reference_kernels):
    """Left-padded greedy decoding over the static cache = over the dynamic one (mistral: sliding window;
    gemma2: softcap, sliding + full layers; gemma3: q/k norms, so rotated K and INT8 K blocks, ``packed_k_bits``
    auto)."""
    model = tm.make_model(arch, attn="turbo_int8")
    ids, mask = _padded(tm)
    dyn = _greedy(model, ids, mask, TurboCache(cfg, config=model.config), 24)
    cache = TurboCache(cfg, config=model.config, max_cache_len=64)
    sta = _greedy(model, ids, mask, cache, 24)
    assert torch.equal(sta.argmax(-1), dyn.argmax(-1))
    assert (sta - dyn).abs().max() < 1e-3  # measured 0 (the reference path; same stored codes)
    assert cache.get_seq_length() == 61 and cache.is_compileable
    if arch == "gemma3":  # the q/k-norm family's format: packed blocks keep INT8 K
        assert {(g.bits, g.k_bits) for lay in cache.layers for g in lay.groups} == {(4, 8)}


def test_static_decode_through_the_kernels(tm):
    """The same through the Triton kernels (interpreter on CPU): store_step + the decode kernel's LENS mode."""
    model = tm.make_model("llama", attn="turbo_int8")
    ids, mask = _padded(tm)
    dyn = _greedy(model, ids, mask, TurboCache(INT4_B16, config=model.config), 20)
    sta = _greedy(model, ids, mask, TurboCache(INT4_B16, config=model.config, max_cache_len=64), 20)
    assert torch.equal(sta.argmax(-1), dyn.argmax(-1))
    assert (sta - dyn).abs().max() < 2e-2  # shares differ only in fp32 merge order: measured 0 on CPU


def test_compiled_decode_step_has_no_graph_break(tm, pytorch_reference_kernels):
    """torch.compile(fullgraph=True) traces a decode step over the static cache (a graph break would raise) and
    computes what the eager step computes; one graph for all steps (no recompile per step)."""
    import torch._dynamo

    model = tm.make_model("gemma3", attn="turbo_int8")
    ids, mask = _padded(tm)
    eager = _greedy(model, ids, mask, TurboCache(INT4_B16, config=model.config, max_cache_len=64), 12)
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    cache = TurboCache(INT4_B16, config=model.config, max_cache_len=64)
    out, m = [], mask
    with torch.no_grad():
        o = model(ids, attention_mask=m, **{cache_kwarg(): cache}, use_cache=True)  # prefill: eager
        for _ in range(12):
            tok = o.logits[:, -1:].argmax(-1)
            out.append(o.logits[:, -1].float())
            m = torch.cat([m, torch.ones_like(tok)], 1)
            full = torch.nn.functional.pad(m, (0, 64 - m.shape[1]))  # a fixed-shape mask, as generate() makes
            pos = torch.full((2, 1), m.shape[1] - 1)  # what the eager loop's model derives from the cache
            o = compiled(input_ids=tok, attention_mask=full, position_ids=pos, **{cache_kwarg(): cache}, use_cache=True)
        out.append(o.logits[:, -1].float())
    assert torch.equal(torch.stack(out, 1), eager)
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("cfg", [INT4_B16, MIXED1_B16], ids=lambda c: c.name)
def test_compiled_step_takes_one_input_per_buffer(tm, pytorch_reference_kernels, cfg):
    """A compiled decode step takes a layer's storage as its byte buffers only — ``_side`` (lengths included) and one
    per bit group — and no per-layer placeholder element: each graph input costs the compiled call host time every
    step (eval/PERF_NOTES.md, sessions 23-25). ``get_seq_length`` inside the step reads the lengths through
    ``_side``."""
    import torch._dynamo

    model = tm.make_model("llama", attn="turbo_int8")
    cache = TurboCache(cfg, config=model.config, max_cache_len=64)
    ids = tm.token_ids(1, 20)
    with torch.no_grad():
        model(ids, **{cache_kwarg(): cache}, use_cache=True)
    names = []

    def backend(gm, example_inputs):
        names.extend(n.target for n in gm.graph.nodes if n.op == "placeholder")
        return gm.forward

    torch._dynamo.reset()
    kw = {cache_kwarg(): cache}
    step = torch.compile(lambda tok: (model(input_ids=tok, **kw, use_cache=True).logits,
                                      cache.get_seq_length()), fullgraph=True, backend=backend)
    with torch.no_grad():
        _, n = step(ids[:, -1:])
    torch._dynamo.reset()
    assert int(n) == 21
    for i, layer in enumerate(cache.layers):
        mine = [x for x in names if f"layers_{i}_" in x]
        assert len(mine) == 1 + len(layer.groups), mine
    assert not any("base" in x or "lens" in x for x in names), names


def test_generate_static_builds_and_compiles_the_static_turbocache(tm, pytorch_reference_kernels):
    """generate(cache_implementation="static") -> a static TurboCache, HF's auto-compile takes it (forced on CPU
    with a fullgraph eager-backend CompileConfig), and greedy tokens equal the dynamic TurboCache's."""
    import torch._dynamo
    from transformers import CompileConfig

    model = tm.make_model("llama", attn="turbo_int8")
    turbo_attn_hf.set_turbo_config(model, INT4_B16)
    ids, mask = _padded(tm)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    cc = CompileConfig(backend="eager", fullgraph=True)
    cc._compile_all_devices = True  # HF compiles only on accelerators otherwise
    torch._dynamo.reset()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, cache_implementation="static",
                         compile_config=cc, return_dict_in_generate=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    assert isinstance(cache, TurboCache) and isinstance(cache.layers[0], TurboStaticLayer)
    assert cache.is_compileable and cache.layers[0].max_cache_len == 1024  # rounded up: one graph for nearby lengths
    assert hasattr(model, "_compiled_call")
    assert torch.equal(out.sequences, ref)
    torch._dynamo.reset()


@pytest.mark.parametrize("arch,preset", [("llama", INT4_B16), ("mistral", MIXED1_B16)],
                         ids=["int4", "mixed"])
def test_generate_static_reuses_the_cache_storage(tm, pytorch_reference_kernels, arch, preset):
    """A second generate(cache_implementation="static") gets the first call's TurboCache back, reset, and its first
    prefill writes into the same storage tensors (a CUDA graph holds their addresses: a new address per call made
    cudagraph trees record the decode step again every call); the tokens stay those of a fresh cache. Another
    batch size or preset gets a new cache; release_static_cache drops it."""
    model = tm.make_model(arch, attn="turbo_int8")  # mixed: 1 of mistral's 2 KV heads in 2 bits, chosen from the prompt
    turbo_attn_hf.set_turbo_config(model, preset)
    ids, mask = _padded(tm)
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, cache_implementation="static",
              disable_compile=True, return_dict_in_generate=True)

    def run(i, m, **k):
        out = model.generate(i, **{**kw, "attention_mask": m, **k})
        return out.sequences, getattr(out, "past_key_values", None) or getattr(out, "cache", None)

    seq1, c1 = run(ids, mask)
    ptrs = {k: t.data_ptr() for k, t in c1.layers[0]._storage().items()}
    made = []  # storage tensors allocated anew (not handed back from the kept ones)
    base_empty = TurboLayer._empty
    TurboLayer._empty = lambda self, key, shape, dtype: made.append(key) or base_empty(self, key, shape, dtype)
    try:
        seq2, c2 = run(ids, mask)
    finally:
        TurboLayer._empty = base_empty
    assert c2 is c1 and torch.equal(seq2, seq1)
    assert {k: t.data_ptr() for k, t in c2.layers[0]._storage().items()} == ptrs
    assert made == [] and all(layer._adopted for layer in c2.layers)  # written in place, nothing allocated twice
    seq3, c3 = run(ids[:1], mask[:1])  # another batch: same object, new storage (layouts differ), right tokens
    ref = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=20, do_sample=False)
    assert torch.equal(seq3, ref) and c3 is c1
    turbo_attn_hf.set_turbo_config(model, "int8")
    _, c4 = run(ids, mask)
    assert c4 is not c1
    turbo_attn_hf.release_static_cache(model)
    assert model._turbo_static_cache is None


def test_static_beam_search_matches_dynamic(tm, pytorch_reference_kernels):
    """Beam search reorders the static storage in place (the addresses a CUDA graph holds stay)."""
    model = tm.make_model("mistral", attn="turbo_int8")
    turbo_attn_hf.set_turbo_config(model, INT4_B16)
    ids, mask = _padded(tm)
    kw = dict(attention_mask=mask, max_new_tokens=8, num_beams=2, do_sample=False)
    ref = model.generate(ids, **kw)
    out = model.generate(ids, cache_implementation="static", disable_compile=True, **kw)
    assert torch.equal(out, ref)


def test_second_prefill_and_crop_match_dynamic(tm, pytorch_reference_kernels):
    """Multi-turn (a second prefill after decode steps) and crop: host lengths re-read from the device."""
    model = tm.make_model("llama", attn="turbo_int8")
    ids, mask = _padded(tm)
    turn2 = tm.token_ids(2, 9, seed=5)
    res = []
    for cache in (TurboCache(INT4_B16, config=model.config), TurboCache(INT4_B16, config=model.config,
                                                                         max_cache_len=96)):
        a = _greedy(model, ids, mask, cache, 10)
        m2 = torch.cat([mask, torch.ones(2, 10 + 9, dtype=mask.dtype)], 1)
        with torch.no_grad():
            b = model(turn2, attention_mask=m2, **{cache_kwarg(): cache}, use_cache=True).logits.float()
        cache.crop(-7)
        n_after_crop = cache.get_seq_length()
        with torch.no_grad():
            c = model(turn2[:, :1], attention_mask=m2[:, :-6], **{cache_kwarg(): cache}, use_cache=True).logits.float()
        res.append((a, b, n_after_crop, c))
    (a0, b0, n0, c0), (a1, b1, n1, c1) = res
    assert torch.equal(a0, a1) and torch.equal(b0, b1) and n0 == n1 == 49 and torch.equal(c0, c1)


def test_static_cache_full_raises_and_keeps_the_storage(tm, pytorch_reference_kernels):
    model = tm.make_model("llama", attn="turbo_int8")
    ids, mask = _padded(tm)
    cache = TurboCache(INT4_B16, config=model.config, max_cache_len=40)
    _greedy(model, ids, mask, cache, 2)  # 37 + 2 stored, the third step's token is the 40th
    layer = cache.layers[0]
    with torch.no_grad():
        model(ids[:, :1], attention_mask=torch.ones(2, 40, dtype=mask.dtype), **{cache_kwarg(): cache})
        before = (layer.lens.clone(), layer.k_tail.clone())
        with pytest.raises(TurboCacheFullError, match="max_cache_len=40"):
            model(ids[:, :1], attention_mask=torch.ones(2, 41, dtype=mask.dtype), **{cache_kwarg(): cache})
    assert torch.equal(layer.lens, before[0]) and torch.equal(layer.k_tail, before[1])
    with pytest.raises(turbo_attn_hf.TurboConfigError, match="max_cache_len"):
        TurboCache(INT4_B16, max_cache_len=16)  # no model config: no layers to make static


def test_static_decode_mask():
    from turbo_attn_hf.masks import static_decode_mask

    pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)  # the past and this token
    kv = static_decode_mask(2, 8, torch.tensor(4), 0, pad)
    want = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(kv, want)
    assert torch.equal(static_decode_mask(1, 4, 1, 0, None), torch.tensor([[1, 1, 0, 0]], dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["int8", "int4", "mixed", "int4:smooth_hadamard"])
def test_static_generate_compiled_on_gpu(preset, tm):
    """GPU: generate(cache_implementation="static") with HF's default CompileConfig (inductor, reduce-overhead:
    the decode step replayed as a CUDA graph) tracks the unquantized model like the dynamic TurboCache
    (test_generation.py's bounds), batch 3 with left padding, blocks packed inside the graph (block 16)."""
    from test_generation import assert_padded_case_tracks, gpu_padded_case  # same folder: its setting and bounds

    import torch._dynamo

    model, ref, ids, mask = gpu_padded_case(tm, preset)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=80, do_sample=False, pad_token_id=0,
                         cache_implementation="static", return_dict_in_generate=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    assert isinstance(cache.layers[0], TurboStaticLayer) and hasattr(model, "_compiled_call")
    # the decode step is one graph (a break per layer once cost 4x the step: one CUDA graph per piece)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert cache.layers[0].n_blocks >= 1  # packed inside the replayed graph (100 tokens, block 16)
    assert_padded_case_tracks(ref, out.sequences)
    torch._dynamo.reset()


@pytest.mark.parametrize("rotate_qk", ["none", "smooth_hadamard"])
def test_custom_ops_pass_opcheck(rotate_qk, pytorch_reference_kernels):
    """The decode step's two custom ops: schema (what they mutate), fake implementations (shapes for tracing) and
    eager agree (torch.library.opcheck), on a static layer holding packed blocks (rotated: the factors go in)."""
    import dataclasses

    g = torch.Generator().manual_seed(0)
    b, hk, d = 1, 2, 64
    layer = TurboStaticLayer(dataclasses.replace(INT4_B16, rotate_qk=rotate_qk), 0, 1, max_cache_len=80)
    layer.update(torch.randn(b, hk, 60, d, generator=g).bfloat16(), torch.randn(b, hk, 60, d, generator=g).bfloat16())
    assert (layer.qk_smooth is not None) == (rotate_qk != "none")
    bufs, layout = layer._step_args()
    k1, v1 = torch.randn(b, hk, 1, d, generator=g).bfloat16(), torch.randn(b, hk, 1, d, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.turbo_attn.store_step.default,
                          (k1, v1, bufs, layout, layer.n_sink, layer.rotated),
                          test_utils=("test_schema", "test_faketensor"))
    q = torch.randn(b, 2 * hk, 1, d, generator=g).bfloat16()
    kv = torch.ones(b, 80, dtype=torch.bool)
    torch.library.opcheck(torch.ops.turbo_attn.decode_step.default,
                          (q, bufs, layout, layer.n_sink, kv, 0.125, True, 0, 0.0, "exact", 6.0,
                           layer.rotated),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_step_inputs_are_a_few_buffers(pytorch_reference_kernels):
    """A static layer hands the compiled step its storage as byte buffers (the gathered layer tensors and one
    per bit group), not as its ~18 tensors: each graph input costs the compiled call host time every step. The
    views the ops make of them are the layer's own tensors, and a second prefill and a reset + first prefill of
    the same shape keep every address (a CUDA graph captured over them replays)."""
    from turbo_attn_hf.ops import STEP_TENSORS, step_storage

    g = torch.Generator().manual_seed(0)
    b, hk, d = 2, 4, 64
    layer = TurboStaticLayer(MIXED_B16, 0, 1, max_cache_len=120)
    kv = lambda n: (torch.randn(b, hk, n, d, generator=g).bfloat16(), torch.randn(b, hk, n, d, generator=g).bfloat16())
    layer.update(*kv(40))
    bufs, layout = layer._step_args()
    assert len(bufs) == 1 + len(layer.groups) == 3 and all(t.dtype == torch.uint8 for t in bufs)
    s = step_storage(bufs, layout)
    for name in STEP_TENSORS:
        a, e = getattr(s, name), getattr(layer, name)
        assert (a is None) == (e is None)
        if e is not None:
            assert (a.data_ptr(), a.shape, a.stride(), a.dtype) == (e.data_ptr(), e.shape, e.stride(), e.dtype)
    for ga, ge in zip(s.groups, layer.groups):
        assert ga.bits == ge.bits and torch.equal(ga.heads, ge.heads)
        for (n, a), (_, e) in zip(ga._tensors(), ge._tensors()):
            assert a.data_ptr() == e.data_ptr() and a.shape == e.shape, n
    # the same view objects every eager step: the decode entry (kept per storage tensor objects) is found again
    s2 = step_storage(bufs, layout)
    assert s2.k_tail is s.k_tail and all(a.k is b.k and a.heads is b.heads for a, b in zip(s2.groups, s.groups))
    addrs = [t.data_ptr() for t in bufs]
    layer.update(*kv(1))
    layer.update(*kv(20))  # a second prefill (multi-turn): stored in place
    assert [t.data_ptr() for t in layer._step_args()[0]] == addrs
    layer.reset()
    layer.update(*kv(40))
    assert [t.data_ptr() for t in layer._step_args()[0]] == addrs and layer._step_args()[1] == layout


def _smollm2_gguf():
    """(directory, file) of SmolLM2-135M-Instruct: ``TURBO_SMOLLM2_GGUF`` (a .gguf path; the GPU machine has no
    package index) or the embedded model; the test is skipped when neither is there."""
    from pathlib import Path

    from turbo_attn_hf.chat import ChatError, embedded_model

    path = os.environ.get("TURBO_SMOLLM2_GGUF")
    if path:
        return str(Path(path).parent), Path(path).name
    try:
        return embedded_model()
    except ChatError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["int4", "mixed"])
def test_compiled_greedy_equals_eager_on_smollm2(preset):
    """GPU, real weights: 200 greedy tokens of generate(cache_implementation="static") with the decode step traced
    by dynamo and replayed as a CUDA graph equal the same static cache run eagerly, token for token. The graph
    runs the eager aten ops (backend "cudagraphs"): inductor's fused pointwise ops round differently from eager
    bf16 ops, and INT8 codes turn those last-bit differences into different tokens after a few steps, for any
    quantized cache, so the exact comparison is made where only the capture differs; HF's default inductor
    compile is then checked to replay deterministically."""
    import torch._dynamo
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

    from turbo_attn_hf.loading import LOAD_KWARGS

    path, gguf = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, attn_implementation="turbo_int8",
                                                 dtype=torch.bfloat16, **LOAD_KWARGS).cuda()
    turbo_attn_hf.set_turbo_config(model, preset)
    msgs = [{"role": "user", "content": "Explain in detail how a refrigerator keeps food cold, step by step."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = {k: v.cuda() for k, v in ids.items()}
    n = ids["input_ids"].shape[1]
    kw = dict(max_new_tokens=200, min_new_tokens=200, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    eager = model.generate(**ids, disable_compile=True, **kw)
    graphed = model.generate(**ids, compile_config=CompileConfig(backend="cudagraphs", mode=None), **kw)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(graphed[:, n:], eager[:, n:]), (tok.decode(eager[0, n:]), tok.decode(graphed[0, n:]))
    torch._dynamo.reset()
    del model._compiled_call
    inductor = [model.generate(**ids, **kw) for _ in range(2)]  # HF's default CompileConfig
    assert torch.equal(inductor[0], inductor[1])
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [INT4_B16, MIXED1_B16,
                                 dataclasses.replace(INT4_B16, rotate_qk="smooth_hadamard", packed_k_bits=8)],
                         ids=["int4", "mixed", "int4-rotated-k8"])
def test_captured_step_replays_the_eager_step(cfg):
    """GPU: one static layer's decode step (``store_step`` + ``decode_step``) captured once as a CUDA graph and
    replayed for 40 tokens (two blocks packed inside the replays) gives the eager static layer's outputs, lengths
    and storage bit for bit: the kernels read every length from ``lens``, nothing the host planned at capture.
    Rotated (Gemma-3's format): the query's round trip through the decode workspace is captured too."""
    g = torch.Generator().manual_seed(0)
    b, hk, hq, d, T0, n = 2, 4, 8, 64, 37, 42
    x = lambda h: torch.randn(b, h, T0 + n, d, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v = x(hq), x(hk), x(hk)
    eager, cap = (TurboStaticLayer(cfg, 0, 1, max_cache_len=T0 + n) for _ in range(2))

    def step(layer, q1, k1, v1):
        kk, vv = layer.update(k1, v1)
        return layer.attention(q1, kk, vv, causal=True)

    for layer in (eager, cap):  # prefill, then two eager steps: kernels compiled, plans and workspace made
        step(layer, q[:, :, :T0], k[:, :, :T0], v[:, :, :T0])
        for t in (T0, T0 + 1):  # inputs laid out as the capture's buffers: the same launch specialisations
            step(layer, q[:, :, t:t + 1].clone(), k[:, :, t:t + 1].clone(), v[:, :, t:t + 1].clone())
    qb, kb, vb = q[:, :, :1].clone(), k[:, :, :1].clone(), v[:, :, :1].clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run: the cache does not move here
        out = step(cap, qb, kb, vb)
    for t in range(T0 + 2, T0 + n):
        want = step(eager, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        for buf, x_ in ((qb, q), (kb, k), (vb, v)):
            buf.copy_(x_[:, :, t:t + 1])
        graph.replay()
        assert torch.equal(out, want), f"step {t}"
    assert cap.lens.tolist() == eager.lens.tolist() == [eager.n_blocks, eager.n_tail]
    assert eager.n_blocks == 2  # the prompt fills 37 of the INT8 buffer's 48 slots (block 16); the replays pack two
    _assert_same_storage(cap, eager)


@pytest.mark.gpu
def test_replayed_graph_is_memcheck_clean():
    """GPU: compute-sanitizer memcheck over test_captured_step_replays_the_eager_step (the decode step captured as
    a CUDA graph and replayed, blocks packed inside it): no invalid access. Skipped without compute-sanitizer.
    (Not over the inductor-compiled generate(): under the sanitizer that ran past 420 s, eval/PERF_NOTES.md
    session 28; its replayed graph runs the same two ops' kernels.)"""
    import shutil
    import subprocess
    import sys

    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer", "/opt/nvidia/compute-sanitizer/compute-sanitizer")
         if os.path.exists(p)), None)
    if tool is None:
        pytest.skip("compute-sanitizer not found")
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "9", "--target-processes", "all", sys.executable, "-m",
           "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", __file__, "-k",
           "test_captured_step_replays_the_eager_step"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    report = [ln for ln in out.splitlines() if "=========" in ln or " passed" in ln or " failed" in ln]
    assert r.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, "\n".join(report[:40]) or out[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("cfg", [INT4_B16, MIXED1_B16], ids=["int4", "mixed"])
def test_prefills_and_eager_steps_never_sync(cfg, static):
    """GPU: no host synchronisation in a layer's first prefill (store + attention), a second prefill (multi-turn)
    or eager decode steps, after a warm-up (``torch.cuda.set_sync_debug_mode("error")`` raises on ``.item()``,
    ``.cpu()`` and pageable host-to-device copies: a per-layer wait for the GPU that once cost the static cache's
    prefill 10-15 ms at 32 layers, eval/PERF_NOTES.md session 15)."""
    g = torch.Generator().manual_seed(0)
    b, hk, hq, d = 1, 4, 8, 64
    x = lambda h, n: torch.randn(b, h, n, d, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    steps = [(x(hq, 100), x(hk, 100), x(hk, 100)), (x(hq, 40), x(hk, 40), x(hk, 40))] + \
        [(x(hq, 1), x(hk, 1), x(hk, 1)) for _ in range(3)]

    def run():
        layer = TurboStaticLayer(cfg, 0, 1, max_cache_len=256) if static else TurboLayer(cfg, 0, 1)
        for q, k, v in steps:
            kk, vv = layer.update(k, v)
            layer.attention(q, kk, vv, causal=True)

    run()  # compiles the kernels, makes the plans and head maps
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
