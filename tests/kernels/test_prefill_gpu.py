"""INT8 flash-attention prefill at real sizes on a GPU: kernel vs reference (tight) and vs fp64 (loose).

Run on the GPU machine: ``python -m pytest tests/kernels/test_prefill_gpu.py -q -s``. CI skips these
(``gpu`` marker, no CUDA). The CPU test files (test_prefill.py, test_quant.py, test_softmax.py) also run
compiled when a GPU is present.

Bounds: measured on an H200 (Triton 3.6, torch 2.11, 2026-11-22), see the numbers next to each bound.
"""
import math
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from test_prefill import turbo_ref
from turbo_attn_hf.kernels import prefill
from turbo_attn_hf.kernels import reference as R

pytestmark = pytest.mark.gpu

# kernel (bf16 out) vs reference (fp32 out): bf16 output rounding (2^-9 relative) plus rare p8 flips
# from ex2.approx / FMA contraction; measured on all CASES: rms-rel 1.65e-3 - 1.66e-3, max |diff| /
# max(1, |ref|) 4.8e-4 - 3.9e-3. vs fp64 (the quantization error itself): rel-L2 1.33e-2 - 1.87e-2
# (static P scale the largest), the reference within 1e-4 of the kernel.
KERNEL_RMS, KERNEL_MAX = 4e-3, 1e-2
FP64_REL = 3e-2


