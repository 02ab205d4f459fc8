"""The PyTorch reference (kernels/reference.py) vs exact fp64 attention, and its building blocks.

Bounds are measurements plus margin (CPU, fp32 inputs, shapes below; relative L2 vs fp64):
  every mask variant, exact or sas, static or block P scale: 9.2e-3 .. 1.5e-2   -> bound 3e-2
"""
import math

import pytest
import torch
import torch.nn.functional as F

from turbo_attn_hf.kernels import reference as R

CPU = torch.device("cpu")


def rel_l2(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def make_qkv(b, hq, hk, lq, lk, d, seed=0, k_bias=0.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g)
    k = torch.randn(b, hk, lk, d, generator=g) + k_bias * torch.randn(1, 1, 1, d, generator=g)
    v = torch.randn(b, hk, lk, d, generator=g)
    return q, k, v


def padding_mask(b, lk):
    kv = torch.ones(b, lk, dtype=torch.bool)
    kv[-1, :7] = False  # left padding
    kv[0, 20:23] = False  # a hole
    return kv


VARIANTS = [
    ("B2-Lq63-Lk111-HQ4-H1-D80-causal", (2, 4, 1, 63, 111, 80), dict(causal=True)),
    ("B1-Lq65-Lk65-HQ2-H2-D64-full", (1, 2, 2, 65, 65, 64), dict(causal=False)),
    ("B1-Lq111-Lk111-HQ7-H1-D96-causal", (1, 7, 1, 111, 111, 96), dict(causal=True)),
    ("B1-Lq33-Lk40-HQ2-H1-D256-causal", (1, 2, 1, 33, 40, 256), dict(causal=True)),
    ("B1-Lq65-Lk111-HQ4-H2-D64-window37", (1, 4, 2, 65, 111, 64), dict(causal=True, window=37)),
    ("B1-Lq63-Lk63-HQ2-H1-D64-full-window20", (1, 2, 1, 63, 63, 64), dict(causal=False, window=20)),
    ("B1-Lq63-Lk111-HQ4-H2-D80-softcap5", (1, 4, 2, 63, 111, 80), dict(causal=True, softcap=5.0)),
    ("B2-Lq63-Lk63-HQ4-H2-D64-keyvalid", (2, 4, 2, 63, 63, 64), dict(causal=True, key_valid=True)),
    ("B2-Lq1-Lk111-HQ4-H4-D64-keyvalid", (2, 4, 4, 1, 111, 64), dict(causal=True, key_valid=True)),
    ("B1-Lq63-Lk63-HQ2-H2-D128-full-keyvalid", (2, 2, 2, 63, 63, 128), dict(causal=False, key_valid=True)),
]


@pytest.mark.parametrize("softmax", R.SOFTMAX_MODES)
@pytest.mark.parametrize("p_scale", R.P_SCALE_MODES)
@pytest.mark.parametrize("name,shape,opts", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_reference_vs_fp64(name, shape, opts, p_scale, softmax):
    b, hq, hk, lq, lk, d = shape
    q, k, v = make_qkv(b, hq, hk, lq, lk, d)
    opts = dict(opts)
    if opts.pop("key_valid", False):
        opts["key_valid"] = padding_mask(b, lk)
    exact = R.attention_fp64(q, k, v, **opts)
    out = R.turbo_attention(q, k, v, p_scale=p_scale, softmax=softmax, block_n=16, **opts)
    assert out.shape == (b, lq, hq, d) and out.dtype == torch.float32
    err = rel_l2(out, exact)
    print(f"{name} {p_scale}/{softmax}: rel-L2 {err:.2e}")
    assert err <= 3e-2


def _sdpa_fp64(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(g, 1),
                                       v.double().repeat_interleave(g, 1), attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def test_fp64_mask_semantics_match_sdpa():
    """Bottom-right causal, HF sliding window (pos - j < W) and padding, against SDPA with an explicit mask."""
    b, hq, hk, lq, lk, d = 2, 4, 2, 9, 20, 64
    q, k, v = make_qkv(b, hq, hk, lq, lk, d)
    kv = padding_mask(b, lk)
    pos = torch.arange(lq) + lk - lq
    j = torch.arange(lk)
    allowed = (j[None] <= pos[:, None]) & (pos[:, None] - j[None] < 5)
    mask = allowed[None, None] & kv[:, None, None, :]
    want = _sdpa_fp64(q, k, v, mask, d ** -0.5)
    got = R.attention_fp64(q, k, v, causal=True, window=5, key_valid=kv)
    assert torch.allclose(got, want, atol=1e-12)
    # softcap: tanh on natural-unit scores before masking
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.125
    s = 3.0 * torch.tanh(s / 3.0)
    s = s.masked_fill(~(j[None] <= pos[:, None]), -math.inf)
    want = (torch.softmax(s, -1) @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    got = R.attention_fp64(q, k, v, causal=True, softcap=3.0, scale=0.125)
    assert torch.allclose(got, want, atol=1e-12)


def test_rows_without_keys_are_zero():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64)
    kv = torch.ones(1, 16, dtype=torch.bool)
    kv[0, :5] = False
    for fn in (R.attention_fp64, R.turbo_attention):
        o = fn(q, k, v, causal=True, key_valid=kv)
        assert torch.all(o[0, :5] == 0) and torch.all(torch.isfinite(o))


def test_k_smoothing_removes_channel_bias_error():
    """SageAttention: a large per-channel offset of K wrecks per-token INT8 unless K is centred first;
    smoothing leaves the exact softmax unchanged."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, k_bias=8.0)
    exact = R.attention_fp64(q, k, v, causal=False)
    smooth = rel_l2(R.turbo_attention(q, k, v, causal=False, smooth_k=True), exact)
    raw = rel_l2(R.turbo_attention(q, k, v, causal=False, smooth_k=False), exact)
    print(f"rel-L2 smoothed {smooth:.2e}, raw {raw:.2e}")
    assert smooth < 0.5 * raw and smooth <= 3e-2


@pytest.mark.parametrize("block_n", [64, 128])
def test_p_scale_accuracy_fa3_outliers(block_n):
    """FA3's outlier test (N(0,1) + N(0,100) x Bernoulli(0.001)), small: the block P scale keeps the
    small weights that the static scale rounds to 0. Measured at L 1k-4k, d 128 (prefill.py docstring,
    eval/PERF_NOTES.md): RMSE static 2.3e-2 - 3.7e-2, block 4.4e-3 - 6.2e-3 with block_n 64 and
    5.2e-3 - 7.6e-3 with block_n 128 (FA3-FP8: 9.1e-3). Here L 512, 2 heads."""
    g = torch.Generator().manual_seed(0)

    def mk():
        x = torch.randn(1, 2, 512, 128, generator=g)
        return x + torch.randn(x.shape, generator=g) * 10 * (torch.rand(x.shape, generator=g) < 1e-3)

    q, k, v = (mk().to(torch.bfloat16) for _ in range(3))
    exact = R.attention_fp64(q, k, v, causal=False)
    rmse = {ps: (R.turbo_attention(q, k, v, causal=False, p_scale=ps, block_n=block_n).double() - exact)
            .pow(2).mean().sqrt().item() for ps in R.P_SCALE_MODES}
    print(f"FA3 outlier RMSE at L 512, block_n {block_n}: {rmse}")
    assert rmse["block"] <= 9.1e-3
    assert rmse["block"] < 0.5 * rmse["static"]


def test_quantizers():
    x = torch.randn(2, 3, 37, 80) * 4
    x[0, 0, 5] = 0
    x8, s = R.quantize_per_token(x, scale=2.0)
    assert x8.dtype == torch.int8 and int(x8.abs().max()) == 127 and int(x8.min()) >= -127
    assert torch.all(x8[0, 0, 5] == 0) and s[0, 0, 5] == 0
    assert torch.all((x8.float() * (s / 2.0)[..., None] - x).abs() <= (s / 2.0)[..., None] * 0.50001)
    assert R._round_half_away(torch.tensor([0.5, -0.5, 1.5, -2.5, 0.49])).tolist() == [1.0, -1.0, 2.0, -3.0, 0.0]
    v8t, sv = R.quantize_v_blocks(x, 16)
    assert v8t.shape == (2, 3, 80, 48) and sv.shape == (2, 3, 3, 80)
    assert torch.all(v8t[..., 37:] == 0)
    deq = v8t.float().view(2, 3, 80, 3, 16) * sv.permute(0, 1, 3, 2)[..., None]
    err = (deq.reshape(2, 3, 80, 48)[..., :37].transpose(-1, -2) - x).abs()
    assert torch.all(err <= sv.repeat_interleave(16, 2)[:, :, :37] * 0.50001)


def test_quantize_p_and_magic():
    # one rounding of the exact 127 p (the kernel's FMA): 127 * fl(1.5 / 127) = 1.4999999944 -> 1;
    # 127 * 0.5 = 63.5: ties go to even (63.5 -> 64)
    p = torch.tensor([0.0, 1.0, 0.5 / 127, 1.5 / 127, 0.3, 1e-9, 0.5, 2.5 / 127])
    assert R.quantize_p(p).tolist() == [0.0, 127.0, 0.0, 1.0, 38.0, 0.0, 64.0, 2.0]
    i = torch.tensor([-(1 << 22) + 1, -5, 0, 7, (1 << 22) - 1], dtype=torch.int32)
    f = (i + R.MAGIC_BITS).view(torch.float32) - R.MAGIC
    assert torch.equal(f, i.float())


def test_the_exact_int_to_float_rounds_once_and_keeps_the_loop_within_its_fp64_bound():
    """``int_to_float="exact"`` (the Gluon kernel's I2F + FMUL): ``x s`` rounded once, where the magic-number form's
    ``-(C s)`` is itself rounded (~0.75 |s| off); the loop on it stays within test_reference_vs_fp64's bound."""
    x = torch.tensor([-(1 << 21) + 3, -5, 0, 7, 123457], dtype=torch.float32)
    s = torch.tensor([3.3e-4, 1.7e-3, 0.9, 2.1e-2, 7.7e-5])
    assert torch.equal(R.i32_scaled(x, s, "exact"), (x.double() * s.double()).float())
    magic_err = (R.i32_scaled(x, s).double() - x.double() * s.double()).abs()
    assert torch.all(magic_err <= 0.75 * s.double() + 1e-6 * (x.double() * s.double()).abs())
    b, hq, hk, lq, lk, d = 1, 4, 2, 63, 111, 64
    q, k, v = make_qkv(b, hq, hk, lq, lk, d)
    q8, sq = R.quantize_per_token(q, scale=d ** -0.5 * R.LOG2E)
    k8, sk = R.quantize_per_token(k, smooth=R.k_smooth_mean(k))
    v8t, sv = R.quantize_v_blocks(v, 16)
    exact = R.attention_fp64(q, k, v, causal=True)
    outs = {m: R.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=True, out_dtype=torch.float32, int_to_float=m)
            for m in R.INT_TO_FLOAT_MODES}
    assert rel_l2(outs["exact"], exact) <= 3e-2
    assert not torch.equal(outs["exact"], outs["magic"])  # the switch reaches both conversions
    with pytest.raises(ValueError, match="int_to_float"):
        R.int8_flash_attention(q8, sq, k8, sk, v8t, sv, int_to_float="i2f")


@pytest.mark.parametrize("causal", [True, False])
def test_a_16bit_pv_has_less_error_than_the_int8_pv(causal):
    """The Gluon prefill's P.V on 16-bit V (P rounded to V's type, fp32 sums; ``v8t`` = V itself padded to whole
    blocks): the same Q.K^T and softmax as the INT8 P.V, less error against fp64 (measured here, bf16 inputs, L 111,
    blocks of 16: rel-L2 8.1e-3 against 1.16e-2, 0.70x; on the GPU, FA3 shapes, MRE 0.9 % against 1.8 %: PERF_NOTES
    session 47)."""
    b, hq, hk, lq, lk, d = 1, 4, 2, 63, 111, 64
    q, k, v = make_qkv(b, hq, hk, lq, lk, d)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    q8, sq = R.quantize_per_token(q, scale=d ** -0.5 * R.LOG2E)
    k8, sk = R.quantize_per_token(k, smooth=R.k_smooth_mean(k))
    v8t, sv = R.quantize_v_blocks(v, 16)
    v16 = F.pad(v, (0, 0, 0, -lk % 16))
    exact = R.attention_fp64(q.float(), k.float(), v.float(), causal=causal)
    int8 = R.int8_flash_attention(q8, sq, k8, sk, v8t, sv, causal=causal, out_dtype=torch.float32,
                                  int_to_float="exact")
    half = R.int8_flash_attention(q8, sq, k8, sk, v16, None, causal=causal, out_dtype=torch.float32, block_n=16,
                                  int_to_float="exact")
    e8, e16 = rel_l2(int8, exact), rel_l2(half, exact)
    print(f"causal {causal}: rel-L2 int8 P.V {e8:.2e}, 16-bit P.V {e16:.2e}")
    assert e16 <= 0.8 * e8


def test_sas_reference_vs_exp2():
    x = -torch.linspace(0, 9, 100001)
    thr2 = 6.0 * R.LOG2E
    got = R.sas_exp2(x, thr2).double()
    exact = torch.exp2(x.double())
    kept = -x <= thr2
    assert (got - exact)[kept].abs().max() <= 5e-4  # measured 4.0e-4
    assert torch.all(got[~kept] == 0)


def test_reference_errors():
    q, k, v = make_qkv(1, 2, 1, 8, 8, 64)
    with pytest.raises(ValueError, match="head_dim 72"):
        R.turbo_attention(torch.randn(1, 2, 8, 72), torch.randn(1, 1, 8, 72), torch.randn(1, 1, 8, 72))
    with pytest.raises(ValueError, match="q_len"):
        R.turbo_attention(torch.randn(1, 2, 9, 64), k, v)
    with pytest.raises(ValueError, match="multiple"):
        R.turbo_attention(torch.randn(1, 3, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64))
    with pytest.raises(ValueError, match="softmax"):
        R.turbo_attention(q, k, v, softmax="fast")
    with pytest.raises(ValueError, match="p_scale"):
        R.turbo_attention(q, k, v, p_scale="dynamic")


# --------------------------------------------------------------------------- non-finite inputs (issue 17)
def _bad_rows(o):
    """bool [b, L, H] of rows holding a non-finite value; o [b, L, H, d]."""
    return ~torch.isfinite(o.float()).all(-1)


def _sdpa(q, k, v, causal, mask=None, math_backend=False):
    """torch SDPA (GQA) as [b, L, H, d]; ``math_backend`` forces the math backend (the CPU flash backend returns
    a finite row for a NaN query, unlike math and the GPU backends)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.MATH] if math_backend else [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]
    with sdpa_kernel(backends):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                           enable_gqa=True)
    return o.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_nonfinite_rows_vs_sdpa(dtype, causal):
    """The rule ``R.nonfinite_rows`` against torch SDPA on the CPU (GQA 4/2), and the reference twin on it:
    - a NaN / Inf query element: SDPA (math backend) gives exactly that row NaN; so do we;
    - a NaN key element: SDPA with is_causal gives exactly the rows that attend it (the rule); with a mask
      tensor SDPA also spreads it to masked rows (NaN + -inf = NaN), we do not;
    - a NaN / Inf value element: SDPA gives NaN in every row that attends it, and also in masked rows
      (0 * NaN in P.V); we give the rows that attend it;
    - an Inf key element: SDPA gives NaN where the score is +inf or NaN and drops the key (finite row) where it
      is -inf (in bf16 on the CPU no row came out NaN); the rule (and we) NaN every row that attends it, a
      superset of SDPA's rows.
    Finite rows of the reference stay within test_reference_vs_fp64's bound of exact attention (bad entries
    zeroed: no finite row sees them)."""
    b, hq, hk, L, d = 2, 4, 2, 24, 64
    q0, k0, v0 = (t.to(dtype) for t in make_qkv(b, hq, hk, L, L, d))
    cases = [("q", float("nan"), "equal"), ("q", float("inf"), "equal"), ("k", float("nan"), "equal"),
             ("v", float("nan"), "subset"), ("v", float("inf"), "subset"), ("k", float("inf"), "superset")]
    for what, val, relation in cases:
        q, k, v = q0.clone(), k0.clone(), v0.clone()
        t = {"q": q, "k": k, "v": v}[what]
        t[1, 1, 9, 3] = val
        want = R.nonfinite_rows(q, k, v, causal=causal)
        assert want[1, :, 1 if what == "q" else 2].any() and not want[0].any()
        sdpa = _bad_rows(_sdpa(q, k, v, causal, math_backend=what == "q"))
        if relation == "equal":
            assert torch.equal(sdpa, want), f"{what}={val}: sdpa rows {sdpa.nonzero().tolist()}"
        elif relation == "subset":  # sdpa spreads further (masked rows)
            assert torch.equal(sdpa & want, want) and (causal or torch.equal(sdpa, want))
        else:
            assert torch.equal(sdpa & want, sdpa)
        if what == "k" and val != val:  # a mask tensor: SDPA's NaN key reaches the rows it masks as well
            allowed = torch.ones(L, L, dtype=torch.bool).tril() if causal else torch.ones(L, L, dtype=torch.bool)
            masked = _bad_rows(_sdpa(q, k, v, causal, mask=allowed))
            assert torch.equal(masked & want, want)
        out = R.turbo_attention(q.float(), k.float(), v.float(), causal=causal, block_n=16)
        assert torch.equal(_bad_rows(out), want), f"{what}={val}: reference rows {_bad_rows(out).nonzero().tolist()}"
        assert torch.isnan(out[want]).all()
        z = [torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0) for x in (q, k, v)]
        exact = R.attention_fp64(*z, causal=causal)[~want]
        assert rel_l2(out[~want], exact) <= 3e-2


def test_nonfinite_rows_masks():
    """The rule under key_valid (left padding), a sliding window and GQA: a bad key reaches only the rows whose
    mask includes it; a bad padded key reaches none; a bad query row is NaN even when it has no valid key."""
    b, hq, hk, L, d = 2, 4, 2, 30, 64
    q, k, v = make_qkv(b, hq, hk, L, L, d)
    kv = torch.ones(b, L, dtype=torch.bool)
    kv[1, :6] = False
    k[1, 0, 12, 0] = float("nan")  # window 5: rows 12..16 of heads 0, 1 see it
    v[1, 1, 3, 0] = float("inf")  # padded: nobody
    q[1, 3, 2, 0] = float("nan")  # a padded query row (no valid key): NaN
    want = torch.zeros(b, L, hq, dtype=torch.bool)
    want[1, 12:17, 0:2] = True
    want[1, 2, 3] = True
    got = R.nonfinite_rows(q, k, v, causal=True, window=5, key_valid=kv)
    assert torch.equal(got, want), got.nonzero().tolist()
    out = R.turbo_attention(q, k, v, causal=True, window=5, key_valid=kv, block_n=16)
    assert torch.equal(_bad_rows(out), want)
    assert torch.all(out[0] == R.turbo_attention(q[:1], k[:1], v[:1], causal=True, window=5, key_valid=kv[:1],
                                                 block_n=16)[0])


def test_quantizers_nonfinite_tokens():
    """A token holding a NaN/Inf: codes 0 and a NaN scale (Q/K), or codes 0 and the key scale marked (V); it is
    out of every statistic: every other token's codes and scales equal those with the bad token zeroed. A
    non-finite channel of K's mean is not subtracted."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 37, 64, generator=g) * 3
    bad = x.clone()
    bad[0, 1, 5, 7] = float("nan")
    bad[1, 2, 30] = float("-inf")
    bad[1, 0, 0, 63] = float("inf")
    rows = ~torch.isfinite(bad).all(-1)
    clean = bad.masked_fill(rows[..., None], 0.0)
    mean = R.k_smooth_mean(bad)
    assert not torch.isfinite(mean).all()
    x8, s = R.quantize_per_token(bad, scale=0.5, smooth=mean)
    c8, cs = R.quantize_per_token(clean, scale=0.5, smooth=torch.nan_to_num(mean, nan=0.0, posinf=0.0, neginf=0.0))
    assert torch.equal(torch.isnan(s), rows) and torch.all(x8[rows] == 0)
    assert torch.equal(x8[~rows], c8[~rows]) and torch.equal(s[~rows], cs[~rows])
    for fn in (R.quantize_v_blocks, R.quantize_v_channels):
        sk = torch.ones(2, 3, 40)
        v8t, sv = fn(bad, 16, poison=sk)
        c8t, csv = fn(clean, 16)
        assert torch.equal(v8t, c8t) and torch.equal(sv, csv) and torch.isfinite(sv).all()
        assert torch.equal(torch.isnan(sk[..., :37]), rows) and torch.all(sk[..., 37:] == 1)
        assert torch.equal(fn(bad, 16)[1], csv)  # no poison target: the same codes, the flag is dropped
