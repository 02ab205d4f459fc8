"""Does the rotated basis make the cache's universal K scale clamp more on later tokens? (issue 23, decode path)

The cache fixes K's INT8 scale per channel at the first prefill (``reference.kv_universal_scales_ref``,
``scale_c = headroom * max_t |k[t,c] - mean_c| / 127`` over the prompt, ``cache.auto_headroom``); later tokens
beyond it clamp. With ``rotate_qk`` the stored K is ``rotate_keys_ref(k, s)`` (every channel mixes all RoPE
frequencies). On captured real Q/K/V (``qk_capture.capture``: full 8-shot GSM8K prompts + gold answer; the prompt
is the first prefill, the answer the later tokens) this measures per layer, for the bases ``none`` (raw K),
``hadamard`` and ``smooth_hadamard`` (plus ``none_rope_pair``: the unrotated ``k_scale_range: rope_pair``) and two
scale granularities (``channel``: the cache's; ``head``: one scale per (layer, KV head) = max over channels):

* ``clamp_frac``: fraction of answer-token K elements (minus the mean) with ``|x| > 127 * scale``;
* ``growth_gt1`` / ``growth_p99``: per channel ``g = max_answer |x| / max_prompt |x|``: fraction of channels
  with g > 1 and the 99th percentile of g (range drift, before headroom);
* ``kerr_stored`` / ``kerr_raw``: rel. RMS error of the INT8-quantized answer K (dequantized) vs exact, in the
  stored basis and mapped back to the raw basis (``k = rotate(k_r) * s``; basis-independent);
* ``kerr_raw_noclamp``: ``kerr_raw`` with rounding only (no clamp): the gap is the clamp's share;
* ``logit_err``: rel. RMS error of the answer queries' logits against the answer keys from the dequantized K
  (exact query; the K term alone);
* ``dec8`` / ``dec4`` (``--decode``): rel. RMS error of the attention output on the answer rows through
  ``build_packed_cache_ref`` + ``turbo_decode_ref`` (int8: sink 0 / recent 0; int4: sink 1 / recent 2, block 64,
  the presets' settings) vs fp64 exact attention.

    OMP_NUM_THREADS=2 python -m eval.experiments.rotated_k_clamp --model .carry/gemma/full \
        --gguf-file gemma-3-270m-q4_k_m.gguf --limit 4 --data-dir ../shared/data --decode \
        --out eval/results/rotated_k_clamp_cpu.json --tag gemma-3-270m
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

from turbo_attn_hf.cache import auto_headroom
from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.rotation import smooth_scales

BASES = ("none", "none_rope_pair", "hadamard", "smooth_hadamard")
SCALES = ("channel", "head")


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


@contextlib.contextmanager
def per_head_scales(on: bool):
    """Within: ``reference.kv_universal_scales_ref``'s K scale is the max over the channels of each head (what
    ``build_packed_cache_ref`` then uses)."""
    if not on:
        yield
        return
    orig = R.kv_universal_scales_ref

    def patched(*a, **kw):
        mean, ks, vs = orig(*a, **kw)
        return mean, ks.amax(-1, keepdim=True).expand_as(ks).contiguous(), vs

    R.kv_universal_scales_ref = patched
    try:
        yield
    finally:
        R.kv_universal_scales_ref = orig


def basis_setup(k, n, basis, rope_dims):
    """-> (stored K fp32 [b,H,L,d], rotate flag, smooth factors or None, rope_dims for the scales)."""
    if basis == "none":
        return k.float(), False, None, 0
    if basis == "none_rope_pair":
        return k.float(), False, None, rope_dims
    s = smooth_scales(k[:, :, :n]) if basis == "smooth_hadamard" else None
    return R.rotate_keys_ref(k, s), True, s, 0


def to_raw(xr, s):
    """Stored (rotated) basis -> raw: ``fwht(x) / sqrt(n)`` (own inverse), then ``* s``."""
    x = R.fwht_rows(xr.float()) * R._rot_scale(xr.shape[-1])
    return x if s is None else x * s.float()[:, :, None, :]


def layer_metrics(lay, n, basis, scale_kind, hr, rope_dims):
    q, k, v = lay["q"], lay["k"], lay["v"]
    kst, rot, s, rd = basis_setup(k, n, basis, rope_dims)
    mean, ks, _ = R.kv_universal_scales_ref(k[:, :, :n], v[:, :, :n], True, hr, rd, rot, s)
    if scale_kind == "head":
        ks = ks.amax(-1, keepdim=True).expand_as(ks).contiguous()
    m = torch.zeros_like(ks) if mean is None else mean
    xa = kst[:, :, n:] - m[:, :, None, :]
    lim = 127.0 * ks[:, :, None, :]
    over = xa.abs() > lim
    out = {"clamp_frac": float(over.float().mean())}
    ratio = xa.abs() / lim
    out["clamp_excess_max"] = float(ratio.max())  # > 1: how far past the range the worst element lies
    # range drift per channel, before headroom (for rope_pair channels the scale's own amax is the pair norm)
    pa = ks * 127.0 / hr
    g = (xa.abs().amax(2) / pa.clamp_min(1e-30)).flatten()
    out["growth_gt1"] = float((g > 1).float().mean())
    out["growth_p99"] = float(torch.quantile(g.double(), 0.99))
    # INT8 fake quant of the answer K (the cache's quantize_int8_universal_ref), dequantized
    k8 = R.quantize_int8_universal_ref(kst[:, :, n:], ks, mean)
    dq = k8.double() * ks.double()[:, :, None, :] + m.double()[:, :, None, :]
    out["kerr_stored"] = rel(dq, kst[:, :, n:])
    raw_dq = to_raw(dq.float(), s) if rot else dq
    out["kerr_raw"] = rel(raw_dq, k[:, :, n:].float())
    # the same without the clamp (rounding only): the gap to kerr_raw is what clamping adds
    nc = R._round_half_away((kst[:, :, n:] - m[:, :, None, :]) / ks[:, :, None, :]).double()
    nc = nc * ks.double()[:, :, None, :] + m.double()[:, :, None, :]
    out["kerr_raw_noclamp"] = rel(to_raw(nc.float(), s) if rot else nc, k[:, :, n:].float())
    # logits of the answer queries vs the answer keys: the K term alone
    g_ = q.shape[1] // k.shape[1]
    qa = q[:, :, n:].double()
    ke = k[:, :, n:].double().repeat_interleave(g_, 1)
    kd = raw_dq.double().repeat_interleave(g_, 1)
    out["logit_err"] = rel(qa @ kd.transpose(-1, -2), qa @ ke.transpose(-1, -2))
    return out


def decode_error(lay, n, basis, scale_kind, hr, rope_dims, bits):
    q, k, v = lay["q"], lay["k"], lay["v"]
    kw = dict(scale=lay["scale"], causal=True, window=lay["window"], softcap=lay["softcap"])
    exact = R.attention_fp64(q, k, v, **kw)[:, n:]
    _, rot, s, rd = basis_setup(k, n, basis, rope_dims)
    sink, recent = (0, 0) if bits == 8 else (1, 2)
    hk = k.shape[1]
    with per_head_scales(scale_kind == "head"):
        groups, kt8, vt8, nt, ks, vs, mean = R.build_packed_cache_ref(
            k, v, n, [bits] * hk, 64, True, hr, sink, recent, rd, rot, s)
    o = R.turbo_decode_ref(q[:, :, n:], groups, kt8, vt8, nt, ks, vs, mean, **kw, n_sink=sink * 64, rotate=rot,
                           qk_smooth=s)
    return rel(o, exact)


def model_rope_dims(config, n_layers):
    from turbo_attn_hf.cache import rope_dims
    out = []
    for i in range(n_layers):
        try:
            out.append(int(rope_dims(config, i)))
        except Exception:  # noqa: BLE001 - no known layout: channel
            out.append(0)
    return out


def versions():
    import transformers
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True).stdout.strip())
    except Exception:  # noqa: BLE001
        rev, dirty = None, None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "git_head": rev, "tracked_tree_dirty": dirty, "host": platform.platform(),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--tag", default=None, help="key of this model's entry in --out (default: the gguf/model name)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=0, help="truncate texts to this many tokens (0: full prompts)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--bases", default=",".join(BASES))
    ap.add_argument("--decode", action="store_true", help="also the attention-output error (int8/int4)")
    ap.add_argument("--decode-bases", default="none,smooth_hadamard")
    ap.add_argument("--decode-texts", type=int, default=0, help="decode errors on the first N texts only (0: all; "
                    "the reference decode is slow on CPU)")
    ap.add_argument("--out", required=True, help="JSON; an existing file gets this model's entry added/replaced")
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval import data as edata
    from eval.experiments.qk_capture import capture
    from eval.fidelity import gsm8k_examples, truncate_examples

    t0 = time.time()
    kw = {"gguf_file": a.gguf_file} if a.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(a.model, **kw)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="sdpa", **kw).eval()
    rows = edata.load_gsm8k(a.data_dir)[a.offset: a.offset + a.limit]
    ex = gsm8k_examples(tok, rows, data_dir=a.data_dir)
    if a.max_tokens:
        ex = truncate_examples(ex, a.max_tokens)
    data = capture(model, ex)
    n_layers = len(data[0]["layers"])
    rdims = model_rope_dims(model.config, n_layers)
    del model
    print(f"captured {len(data)} texts, {n_layers} layers in {time.time() - t0:.0f}s", flush=True)
    bases = a.bases.split(",")
    dbases = a.decode_bases.split(",") if a.decode else []
    per: dict = {}  # basis -> scale -> metric -> layer -> [per text]

    def add(b, sc, key, li, val):
        per.setdefault(b, {}).setdefault(sc, {}).setdefault(key, {}).setdefault(li, []).append(val)

    texts = []
    for ti, t in enumerate(data):
        n = t["prompt_len"]
        L = t["layers"][0]["k"].shape[2]
        hr = auto_headroom(n)
        texts.append({"prompt_tokens": n, "answer_tokens": L - n, "headroom": hr,
                      "decode": bool(dbases) and (not a.decode_texts or ti < a.decode_texts)})
        for li, lay in enumerate(t["layers"]):
            for b in bases:
                if b == "none_rope_pair" and not rdims[li]:
                    continue
                for sc in SCALES:
                    for key, val in layer_metrics(lay, n, b, sc, hr, rdims[li]).items():
                        add(b, sc, key, li, val)
                    if b in dbases and (not a.decode_texts or ti < a.decode_texts):
                        for bits in (8, 4):
                            add(b, sc, f"dec{bits}", li, decode_error(lay, n, b, sc, hr, rdims[li], bits))
        print(f"text {ti}: prompt {n}, answer {L - n}, {time.time() - t0:.0f}s", flush=True)

    result = {"per_layer": {}, "mean": {}}
    for b, d1 in per.items():
        for sc, d2 in d1.items():
            for key, d3 in d2.items():
                lv = [sum(v) / len(v) for _, v in sorted(d3.items())]
                result["per_layer"].setdefault(b, {}).setdefault(sc, {})[key] = lv
                agg = max if key in ("clamp_excess_max",) else (lambda x: sum(x) / len(x))
                result["mean"].setdefault(b, {}).setdefault(sc, {})[key] = agg(lv)
    entry = {
        "command": " ".join([sys.executable, "-m", "eval.experiments.rotated_k_clamp", *sys.argv[1:]]),
        "model": a.model, "gguf_file": a.gguf_file, "n_layers": n_layers, "rope_dims": rdims,
        "head_dim": int(data[0]["layers"][0]["k"].shape[-1]), "kv_heads": int(data[0]["layers"][0]["k"].shape[1]),
        "q_heads": int(data[0]["layers"][0]["q"].shape[1]), "texts": texts, "versions": versions(),
        "seconds": round(time.time() - t0, 1),
        "notes": "mean = mean over layers of the per-layer mean over texts (clamp_excess_max: max over layers). "
                 "growth = max_answer|k - mean| / max_prompt|k - mean| per (head, channel) (head scale: over the head). "
                 "kerr_raw / logit_err are basis-independent (mapped back to raw K). dec8/dec4: rel. RMS error of the "
                 "attention output on the answer rows (reference kernels) vs fp64 exact.",
        **result,
    }
    tag = a.tag or (a.gguf_file or os.path.basename(a.model.rstrip("/")))
    doc = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    doc.setdefault("models", {})[tag] = entry
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    keys = ["clamp_frac", "growth_gt1", "growth_p99", "kerr_raw", "kerr_raw_noclamp", "logit_err"] + (["dec8", "dec4"] if dbases else [])
    print("| basis | scale | " + " | ".join(keys) + " |")
    for b in per:
        for sc in SCALES:
            mm = result["mean"][b][sc]
            print(f"| {b} | {sc} | " + " | ".join(f"{mm[k_]:.3g}" if k_ in mm else "-" for k_ in keys) + " |")


if __name__ == "__main__":
    main()