def _metrics(out, ref):
    out, ref = out.double(), ref.double()
    diff = (out - ref).abs()
    rms = (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    scaled = diff / ref.abs().clamp_min(1.0)
    idx = tuple(int(i) for i in torch.unravel_index(scaled.argmax(), scaled.shape))
    return rms, scaled.max().item(), idx


def _inputs(b, hq, hk, lq, lk, d, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, lq, hq, d, device="cuda", generator=g, dtype=torch.float32).to(dtype).transpose(1, 2)
    k = (torch.randn(b, lk, hk, d, device="cuda", generator=g) + 0.5).to(dtype).transpose(1, 2)
    v = torch.randn(b, lk, hk, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    return q, k, v


# b, hq, hk, lq, lk, d, options
CASES = [
    (2, 16, 16, 4096, 4096, 64, dict(causal=True)),
    (2, 16, 16, 4096, 4096, 64, dict(causal=False)),
    (2, 16, 16, 4096, 4096, 128, dict(causal=True)),
    (2, 16, 16, 4096, 4096, 128, dict(causal=False)),
    (2, 16, 16, 4096, 4096, 256, dict(causal=True)),
    (2, 16, 16, 4096, 4096, 256, dict(causal=False)),
    (1, 32, 8, 4095, 4095, 128, dict(causal=True)),
    (2, 16, 4, 1000, 4097, 128, dict(causal=True)),
    (2, 16, 16, 4096, 4096, 128, dict(causal=True, softmax="sas")),
    (2, 16, 16, 4096, 4096, 128, dict(causal=True, p_scale="static")),
    (2, 16, 4, 2048, 2048, 80, dict(causal=True, window=1000, key_valid=True)),
    (1, 8, 4, 2048, 2048, 256, dict(causal=True, softcap=50.0, window=777)),
    (2, 28, 4, 1500, 1500, 96, dict(causal=False, key_valid=True, softmax="sas")),
]


def _id(c):
    b, hq, hk, lq, lk, d, o = c
    tags = [f"B{b}-Lq{lq}-Lk{lk}-HQ{hq}-H{hk}-D{d}"]
    tags += [("causal" if v else "full") if k == "causal" else (k if v is True else f"{k}{v}") for k, v in o.items()]
    return "-".join(tags)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_prefill_real_sizes(case):
    b, hq, hk, lq, lk, d, opts = case
    opts = dict(opts)
    q, k, v = _inputs(b, hq, hk, lq, lk, d)
    if opts.pop("key_valid", False):
        kv = torch.ones(b, lk, dtype=torch.bool, device="cuda")
        kv[-1, : lk // 3] = False  # left padding
        kv[0, 100:140] = False  # a hole
        opts["key_valid"] = kv
    out = torch.full((b, lq, hq, d), float("nan"), dtype=q.dtype, device="cuda")
    prefill.turbo_attention(q, k, v, out=out, **opts)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    ref = turbo_ref(q, k, v, "cuda", **opts)
    rms, mx, idx = _metrics(out, ref)
    # fp64 attention on the first and last query head (the full set costs minutes of fp64 matmuls)
    mask_opts = {key: val for key, val in opts.items() if key not in ("softmax", "p_scale")}
    g = hq // hk
    num = den = num_ref = 0.0
    for hh in (0, hq - 1):
        exact = R.attention_fp64(q[:, hh:hh + 1], k[:, hh // g:hh // g + 1], v[:, hh // g:hh // g + 1],
                                 **mask_opts)[:, :, 0]
        num += (out[:, :, hh].double() - exact).pow(2).sum().item()
        num_ref += (ref[:, :, hh].double() - exact).pow(2).sum().item()
        den += exact.pow(2).sum().item()
    rel, rel_ref = math.sqrt(num / den), math.sqrt(num_ref / den)
    print(f"\n[prefill-gpu] {_id(case)}: kernel-ref rms-rel {rms:.2e} max {mx:.2e} at {idx}; "
          f"kernel-fp64 rel-L2 {rel:.2e} (reference {rel_ref:.2e})")
    assert rms <= KERNEL_RMS and mx <= KERNEL_MAX
    assert rel <= FP64_REL


def test_fp16_and_kernel_only_path():
    q, k, v = _inputs(1, 8, 2, 3000, 3000, 128, dtype=torch.float16)
    o = prefill.turbo_attention(q, k, v, causal=True)
    ref = turbo_ref(q, k, v, "cuda", causal=True)
    rms, mx, _ = _metrics(o, ref)
    assert o.dtype == torch.float16 and rms <= KERNEL_RMS and mx <= KERNEL_MAX
    q8, sq = prefill.quantize_per_token(q, scale=128 ** -0.5 * R.LOG2E)
    k8, sk = prefill.quantize_per_token(k, smooth=R.k_smooth_mean(k))
    # the V block must be turbo_attention's default (128 at d128 since the H200 sweep), or the math differs
    if prefill.pv_dtype(q.device, v.dtype, 128) is None:
        v8t, sv = prefill.quantize_v_blocks(v, R.default_block_n(128))
        o2 = prefill.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=True, window=None, softcap=None,
                                          key_valid=None, softmax="exact", sas_threshold=6.0, Lk=3000,
                                          out_dtype=torch.float16)
    else:  # the Gluon kernel's P.V on V itself, on the operand the plan's V pass writes
        from turbo_attn_hf.kernels import prefill_hopper, quant

        sk = torch.nn.functional.pad(sk, (0, -3000 % 4)).contiguous()
        o2 = prefill_hopper.launch_ws(q8, sq, k8, sk, quant.v_operand_half(v, R.default_block_n(128), poison=sk),
                                      torch.empty(1, 2, 1, 128, device="cuda"), torch.empty_like(o), causal=True,
                                      Lk=3000)
    assert torch.equal(o, o2)


def test_quantizers_bit_exact_real_size():
    q, k, v = _inputs(2, 16, 8, 4096, 4096, 128)
    mean = R.k_smooth_mean(k)
    for got, want in ((prefill.quantize_per_token(k, smooth=mean), R.quantize_per_token(k, smooth=mean)),
                      (prefill.quantize_per_token(q, scale=0.1275), R.quantize_per_token(q, scale=0.1275)),
                      (prefill.quantize_v_blocks(v, 64), R.quantize_v_blocks(v, 64))):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_large_batch_offsets_int64():
    """More than 2^31 elements in q/k/v: the batch/head base offsets must not overflow int32."""
    free, _ = torch.cuda.mem_get_info()
    b, h, L, d = 4100, 64, 64, 128  # 2.15e9 > 2^31 elements per tensor, 4.3 GB each in bf16
    if free < 40e9:
        pytest.skip("needs ~40 GB of free GPU memory")
    q = torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16)
    out = prefill.turbo_attention(q, k, v, causal=True)
    for i in (0, b - 1):
        ref = turbo_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], "cuda", causal=True)
        rms, mx, _ = _metrics(out[i:i + 1], ref)
        assert rms <= KERNEL_RMS and mx <= KERNEL_MAX, (i, rms, mx)


