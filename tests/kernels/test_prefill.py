"""INT8 flash-attention prefill kernel vs its PyTorch twin (tight) on small, awkward shapes.

Runs the real Triton kernel: in the interpreter on a CPU machine (TRITON_INTERPRET=1, tests/conftest.py),
compiled on a GPU. Outputs are allocated NaN-poisoned so that an unwritten tile fails.

Tolerances (measured in the interpreter, Triton 3.6, on these cases; bound = measurement x ~3):
the kernel runs the reference's fp32 steps, so differences come from the output rounding (fp16: <= 1 ulp;
bf16: the interpreter truncates fp32 -> bf16, <= 1 ulp = 2^-8 relative) and from a rare p8 code flip
where FMA contraction or summation order moves 127 p across a rounding boundary.
"max-abs" is max |out - ref| / max(1, |ref|) (an ulp grows with the value).
  fp16: rms-rel <= 2.1e-4, max-abs <= 4.9e-4 measured   -> bounds 1e-3, 2e-3
  bf16: rms-rel <= 3.3e-3, max-abs <= 7.0e-3 measured   -> bounds 8e-3, 1.2e-2 (RTZ: < 2^-7)
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from turbo_attn_hf.kernels import prefill, quant
from turbo_attn_hf.kernels import reference as R

TOL = {torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1.2e-2)}
# Compiled on a GPU, exp2 is ex2.approx (relative error ~2^-22) while the reference runs torch's exp2 on the
# CPU: a 127 p that sits on a rounding boundary flips by one code. In a short row (window 20: l ~ 600) one
# flip moves o by ~|v| / l: measured on an H200 (2026-11-22) fp16 max-abs 3.1e-3 (rms-rel 6.0e-4) for
# B1-Lq63-Lk63-D64-window20, every other case within TOL -> fp16 max-abs bound 6e-3 on CUDA.
TOL_CUDA = {torch.float16: (1e-3, 6e-3), torch.bfloat16: (8e-3, 1.2e-2)}


def tol(device, dtype):
    return (TOL_CUDA if device.type == "cuda" else TOL)[dtype]


def turbo_ref(q, k, v, device="cpu", **opts):
    """``R.turbo_attention`` on fp32 copies (on ``device``) with the P.V that ``prefill.turbo_attention`` runs for these
    inputs and options (``prefill.pv_dtype``: on V itself in 16 bits where the Gluon kernel runs the call, else
    INT8), so each kernel is held to its own twin."""
    pv = prefill.pv_dtype(q.device, v.dtype, q.shape[-1], opts.get("block_n"), **{
        key: opts[key] for key in ("window", "softcap", "key_valid", "softmax", "p_scale", "v_scale") if key in opts})
    return R.turbo_attention(q.float().to(device), k.float().to(device), v.float().to(device), pv_dtype=pv,
                             **{key: (val.to(device) if isinstance(val, torch.Tensor) else val)
                                for key, val in opts.items()})


def assert_close(name, ref, out, rms_tol, max_tol):
    """RMS-relative + max-abs (scaled by max(1, |ref|)) comparison, FLA style; prints the worst index."""
    ref, out = ref.float().cpu(), out.float().cpu()
    bad = ~torch.isfinite(out)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite outputs (unwritten tile?), first at " \
                          f"{bad.nonzero()[0].tolist()}"
    diff = (out - ref).abs()
    rms = (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()
    diff = diff / ref.abs().clamp_min(1.0)
    mx = diff.max().item()
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    msg = (f"{name}: rms-rel {rms:.2e} (tol {rms_tol:.1e}), max-abs {mx:.2e} (tol {max_tol:.1e}) at {idx}: "
           f"ref {ref[idx].item():.5f} out {out[idx].item():.5f}")
    print(msg)
    assert rms <= rms_tol and mx <= max_tol, msg


def make_qkv(b, hq, hk, lq, lk, d, dtype, device, seed=0, hf_layout=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g)
    k = torch.randn(b, hk, lk, d, generator=g) + 0.5 * torch.randn(1, 1, 1, d, generator=g)  # channel bias
    v = torch.randn(b, hk, lk, d, generator=g)
    q, k, v = (t.to(dtype=dtype, device=device) for t in (q, k, v))
    if hf_layout:  # HF hands over [b, L, H, d] storage viewed as [b, H, L, d]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return q, k, v


def padding_mask(b, lk, device, left=(0, 7), hole=(20, 23)):
    """bool [b, Lk]: batch row i has ``left[i]`` left-padded keys; row 0 also has a hole."""
    kv = torch.ones(b, lk, dtype=torch.bool)
    for i in range(b):
        kv[i, : left[i % len(left)]] = False
    if hole is not None and lk > hole[1]:
        kv[0, hole[0]:hole[1]] = False
    return kv.to(device)


# b, hq, hk, lq, lk, d, dtype, block_n, options
CASES = [
    (2, 4, 1, 63, 111, 80, torch.float16, 16, dict(causal=True)),
    (1, 2, 2, 65, 65, 64, torch.float16, 32, dict(causal=False)),
    (1, 7, 1, 111, 111, 96, torch.float16, 32, dict(causal=True)),
    (1, 2, 1, 63, 63, 128, torch.bfloat16, 16, dict(causal=True)),
    (1, 2, 1, 33, 40, 256, torch.float16, 16, dict(causal=True)),
    (1, 2, 1, 1, 65, 64, torch.float16, 16, dict(causal=True)),
    (1, 4, 2, 65, 111, 64, torch.float16, 16, dict(causal=True, window=37)),
    (1, 2, 1, 63, 63, 64, torch.float16, 16, dict(causal=False, window=20)),
    (1, 4, 2, 63, 111, 80, torch.float16, 32, dict(causal=True, softcap=5.0)),
    (2, 4, 2, 63, 63, 64, torch.float16, 16, dict(causal=True, key_valid=True)),
    (2, 4, 4, 7, 111, 64, torch.float16, 32, dict(causal=False, key_valid=True)),
    (2, 4, 1, 63, 111, 80, torch.float16, 16, dict(causal=True, softmax="sas")),
    (1, 4, 2, 65, 111, 64, torch.float16, 16, dict(causal=True, window=37, softmax="sas")),
    (2, 4, 2, 63, 63, 64, torch.float16, 16, dict(causal=True, key_valid=True, softmax="sas")),
    (2, 4, 1, 63, 111, 80, torch.float16, 16, dict(causal=True, p_scale="static")),
    (1, 2, 2, 65, 65, 64, torch.float16, 32, dict(causal=False, p_scale="static", softmax="sas")),
    (2, 7, 1, 65, 111, 96, torch.bfloat16, 16,
     dict(causal=True, window=50, softcap=30.0, key_valid=True, softmax="sas", hf_layout=True)),
    (2, 4, 1, 63, 111, 80, torch.float16, 16, dict(causal=True, v_scale="channel")),
    (1, 4, 2, 65, 111, 64, torch.float16, 32, dict(causal=True, window=37, v_scale="channel", softmax="sas")),
    (1, 2, 1, 100, 300, 128, torch.float16, 128, dict(causal=True)),
]


def _case_id(c):
    b, hq, hk, lq, lk, d, dtype, bn, opts = c
    tags = [f"B{b}-Lq{lq}-Lk{lk}-HQ{hq}-H{hk}-D{d}", "bf16" if dtype == torch.bfloat16 else "fp16", f"BN{bn}"]
    for key, val in opts.items():
        if key == "causal":
            tags.append("causal" if val else "full")
        elif val is True:
            tags.append(key)
        else:
            tags.append(f"{key}{val}")
    return "-".join(tags)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_kernel_matches_reference(case, device):
    b, hq, hk, lq, lk, d, dtype, block_n, opts = case
    if device.type == "cuda":
        block_n = max(block_n, 32)  # compiled int8 dots need a reduction depth >= 32
    opts = dict(opts)
    hf_layout = opts.pop("hf_layout", False)
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, device, hf_layout=hf_layout)
    if opts.pop("key_valid", False):
        opts["key_valid"] = padding_mask(b, lk, device)
    out = torch.full((b, lq, hq, d), float("nan"), dtype=dtype, device=device)
    res = prefill.turbo_attention(q, k, v, block_n=block_n, out=out, **opts)
    assert res.data_ptr() == out.data_ptr() and res.shape == (b, lq, hq, d) and res.dtype == dtype
    # reference on fp32 copies: same quantized math, fp32 output (the kernel's rounding shows alone)
    ref = turbo_ref(q, k, v, block_n=block_n, **opts)
    assert_close(_case_id(case), ref, out, *tol(device, dtype))


# b, hq, hk, lq, lk, d, dtype, block_n, rotate_qk mode, options
ROT_CASES = [
    (1, 4, 2, 63, 111, 128, torch.bfloat16, 16, "smooth_hadamard", dict(causal=True)),
    (2, 4, 1, 63, 111, 80, torch.float16, 16, "hadamard", dict(causal=True, key_valid=True)),
    (1, 2, 1, 33, 40, 256, torch.bfloat16, 16, "hadamard", dict(causal=True, softcap=30.0)),
    (1, 2, 2, 65, 65, 96, torch.float16, 32, "smooth_hadamard", dict(causal=False, hf_layout=True)),
]


@pytest.mark.parametrize("case", ROT_CASES, ids=[f"{c[8]}-{_case_id(c[:8] + c[9:])}" for c in ROT_CASES])
def test_kernel_matches_reference_rotated(case, device):
    """``rotate_qk`` fused into the Q+K quantization pass (issue 23 item 5) == the reference's same math, at the
    unrotated cases' tolerances; q, k (and the mean) go in unrotated."""
    from turbo_attn_hf.kernels.rotation import smooth_scales

    b, hq, hk, lq, lk, d, dtype, block_n, mode, opts = case
    if device.type == "cuda":
        block_n = max(block_n, 32)
    opts = dict(opts)
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, device, hf_layout=opts.pop("hf_layout", False))
    if opts.pop("key_valid", False):
        opts["key_valid"] = padding_mask(b, lk, device)
    s = smooth_scales(k) if mode == "smooth_hadamard" else None
    out = prefill.turbo_attention(q, k, v, block_n=block_n, rotate_qk=True, qk_smooth=s, **opts)
    ref = turbo_ref(q, k, v, block_n=block_n, rotate_qk=True, qk_smooth=s, **opts)
    assert_close(f"{mode}-{d}", ref, out, *tol(device, dtype))


