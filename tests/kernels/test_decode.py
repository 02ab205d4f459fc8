"""Decode kernel over packed blocks + INT8 tail: kernel == reference (tight), reference ~ fp64 (loose).

CPU: Triton interpreter, small shapes (d 32 / 64 / 80, block 16 or 64). GPU sizes: test_decode_gpu.py.
"""
import math

import pytest
import torch

from turbo_attn_hf.kernels import reference as R
from turbo_attn_hf.kernels.decode import RESIDENT_PER_SM, first_visible_tile, plan_splits, turbo_decode_attention
from turbo_attn_hf.kernels.pack import PackedKV

# kernel vs reference, CPU interpreter: measured max |diff| 1.2e-7 over the cases below (the same fp32 ops in
# the same order; integer dots exact) -> 1e-5.
ATOL_KERNEL = 1e-5


def assert_close(out, ref, atol, rtol_rms=None, name="out"):
    out, ref = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    diff = (out - ref).abs()
    worst = diff.argmax()
    idx = tuple(int(i) for i in torch.unravel_index(worst, diff.shape))
    assert diff.max() <= atol, f"{name}: max |diff| {diff.max():.3g} at {idx}: {out[idx]:.6g} vs {ref[idx]:.6g}"
    if rtol_rms is not None:
        rel = (out - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel <= rtol_rms, f"{name}: rms-relative error {rel:.3g} > {rtol_rms}"


def to_packed(groups, device):
    """Reference groups -> PackedKV on ``device`` (contiguous buffers as the cache holds them)."""
    out = []
    for g in groups:
        kw = {n: (None if getattr(g, n) is None else getattr(g, n).contiguous().to(device))
              for n in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")}
        out.append(PackedKV(bits=g.bits, heads=g.heads.to(device), n_blocks=g.n_blocks, k_bits=g.k_bits, **kw))
    return out


def make_case(b, hk, G, L, lq, d, head_bits, bs, n_prefill=None, seed=0, qscale=2.0, int8_k=False):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hk, L, d, generator=g) + 0.5 * torch.randn(1, hk, 1, d, generator=g)
    v = torch.randn(b, hk, L, d, generator=g)
    q = torch.randn(b, hk * G, lq, d, generator=g) * qscale
    state = R.build_packed_cache_ref(k, v, n_prefill or min(L, 70), head_bits, bs, int8_k=int8_k)
    return q, k, v, state


CASES = [
    # b, hk, G, L, lq, d, head_bits, block, softmax, n_splits
    (1, 1, 1, 64, 1, 32, [8], 16, "exact", 1),
    (3, 2, 4, 100, 1, 32, [4, 2], 16, "exact", 3),
    (1, 2, 7, 70, 5, 32, [2, 8], 16, "sas", 2),
    (3, 2, 4, 128, 1, 32, [8, 4], 64, "sas", 1),
    (1, 2, 4, 131, 6, 32, [4, 4], 64, "exact", 2),
    (2, 1, 4, 65, 1, 80, [2], 16, "exact", 4),
    (1, 3, 1, 47, 3, 32, [4, 8, 2], 16, "sas", 2),
    (1, 2, 4, 100, 40, 32, [4, 8], 16, "exact", 2),  # a second prefill: G*Lq = 160 rows -> 3 M tiles
    (1, 3, 3, 130, 1, 64, [4, 2, 2], 64, "exact", 2),  # SmolLM2-135M shape: d 64, GQA 3, mixed
    # folded packed blocks: 5 in one share, shares of 2 + 2 / 2 + tail
    (2, 2, 4, 330, 1, 64, [4, 4], 64, "exact", 1),
    (1, 2, 4, 400, 3, 128, [4, 2], 64, "sas", 2),
]


@pytest.mark.parametrize(
    "b,hk,G,L,lq,d,head_bits,bs,softmax,n_splits", CASES,
    ids=[f"B{c[0]}-L{c[3]}-G{c[2]}-Lq{c[4]}-D{c[5]}-bits{''.join(map(str, c[6]))}-BS{c[7]}-{c[8]}-S{c[9]}"
         for c in CASES],
)
def test_decode_kernel_matches_reference(b, hk, G, L, lq, d, head_bits, bs, softmax, n_splits, device):
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, head_bits, bs)
    out = turbo_decode_attention(q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt,
                                 ks.to(device), vs.to(device), mu.to(device), softmax=softmax, n_splits=n_splits)
    assert out.shape == (b, lq, hk * G, d) and out.dtype == q.dtype
    ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, softmax=softmax, n_splits=n_splits)
    assert_close(out, ref, ATOL_KERNEL)
    if n_splits > 1:  # the split + merge changes only rounding of P relative to the share's running max
        one = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, softmax=softmax, n_splits=1)
        assert_close(ref, one, 0.05)


K8_CASES = [
    # b, hk, G, L, lq, d, head_bits, block, kw: packed blocks with INT8 K and 4/2-bit V (PackedKV.k_bits 8)
    (2, 2, 4, 330, 1, 64, [4, 4], 64, {}),  # folded: 5 blocks
    (1, 2, 3, 400, 3, 128, [4, 2], 64, dict(softcap=6.0, window=190)),  # folded, masked blocks, softcap
    (1, 3, 2, 100, 2, 32, [4, 8, 2], 16, {}),  # restoring loop (block 16), an INT8 head beside
]


@pytest.mark.parametrize("b,hk,G,L,lq,d,head_bits,bs,kw", K8_CASES,
                         ids=[f"L{c[3]}-D{c[5]}-bits{''.join(map(str, c[6]))}-BS{c[7]}-{len(c[8])}opts"
                              for c in K8_CASES])
