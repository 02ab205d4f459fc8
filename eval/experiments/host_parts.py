"""Host time of a prefill forward, split by function, in context (issue 19): where turbo's extra host goes.

    python -m eval.experiments.host_parts LAYERS T ROUNDS CONFIGS OUT.json   # e.g. 32 1024 16 sdpa,int8,int4,mixed x.json

Llama-3-8B shape, random bf16 weights, 1 x T, ``model(ids, past_key_values=fresh cache, logits_to_keep=1)``, configs
alternating per round in one process. Named functions (HF's ``Cache.update``, ``TurboCache.update``, the attention
function, SDPA, the first store's replay, its key, ``torch.empty`` in the replay, ``LeanLaunch.relaunch``) are wrapped
by ``perf_counter`` pairs (~1 us each on the GPU host, both sides) and summed per forward: unlike ``layer_host_ab``
(one layer in a tight loop) this sees each piece next to the model's own host work. Prints and stores medians over
rounds of the host time to issue the forward, its wall time, and each part (ms per forward)."""
import sys, time, json, statistics, collections
import torch
from eval.bench_e2e import LLAMA3_8B, alternating, build_model, first_stores_per_layer, timed_prefill
L, T, R = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]); cfgs = sys.argv[4].split(","); out = sys.argv[5]
ACC = collections.defaultdict(float)
pc = time.perf_counter


def timed(f, label):
    """``f`` with its time added to ``ACC[label]`` per call."""
    def w(*a, **k):
        t0 = pc()
        try:
            return f(*a, **k)
        finally:
            ACC[label] += pc() - t0
    return w


def wrap(owner, name, label):
    setattr(owner, name, timed(getattr(owner, name), label))


import transformers.cache_utils as cu  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import turbo_attn_hf  # noqa: E402
import turbo_attn_hf.attention as A  # noqa: E402
import turbo_attn_hf.cache as C  # noqa: E402
import turbo_attn_hf.first_prefill as FP  # noqa: E402
from turbo_attn_hf.kernels.launch import LeanLaunch  # noqa: E402

wrap(cu.Cache, "update", "hf.Cache.update")
wrap(C.TurboCache, "update", "t.TurboCache.update")
wrap(C.TurboLayer, "_replay_first_prefill", "t.replay_first")
wrap(FP, "replay", "t.fp.replay")
if hasattr(FP, "Batch"):
    wrap(FP.Batch, "flush", "t.flush")
wrap(C.TurboLayer, "_first_store_key", "t.key")
wrap(C.TurboLayer, "_first_prefill_keys", "t.prefill_keys")
wrap(C.TurboLayer, "attention", "t.layer.attention")
wrap(A, "exact_attention", "t.exact")
if hasattr(C, "exact_attention"):
    wrap(C, "exact_attention", "t.exact")
for name in ("sdpa", turbo_attn_hf.ATTN_NAME):  # the models look the function up by name at each call
    ALL_ATTENTION_FUNCTIONS[name] = timed(ALL_ATTENTION_FUNCTIONS[name], "attn_fn")
wrap(torch.nn.functional, "scaled_dot_product_attention", "F.sdpa")
FP.torch = type(sys)("fp_torch")  # the replay's torch.empty only
FP.torch.__dict__.update(torch.__dict__)
FP.torch.empty = timed(torch.empty, "torch.empty")
LeanLaunch.relaunch = staticmethod(timed(LeanLaunch.relaunch, "relaunch"))
model = build_model(L, LLAMA3_8B, "cuda", torch.bfloat16)
ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")


def fwd(c):
    ACC.clear()
    h, _, w = timed_prefill(model, ids, first_stores_per_layer(c))  # ``int4@perlayer``: session 20's A/B
    return h, w, {k: v * 1e3 for k, v in ACC.items()}


rows = [dict(round=r, cfg=c, host=h, wall=w, parts=parts) for r, c, (h, w, parts) in alternating(cfgs, R, fwd)]
res = {}
for c in cfgs:
    rs = [x for x in rows if x["cfg"] == c]
    keys = sorted({k for x in rs for k in x["parts"]})
    res[c] = dict(host=statistics.median([x["host"] for x in rs]), wall=statistics.median([x["wall"] for x in rs]),
                  parts={k: round(statistics.median([x["parts"].get(k, 0.0) for x in rs]), 3) for k in keys})
    print(c, f"host {res[c]['host']:.2f} wall {res[c]['wall']:.2f}", " ".join(f"{k}={v:.2f}" for k, v in res[c]["parts"].items()), flush=True)
json.dump(dict(machine=torch.cuda.get_device_name(), res=res, rows=rows), open(out, "w"))
