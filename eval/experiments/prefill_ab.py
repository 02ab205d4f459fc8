"""A/B of the INT8 prefill (turbo_attention, quantization included) on the installed tree: do_bench medians and FA3 outlier RMSE. Run it once per tree on one warm machine (`python -m eval.experiments.prefill_ab TAG OUT.json`); the 16k fp64 reference needs ~70 GiB (it ran out of memory on an H100: the RMSE rows stop at 4k)."""
import json, sys, torch, triton
from turbo_attn_hf.kernels.prefill import turbo_attention
B = lambda f: triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
res = {"tag": sys.argv[1], "rows": []}
for (b, hq, hk, L, d, causal) in [(1, 32, 8, 1024, 128, True), (1, 32, 8, 4096, 128, True), (1, 32, 8, 4096, 128, False),
                                  (1, 32, 8, 16384, 128, True), (1, 4, 1, 4096, 256, True), (1, 16, 16, 4096, 64, True)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, L, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hk, L, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hk, L, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ms = B(lambda: turbo_attention(q, k, v, causal=causal))
    fl = 4 * b * hq * L * L * d / (2 if causal else 1)
    sd = B(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
    r = dict(shape=[b, hq, hk, L, d], causal=causal, ms=ms, tflops=fl / ms / 1e9, sdpa_ms=sd)
    res["rows"].append(r); print(json.dumps(r), flush=True)
# FA3 outlier RMSE (N(0,1) + N(0,100) x Bernoulli(0.001)) vs fp64, non-causal, d 128, 32 heads
for L in (1024, 4096, 16384):
    g = torch.Generator(device="cuda").manual_seed(1)
    def mk():
        x = torch.randn(1, 32, L, 128, device="cuda", generator=g)
        return (x + torch.randn(x.shape, device="cuda", generator=g) * 10 * (torch.rand(x.shape, device="cuda", generator=g) < 1e-3)).to(torch.bfloat16)
    q, k, v = mk(), mk(), mk()
    o = turbo_attention(q, k, v, causal=False).double()
    ex = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double()).transpose(1, 2)
    if o.shape != ex.shape: ex = ex.transpose(1, 2)
    rm = (o - ex).pow(2).mean().sqrt().item()
    res.setdefault("fa3_rmse", {})[L] = rm; print("fa3 rmse", L, rm, flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