def test_decode_int8_k_blocks_match_reference(b, hk, G, L, lq, d, head_bits, bs, kw, device):
    """Packed blocks that keep K's INT8 codes (issue 23: q/k-norm families): kernel == reference, and the reference
    reads K exactly (closer to fp64 attention than the same cache with K packed)."""
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, head_bits, bs, seed=4, int8_k=True)
    assert all(g.k_bits == 8 and g.k.dtype == torch.int8 and g.k_scale is None for g in groups)
    for S in (1, 2):
        out = turbo_decode_attention(q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt,
                                     ks.to(device), vs.to(device), mu.to(device), n_splits=S, **kw)
        ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, n_splits=S, **kw)
        assert_close(out, ref, ATOL_KERNEL)
    packed = make_case(b, hk, G, L, lq, d, head_bits, bs, seed=4)[3]
    f = R.attention_fp64(q, k, v, **kw).float()
    err = [(R.turbo_decode_ref(q, *st[:3], st[3], *st[4:], **kw).float() - f).norm() / f.norm()
           for st in ((groups, kt, vt, nt, ks, vs, mu), packed)]
    assert err[0] < err[1], err


@pytest.mark.parametrize("head_bits,bs", [([4], 64), ([8], 16)])
def test_decode_tiles_far_below_the_running_max_add_nothing(head_bits, bs, device):
    """Tiles whose every logit lies 126-149 base-2 units under the running max (p subnormal, as Q/K outlier channels
    make them) add nothing to P·V instead of NaN (127 / max w overflowed; ``reference.W_MIN``), kernel and
    reference alike, and the output is token 0's value, as in exact attention."""
    b, hk, G, L, d = 1, 1, 2, 200, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hk * G, 1, d, generator=g)
    k = 0.01 * torch.randn(b, hk, L, d, generator=g)
    v = torch.randn(b, hk, L, d, generator=g)
    q0 = q[0, 0, 0]
    k[0, 0, 0] = q0 / q0.norm() ** 2 * 135 / (d ** -0.5 * R.LOG2E)  # row 0's logit of token 0: 135 base-2 units
    groups, kt, vt, nt, ks, vs, mu = R.build_packed_cache_ref(k, v, 150, head_bits, bs, sink_blocks=1)
    assert groups[0].n_blocks >= 2
    ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, n_sink=bs, n_splits=2)
    out = turbo_decode_attention(q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt,
                                 ks.to(device), vs.to(device), mu.to(device), n_sink=bs, n_splits=2)
    assert torch.isfinite(ref).all() and torch.isfinite(out.cpu()).all()
    assert_close(out, ref, ATOL_KERNEL)
    f = R.attention_fp64(q, k, v).float()
    assert (ref[0, 0, 0] - f[0, 0, 0]).abs().max() < 0.05  # token 0's value (its INT8 code error)


@pytest.mark.parametrize("variant", ["window", "softcap", "key_valid", "noncausal"])
def test_decode_masks_and_softcap(variant, device):
    b, hk, G, L, lq, d, bs = 2, 2, 2, 90, 4, 32, 16
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, [4, 8], bs, seed=7)
    kw = dict(scale=0.3)
    if variant == "window":
        kw["window"] = 21
        assert first_visible_tile(L, lq, 21, bs) == 4  # the kernel skips 4 of the 6 tiles
    elif variant == "softcap":
        kw["softcap"] = 5.0
    elif variant == "key_valid":
        kv = torch.ones(b, L, dtype=torch.bool)
        kv[0, :13] = False  # left padding
        kv[1, 40:47] = False
        kw["key_valid"] = kv
    else:
        kw["causal"] = False
    dkw = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in kw.items()}
    out = turbo_decode_attention(q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt,
                                 ks.to(device), vs.to(device), mu.to(device), n_splits=2, **dkw)
    ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, n_splits=2, **kw)
    assert_close(out, ref, ATOL_KERNEL)
    # the reference honours the same mask/softcap as exact attention (int8 heads bound the error)
    f = R.attention_fp64(q, k, v, **kw).float()
    assert ((ref.float() - f).norm() / f.norm()) < 0.2  # measured 0.093-0.135 (4-bit head, clamped outliers)


def test_decode_folded_steps_with_masks(device):
    """The folded loop honours key_valid, a window and softcap (5 packed blocks, window over the last 3)."""
    b, hk, G, L, lq, d, bs = 2, 2, 2, 330, 2, 64, 64
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, [4, 2], bs, seed=5)
    kv = torch.ones(b, L, dtype=torch.bool)
    kv[0, :75] = False  # left padding across the first packed block and into the second
    kv[1, 200:203] = False
    kw = dict(window=190, softcap=6.0, key_valid=kv)
    dkw = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in kw.items()}
    for S in (1, 2):
        out = turbo_decode_attention(q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt,
                                     ks.to(device), vs.to(device), mu.to(device), n_splits=S, **dkw)
        assert_close(out, R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, n_splits=S, **kw), ATOL_KERNEL)


