"""Host µs of one layer's rotary embedding on CUDA (issue 18): HF's ``apply_rotary_pos_emb`` against the wrapped one
with a marked ``cos`` (``turbo_attn_hf.rotary``: the fused kernel) and with an unmarked one (HF's function behind the
wrapper's checks), Llama-3-8B decode shapes (32 / 8 heads, head_dim 128, one token), and whether the outputs are
equal bit for bit. Calls are timed back to back without a sync (the host's cost while the GPU keeps up).

    python -m eval.experiments.host_rope [--batches 1,4] [--reps 3] [--out host_rope.json]
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    import torch
    from transformers.models.llama import modeling_llama as ML

    from turbo_attn_hf import rotary

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", default="host_rope.json")
    a = ap.parse_args(argv)
    hf = getattr(ML.apply_rotary_pos_emb, "__wrapped_original__", ML.apply_rotary_pos_emb)
    rotary._wrap(ML)
    wrapped = ML.apply_rotary_pos_emb
    rows = []
    for b in map(int, a.batches.split(",")):
        q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, 1, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        ang = torch.randn(b, 1, 128, device="cuda")
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
        plain_cos = cos.clone()
        rotary._mark(None, None, (cos, sin))
        same = all(torch.equal(x, y) for x, y in zip(wrapped(q, k, cos, sin), hf(q, k, plain_cos, sin)))

        def host_us(fn, c):
            for _ in range(200):
                fn(q, k, c, sin)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn(q, k, c, sin)
            t = (time.perf_counter() - t0) / a.calls * 1e6
            torch.cuda.synchronize()
            return t

        for rep in range(a.reps):
            rows.append(dict(batch=b, rep=rep, hf_us=host_us(hf, plain_cos), fused_us=host_us(wrapped, cos),
                             wrapped_unmarked_us=host_us(wrapped, plain_cos), bit_equal=same))
            print(rows[-1], flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(benchmark="host_rope", device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
