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
from eval.bench_e2e import LLAMA3_8B, build_model, new_cache, set_impl
L, T, R = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]); cfgs = sys.argv[4].split(","); out = sys.argv[5]
ACC = collections.defaultdict(float)
pc = time.perf_counter
def wrap(owner, name, label):
    f = getattr(owner, name)
    def w(*a, **k):
        t0 = pc()
        try:
            return f(*a, **k)
        finally:
            ACC[label] += pc() - t0
    setattr(owner, name, w)
import transformers.cache_utils as cu, transformers.integrations.sdpa_attention as sa
import turbo_attn_hf, turbo_attn_hf.cache as C, turbo_attn_hf.attention as A, turbo_attn_hf.first_prefill as FP
from turbo_attn_hf.kernels.launch import LeanLaunch
import transformers.modeling_utils as mu
wrap(cu.Cache, "update", "hf.Cache.update")
wrap(C.TurboCache, "update", "t.TurboCache.update")
wrap(C.TurboLayer, "_replay_first_prefill", "t.replay_first")
wrap(FP, "replay", "t.fp.replay")
wrap(C.TurboLayer, "_first_store_key", "t.key")
wrap(C.TurboLayer, "_first_prefill_keys", "t.prefill_keys")
wrap(C.TurboLayer, "attention", "t.layer.attention")
wrap(A, "exact_attention", "t.exact")
wrap(C, "exact_attention", "t.exact") if hasattr(C, "exact_attention") else None
# the attention interface: HF looks up ALL_ATTENTION_FUNCTIONS by name at call time
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
for k in ("sdpa", turbo_attn_hf.ATTN_NAME):
    f = ALL_ATTENTION_FUNCTIONS[k]
    def mk(f, k):
        def w(*a, **kw):
            t0 = pc()
            try:
                return f(*a, **kw)
            finally:
                ACC["attn_fn"] += pc() - t0
        return w
    ALL_ATTENTION_FUNCTIONS[k] = mk(f, k)
_sdpa = torch.nn.functional.scaled_dot_product_attention
def sdpa_w(*a, **kw):
    t0 = pc()
    try:
        return _sdpa(*a, **kw)
    finally:
        ACC["F.sdpa"] += pc() - t0
torch.nn.functional.scaled_dot_product_attention = sdpa_w
_empty = torch.empty
def empty_w(*a, **kw):
    t0 = pc()
    try:
        return _empty(*a, **kw)
    finally:
        ACC["torch.empty"] += pc() - t0
FP.torch = type(sys)("fp_torch"); FP.torch.__dict__.update(torch.__dict__); FP.torch.empty = empty_w
_rl = LeanLaunch.relaunch
def rl_w(*a, **kw):
    t0 = pc()
    try:
        return _rl(*a, **kw)
    finally:
        ACC["relaunch"] += pc() - t0
LeanLaunch.relaunch = staticmethod(rl_w)
model = build_model(L, LLAMA3_8B, "cuda", torch.bfloat16)
ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
def fwd(c):
    set_impl(model, c); cache = new_cache(model, c); torch.cuda.synchronize()
    ACC.clear()
    t0 = pc()
    with torch.no_grad():
        model(ids, past_key_values=cache, logits_to_keep=1, use_cache=True)
    t1 = pc(); torch.cuda.synchronize(); t2 = pc()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3, {k: v * 1e3 for k, v in ACC.items()}
for c in cfgs:
    for _ in range(3): fwd(c)
rows = []
for r in range(R):
    for c in cfgs:
        h, w, parts = fwd(c)
        rows.append(dict(round=r, cfg=c, host=h, wall=w, parts=parts))
res = {}
for c in cfgs:
    rs = [x for x in rows if x["cfg"] == c]
    keys = sorted({k for x in rs for k in x["parts"]})
    res[c] = dict(host=statistics.median([x["host"] for x in rs]), wall=statistics.median([x["wall"] for x in rs]),
                  parts={k: round(statistics.median([x["parts"].get(k, 0.0) for x in rs]), 3) for k in keys})
    print(c, f"host {res[c]['host']:.2f} wall {res[c]['wall']:.2f}", " ".join(f"{k}={v:.2f}" for k, v in res[c]["parts"].items()), flush=True)
json.dump(dict(machine=torch.cuda.get_device_name(), res=res, rows=rows), open(out, "w"))