@pytest.mark.parametrize("head_bits,softmax", [([4, 4], "exact"), ([2, 4], "sas")])
def test_decode_folded_chunk_over_packed_blocks(head_bits, softmax, device):
    """A query chunk whose causal edge crosses packed blocks: the folded loop runs the blocks every row sees
    without masks and the rest masked (reference.fold_unmasked_blocks); an all-zero query row (sq = 0 -> SQ_MIN)
    keeps -inf masked logits, not NaN."""
    b, hk, G, L, lq, d, bs = 1, 2, 2, 330, 90, 64 if head_bits[0] == 4 else 128, 64
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, head_bits, bs, n_prefill=300, seed=11)
    q[0, 1, 5] = 0.0
    n_blocks = groups[0].n_blocks
    assert 0 < R.fold_unmasked_blocks(L, lq, 0, bs, causal=True, window=None, key_valid=False, softcap=None) < n_blocks
    for S in (1, 3):
        out = turbo_decode_attention(q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt,
                                     ks.to(device), vs.to(device), mu.to(device), softmax=softmax, n_splits=S)
        assert_close(out, R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, softmax=softmax, n_splits=S),
                     ATOL_KERNEL)


def test_decode_fully_masked_rows_are_zero(device):
    b, hk, G, L, lq, d, bs = 2, 1, 4, 40, 1, 32, 16
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, [4], bs, seed=3)
    kv = torch.ones(b, L, dtype=torch.bool)
    kv[1] = False
    out = turbo_decode_attention(q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt,
                                 ks.to(device), vs.to(device), mu.to(device), key_valid=kv.to(device), n_splits=3)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0 and out[0].abs().max() > 0


def test_plan_splits_shares():
    dev = torch.device("cpu")
    for n_tiles in (1, 5, 64, 513):
        for units in (1, 8, 100):
            S, tps = plan_splits(n_tiles, units, dev)
            assert 1 <= S <= n_tiles and (S - 1) * tps < n_tiles <= S * tps  # no empty share
    assert plan_splits(10, 1, dev, n_splits=3) == (3, 4)
    # the default plan stays within one resident wave (RESIDENT_PER_SM programs per SM; 4 "SMs" on CPU)
    for units in (1, 3, 7, 20, 40):
        S, _ = plan_splits(4096, units, dev)
        assert S * units <= max(RESIDENT_PER_SM * 4, units)


# reference decode vs fp64 attention over the unquantized K/V, N(0,1) keys (+ channel offsets) and values,
# L 130, scales from the whole sequence (no clamped outliers), worst rms-relative error over 3 seeds,
# measured: 8-bit 0.031, 4-bit 0.181, 2-bit 0.953 (exact and sas alike) -> bounds 0.045 / 0.25 / 1.1.
# Gaussian data leaves a 2-bit block 4 levels per channel (noise ~ half the spread): useless on such data,
# the format is meant for the low-priority heads of real models (TurboAttention §3.2); the bound only
# catches a broken path (an unrelated output of the same norm gives ~sqrt(2) = 1.41).
BOUNDS = {8: 0.045, 4: 0.25, 2: 1.1}


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("softmax", ["exact", "sas"])
def test_reference_vs_fp64(bits, softmax):
    worst = 0.0
    for seed in range(3):
        q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(2, 2, 4, 130, 1, 64, [bits] * 2, 64,
                                                               n_prefill=130, seed=seed)
        ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, softmax=softmax)
        f = R.attention_fp64(q, k, v).float()
        worst = max(worst, float((ref.float() - f).norm() / f.norm()))
    assert worst < BOUNDS[bits], f"{bits}-bit {softmax}: {worst:.3f}"


def test_decode_rejects_bad_inputs(device):
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(1, 2, 2, 40, 1, 32, [4, 4], 16)
    pk = to_packed(groups, device)
    args = (kt.to(device), vt.to(device), nt, ks.to(device), vs.to(device), mu.to(device))
    with pytest.raises(ValueError, match="multiple"):
        turbo_decode_attention(torch.randn(1, 3, 1, 32, device=device), pk, *args)
    with pytest.raises(ValueError, match="key_valid"):
        turbo_decode_attention(q.to(device), pk, *args, key_valid=torch.ones(1, 39, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="exceeds"):
        turbo_decode_attention(torch.randn(1, 4, 41, 32, device=device), pk, *args)
    with pytest.raises(ValueError, match="softmax"):
        turbo_decode_attention(q.to(device), pk, *args, softmax="fast")
    pk[0].v_sz = pk[0].v_sz.transpose(-1, -2).contiguous().transpose(-1, -2)  # right shape, scales not one row
    with pytest.raises(ValueError, match="v_sz"):
        turbo_decode_attention(q.to(device), pk, *args)


@pytest.mark.parametrize("merge,fold,block_m", [("kernel", True, None), ("fused", False, None), ("fused", True, 16)],
                         ids=["merge-kernel", "restore-int8-tiles", "BM16"])
def test_decode_launch_variants_match_reference(merge, fold, block_m, device):
    """The launch variants the benchmarks compare (merge kernel vs fused last-share merge, INT8-restoring
    loop vs folded scale/zero, padded query rows) compute the same numbers; the arrival counters are back
    at zero after a fused call (the next call reuses them)."""
    from turbo_attn_hf.kernels import decode as DK

    b, hk, G, L, lq, d, bs = 2, 2, 4, 150, 2, 32, 16
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, [4, 2], bs, seed=11)
    args = (q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt, ks.to(device),
            vs.to(device), mu.to(device))
    out = turbo_decode_attention(*args, n_splits=3, merge=merge, fold=fold, block_m=block_m, softmax="sas")
    ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, n_splits=3, softmax="sas", fold=fold)
    assert_close(out, ref, ATOL_KERNEL)
    if merge == "fused":
        assert int(DK._WORKSPACE[(args[0].device.type, args[0].device.index)][2].abs().sum()) == 0