def test_default_tiles_and_fresh_output(device):
    """No out=, default block_n (64) and p_scale; HF-layout fp16 inputs."""
    q, k, v = make_qkv(1, 4, 2, 70, 130, 64, torch.float16, device, hf_layout=True)
    o = prefill.turbo_attention(q, k, v)
    ref = turbo_ref(q, k, v)
    assert o.shape == (1, 70, 4, 64) and o.dtype == torch.float16
    assert_close("defaults", ref, o, *tol(device, torch.float16))


def test_rows_without_valid_keys_are_zero(device):
    """Left padding longer than a query's causal reach: those rows attend nothing and must return 0."""
    b, h, L, d = 2, 2, 40, 64
    q, k, v = make_qkv(b, h, h, L, L, d, torch.float16, device)
    kv = torch.ones(b, L, dtype=torch.bool, device=device)
    kv[1, :19] = False
    kv[0, :] = False  # a fully padded sequence
    out = torch.full((b, L, h, d), float("nan"), dtype=torch.float16, device=device)
    prefill.turbo_attention(q, k, v, key_valid=kv, block_n=16 if device.type == "cpu" else 32, out=out)
    assert torch.all(out[0] == 0)
    assert torch.all(out[1, :19] == 0)
    assert out[1, 19:].abs().sum() > 0


