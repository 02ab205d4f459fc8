"""Layer-level sweep of Q/K outlier remedies on captured real Q/K/V (issue 23; capture with
``eval/experiments/qk_capture.py``). For each layer of each text: rel. RMS error of the attention output vs fp64
exact attention on the same Q/K/V, for the prefill path (``reference.turbo_attention``, every query row) and the
decode path (``reference.build_packed_cache_ref`` over the prompt + answer, the answer's rows queried through
``reference.turbo_decode_ref``), plus fake-quant decompositions (one operand quantized, the rest exact).

    python -m eval.experiments.qk_outlier_sweep /tmp/qkv_gemma.pt
"""

from __future__ import annotations

import argparse
import math

import torch

from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.rotation import rotate


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def headroom(n):
    return min(2.0, max(1.25, math.sqrt(math.log(32768) / math.log(n))))


# ---------------------------------------------------------------- transforms (q, k, prompt_len) -> (q', k')
def smooth_scales(q, k, n, alpha=0.5):
    """SmoothAttention: s_c = max|K_c|^alpha / max|Q_c|^(1-alpha) over the first n tokens, per KV head."""
    g = q.shape[1] // k.shape[1]
    qa = q[:, :, :n].float().abs().amax(2)  # [b, Hq, d]
    qa = qa.view(q.shape[0], k.shape[1], g, -1).amax(2)  # per KV head
    ka = k[:, :, :n].float().abs().amax(2)
    s = ka.clamp_min(1e-6) ** alpha / qa.clamp_min(1e-6) ** (1 - alpha)
    return s  # [b, Hk, d]


def apply_smooth(q, k, s):
    g = q.shape[1] // k.shape[1]
    sq = s.repeat_interleave(g, 1)[:, :, None]
    return (q.float() * sq).to(q.dtype), (k.float() / s[:, :, None]).to(k.dtype)


def T_none(q, k, n):
    return q, k


def T_had(q, k, n):
    return rotate(q), rotate(k)


def T_smooth(q, k, n):
    return apply_smooth(q, k, smooth_scales(q, k, n))


def T_smooth_had(q, k, n):
    q, k = apply_smooth(q, k, smooth_scales(q, k, n))
    return rotate(q), rotate(k)


def T_had_smooth(q, k, n):
    q, k = rotate(q), rotate(k)
    return apply_smooth(q, k, smooth_scales(q, k, n))


def smooth_scales_k(k, n):
    """K-only smoothing (what a cache can fix at its first store, before any query is seen): s_c = sqrt(max|K_c|),
    normalized to geometric mean 1 per head."""
    ka = (k[:, :, :n].float() - R.k_smooth_mean(k[:, :, :n])[:, :, None]).abs().amax(2).clamp_min(1e-6)
    s = ka.sqrt()
    return s / s.log().mean(-1, keepdim=True).exp()


def T_smoothk_had(q, k, n):
    q, k = apply_smooth(q, k, smooth_scales_k(k, n))
    return rotate(q), rotate(k)


def T_smoothk(q, k, n):
    return apply_smooth(q, k, smooth_scales_k(k, n))


TRANSFORMS = {"smoothk+had": T_smoothk_had, "smoothk": T_smoothk, "none": T_none, "had": T_had, "smooth": T_smooth, "smooth+had": T_smooth_had,
              "had+smooth": T_had_smooth}


# ---------------------------------------------------------------- fake-quant pieces (dequantized, fp64 attention)
def fq_token(x, smooth=None):
    x8, s = R.quantize_per_token(x, smooth=smooth)
    out = x8.double() * s.double()[..., None]
    if smooth is not None:
        out = out + smooth.double()[:, :, None]
    return out


def fq_vblock(v, block=128):
    v8t, sv = R.quantize_v_blocks(v, block)
    L = v.shape[2]
    vd = v8t.double().transpose(-1, -2)[:, :, :L]
    svr = sv.double().repeat_interleave(block, 2)[:, :, :L]
    return vd * svr


def p_term_error(lay, block=128):
    """The prefill's 8-bit P alone: exact softmax, ``p8 = round(127 p / blockmax)`` per row and 128-key block (the
    kernel's "block" P scale without its running-max gap), renormalised; everything else exact (fp64)."""
    q, k, v = (t.double() for t in (lay["q"], lay["k"], lay["v"]))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    L = q.shape[2]
    s = q @ k.transpose(-1, -2) * lay["scale"]
    i = torch.arange(L)
    m = i[None, :] <= i[:, None]
    if lay["window"]:
        m &= (i[:, None] - i[None, :]) < lay["window"]
    s = s.masked_fill(~m, -math.inf)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    pq = torch.zeros_like(e)
    for j in range(0, L, block):
        blk = e[..., j:j + block]
        bm = blk.amax(-1, keepdim=True).clamp_min(1e-300)
        pq[..., j:j + block] = torch.round(127 * blk / bm) * bm / 127
    exact = (e @ v) / e.sum(-1, keepdim=True)
    return rel((pq @ v) / pq.sum(-1, keepdim=True), exact)