def test_spare_slot_shares_rule():
    """The default per-group plan: the resident slots a filled plan leaves over go to the wider group as one more
    share per item (H100: 132 SMs x 8 slots), only when they cover all its items."""
    from turbo_attn_hf.kernels.decode import spare_slot_shares

    assert spare_slot_shares(16, 32, 32, 4, 2, 132) == (17, 16)  # mixed, batch 8: 1056 programs
    assert spare_slot_shares(16, 32, 32, 2, 4, 132) == (16, 17)  # the wider group second
    assert spare_slot_shares(4, 128, 128, 4, 2, 132) is None  # batch 32: 32 spare slots < 128 items
    assert spare_slot_shares(13, 32, 32, 4, 2, 132) is None  # not the filled plan (short context)
    assert spare_slot_shares(16, 32, 32, 4, 4, 132) is None  # one bit width


def test_group_splits_reports_the_launchers_per_group_plan(device):
    """``group_splits`` (what the reference needs to reproduce a launch) follows the launcher's plan, the spare-slot
    rule included: on the interpreter's 4 "SMs" (32 slots) one INT4 + two INT2 work items fill 10 shares each,
    and the 2 slots left over give the INT4 item an 11th."""
    from turbo_attn_hf.kernels import decode as DK

    heads = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731 - only their number matters here
    g4, g2 = (DK.PackedKV.empty(bits, heads(n), 1, 32, 16, "cpu") for bits, n in ((4, 1), (2, 2)))
    assert DK.group_splits(1024, [g4, g2], 1, 1, torch.device("cpu")) == {4: 11, 2: 10}
    assert DK.spare_slot_shares(10, 1, 2, 4, 2, 4) == (11, 10)


@pytest.mark.parametrize("per_group,lq", [((3, 2), 1), ((2, 5), 1), ((13, 7), 1), ((4, 3), 40)],
                         ids=["3-2", "2-5", "13-7-two-level", "4-3-two-M-tiles"])
def test_decode_per_group_shares_match_reference(per_group, lq, device):
    """``n_splits={bits: n}`` with a share count per bit group of one launch (the flat grid holds exactly both
    groups' programs): the reference's output with the same counts, to fp32 rounding of the merge order; every
    arrival counter back at zero; merge='kernel' (one count for all) refuses different counts."""
    from turbo_attn_hf.kernels import decode as DK

    b, hk, G, L, d, bs = 2, 2, 4, 640, 32, 16
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, [4, 2], bs, seed=7)
    args = (q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt, ks.to(device),
            vs.to(device), mu.to(device))
    splits = dict(zip((4, 2), per_group))
    out = turbo_decode_attention(*args, n_splits=splits)
    ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, n_splits=splits)
    assert_close(out, ref, ATOL_KERNEL)
    assert int(DK._WORKSPACE[(args[0].device.type, args[0].device.index)][2].abs().sum()) == 0
    with pytest.raises(ValueError, match="merge='fused'"):
        turbo_decode_attention(*args, n_splits=splits, merge="kernel")


@pytest.mark.parametrize("block_m,n_splits", [(64, 13), (32, 13), (64, 40), (None, 40)],
                         ids=["SC2-5groups", "SC4-3groups", "SC2-20groups", "SC8-5groups"])
def test_decode_two_level_merge_matches_reference(block_m, n_splits, device):
    """More shares than one merge chunk (SC): the last share of each group of SC merges its group, the last
    group merger merges the groups (kernels/decode.py). Same numbers as the reference's flat merge to fp32
    rounding, uneven last groups included; every arrival counter (groups and top) back at zero."""
    from turbo_attn_hf.kernels import decode as DK

    b, hk, G, L, lq, d, bs = 2, 2, 4, 640, 1, 32, 16
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, [4, 2], bs, seed=5)
    args = (q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt, ks.to(device),
            vs.to(device), mu.to(device))
    S = DK.plan_splits(L // bs, 1, torch.device(device), n_splits=n_splits)[0]
    BM = block_m or 4
    assert S > DK._merge_chunk(S, BM, 32, 1)  # two levels
    out = turbo_decode_attention(*args, n_splits=n_splits, block_m=block_m)
    ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, n_splits=n_splits)
    assert_close(out, ref, ATOL_KERNEL)
    assert int(DK._WORKSPACE[(args[0].device.type, args[0].device.index)][2].abs().sum()) == 0


def test_static_part_reused_across_steps_and_rebuilt_for_new_storage(device):
    """The call's static part (kernels/decode.py ``_DecodeStatic``) is reused while the same storage tensors
    come back with a new query / ``n_tail`` (decode steps), rebuilt when a buffer is a new object (capacity
    growth, beam reorder), and never keeps the storage alive."""
    import gc
    import weakref

    from turbo_attn_hf.kernels import decode as DK

    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(1, 2, 4, 150, 1, 32, [4, 2], 16, n_prefill=150)
    packed = to_packed(groups, device)
    kt, vt, ks, vs, mu = (t.to(device) for t in (kt, vt, ks, vs, mu))
    DK._STATIC.clear()
    for step, n_tail in enumerate((nt - 2, nt - 1, nt)):  # the tail grows by one token per step
        q_s = q * (1 + step)
        out = turbo_decode_attention(q_s.to(device), packed, kt, vt, n_tail, ks, vs, mu, n_splits=2)
        ref = R.turbo_decode_ref(q_s, groups, kt.cpu(), vt.cpu(), n_tail, ks.cpu(), vs.cpu(), mu.cpu(), n_splits=2)
        assert_close(out, ref, ATOL_KERNEL, name=f"step {step}")
    assert len(DK._STATIC) == 1
    # a buffer replaced by a new object (other values): a new entry, the new values read
    groups[0].k = torch.flip(groups[0].k, dims=[-2]).contiguous()
    packed[0].k = groups[0].k.to(device)
    out = turbo_decode_attention(q.to(device), packed, kt, vt, nt, ks, vs, mu, n_splits=2)
    assert_close(out, R.turbo_decode_ref(q, groups, kt.cpu(), vt.cpu(), nt, ks.cpu(), vs.cpu(), mu.cpu(), n_splits=2),
                 ATOL_KERNEL, name="replaced buffer")
    assert len(DK._STATIC) == 2
    # the entries hold weak references only: dropping the storage frees it
    ref_k = weakref.ref(packed[0].k)
    del packed, groups, out
    gc.collect()
    assert ref_k() is None