def test_int8_flash_attention_on_quantized_operands(device):
    """The kernel-only entry point with operands from the Triton quantizers vs the reference loop."""
    b, hq, hk, lq, lk, d = 1, 4, 2, 50, 90, 80
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, torch.float16, device)
    scale = 0.1
    q8, sq = quant.quantize_per_token(q, scale=scale * R.LOG2E)
    k8, sk = quant.quantize_per_token(k, smooth=quant.k_smooth_mean(k))
    v8t, sv = quant.quantize_v_blocks(v, 32)
    for p_scale in R.P_SCALE_MODES:
        out = torch.full((b, lq, hq, d), float("nan"), dtype=torch.float16, device=device)
        prefill.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=True, window=None, softcap=None,
                                     key_valid=None, softmax="exact", sas_threshold=6.0, Lk=lk,
                                     out_dtype=torch.float16, p_scale=p_scale, out=out)
        ref = R.int8_flash_attention(*(t.cpu() for t in (q8, sq, k8, sk, v8t, sv)), causal=True, Lk=lk,
                                     out_dtype=torch.float32, p_scale=p_scale)
        assert_close(f"int8_flash_attention-{p_scale}", ref, out, *tol(device, torch.float16))
    v8c, svc = quant.quantize_v_channels(v, 32)  # per-channel V scale: the KV block is block_n
    out = torch.full((b, lq, hq, d), float("nan"), dtype=torch.float16, device=device)
    prefill.int8_flash_attention(q8, sq, k8, sk, v8c, svc, causal=True, Lk=lk, out_dtype=torch.float16,
                                 out=out, block_n=32)
    refc = R.int8_flash_attention(*(t.cpu() for t in (q8, sq, k8, sk, v8c, svc)), causal=True, Lk=lk,
                                  out_dtype=torch.float32, block_n=32)
    assert_close("int8_flash_attention-channel", refc, out, *tol(device, torch.float16))
    # and the same through turbo_attention (same quantizers, same mean)
    full = prefill.turbo_attention(q, k, v, scale=scale, block_n=32)
    assert_close("turbo vs kernel-only", ref.to(torch.float16).float(), full, *tol(device, torch.float16))


