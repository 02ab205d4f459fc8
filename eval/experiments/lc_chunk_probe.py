"""Does turbo's error on tokens stored after the first prefill depend on how they are fed? (issue 21)

KL(eager-fp32 || method), top-1 and perplexity over positions ``--prefill`` .. ``--window`` of the long text of
``eval/long_context.py``, the window fed as one prefill forward, or as a ``--prefill``-token prefill followed by
chunks of each ``--chunks`` size. CPU-sized; on a machine without CUDA turbo runs its PyTorch twins.

    python -m eval.experiments.lc_chunk_probe --methods turbo-int8 --window 2048 --chunks 512,64
    python -m eval.experiments.lc_chunk_probe --methods "turbo-int8;turbo-int8:k_scale_range=rope_pair"
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import turbo_attn_hf  # noqa: F401  (registers turbo_int8)
    from turbo_attn_hf.chat import embedded_model

    from .. import long_context as lc
    from ..fidelity import Stats, prepare

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="sdpa-bf16,turbo-int8")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--chunks", default="512,64")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)

    path, gguf = embedded_model()
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    ref = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    low = copy.deepcopy(ref).to(torch.bfloat16)
    W, P = args.window, args.prefill
    ids, _ = lc.long_text(tok, "gsm8k", W, args.data_dir)
    with torch.no_grad():
        rlp = F.log_softmax(ref(ids[None]).logits[0, :-1].float(), -1)
    tgt = ids[1:]
    for name in args.methods.split(";" if ";" in args.methods else ","):  # ';' where a method has overrides
        m = lc.method(name)
        prepare(low, m.impl)
        for chunk in [0] + [int(c) for c in args.chunks.split(",")]:  # 0: the whole window in one prefill
            t0, st = time.time(), Stats()
            with torch.no_grad():
                for s, lp in lc.chunked_logprobs(low, m, ids, W - 1 if chunk == 0 else P, chunk or W):
                    n, a = lp.shape[0], max(s, P)
                    if s + n > P:  # score positions P.. only
                        st.add(rlp[a:s + n], lp[a - s:], tgt[a:s + n])
            r = st.summary()
            print(f"{name} {'one prefill' if chunk == 0 else f'prefill {P} + chunks of {chunk}'}: positions {P}-{W - 1}: "
                  f"KL {r['kl']:.3e} top-1 {r['top1']:.3f} ppl {r['ppl']:.3f} (fp32 {r['ppl_ref']:.3f}) "
                  f"[{time.time() - t0:.0f}s]", flush=True)


if __name__ == "__main__":
    main()