def test_second_storage_of_one_layout_reads_its_own_values(device):
    """Two caches of one layout (two generate() calls): the second's first call rebinds the first's entry
    (``_DecodeStatic.rebound``) and reads its own values, and the first cache's entry still reads its own (on a GPU:
    the rebound launches' addresses)."""
    from turbo_attn_hf.kernels import decode as DK

    DK._STATIC.clear()
    DK._LAYOUTS.clear()
    cases = []
    for seed in (0, 1):
        q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(1, 2, 4, 150, 1, 32, [4, 2], 16, n_prefill=150,
                                                               seed=seed)
        cases.append((q, groups, to_packed(groups, device), *(t.to(device) for t in (kt, vt, ks, vs, mu)), nt))
    for q, groups, packed, kt, vt, ks, vs, mu, nt in cases + cases[:1]:
        out = turbo_decode_attention(q.to(device), packed, kt, vt, nt, ks, vs, mu, n_splits=2)
        ref = R.turbo_decode_ref(q, groups, kt.cpu(), vt.cpu(), nt, ks.cpu(), vs.cpu(), mu.cpu(), n_splits=2)
        assert_close(out, ref, ATOL_KERNEL)
    assert len(DK._STATIC) == 2 and len(DK._LAYOUTS) == 1


def test_static_part_not_cached_for_converted_inputs(device):
    """Scales that need a converted copy (here fp64) are converted per call, never cached: a cached copy would
    not follow in-place updates of the caller's tensor."""
    from turbo_attn_hf.kernels import decode as DK

    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(1, 1, 4, 80, 1, 32, [4], 16)
    packed = to_packed(groups, device)
    ks64 = ks.double().to(device)
    DK._STATIC.clear()
    a = turbo_decode_attention(q.to(device), packed, kt.to(device), vt.to(device), nt, ks64, vs.to(device),
                               mu.to(device), n_splits=1)
    ks64.mul_(2.0)  # in place: the next call must see it
    b_ = turbo_decode_attention(q.to(device), packed, kt.to(device), vt.to(device), nt, ks64, vs.to(device),
                                mu.to(device), n_splits=1)
    assert len(DK._STATIC) == 0
    ref = R.turbo_decode_ref(q, groups, kt, vt, nt, (ks64 / 1).cpu().float(), vs, mu, n_splits=1)
    assert_close(b_, ref, ATOL_KERNEL)
    assert not torch.equal(a, b_)


def test_key_valid_converted_once_per_mask_object_and_version():
    """The launcher converts ``key_valid`` to int8 once per mask tensor (every layer of a forward passes the same
    one) and again after an in-place change (version) or for a new mask object."""
    from turbo_attn_hf.kernels.decode import _kvalid_int8

    kv = torch.tensor([[True, False, True, True]])
    a = _kvalid_int8(kv)
    assert a.dtype == torch.int8 and a.tolist() == [[1, 0, 1, 1]]
    assert _kvalid_int8(kv) is a  # same object, same version: reused
    kv[0, 0] = False  # in place: the version changes
    b = _kvalid_int8(kv)
    assert b is not a and b.tolist() == [[0, 0, 1, 1]]
    other = kv.clone()
    assert _kvalid_int8(other) is not b and _kvalid_int8(other).tolist() == [[0, 0, 1, 1]]
    with torch.inference_mode():  # inference tensors have no version counter: converted every call
        inf = torch.tensor([[True, True]])
        assert _kvalid_int8(inf).tolist() == [[1, 1]]