# -------------------------------------------------------------------------- chained int8 dot (#3580)
@triton.jit
def _chained_dot_kernel(A, B, VT, OUT, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    """C = A [M, K] . B^T (B [N, K], K-major); P = C & 127 as int8; OUT = P . VT^T (VT [D, N], N-major)."""
    o_m, o_k, o_n, o_d = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N), tl.arange(0, D)
    a = tl.load(A + o_m[:, None] * K + o_k[None, :])
    bt = tl.load(B + o_n[None, :] * K + o_k[:, None])  # [K, N] view of [N, K]
    c = tl.dot(a, bt)
    p = (c & 127).to(tl.int8)
    vt = tl.load(VT + o_d[:, None] * N + o_n[None, :])  # [D, N], tokens contiguous
    o = tl.dot(p, tl.trans(vt))
    tl.store(OUT + o_m[:, None] * D + o_d[None, :], o)


@triton.jit
def _i2f_kernel(X, Y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(Y + o, prefill._i32_to_f32(tl.load(X + o, mask=m, other=0)), mask=m)


def test_chained_int8_dot(device):
    """P produced by one int8 dot feeds the next (Triton issue #3580 reported wrong results once)."""
    M, K, N, D = 64, 64, 32, 64
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    vt = torch.randint(-127, 128, (D, N), generator=g, dtype=torch.int8)
    c = a.long() @ b.long().T
    p = c & 127
    want = (p @ vt.long().T).to(torch.int32)
    out = torch.full((M, D), -1, dtype=torch.int32, device=device)
    _chained_dot_kernel[(1,)](a.to(device), b.to(device), vt.to(device), out, M=M, K=K, N=N, D=D)
    assert torch.equal(out.cpu(), want)


def test_i32_to_f32_exact(device):
    """The magic-number int32 -> fp32 conversion is exact on |x| < 2^22 (the kernel's dot results)."""
    x = torch.cat([torch.arange(-(1 << 22) + 1, -(1 << 22) + 2000), torch.arange(-3000, 3000),
                   torch.arange((1 << 22) - 2000, 1 << 22),
                   torch.randint(-(1 << 22) + 1, 1 << 22, (20000,), generator=torch.Generator().manual_seed(1))])
    x = x.to(torch.int32)
    y = torch.full(x.shape, float("nan"), dtype=torch.float32, device=device)
    n = x.numel()
    _i2f_kernel[(triton.cdiv(n, 1024),)](x.to(device), y, n, BLOCK=1024)
    assert torch.equal(y.cpu(), x.float())


# -------------------------------------------------------------------------------------- errors
def _qkv(device, b=1, hq=2, hk=1, lq=8, lk=8, d=64, dtype=torch.float16):
    return make_qkv(b, hq, hk, lq, lk, d, dtype, device)


@pytest.mark.parametrize("d", [32, 112, 160])
def test_unsupported_head_dim_raises(device, d):
    q, k, v = _qkv(device, d=d)
    with pytest.raises(ValueError, match=rf"head_dim {d} .*\(64, 80, 96, 128, 256\).*attn_implementation='sdpa'"):
        prefill.turbo_attention(q, k, v)
    with pytest.raises(ValueError, match=rf"head_dim {d}"):
        R.turbo_attention(q.cpu(), k.cpu(), v.cpu())


def test_bad_inputs_raise(device):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match="float32"):
        prefill.turbo_attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="same shape"):
        prefill.turbo_attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="q_len 9 > kv_len 8"):
        prefill.turbo_attention(torch.cat([q, q[:, :, :1]], 2), k, v)
    q3, k2, v2 = _qkv(device, hq=3, hk=2)
    with pytest.raises(ValueError, match="not a multiple"):
        prefill.turbo_attention(q3, k2, v2)
    with pytest.raises(ValueError, match="share a dtype"):
        prefill.turbo_attention(q, k.bfloat16(), v.bfloat16())
    with pytest.raises(ValueError, match="key_valid"):
        prefill.turbo_attention(q, k, v, key_valid=torch.ones(1, 7, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="key_valid"):
        prefill.turbo_attention(q, k, v, key_valid=torch.ones(1, 8, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="softmax"):
        prefill.turbo_attention(q, k, v, softmax="fast")
    with pytest.raises(ValueError, match="window"):
        prefill.turbo_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="softcap"):
        prefill.turbo_attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="block_n"):
        prefill.turbo_attention(q, k, v, block_n=48)
    with pytest.raises(ValueError, match="v_scale"):
        prefill.turbo_attention(q, k, v, v_scale="tensor")
    with pytest.raises(ValueError, match="out must be"):
        prefill.turbo_attention(q, k, v, out=torch.empty(1, 8, 2, 64, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="4-D"):
        prefill.turbo_attention(q[0], k[0], v[0])


def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    """Outside the interpreter, CPU tensors are refused with a pointer to the PyTorch reference."""
    monkeypatch.setattr(quant, "interpreting", lambda: False)
    q, k, v = _qkv(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"CUDA.*TRITON_INTERPRET=1.*reference\.turbo_attention"):
        prefill.turbo_attention(q, k, v)
    with pytest.raises(ValueError, match="CUDA"):
        quant.quantize_per_token(q)


def test_quantized_operand_checks(device):
    q, k, v = _qkv(device)
    q8, sq = quant.quantize_per_token(q, scale=0.1)
    k8, sk = quant.quantize_per_token(k)
    v8t, sv = quant.quantize_v_blocks(v, 16)
    kw = dict(causal=True, window=None, softcap=None, key_valid=None, softmax="exact", sas_threshold=6.0,
              Lk=8, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="q8 must be torch.int8"):
        prefill.int8_flash_attention(q8.float(), sq, k8, sk, v8t, sv, **kw)
    with pytest.raises(ValueError, match="sv"):
        prefill.int8_flash_attention(q8, sq, k8, sk, v8t, sv[:, :, :, :32], **kw)
    with pytest.raises(ValueError, match="out_dtype"):
        prefill.int8_flash_attention(q8, sq, k8, sk, v8t, sv, **{**kw, "out_dtype": torch.float32})
    with pytest.raises(ValueError, match="Lk=9"):
        prefill.int8_flash_attention(q8, sq, k8, sk, v8t, sv, **{**kw, "Lk": 9})


def test_no_recompile_across_sequence_lengths(device):
    """Sequence lengths are not specialized: new lengths reuse the compiled kernel (GPU only: the
    interpreter has no cache)."""
    if device.type != "cuda":
        pytest.skip("compilation cache exists on the GPU only")
    kern = prefill._int8_attn_fwd_kernel
    counts = []
    for lk in (64, 77, 128, 129, 200, 333):
        q, k, v = _qkv(device, lq=lk, lk=lk)
        prefill.turbo_attention(q, k, v)
        kernel_cache = kern.device_caches[torch.cuda.current_device()][0]
        counts.append(len(kernel_cache))
    assert len(set(counts)) == 1, f"compiled variants after each new length: {counts}"


# --------------------------------------------------------------------------- non-finite inputs (issue 17)
# One bad element (or a whole bad token) in Q, K or V: the non-finite output rows must be exactly
# R.nonfinite_rows (a bad query's row; every row whose mask lets the bad key in), nowhere else, for the kernel and
# for the reference; the finite rows match the reference within TOL (same quantized math: the bad token is coded
# 0 and kept out of every statistic) and exact attention (bad entries zeroed: no finite row sees them).
# (what, b, head, token, value, whole token); each set is one run (its bad tokens in different heads or rows)
POISON_SETS = {
    "q": [("q", 0, 1, 20, float("nan"), False),
          ("q", 1, 3, 5, float("inf"), False)],  # left-padded batch row: a query with no valid key, still NaN
    "k": [("k", 0, 1, 20, float("nan"), False),
          ("k", 1, 0, 33, float("inf"), True),
          ("k", 0, 0, 40, float("-inf"), False)],
    "v": [("v", 0, 1, 20, float("nan"), False),
          ("v", 1, 1, 3, float("inf"), False),  # a padded key where key_valid is on: then no row sees it
          ("v", 1, 0, 44, float("nan"), True)],
}
# b, hq, hk, lq, lk, d, dtype, block_n, options
NONFINITE_CASES = [
    (2, 4, 2, 48, 48, 64, torch.float16, 16, dict(causal=True)),
    (2, 4, 2, 48, 48, 64, torch.bfloat16, 16, dict(causal=False)),
    (2, 4, 2, 40, 48, 64, torch.float16, 32, dict(causal=True, key_valid=True)),
    (2, 4, 1, 48, 48, 80, torch.float16, 16, dict(causal=True, window=13, softmax="sas")),
    (2, 4, 2, 48, 48, 64, torch.bfloat16, 16, dict(causal=True, softcap=20.0, key_valid=True)),
    (2, 4, 2, 48, 48, 64, torch.float16, 16, dict(causal=False, p_scale="static", v_scale="channel")),
]


def _poison(q, k, v, poisons):
    """Copies of q, k, v with bad elements (or whole tokens) set; heads taken modulo the tensor's heads."""
    q, k, v = q.clone(), k.clone(), v.clone()
    for what, b, h, j, val, whole in poisons:
        t = {"q": q, "k": k, "v": v}[what]
        t[b, h % t.shape[1], j, slice(None) if whole else 5] = val
    return q, k, v


def _exact_finite_rows(q, k, v, opts):
    """fp64 attention with the bad entries set to 0 (the finite rows never see them)."""
    z = [torch.nan_to_num(t.float().cpu(), nan=0.0, posinf=0.0, neginf=0.0) for t in (q, k, v)]
    return R.attention_fp64(*z, **{key: (val.cpu() if isinstance(val, torch.Tensor) else val)
                                   for key, val in opts.items() if key in ("causal", "window", "softcap", "key_valid")})


def _check_nonfinite(name, q, k, v, out, opts, device, dtype):
    want = R.nonfinite_rows(q.cpu(), k.cpu(), v.cpu(), causal=opts.get("causal", True), window=opts.get("window"),
                            key_valid=None if opts.get("key_valid") is None else opts["key_valid"].cpu())
    ref = turbo_ref(q, k, v, **opts)
    got = ~torch.isfinite(out.float().cpu()).all(-1)
    got_ref = ~torch.isfinite(ref).all(-1)
    assert torch.equal(got_ref, want), f"{name}: reference non-finite rows {got_ref.nonzero().tolist()} != " \
                                       f"{want.nonzero().tolist()}"
    assert torch.equal(got, want), f"{name}: kernel non-finite rows differ at {(got != want).nonzero().tolist()[:8]}"
    assert torch.isnan(out.float().cpu()[want]).all(), f"{name}: a poisoned row is only partly NaN"
    fin = ~want
    assert_close(name, ref[fin], out[fin.to(out.device)], *tol(device, dtype))
    exact = _exact_finite_rows(q, k, v, opts)[fin]
    err = ((out.float().cpu()[fin].double() - exact).norm() / exact.norm()).item()
    assert err <= 3e-2, f"{name}: finite rows vs exact attention rel-L2 {err:.2e}"  # test_reference's bound


@pytest.mark.parametrize("poison", list(POISON_SETS))
@pytest.mark.parametrize("case", NONFINITE_CASES, ids=[_case_id(c) for c in NONFINITE_CASES])
def test_nonfinite_rows_match_sdpa_semantics(case, poison, device):
    b, hq, hk, lq, lk, d, dtype, block_n, opts = case
    if device.type == "cuda":
        block_n = max(block_n, 32)
    opts = dict(opts)
    if opts.pop("key_valid", False):
        opts["key_valid"] = padding_mask(b, lk, device, hole=None)
    q, k, v = _poison(*make_qkv(b, hq, hk, lq, lk, d, dtype, device), POISON_SETS[poison])
    out = prefill.turbo_attention(q, k, v, block_n=block_n, **opts)
    opts["block_n"] = block_n
    _check_nonfinite(f"{_case_id(case)} {poison}", q, k, v, out, opts, device, dtype)


def test_fp16_overflow_inf_is_not_swallowed(device):
    """An upstream fp16 overflow (a value past 65504 cast to fp16 is Inf) and a bf16 Inf: NaN where sdpa's math
    says, for a query row and for a key seen by later rows only (causal)."""
    b, hq, hk, L, d = 1, 2, 1, 40, 64
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (t.float() for t in make_qkv(b, hq, hk, L, L, d, torch.float32, device))
        big = 1e5 if dtype == torch.float16 else float("inf")
        q[0, 1, 7, 3] = big
        k[0, 0, 25, 9] = -big
        q, k, v = (t.to(dtype) for t in (q, k, v))
        assert torch.isinf(q[0, 1, 7, 3]) and torch.isinf(k[0, 0, 25, 9])
        out = prefill.turbo_attention(q, k, v, block_n=16 if device.type == "cpu" else 32)
        got = ~torch.isfinite(out.float().cpu()).all(-1)
        want = torch.zeros(b, L, hq, dtype=torch.bool)
        want[0, 7, 1] = True
        want[0, 25:, :] = True
        assert torch.equal(got, want), f"{dtype}: non-finite rows {got.nonzero().tolist()}"


def test_int8_flash_attention_nan_scales(device):
    """The kernel alone: a NaN query scale gives a NaN row, a NaN key scale NaN in the rows that do not mask
    that key, a NaN-scaled key that every row masks changes nothing (the scale is the whole flag)."""
    b, hq, hk, lq, lk, d = 1, 2, 1, 40, 56, 64
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, torch.float16, device)
    q8, sq = quant.quantize_per_token(q, scale=d ** -0.5 * R.LOG2E)
    k8, sk = quant.quantize_per_token(k, smooth=quant.k_smooth_mean(k))
    v8t, sv = quant.quantize_v_blocks(v, 16 if device.type == "cpu" else 32)
    kv = torch.ones(b, lk, dtype=torch.bool, device=device)
    kv[0, 2] = False
    clean = prefill.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=True, key_valid=kv, Lk=lk,
                                         out_dtype=torch.float16)
    sq[0, 0, 11] = float("nan")
    sk[0, 0, 30] = float("nan")  # position 30 = query row 30 - (56 - 40) = 14 onwards
    sk[0, 0, 2] = float("nan")  # padded key
    out = prefill.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=True, key_valid=kv, Lk=lk,
                                       out_dtype=torch.float16)
    got = ~torch.isfinite(out.float()).all(-1).cpu()
    want = torch.zeros(b, lq, hq, dtype=torch.bool)
    want[0, 11, 0] = True
    want[0, 14:, :] = True
    assert torch.equal(got, want), f"non-finite rows {got.nonzero().tolist()}"
    assert torch.equal(out[~want.to(device)], clean[~want.to(device)])