def prefill_errors(lay, T, n):
    q, k, v = lay["q"], lay["k"], lay["v"]
    kw = dict(scale=lay["scale"], causal=True, window=lay["window"], softcap=lay["softcap"])
    exact = R.attention_fp64(q, k, v, **kw)
    qt, kt = T(q, k, n)
    out = {"prefill": rel(R.turbo_attention(qt, kt, v, **kw), exact)}
    mean = R.k_smooth_mean(kt)
    out["pf_Q"] = rel(R.attention_fp64(fq_token(qt), kt.double(), v.double(), **kw), exact)
    out["pf_K"] = rel(R.attention_fp64(qt.double(), fq_token(kt, mean), v.double(), **kw), exact)
    if T is T_none:
        out["pf_V"] = rel(R.attention_fp64(q.double(), k.double(), fq_vblock(v), **kw), exact)
        out["pf_P"] = p_term_error(lay)
    return out


def decode_errors(lay, T, n, bits, sink_blocks, recent_blocks, qgroup=None):
    q, k, v = lay["q"], lay["k"], lay["v"]
    L = q.shape[2]
    kw = dict(scale=lay["scale"], causal=True, window=lay["window"], softcap=lay["softcap"])
    exact = R.attention_fp64(q, k, v, **kw)[:, n:]
    qt, kt = T(q, k, n)
    hk = k.shape[1]
    groups, kt8, vt8, nt, ks, vs, mean = R.build_packed_cache_ref(
        kt, v, n, [bits] * hk, 64, True, headroom(n), sink_blocks, recent_blocks)
    o = R.turbo_decode_ref(qt[:, :, n:], groups, kt8, vt8, nt, ks, vs, mean, **kw, n_sink=sink_blocks * 64)
    res = {"decode": rel(o, exact)}
    # decomposition (int8 storage only): q' per-row INT8 alone, K universal INT8 alone
    if bits == 8:
        g = q.shape[1] // hk
        ksr = ks.repeat_interleave(g, 1)[:, :, None]
        qs = qt[:, :, n:].double() * ksr
        amax = qs.abs().amax(-1, keepdim=True)
        qdq = torch.round(qs / amax * 127) * amax / 127 / ksr
        res["dc_Q"] = rel(R.attention_fp64(qdq, kt.double(), v.double(), **kw), exact)
        k8 = R.quantize_int8_universal_ref(kt, ks, mean)
        kdq = k8.double() * ks.double()[:, :, None] + mean.double()[:, :, None]
        res["dc_K"] = rel(R.attention_fp64(qt[:, :, n:].double(), kdq, v.double(), **kw), exact)
        if T is T_none:
            v8 = R.quantize_int8_universal_ref(v, vs)
            res["dc_V"] = rel(R.attention_fp64(q[:, :, n:].double(), k.double(), v8.double() * vs.double()[:, :, None],
                                               **kw), exact)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--transforms", default=",".join(TRANSFORMS))
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--fast", action="store_true", help="no int4, no decompositions")
    a = ap.parse_args(argv)
    data = torch.load(a.path)[: a.texts]
    names = a.transforms.split(",")
    agg: dict = {}
    for t in data:
        n = t["prompt_len"]
        for li, lay in enumerate(t["layers"]):
            for name in names:
                T = TRANSFORMS[name]
                r = prefill_errors(lay, T, n)
                r.update({f"{k}8": v for k, v in decode_errors(lay, T, n, 8, 1, 2).items()})
                if not a.fast:
                    r["decode4"] = decode_errors(lay, T, n, 4, 1, 2)["decode"]
                for k_, v_ in r.items():
                    agg.setdefault(name, {}).setdefault(k_, {}).setdefault(li, []).append(v_)
    keys = sorted({k for d in agg.values() for k in d})
    print("mean over layers (max layer) of rel. RMS error %, texts:", len(data))
    print("| transform | " + " | ".join(keys) + " |")
    for name in names:
        cells = []
        for k_ in keys:
            per = agg[name].get(k_)
            if not per:
                cells.append("-")
                continue
            lv = [sum(v) / len(v) for _, v in sorted(per.items())]
            cells.append(f"{100 * sum(lv) / len(lv):.2f} ({100 * max(lv):.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    torch.save(agg, a.path + ".sweep.pt")


if __name__ == "__main__":
    main()
