"""Error budget of the INT8 prefill and the int8/int4 decode paths on captured Q/K/V (issue 23, Gemma-3).

On real Q/K/V (``qk_capture.capture``: 8-shot GSM8K prompt + gold answer, every layer fed exact inputs) with
``rotate_qk: smooth_hadamard`` (Gemma's default), the attention output's rel. RMS error vs fp64 exact attention
(``reference.attention_fp64``) is decomposed by switching one quantization off at a time (``off:X``, from the
full path) and one on at a time (``on:X``, from exact), through the reference twins themselves:

* prefill (``reference.int8_flash_attention`` fed as ``reference.turbo_attention`` feeds it, on the whole text):
  ``Q`` (per-token INT8), ``K`` (per-token INT8 around the mean), ``V`` (per-block per-channel INT8, block 128),
  ``P`` (8-bit P, ``p_scale`` block). Rows: every token.
* decode (the answer rows through ``reference.turbo_decode_ref``; the cache state of ``build_packed_cache_ref``,
  scales fixed by the prompt, headroom ``cache.auto_headroom``): int8 (sink 0 / recent 0, block 64) with
  ``Q``, ``K8`` (universal per-channel INT8), ``V8``, ``P`` (the per-tile 8-bit ``w = p * s_t`` of
  ``pv_tile_ref``); int4 (sink 1 / recent 2, block 64) adds ``K4`` (per-channel 4-bit blocks on the INT8
  codes) and ``V4`` (per-token 4-bit blocks). ``off:K8`` keeps the 4-bit step (packed on the exact codes).

"Off" = the codes are not rounded (float codes with the same scales; no clamp), ``P`` = ``127 p`` unrounded.
The reference's integer-to-float products (``i32_scaled``, ~0.75 ulp of ``C s``) are made exact in every
variant; ``full_ref`` is the unpatched reference for comparison. Outputs are kept fp32 (no bf16 rounding).

Candidate fixes (reference only): ``vrot`` (V Hadamard-rotated per head before its quantization, the output
de-rotated: exact math), ``vgrp32`` / ``vgrp64`` (int4: V per token in groups of 32/64 channels instead of one
group of d; modelled with restored V values, so P is quantized without the token scale: compare with
``vgrp256``, the same route with one group), ``kblk32`` (int4: K's per-channel 4-bit groups over 32 tokens
instead of 64), prefill ``pstatic`` (``p_scale: static``), ``vchan`` (``v_scale: channel``), ``bn64``
(``block_n`` 64: P's per-row block max and V's blocks over 64 keys), ``pbf16`` (P rounded to bf16, V exact:
a SageAttention-style bf16 P.V MMA) and ``fp8pv`` (P and V in FP8 e4m3, P scaled by 448 relative to the same
per-row reference as the INT8 P, V per block and channel: SageAttention2-style).

    OMP_NUM_THREADS=2 python -m eval.experiments.error_budget --model .carry/gemma/full \
        --gguf-file gemma-3-270m-q4_k_m.gguf --limit 3 --data-dir ../shared/data \
        --out eval/results/error_budget_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch

from turbo_attn_hf.cache import auto_headroom
from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.rotation import smooth_scales

PREFILL = ["full_ref", "full", "exact", "off:Q", "off:K", "off:V", "off:P", "on:Q", "on:K", "on:V", "on:P",
           "cand:pstatic", "cand:vchan", "cand:vrot", "cand:vrot+on:V", "cand:bn64", "cand:bn64+on:P", "cand:pbf16",
           "cand:fp8pv", "cand:fp8pv+on:P"]
DEC8 = ["full_ref", "full", "exact", "off:Q", "off:K8", "off:V8", "off:P", "on:Q", "on:K8", "on:V8", "on:P",
        "cand:vrot", "cand:vrot+on:V8"]
DEC4 = ["full_ref", "full", "exact", "off:Q", "off:K8", "off:K4", "off:K", "off:V8", "off:V4", "off:V", "off:P",
        "on:Q", "on:K8", "on:K", "on:V8", "on:V", "on:P",
        "cand:vrot", "cand:vrot+on:V", "cand:vgrp256", "cand:vgrp64", "cand:vgrp32",
        "cand:vgrp256+on:V", "cand:vgrp64+on:V", "cand:vgrp32+on:V", "cand:vrot+cand:vgrp32",
        "cand:vrot+cand:vgrp32+on:V", "cand:kblk32", "cand:kblk32+on:K", "cand:kblk32+cand:vgrp32"]


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _sym_exact(x, amax, dim):
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return x * inv.unsqueeze(dim)  # float codes: no rounding, no clamp


@contextlib.contextmanager
def patch(obj, name, fn, on=True):
    if not on:
        yield
        return
    orig = getattr(obj, name)
    setattr(obj, name, fn)
    try:
        yield
    finally:
        setattr(obj, name, orig)


def _i32_exact(x, s):
    return (x.double() * s.double()).float()


def _quantize_p_exact(p):
    return p.float() * 127.0


def _quantize_p_bf16(p):
    return p.float().bfloat16().float() * 127.0


def _quantize_p_fp8(p):
    return (p.float() * 448.0).to(torch.float8_e4m3fn).float() * (127.0 / 448.0)


def _sym_fp8(x, amax, dim):
    inv = torch.where(amax > 0, torch.full_like(amax, 448.0) / amax, torch.zeros_like(amax))
    return (x * inv.unsqueeze(dim)).to(torch.float8_e4m3fn).float() * (127.0 / 448.0)


def _pv_tile_exact(p, vc, vs, vz):
    w = p * vs[..., None, :]
    pc = (w.double() @ vc.double()).float()
    return pc + (p * vz[..., None, :]).sum(-1)[..., None]


def hrot(x):
    """Orthonormal (block) Hadamard along the last dim, fp32 (its own inverse)."""
    return R.fwht_rows(x.float()) * R._rot_scale(x.shape[-1])


def config_off(variant, comps):
    """variant -> set of components that are exact."""
    base = variant.split("+")
    off = set()
    for part in base:
        if part == "exact":
            off |= set(comps)
        elif part.startswith("off:"):
            off |= {part[4:]} if part[4:] in comps else {c for c in comps if c.startswith(part[4:])}
        elif part.startswith("on:"):
            on = {part[3:]} if part[3:] in comps else {c for c in comps if c.startswith(part[3:])}
            off |= set(comps) - on
    return off


# ------------------------------------------------------------------------------------------------ prefill
def prefill(lay, variant):
    q, k, v = lay["q"], lay["k"], lay["v"]
    off = config_off(variant, ["Q", "K", "V", "P"])
    p_scale = "static" if "cand:pstatic" in variant else "block"
    vq = R.quantize_v_channels if "cand:vchan" in variant else R.quantize_v_blocks
    vrot = "cand:vrot" in variant
    block_n = 64 if "cand:bn64" in variant else 128
    if "cand:pbf16" in variant:
        off |= {"V"}  # bf16 P . bf16 V (SageAttention-style PV): V exact, P rounded to bf16
    fp8 = "cand:fp8pv" in variant  # SageAttention2-style FP8 (e4m3) P and per-block per-channel FP8 V
    softcap = lay["softcap"]
    d = q.shape[-1]
    scale = d ** -0.5 if lay["scale"] is None else float(lay["scale"])
    sf = smooth_scales(k)
    fq, fk = sf.repeat_interleave(q.shape[1] // k.shape[1], dim=1), torch.full_like(sf, 1.0) / sf
    with patch(R, "_symmetric_int8", _sym_exact, "Q" in off):
        q8, sq = R.quantize_per_token(q, scale=scale * R.LOG2E, rotate=True, factor=fq)
    mean = R.k_smooth_mean(k) if softcap is None else None
    with patch(R, "_symmetric_int8", _sym_exact, "K" in off):
        k8, sk = R.quantize_per_token(k, smooth=mean, rotate=True, factor=fk)
    vv = hrot(v) if vrot else v
    with patch(R, "_symmetric_int8", _sym_fp8 if fp8 and "V" not in off else _sym_exact, "V" in off or fp8):
        v8t, sv = vq(vv, block_n, poison=sk)
    ctx = contextlib.ExitStack()
    if variant != "full_ref":
        ctx.enter_context(patch(R, "i32_scaled", _i32_exact))
    pq = _quantize_p_exact if "P" in off else (_quantize_p_bf16 if "cand:pbf16" in variant else
                                                (_quantize_p_fp8 if fp8 else None))
    ctx.enter_context(patch(R, "quantize_p", pq, pq is not None))
    with ctx:
        o = R.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=True, window=lay["window"], softcap=softcap,
                                   Lk=k.shape[2], out_dtype=torch.float32, p_scale=p_scale, block_n=block_n)
    return hrot(o) if vrot else o


# ------------------------------------------------------------------------------------------------- decode
def _pack_float(x, bits, dim):
    """Float analogue of pack_blocks_ref (min/max asymmetric, 2^bits - 1 steps) along ``dim``: restored values."""
    qmax = (1 << bits) - 1
    mn, mx = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    sc = ((mx - mn) / qmax).clamp_min(1e-30)
    return torch.round((x - mn) / sc).clamp(0, qmax) * sc + mn


def _pack_int(x8, bits, axis_tile):
    """pack_blocks_ref + unpack on int tiles [N, R, C]: (codes int32, scale, zero) with reduced axis."""
    p, s, z = R.pack_blocks_ref(x8.to(torch.int8), bits, axis_tile)
    return R.unpack_codes_ref(p, bits), s, z


class _FakeGroup:
    def __init__(self, hk, bs, nb):
        self.bits, self.heads, self.n_blocks = 8, torch.arange(hk, dtype=torch.int32), nb
        self.k = torch.empty(1, 1, 1, bs)


def decode(lay, n, bits, variant):
    q, k, v = lay["q"], lay["k"], lay["v"]
    comps = ["Q", "K8", "V8", "P"] + (["K4", "V4"] if bits == 4 else [])
    off = config_off(variant, comps)
    vrot = "cand:vrot" in variant
    vgrp = None
    kblk = 32 if "cand:kblk32" in variant else 64
    for part in variant.split("+"):
        if part.startswith("cand:vgrp"):
            vgrp = int(part[len("cand:vgrp"):])
    b, hk, L, d = k.shape
    bs = 64
    sink, recent = (0, 0) if bits == 8 else (1, 2)
    hr = auto_headroom(n)
    s = smooth_scales(k[:, :, :n])
    vv = hrot(v) if vrot else v.float()
    mean, ks, vs = R.kv_universal_scales_ref(k[:, :, :n], vv[:, :, :n], True, hr, 0, True, s)
    kr = R.rotate_keys_ref(k, s)
    if "K8" in off:
        kc = (kr - mean[:, :, None, :]) / ks[:, :, None, :]
    else:
        kc = R.quantize_int8_universal_ref(kr, ks, mean).float()
    if "V8" in off:
        vc = vv / vs[:, :, None, :]
    else:
        vc = R.quantize_int8_universal_ref(vv, vs).float()
    vsc = torch.ones(b, hk, L)
    vz = torch.zeros(b, hk, L)
    nb, ranges = R.int8_buffer_layout(L, bs, sink, recent)
    p0 = sink * bs if nb else 0
    if bits == 4 and nb:
        sl = slice(p0, p0 + nb * bs)
        kb = kc[:, :, sl].reshape(-1, kblk, d)
        if "K4" not in off:
            if "K8" in off:
                kc[:, :, sl] = _pack_float(kb, 4, 1).view(b, hk, nb * bs, d)
            else:
                cd, sc_, z_ = _pack_int(kb, 4, 0)
                kc[:, :, sl] = (cd * sc_.int()[:, None, :] + z_.int()[:, None, :]).float().view(b, hk, nb * bs, d)
        if "V4" not in off:
            vb = vc[:, :, sl].reshape(b, hk, nb, bs, d)
            if vgrp is not None:  # restored values, groups of vgrp channels per token (scale not in P)
                g_ = vb.reshape(b, hk, nb, bs, d // vgrp, vgrp)
                rest = _pack_float(g_, 4, -1) if "V8" in off else None
                if rest is None:
                    x = g_.round().int()
                    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
                    sc_ = torch.clamp(torch.div(mx - mn + 14, 15, rounding_mode="floor"), min=1)
                    cd = torch.clamp(torch.div(2 * (x - mn) + sc_, 2 * sc_, rounding_mode="floor"), max=15)
                    cd = torch.minimum(cd, torch.div(127 - mn, sc_, rounding_mode="floor"))
                    rest = (cd * sc_ + mn).float()
                vc[:, :, sl] = rest.reshape(b, hk, nb * bs, d)
            elif "V8" in off:  # float per-token pack: code, scale, zero
                x = vb
                mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
                sc_ = ((mx - mn) / 15).clamp_min(1e-30)
                cd = torch.round((x - mn) / sc_).clamp(0, 15)
                vc[:, :, sl] = cd.reshape(b, hk, nb * bs, d)
                vsc[:, :, sl] = sc_.reshape(b, hk, nb * bs)
                vz[:, :, sl] = mn.reshape(b, hk, nb * bs)
            else:  # the reference's pack: tiles [d, bs], per token
                cd, sc_, z_ = _pack_int(vb.transpose(-1, -2).reshape(-1, d, bs), 4, 0)
                vc[:, :, sl] = cd.view(b, hk, nb, d, bs).transpose(-1, -2).reshape(b, hk, nb * bs, d).float()
                vsc[:, :, sl] = sc_.float().view(b, hk, nb * bs)
                vz[:, :, sl] = z_.float().view(b, hk, nb * bs)
    # tail slots -> positions, as build_packed_cache_ref + _group_tiles_ref lay them out
    tail_pos = torch.cat([torch.arange(t0, t1) for t0, t1 in ranges]) if ranges else torch.arange(0)
    n_tail = len(tail_pos)

    def tiles(grp, k_tail, v_tail, n_tail_, bs_, n_sink=0):
        for t in range(nb):
            j = torch.arange(p0 + t * bs, p0 + (t + 1) * bs)
            yield j, kc[:, :, j], vc[:, :, j], vsc[:, :, j], vz[:, :, j], None
        for s0 in range(0, n_tail, bs):
            j = tail_pos[s0:s0 + bs]
            yield j, kc[:, :, j], vc[:, :, j], vsc[:, :, j], vz[:, :, j], None

    kw = dict(scale=lay["scale"], causal=True, window=lay["window"], softcap=lay["softcap"])
    k_tail = torch.zeros(b, hk, 1, d, dtype=torch.int8)
    ctx = contextlib.ExitStack()
    ctx.enter_context(patch(R, "_group_tiles_ref", tiles))
    ctx.enter_context(patch(R, "_symmetric_int8", _sym_exact, "Q" in off))
    ctx.enter_context(patch(R, "pv_tile_ref", _pv_tile_exact, "P" in off))
    with ctx:
        o = R.turbo_decode_ref(q[:, :, n:].float(), [_FakeGroup(hk, bs, nb)], k_tail, None, n_tail, ks, vs, mean,
                               **kw, n_sink=sink * bs, rotate=True, qk_smooth=s, fold=False)
    return hrot(o) if vrot else o


def decode_ref(lay, n, bits):
    """The unpatched reference path (build_packed_cache_ref + turbo_decode_ref), fp32 out: ``full_ref``."""
    q, k, v = lay["q"], lay["k"], lay["v"]
    sink, recent = (0, 0) if bits == 8 else (1, 2)
    s = smooth_scales(k[:, :, :n])
    kw = dict(scale=lay["scale"], causal=True, window=lay["window"], softcap=lay["softcap"])
    groups, kt8, vt8, nt, ks, vs, mean = R.build_packed_cache_ref(k, v, n, [bits] * k.shape[1], 64, True,
                                                                  auto_headroom(n), sink, recent, 0, True, s)
    return R.turbo_decode_ref(q[:, :, n:].float(), groups, kt8, vt8, nt, ks, vs, mean, **kw, n_sink=sink * 64,
                              rotate=True, qk_smooth=s)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--layers", default="", help="comma list of layers (default: all)")
    ap.add_argument("--capture-cache", default=None, help="torch.save the capture here / reuse it")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.capture_cache and os.path.exists(a.capture_cache):
        data = torch.load(a.capture_cache)
        n_layers = len(data[0]["layers"])
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from eval import data as edata
        from eval.experiments.qk_capture import capture
        from eval.fidelity import gsm8k_examples

        kw = {"gguf_file": a.gguf_file} if a.gguf_file else {}
        tok = AutoTokenizer.from_pretrained(a.model, **kw)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                     **kw).eval()
        rows = edata.load_gsm8k(a.data_dir)[a.offset: a.offset + a.limit]
        data = capture(model, gsm8k_examples(tok, rows, data_dir=a.data_dir))
        del model
        if a.capture_cache:
            torch.save(data, a.capture_cache)
    data = data[:a.limit]
    n_layers = len(data[0]["layers"])
    layers = [int(x) for x in a.layers.split(",")] if a.layers else list(range(n_layers))
    print(f"captured {len(data)} texts, {n_layers} layers in {time.time() - t0:.0f}s", flush=True)
    per = {"prefill": {}, "dec8": {}, "dec4": {}}  # path -> variant -> layer -> [per text]
    texts = []
    with torch.no_grad():
        for ti, t in enumerate(data):
            n = t["prompt_len"]
            L = t["layers"][0]["k"].shape[2]
            texts.append({"prompt_tokens": n, "answer_tokens": L - n, "headroom": auto_headroom(n)})
            for li in layers:
                lay = t["layers"][li]
                kw = dict(scale=lay["scale"], causal=True, window=lay["window"], softcap=lay["softcap"])
                ex = R.attention_fp64(lay["q"], lay["k"], lay["v"], **kw)
                for var in PREFILL:
                    if var == "full_ref":
                        o = R.turbo_attention(lay["q"].float(), lay["k"].float(), lay["v"].float(), **kw,
                                              rotate_qk=True, qk_smooth=smooth_scales(lay["k"]))
                    else:
                        o = prefill(lay, var)
                    per["prefill"].setdefault(var, {}).setdefault(li, []).append(rel(o, ex))
                exd = ex[:, n:]
                for bits, vars_ in ((8, DEC8), (4, DEC4)):
                    for var in vars_:
                        o = decode_ref(lay, n, bits) if var == "full_ref" else decode(lay, n, bits, var)
                        per[f"dec{bits}"].setdefault(var, {}).setdefault(li, []).append(rel(o, exd))
                print(f"text {ti} layer {li}: prefill full {per['prefill']['full'][li][-1]:.4f} "
                      f"dec8 {per['dec8']['full'][li][-1]:.4f} dec4 {per['dec4']['full'][li][-1]:.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)
    kinds = ["full" if data[0]["layers"][li]["window"] is None else "sliding" for li in layers]
    result = {"per_layer": {}, "summary": {}}
    for path, d1 in per.items():
        for var, d2 in d1.items():
            lv = [sum(d2[li]) / len(d2[li]) for li in layers]
            result["per_layer"].setdefault(path, {})[var] = lv
            sm = {"mean": sum(lv) / len(lv), "max": max(lv)}
            for kind in ("full", "sliding"):
                sel = [x for x, kd in zip(lv, kinds) if kd == kind]
                if sel:
                    sm[f"mean_{kind}_attn"] = sum(sel) / len(sel)
            result["summary"].setdefault(path, {})[var] = sm
    from eval.experiments.rotated_k_clamp import versions

    doc = {
        "command": " ".join([sys.executable, "-m", "eval.experiments.error_budget", *sys.argv[1:]]),
        "model": a.model, "gguf_file": a.gguf_file, "rotate_qk": "smooth_hadamard",
        "machine": "CPU, " + versions()["host"], "versions": versions(), "layers": layers, "layer_kind": kinds,
        "texts": texts, "seconds": round(time.time() - t0, 1),
        "notes": "rel. RMS error of the attention output vs fp64 exact attention, per layer (mean over texts); "
                 "summary mean/max over layers. prefill: all rows of the text; dec8/dec4: the answer rows through the "
                 "cache (prompt = first prefill). off:X = X exact, rest quantized; on:X = only X quantized; "
                 "off:K / on:K (int4) = K8 and K4 together. full_ref = unpatched reference (i32_scaled rounding "
                 "kept); every other row has exact int->float products. See the module docstring for the candidates.",
        **result,
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for path in per:
        print(f"\n{path}: | variant | mean | max | full-attn | sliding |")
        for var, sm in result["summary"][path].items():
            print(f"| {var} | {sm['mean']:.4f} | {sm['max']:.4f} | {sm.get('mean_full_attn', math.nan):.4f} | "
                  f"{sm.get('mean_sliding_attn', math.nan):.4f} |")


if __name__ == "__main__":
    main()