# ------------------------------------------------------------------------ sm_90 compile (no GPU needed)
# The interpreter runs tl.maximum's NaN-dropping maxnumf as np.maximum, which keeps NaN: only the compiled
# kernel shows whether the loop's row max keeps a NaN score. (d, causal, block_n, options) as the launcher
# launches them; ~20-40 s per cold compile on 2 CPU cores.
PREFILL_COMPILE_CASES = [(128, True, 128, {}), (64, False, 64, {"key_valid": True, "softcap": 30.0, "softmax": "sas"})]


def test_prefill_kernel_compiles_for_sm90_keeping_nan():
    """The prefill kernel goes through the real pipeline for sm_90, and its row max is NaN-keeping (PTX
    ``max.NaN.f32``): with the default max a poisoned key would come out finite on the GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, json.dumps(PREFILL_COMPILE_CASES)], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"compile subprocess failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    out = json.loads(lines[-1])
    if "unavailable" in out:
        pytest.skip(f"cannot compile Triton kernels for sm_90 on this machine: {out['unavailable']}")
    for case, res in out["results"].items():
        assert isinstance(res, dict), f"{case}: {res}"
        assert res["max_nan"] > 0, f"{case}: no NaN-keeping max in the PTX ({res})"


def _compile_prefill_sm90(d, causal, block_n, opts):
    """PTX of ``_int8_attn_fwd_kernel`` for sm_90 with the arguments ``int8_flash_attention`` launches it with
    (recorded on meta tensors; 16-byte aligned pointers, integers as the JIT specializes them)."""
    from triton.backends.compiler import GPUTarget

    kernel, calls = prefill._int8_attn_fwd_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((args, kw))

    check = prefill._check_device
    prefill._int8_attn_fwd_kernel, prefill._check_device = Recorder(), (lambda *a: None)
    try:
        b, hq, hk, L = 2, 16, 4, 4096
        meta = dict(device="meta")
        q8, k8 = torch.empty(b, hq, L, d, dtype=torch.int8, **meta), torch.empty(b, hk, L, d, dtype=torch.int8, **meta)
        v8t = torch.empty(b, hk, d, L, dtype=torch.int8, **meta)
        sq, sk = torch.empty(b, hq, L, **meta), torch.empty(b, hk, L, **meta)
        sv = torch.empty(b, hk, L // block_n, d, **meta)
        kv = torch.empty(b, L, dtype=torch.bool, **meta) if opts.get("key_valid") else None
        prefill.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=causal, key_valid=kv,
                                     softcap=opts.get("softcap"), softmax=opts.get("softmax", "exact"))
    finally:
        prefill._int8_attn_fwd_kernel, prefill._check_device = kernel, check
    (args, kw), = calls
    names = [p.name for p in kernel.params if not p.is_constexpr]
    dns = {p.name for p in kernel.params if p.do_not_specialize}
    types = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int8: "*i8", torch.uint8: "*u8"}
    sig, attrs = {}, {}
    constexprs = {k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")}
    for name, a in zip(names, args):
        i = kernel.arg_names.index(name)
        if isinstance(a, torch.Tensor):
            sig[name], attrs[(i,)] = types[a.dtype], [["tt.divisibility", 16]]
        elif isinstance(a, float):
            sig[name] = "fp32"
        elif name not in dns and a == 1:
            sig[name], constexprs[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if name not in dns and a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({k: "constexpr" for k in constexprs})
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    opts_c = dict(num_warps=kw["num_warps"], num_stages=kw["num_stages"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts_c).asm["ptx"]


def _compile_main(cases):
    try:  # a trivial kernel first: a failure here is the machine (no ptxas ...), not the kernel
        from triton.backends.compiler import GPUTarget

        @triton.jit
        def _copy(x, y):
            tl.store(y + tl.arange(0, 16), tl.load(x + tl.arange(0, 16)))

        triton.compile(triton.compiler.ASTSource(fn=_copy, signature=dict(x="*fp32", y="*fp32")),
                       target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # noqa: BLE001 - any failure means "cannot compile for sm_90 on this machine"
        print(json.dumps({"unavailable": f"{type(e).__name__}: {str(e)[-300:]}"}))
        return
    res = {}
    for c in cases:
        try:
            ptx = _compile_prefill_sm90(*c)
            res[repr(c)] = {"max_nan": ptx.count("max.NaN.f32"), "max": ptx.count("max.f32")}
        except Exception as e:  # noqa: BLE001 - report every failing case, not only the first
            res[repr(c)] = f"{type(e).__name__}: {str(e)[-600:]}"
    print(json.dumps({"results": res}))


if __name__ == "__main__":
    _compile_main([tuple(c) for c in json.loads(sys.argv[1])])