@pytest.mark.parametrize("variant", ["plain", "window", "key_valid", "softcap"])
def test_decode_lengths_on_device(variant, device):
    """LENS (a static cache in a CUDA graph): the kernel reads (n_blocks, n_tail) from a device tensor and cuts the
    visible tiles into the launch's fixed shares itself (planned for the groups' capacity: most shares empty at
    this length); the host lengths passed are ignored. Equals the reference with the same shares, and the host-
    length launch up to the shares' rounding."""
    from turbo_attn_hf.kernels.decode import group_splits

    b, hk, G, L, lq, d, bs = 2, 2, 2, 150, 1, 64, 64  # 2 packed blocks + a tail tile
    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(b, hk, G, L, lq, d, [4, 2], bs, seed=9)
    kw = dict(scale=0.2)
    if variant == "window":
        kw["window"] = 40  # the first block is skipped
    elif variant == "softcap":
        kw["softcap"] = 6.0
    kvw = None
    if variant == "key_valid":
        kvw = torch.ones(b, L + 40, dtype=torch.bool)  # a static cache's mask spans its capacity
        kvw[0, :75] = False
        kvw[1, 100:103] = False
        kvw[:, L:] = False
    packed = to_packed(groups, device)
    n_blocks = packed[0].n_blocks
    for g_ in packed:
        g_.reserve(n_blocks + 60)  # capacity past the stored blocks, as a static cache holds it
        g_.n_blocks = 0  # host lengths must not be read
    lens = torch.tensor([n_blocks, nt], dtype=torch.int32, device=device)
    dkw = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in kw.items()}
    out = turbo_decode_attention(q.to(device), packed, kt.to(device), vt.to(device), 0, ks.to(device),
                                 vs.to(device), mu.to(device), lens=lens,
                                 key_valid=None if kvw is None else kvw.to(device), **dkw)
    cap_tiles = packed[0].capacity + kt.shape[2] // bs
    S = group_splits(cap_tiles, packed, b, 1, torch.device(device))
    assert min(S.values()) > n_blocks + 1  # empty shares exist
    rkw = dict(kw, key_valid=None if kvw is None else kvw[:, :L])
    ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, n_splits=S, **rkw)
    assert_close(out, ref, ATOL_KERNEL)
    assert_close(ref, R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, n_splits=1, **rkw), 0.05)


ROTATE_CASES = [
    # b, hk, G, L, lq, d, head_bits, block, smooth (factors), softcap, n_splits
    (1, 2, 4, 200, 1, 64, [4, 8], 64, False, None, 2),  # "hadamard": one block of 64, folded int4 + INT8 heads
    (1, 2, 3, 200, 3, 128, [2, 4], 64, True, None, 2),  # "smooth_hadamard", a chunk, int2 + int4
    (2, 1, 2, 70, 2, 96, [4], 16, True, 5.0, 1),  # block-diagonal (n 32 of d 96), softcap: q·mean in the rotated basis
]


@pytest.mark.parametrize(
    "b,hk,G,L,lq,d,head_bits,bs,smooth,softcap,n_splits", ROTATE_CASES,
    ids=[f"D{c[5]}-G{c[2]}-Lq{c[4]}-bits{''.join(map(str, c[6]))}-{'smooth' if c[8] else 'plain'}"
         f"{'-softcap' if c[9] else ''}" for c in ROTATE_CASES],
)
def test_decode_rotated_query_matches_reference(b, hk, G, L, lq, d, head_bits, bs, smooth, softcap, n_splits,
                                                device):
    """rotate_qk: K stored as ``rotation.rotate(k, s, "k")``, the query passed unrotated and rotated in the kernel's
    prologue (factor, butterfly, 1/sqrt(n) in the row scale) == the reference twin; and the twin equals the
    unrotated-query path fed ``rotation.rotate(q, s, "q")`` (fp32 throughout) up to fp32 rounding."""
    from turbo_attn_hf.kernels.rotation import rotate, smooth_scales

    g = torch.Generator().manual_seed(23)
    k = torch.randn(b, hk, L, d, generator=g) + 0.5 * torch.randn(1, hk, 1, d, generator=g)
    k[..., 3] *= 8.0  # an outlier channel, as the rotation is for
    v = torch.randn(b, hk, L, d, generator=g)
    q = torch.randn(b, hk * G, lq, d, generator=g) * 2.0
    s = smooth_scales(k) if smooth else None
    groups, kt, vt, nt, ks, vs, mu = R.build_packed_cache_ref(rotate(k, s, "k"), v, min(L, 70), head_bits, bs)
    kw = dict(softcap=softcap, n_splits=n_splits)
    ref = R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, rotate=True, qk_smooth=s, **kw)
    out = turbo_decode_attention(q.to(device), to_packed(groups, device), kt.to(device), vt.to(device), nt,
                                 ks.to(device), vs.to(device), mu.to(device), rotate=True,
                                 qk_smooth=None if s is None else s.to(device), **kw)
    assert_close(out, ref, ATOL_KERNEL)
    pre = R.turbo_decode_ref(rotate(q, s, "q"), groups, kt, vt, nt, ks, vs, mu, **kw)
    assert_close(ref, pre, 1e-4, name="rotated in the prologue vs rotated before")


def test_decode_qk_smooth_checks_and_static_entries(device):
    """qk_smooth needs rotate and [b, HK, D]; it is one of the storage tensors of the call's static entry (a new
    factor tensor is a new entry, never a stale pointer)."""
    from turbo_attn_hf.kernels import decode as DK

    q, k, v, (groups, kt, vt, nt, ks, vs, mu) = make_case(1, 2, 2, 40, 1, 32, [4, 4], 16)
    pk = to_packed(groups, device)
    args = (q.to(device), pk, kt.to(device), vt.to(device), nt, ks.to(device), vs.to(device), mu.to(device))
    with pytest.raises(ValueError, match="needs rotate_qk=True"):
        turbo_decode_attention(*args, qk_smooth=torch.ones(1, 2, 32, device=device))
    with pytest.raises(ValueError, match="qk_smooth must be"):
        turbo_decode_attention(*args, rotate=True, qk_smooth=torch.ones(1, 1, 32, device=device))
    DK._STATIC.clear()
    # both factor tensors alive on the device (a freed one's entry goes with its weak reference)
    factors = [(torch.rand(1, 2, 32, generator=torch.Generator().manual_seed(seed)) + 0.5).to(device)
               for seed in (1, 2)]
    for s in factors:
        out = turbo_decode_attention(*args, rotate=True, qk_smooth=s)
        assert_close(out, R.turbo_decode_ref(q, groups, kt, vt, nt, ks, vs, mu, rotate=True, qk_smooth=s.cpu()),
                     ATOL_KERNEL)
    assert len(DK._STATIC) == 2
    DK._STATIC.clear()


