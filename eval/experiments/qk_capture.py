"""Capture every attention layer's Q/K/V (bf16, RoPE applied, as HF passes them) of a real model on the
fidelity texts, each layer fed exact inputs (fp32 attention passed on), for offline quantization sweeps
(issue 23, ``eval/experiments/qk_outlier_sweep.py``).

    python -m eval.experiments.qk_capture --model .carry/gemma/full --gguf-file gemma-3-270m-q4_k_m.gguf \
        --limit 4 --max-tokens 512 --data-dir ../shared/data --out /tmp/qkv_gemma.pt
"""

from __future__ import annotations

import argparse

import torch


@torch.no_grad()
def capture(model, examples) -> list[dict]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from turbo_attn_hf.attention import torch_attention

    texts = []
    cur: dict = {}

    def fn(module, q, k, v, mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kw):
        w = sliding_window if sliding_window and sliding_window > 0 else None
        cur[int(module.layer_idx)] = dict(q=q.detach().clone(), k=k.detach().clone(), v=v.detach().clone(),
                                          scale=scaling, window=w, softcap=softcap)
        exact = torch_attention(q.float(), k.float(), v.float(), scale=scaling, causal=True, window=w,
                                softcap=softcap)
        return exact.to(q.dtype), None

    ALL_ATTENTION_FUNCTIONS["qkcap"] = fn
    try:
        model.set_attn_implementation("qkcap")
        for ex in examples:
            cur = {}
            model(ex.ids[None], use_cache=False)
            texts.append(dict(prompt_len=ex.prompt_len, layers=[cur[i] for i in sorted(cur)]))
    finally:
        model.set_attn_implementation("sdpa")
        del ALL_ATTENTION_FUNCTIONS["qkcap"]
    return texts


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval import data as edata
    from eval.fidelity import gsm8k_examples, truncate_examples

    kw = {"gguf_file": a.gguf_file} if a.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(a.model, **kw)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="sdpa", **kw).eval()
    rows = edata.load_gsm8k(a.data_dir)[a.offset: a.offset + a.limit]
    ex = truncate_examples(gsm8k_examples(tok, rows, data_dir=a.data_dir), a.max_tokens)
    torch.save(capture(model, ex), a.out)


if __name__ == "__main__":
    main()
