"""How many K / V values fall outside the universal INT8 range fixed on the first prefill, by distance from it
(issue 21): the mechanism behind turbo's long-context error (PERF_NOTES "Long context").

One sdpa forward of ``--window`` tokens of the long text of ``eval/long_context.py`` gives every layer's
post-RoPE K and V; a TurboCache of ``--preset`` stores the first ``--prefill`` tokens (which fixes the universal
scales and K mean exactly as in generation); then the fraction of values with ``|k - mean| / k_scale > 127.5``
(``|v| / v_scale`` for V) — the ones the INT8 store clamps — is counted per 1024-token bucket, and the K channels
clamped most in the last bucket are listed (HF RoPE pairs channel j with j + d/2; higher j = lower frequency).

    python -m eval.experiments.lc_clamp_probe --window 4096 --prefill 1024
    python -m eval.experiments.lc_clamp_probe --preset int8:k_scale_range=rope_pair   # preset:field=value overrides
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import turbo_attn_hf
    from turbo_attn_hf.chat import embedded_model

    from .. import long_context as lc

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--preset", default="int8")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)

    path, gguf = embedded_model()
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    ids, _ = lc.long_text(tok, "gsm8k", args.window, args.data_dir)
    dc = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[None], past_key_values=dc, use_cache=True)
    tc = turbo_attn_hf.TurboCache(lc.method("turbo-" + args.preset).impl.turbo_config, config=model.config)
    P = args.prefill
    edges = [(a, min(a + 1024, args.window)) for a in range(0, args.window, 1024)]
    n = len(dc.layers)
    out_k, out_v = [0.0] * len(edges), [0.0] * len(edges)
    chan = None
    for li in range(n):
        K, V = dc.layers[li].keys, dc.layers[li].values
        tc.update(K[:, :, :P].contiguous(), V[:, :, :P].contiguous(), li)  # the first prefill fixes the scales
        layer = tc.layers[li]
        H, d = K.shape[1], K.shape[3]
        km = layer.k_mean if layer.k_mean is not None else torch.zeros_like(layer.k_scale)  # rope_pair: no mean
        ks, km, vs = (t.float().reshape(1, H, 1, d) for t in (layer.k_scale, km, layer.v_scale))
        for i, (a, b) in enumerate(edges):
            ck = ((K[:, :, a:b].float() - km) / ks).abs() > 127.5
            out_k[i] += ck.float().mean().item() / n
            out_v[i] += ((V[:, :, a:b].float() / vs).abs() > 127.5).float().mean().item() / n
            if i == len(edges) - 1:
                c = ck.float().mean(dim=(0, 1, 2)) / n
                chan = c if chan is None else chan + c
    print(f"preset {args.preset}, prefill {P} tokens, headroom {getattr(tc.layers[0], 'headroom', None)}")
    print("bucket        " + " ".join(f"{a}-{b}".rjust(10) for a, b in edges))
    print("K outside %   " + " ".join(f"{100 * x:10.2f}" for x in out_k))
    print("V outside %   " + " ".join(f"{100 * x:10.2f}" for x in out_v))
    top = chan.topk(8)
    print(f"K channels clamped most in {edges[-1][0]}-{edges[-1][1]}: "
          + ", ".join(f"{i} ({100 * v:.1f} %)" for i, v in zip(top.indices.tolist(), top.values.tolist())))


if __name__ == "__main__":
    main()