class _RecordingKernel:
    """A compiled kernel stand-in: records what each relaunch hands its launcher."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class _RecordingJit:
    """The decode kernel's parameters; a first launch 'compiles' one recording kernel (test_launch.py's fakes)."""

    def __init__(self, fn):
        import inspect
        from types import SimpleNamespace

        import triton.language as tl

        fn = getattr(fn, "fn", fn)
        self.params = [SimpleNamespace(name=p.name, is_constexpr=p.annotation is tl.constexpr,
                                       do_not_specialize=False, default=p.default)
                       for p in inspect.signature(fn).parameters.values()]
        self.kernel = _RecordingKernel()

    def __getitem__(self, grid):
        return lambda *a, **kw: self.kernel


def _recording_launches(monkeypatch) -> "_RecordingJit":
    """The GPU host's launch path with the decode kernel faked: ``LeanLaunch`` over a :class:`_RecordingJit` (the
    interpreter off, a stub driver). Returns the recorder: ``jit.kernel.calls`` holds each relaunch's arguments."""
    from types import SimpleNamespace

    from triton.runtime.driver import driver

    from turbo_attn_hf.kernels import decode as DK
    from turbo_attn_hf.kernels import launch as launch_mod

    monkeypatch.setattr(launch_mod, "interpreting", lambda: False)
    monkeypatch.setattr(driver, "_active", SimpleNamespace(get_current_device=lambda: 0,
                                                           get_current_stream=lambda device=None: 7))
    jit = _RecordingJit(DK._decode_kernel)
    monkeypatch.setattr(DK, "_DECODE", DK.LeanLaunch(jit))
    return jit


@pytest.mark.parametrize("case", ["int4-split", "mixed-window", "int8-one-launch"])
def test_new_storage_of_a_known_layout_rebinds_its_entry(case, monkeypatch):
    """A new cache's storage of a layout seen before (every generate() makes one) rebinds that layout's entry
    (``_DecodeStatic.rebound``: no new plan or specialisation): its launches hand the launcher what a fresh entry's do
    on that storage, the output's address aside; the first storage's entry keeps its own addresses; a storage tensor
    of another alignment makes a new entry."""
    import copy

    from turbo_attn_hf.kernels import decode as DK

    jit = _recording_launches(monkeypatch)
    bits = {"mixed-window": [4, 2], "int8-one-launch": [8, 8]}.get(case, [4, 4])
    window = 48 if case == "mixed-window" else None
    splits = 1 if case == "int8-one-launch" else 2
    q, _, _, (groups, kt, vt, nt, ks, vs, mu) = make_case(1, 2, 4, 200, 1, 32, bits, 16, n_prefill=150)

    def storage(gs, *t):
        packed = to_packed(gs, "cpu")
        return packed, DK.decode_storage(*t, None, packed)

    outs = []  # every output kept alive: no two launches get one output address

    def launched(entry, packed, stor):
        outs.append(entry.run(q, packed, stor, nt, None))
        return jit.kernel.calls[-1]

    DK._STATIC.clear()
    DK._LAYOUTS.clear()
    pa, sa = storage(groups, kt, vt, ks, vs, mu)
    ea = DK.decode_entry(q, pa, sa, True, True, window=window, n_splits=splits)
    ea.run(q, pa, sa, nt, None)  # compiles (the recorder); the next runs relaunch
    by_a = launched(ea, pa, sa)
    groups_b = copy.deepcopy(groups)
    pb, sb = storage(groups_b, kt.clone(), vt.clone(), ks.clone(), vs.clone(), mu.clone())
    made, init = [], DK._DecodeStatic.__init__
    monkeypatch.setattr(DK._DecodeStatic, "__init__", lambda self, *a, **kw: made.append(1))  # none may be made
    eb = DK.decode_entry(q, pb, sb, True, True, window=window, n_splits=splits)
    assert not made and eb is not ea and eb.alive(sb)
    n_calls = len(jit.kernel.calls)
    replayed = None  # the rebound entry's first step: ea's first recorded step on sb's addresses
    if ea.first is not None:
        assert eb.step is eb.first and eb.step is not ea.first
        outs.append(eb.run_step(q, pb, sb, nt, None))
        assert outs[-1] is not None
        replayed = jit.kernel.calls[-1]
    else:
        assert eb.step is None
    by_b = launched(eb, pb, sb)
    assert len(jit.kernel.calls) == n_calls + 1 + (replayed is not None)  # relaunches: nothing compiled again
    monkeypatch.setattr(DK._DecodeStatic, "__init__", init)
    DK._STATIC.clear()
    DK._LAYOUTS.clear()
    fresh = DK.decode_entry(q, pb, sb, True, True, window=window, n_splits=splits)
    fresh.run(q, pb, sb, nt, None)
    by_fresh = launched(fresh, pb, sb)
    diff = [i for i, (x, y) in enumerate(zip(by_b, by_fresh)) if x != y]
    assert len(by_b) == len(by_fresh) and len(diff) == 1, f"positions {diff} differ"  # the output's address
    if replayed is not None:
        assert [x for i, x in enumerate(replayed) if i != diff[0]] == [x for i, x in enumerate(by_fresh) if i != diff[0]]
    assert by_b != by_a and launched(ea, pa, sa)[diff[0] + 1:] == by_a[diff[0] + 1:]
    if case == "int8-one-launch":  # the rebound entry records its own step, which replays with its addresses
        assert eb.step is not None and eb.run_step(q, pb, sb, nt, None) is not None
        assert [x for i, x in enumerate(jit.kernel.calls[-1]) if i != diff[0]] == \
            [x for i, x in enumerate(by_b) if i != diff[0]]
    # another alignment of one storage tensor: another layout, a new entry
    mu_odd = torch.zeros(mu.numel() + 1)[1:].view_as(mu).copy_(mu)
    pc, sc = storage(groups_b, kt, vt, ks, vs, mu_odd)
    ec = DK.decode_entry(q, pc, sc, True, True, window=window, n_splits=splits)
    assert ec.launches == {} and len(DK._LAYOUTS) == 2