# (what, batch, head, token, value, whole token): one run per option set with all of them (different heads / rows)
NONFINITE_POISONS = [("q", 0, 3, 1000, float("nan"), False), ("q", 1, 9, 5, float("inf"), False),
                     ("k", 0, 1, 2000, float("nan"), False), ("k", 1, 2, 3000, float("-inf"), True),
                     ("v", 0, 2, 777, float("nan"), False), ("v", 1, 3, 4000, float("inf"), True),
                     ("v", 1, 0, 100, float("nan"), False)]  # under key_valid's left padding: no row sees it


@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=False), dict(causal=True, key_valid=True),
                                  dict(causal=True, window=1000, softmax="sas", v_scale="channel")],
                         ids=["causal", "full", "causal-key_valid", "window-sas-channel"])
def test_nonfinite_inputs_real_size(opts):
    """Compiled kernel (where tl.max's default drops NaN): the non-finite rows are exactly R.nonfinite_rows,
    the finite rows match the reference within the bounds above; a bad query leaves every other row bit-equal."""
    b, hq, hk, L, d = 2, 16, 4, 4096, 128
    opts = dict(opts)
    q, k, v = _inputs(b, hq, hk, L, L, d)
    if opts.pop("key_valid", False):
        kv = torch.ones(b, L, dtype=torch.bool, device="cuda")
        kv[1, :300] = False
        opts["key_valid"] = kv
    clean = prefill.turbo_attention(q, k, v, **opts)
    for what, ib, h, j, val, whole in NONFINITE_POISONS:
        t = {"q": q, "k": k, "v": v}[what]
        t[ib, h % t.shape[1], j, slice(None) if whole else 7] = val
    out = prefill.turbo_attention(q, k, v, **opts)
    want = R.nonfinite_rows(q, k, v, causal=opts["causal"], window=opts.get("window"),
                            key_valid=opts.get("key_valid"))
    got = ~torch.isfinite(out).all(-1)
    diff = (got != want).nonzero()
    assert torch.equal(got, want), f"{len(diff)} rows differ, e.g. {diff[:5].tolist()}"
    assert torch.isnan(out[want]).all()
    ref = turbo_ref(q, k, v, "cuda", **opts)
    assert torch.equal(~torch.isfinite(ref).all(-1), want)
    rms, mx, idx = _metrics(out[~want], ref[~want])
    tags = {key: val for key, val in opts.items() if not isinstance(val, torch.Tensor)}
    print(f"\n[prefill-gpu nonfinite] {tags}: {int(want.sum())} NaN rows; finite rows kernel-ref rms-rel {rms:.2e} "
          f"max {mx:.2e}")
    assert rms <= KERNEL_RMS and mx <= KERNEL_MAX
    # the bad query alone: nothing else moves (per-token Q scales)
    q1 = _inputs(b, hq, hk, L, L, d)[0]
    q1[0, 3, 1000, 7] = float("nan")
    _, k0, v0 = _inputs(b, hq, hk, L, L, d)
    out1 = prefill.turbo_attention(q1, k0, v0, **opts)
    rows = torch.zeros_like(want)
    rows[0, 1000, 3] = True
    assert torch.equal(~torch.isfinite(out1).all(-1), rows)
    assert torch.equal(out1[~rows], clean[~rows])


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_memcheck_one_prefill_call(tmp_path):
    """compute-sanitizer --tool memcheck on a small prefill call with every mask (tails, window, padding)."""
    code = textwrap.dedent("""
        import torch
        from turbo_attn_hf.kernels import prefill
        q = torch.randn(2, 4, 77, 80, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 2, 301, 80, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, 2, 301, 80, device="cuda", dtype=torch.bfloat16)
        kv = torch.ones(2, 301, dtype=torch.bool, device="cuda"); kv[1, :50] = False
        o = prefill.turbo_attention(q, k, v, causal=True, window=100, key_valid=kv, softmax="sas")
        o = prefill.turbo_attention(q, k, v, causal=False, softcap=20.0)
        torch.cuda.synchronize()
        print("ok", float(o.float().abs().sum()))
    """)
    res = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", sys.executable,
                          "-c", code], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    print(res.stdout[-3000:], res.stderr[-3000:])
    assert res.returncode == 0 and "ERROR SUMMARY: 0 errors" in res.stdout + res.stderr