@pytest.mark.parametrize("case", ["int4-split", "mixed-window", "int8-key_valid", "rotated-store", "rotated-no-store",
                                  "chunk-no-store", "chunk-strided-query"])
def test_run_step_relaunches_with_the_arguments_of_run(case, monkeypatch):
    """``_DecodeStatic.run_step`` (a step like the last one ``run`` launched, with or without a stored token) hands the
    launcher exactly what ``run``'s relaunch does, the output's address aside, also after another call regrew the
    shared workspace; it declines (None) a step on a new tile plan, a misaligned token, a mask it was not recorded
    with and a launch hook."""
    import gc
    import weakref

    from eval.bench_store import count_launches
    from turbo_attn_hf.kernels import decode as DK

    jit = _recording_launches(monkeypatch)
    bits = {"mixed-window": [4, 2], "int8-key_valid": [8, 8]}.get(case, [4, 4])
    window = 48 if case == "mixed-window" else None  # the first visible tile stays put over the steps below
    lq = 3 if case.startswith("chunk") else 1
    q, _, _, (groups, kt, vt, nt, ks, vs, mu) = make_case(1, 2, 4, 200, lq, 32, bits, 16, n_prefill=150)
    if case == "chunk-strided-query":  # channels not contiguous: the launches take a contiguous copy
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    packed = to_packed(groups, "cpu")
    stor = DK.decode_storage(kt, vt, ks, vs, mu, None, packed)
    kv = case == "int8-key_valid"
    entry = DK.decode_entry(q, packed, stor, not kv, True, window=window, n_splits=2, rotate=case.startswith("rotated"))
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, 2, 1, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    nf = torch.zeros(1, dtype=torch.int32)
    tok = (k, v, nf) if lq == 1 and case != "rotated-no-store" else None
    n0 = packed[0].n_blocks * 16
    mask = lambda n: torch.ones(1, n0 + n, dtype=torch.bool) if kv else None  # noqa: E731
    for n_tail in (nt - 3, nt - 3):  # compiles (the recorder), then relaunches; each records the step
        entry.run(q, packed, stor, n_tail, mask(n_tail), tok)
    for n_tail in range(nt - 2, nt + 1):  # the same tiles: replayed, then run's own launch
        if n_tail == nt - 1:  # another call grows the shared workspace: the replay takes the new one
            ws = DK._WORKSPACE[(q.device.type, q.device.index)]
            old = weakref.ref(ws[0])
            DK._workspace(q.device, *(t.numel() + 1 for t in ws))
            del ws
            gc.collect()
            assert old() is None  # the record kept no reference to the old buffers
        m = mask(n_tail)  # one mask object: converted to int8 once (``_kvalid_int8``)
        o = entry.run_step(q, packed, stor, n_tail, m, *(tok or ()))
        o_run = entry.run(q, packed, stor, n_tail, m, tok)
        assert o is not None and o.shape == o_run.shape
        by_step, by_run = jit.kernel.calls[-2:]
        assert len(by_run) == len(by_step)
        diff = [i for i, (a, b) in enumerate(zip(by_run, by_step)) if a != b]
        if entry.q_copy:  # each call launches on its own contiguous copy of the query, never on the strided one
            assert by_step[9] != q.data_ptr() and by_run[9] != q.data_ptr()
            diff = [i for i in diff if i != 9]
        assert len(diff) == 1, f"n_tail {n_tail}: positions {diff} differ"
        assert (by_run[diff[0]], by_step[diff[0]]) == (o_run.data_ptr(), o.data_ptr())
    assert count_launches(lambda: entry.run_step(q, packed, stor, nt, mask(nt), *(tok or ())))["triton"] == 1
    if tok is None:
        assert entry.q_copy == (case == "chunk-strided-query")
        assert entry.run_step(q, packed, stor, nt, mask(nt), k, v, nf) is None  # a token it was not recorded with
        return
    # not like the recorded step: declined
    assert entry.run_step(q, packed, stor, nt + 16, mask(nt + 16), k, v, nf) is None  # one tile more
    km = torch.zeros(1, 2, 2, 33, dtype=torch.bfloat16)[:, :, :1, 1:]
    assert entry.run_step(q, packed, stor, nt, mask(nt), km, v, nf) is None  # misaligned, other strides
    rec = entry.step
    entry.run(q, packed, stor, nt, mask(nt), (km, v, nf))  # a launch with a misaligned pointer is never recorded
    assert entry.step is rec
    other = None if kv else torch.ones(1, n0 + nt, dtype=torch.bool)
    assert entry.run_step(q, packed, stor, nt, other, k, v, nf) is None
    monkeypatch.setattr(DK.LeanLaunch, "hooks_active", staticmethod(lambda: True))
    assert entry.run_step(q, packed, stor, nt, mask(nt), k, v, nf) is None
