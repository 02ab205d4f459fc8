"""The Gluon Hopper prefill kernel (kernels/prefill_hopper.py, issue 20).

CPU: the path choice and its refusals, the schedule switches, the operand key order (the sm_90 compile:
test_prefill_hopper_compile.py). GPU (marked ``gpu``, sm_90): each kernel against its twin's conversion, every exact
schedule bit for bit, causal and not, GQA, ragged lengths, poisoned keys.
"""
import os

import pytest
import torch

from turbo_attn_hf.kernels import prefill, prefill_hopper, quant, reference

def _operands(b, hq, hk, lq, lk, d, device, seed=0, poison=(), half=False, poison_v=()):
    """The kernel's operands: INT8 V^T and its scales, or (``half``) V itself as the V pass writes it (16-bit, padded,
    bad tokens zeroed and flagged in sk) and an unread sv."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(b, h, L, d, generator=g).to(device=device, dtype=torch.bfloat16)
               for h, L in ((hq, lq), (hk, lk), (hk, lk)))
    for bi, hi, t in poison:
        k[bi, hi, t, 3] = float("nan")
    for bi, hi, t in poison_v:
        v[bi, hi, t, 5] = float("inf")
    q8, sq = quant.quantize_per_token(q, scale=d ** -0.5 * reference.LOG2E)
    k8, sk = quant.quantize_per_token(k, smooth=reference.k_smooth_mean(k))
    if half:
        sk = torch.nn.functional.pad(sk, (0, -lk % 4)).contiguous()
        return q8, sq, k8, sk, quant.v_operand_half(v, prefill_hopper.BLOCK_N, poison=sk), torch.empty(
            b, hk, 1, d, device=device)
    v8t, sv = quant.quantize_v_blocks(v, prefill_hopper.BLOCK_N, poison=sk if poison_v else None)
    return q8, sq, k8, sk, v8t, sv


def test_auto_is_the_default_and_hopper_refuses_what_it_cannot_run(monkeypatch):
    assert prefill.kernel_choice() in prefill.PREFILL_KERNELS
    if "TURBO_PREFILL_KERNEL" not in os.environ:
        assert prefill.kernel_choice() == "auto"
    cpu = torch.device("cpu")
    assert prefill.hopper_takes(cpu, 128, 128, window=None, softcap=None, key_valid=None, softmax="exact",
                                p_scale="block") == "not a CUDA device"
    assert not prefill_hopper.supports(d=128, block_n=128, window=64, softcap=None, has_key_valid=False,
                                       use_sas=False, block_p=True)
    assert not prefill_hopper.supports(d=256, block_n=128, window=None, softcap=None, has_key_valid=False,
                                       use_sas=False, block_p=True)  # head_dim 256: only P.V on 16-bit V
    assert prefill_hopper.supports(d=256, block_n=128, window=None, softcap=None, has_key_valid=False,
                                   use_sas=False, block_p=True, pv_half=True)
    with pytest.raises(ValueError, match="head_dim 256 runs only P.V on 16-bit V"):
        z = torch.zeros(1, 1, 128, 256, dtype=torch.int8)
        prefill_hopper.ws_spec(z, torch.zeros(1, 1, 128), z, torch.zeros(1, 1, 128), z.transpose(2, 3),
                               torch.zeros(1, 1, 1, 256), torch.empty(1, 128, 1, 256), causal=True, Lk=128)
    assert prefill_hopper.supports(d=64, block_n=128, window=None, softcap=None, has_key_valid=False,
                                   use_sas=False, block_p=True)
    monkeypatch.setattr(prefill, "_KERNEL", ["fastest"])
    with pytest.raises(ValueError, match="TURBO_PREFILL_KERNEL"):
        prefill.kernel_choice()


def test_forcing_the_hopper_kernel_where_it_cannot_run_is_a_clear_error():
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # a window: refused on every machine, with its reason
    ops = _operands(1, 2, 1, 32, 32, 64, dev)
    with pytest.raises(ValueError, match="Hopper prefill kernel cannot run this call: (not a CUDA|its options|not an)"):
        prefill.int8_flash_attention(*ops, causal=True, window=16, _kernel="hopper")


# ----------------------------------------------------------------------------------------------------- GPU
sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
                               and prefill_hopper.gluon_available()), reason="needs an sm_90 GPU and Gluon")

CASES = [  # b, hq, hk, lq, lk, d, causal
    (1, 4, 4, 1024, 1024, 128, True), (2, 8, 2, 777, 1500, 128, True), (1, 4, 1, 300, 300, 128, False),
    (2, 4, 2, 4096, 4096, 64, True), (1, 2, 2, 129, 4000, 64, False), (1, 8, 8, 1, 257, 128, True),
]
#: head_dim 256 runs only the 16-bit P.V (``prefill_hopper.INT8_PV_HEAD_DIMS``)
HALF_CASES = CASES + [(1, 4, 2, 1024, 1024, 256, True), (2, 2, 1, 300, 1500, 256, False), (1, 2, 2, 1, 257, 256, True)]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_each_kernel_matches_its_twin(case):
    """The Gluon kernel (its defaults: int32 scores and P.V through I2F and one rounding of x s) against the reference
    with ``int_to_float="exact"``, as the portable kernel (the magic-number form) is held to the reference's
    "magic"; and the Gluon kernel without ``i2f`` is the portable kernel's math."""
    from test_prefill import assert_close, tol

    b, hq, hk, lq, lk, d, causal = case
    ops = _operands(b, hq, hk, lq, lk, d, "cuda", seed=lq + lk)
    cpu_ops = [t.cpu() for t in ops]
    hopper = prefill.int8_flash_attention(*ops, causal=causal, _kernel="hopper")
    for mode, out in (("magic", prefill.int8_flash_attention(*ops, causal=causal, _kernel="portable")),
                      ("exact", hopper)):
        ref = reference.int8_flash_attention(*cpu_ops, causal=causal, Lk=lk, out_dtype=torch.float32,
                                             int_to_float=mode)
        assert_close(f"{mode} {case}", ref, out, *tol(torch.device("cuda"), torch.bfloat16))
    assert hopper.isfinite().all()
    magic = prefill_hopper.launch_ws(*ops, torch.empty(b, lq, hq, d, device="cuda", dtype=torch.bfloat16),
                                     causal=causal, Lk=lk, i2f=False)
    diff = (magic.float() - prefill.int8_flash_attention(*ops, causal=causal, _kernel="portable").float()).abs()
    # the same integer dots, scales and softmax in the same order; the FMA contraction of the two compilers may
    # round an fp32 step differently, which can move one p8 level
    assert float(diff.max()) < 2e-2 and float((diff > 0).float().mean()) < 0.05


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", HALF_CASES, ids=lambda c: "x".join(map(str, c)))
def test_the_16bit_pv_matches_its_twin(case):
    """P.V on V itself (bf16, the V pass's padded operand; FlashAttention-3's in-warpgroup order) against the
    reference with the same 16-bit V and ``int_to_float="exact"``."""
    from test_prefill import assert_close, tol

    b, hq, hk, lq, lk, d, causal = case
    ops = _operands(b, hq, hk, lq, lk, d, "cuda", seed=lq + lk, half=True)
    out = prefill_hopper.launch_ws(*ops, torch.empty(b, lq, hq, d, device="cuda", dtype=torch.bfloat16),
                                   causal=causal, Lk=lk)
    cpu_ops = [t.cpu() for t in ops]
    cpu_ops[3] = cpu_ops[3][..., :lk]
    ref = reference.int8_flash_attention(*cpu_ops, causal=causal, Lk=lk, out_dtype=torch.float32,
                                         int_to_float="exact")
    assert_close(f"16-bit P.V {case}", ref, out, *tol(torch.device("cuda"), torch.bfloat16))
    assert out.isfinite().all()
    if d in reference.PV_HALF_BLOCK_N:  # two CTAs an SM (64-key blocks) by default; one CTA runs blocks of 128
        one = prefill_hopper.launch_ws(*ops, torch.empty(b, lq, hq, d, device="cuda", dtype=torch.bfloat16),
                                       causal=causal, Lk=lk, two_ctas=False)
        ref = reference.int8_flash_attention(*cpu_ops, causal=causal, Lk=lk, out_dtype=torch.float32,
                                             int_to_float="exact", block_n=prefill_hopper.BLOCK_N)
        assert_close(f"16-bit P.V, one CTA {case}", ref, one, *tol(torch.device("cuda"), torch.bfloat16))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [True, False])
def test_a_bad_value_token_poisons_exactly_the_rows_that_see_it_with_either_pv(causal):
    """An Inf in V's token 400: the V pass zeroes it in the 16-bit operand (a masked p is 0, and 0 x Inf would be NaN
    in rows that do not see it) and flags its key; the rows that see it are NaN, as with the INT8 P.V."""
    lq = lk = 700
    int8 = _operands(1, 2, 1, lq, lk, 128, "cuda", poison_v=[(0, 0, 400)])
    half = _operands(1, 2, 1, lq, lk, 128, "cuda", poison_v=[(0, 0, 400)], half=True)
    outs = [prefill_hopper.launch_ws(*ops, torch.empty(1, lq, 2, 128, device="cuda", dtype=torch.bfloat16),
                                     causal=causal, Lk=lk) for ops in (int8, half)]
    assert torch.equal(outs[0].isnan(), outs[1].isnan())
    nan_rows = outs[1].isnan().all(-1)
    assert nan_rows.any() and torch.equal(nan_rows, outs[1].isnan().any(-1))
    assert causal == (not nan_rows.all())  # causal: the rows before key 400 stay finite


#: schedules that reorder or regroup the same operations: bit for bit the default schedule's output
EXACT_SCHEDULES = [dict(pv_parts=1), dict(pv_parts=2), dict(worker_regs=(240, 24)), dict(keys_permuted=False),
                   dict(keys_permuted=False, pv_parts=2), dict(keys_permuted=False, pv_parts=1)]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("schedule", EXACT_SCHEDULES, ids=lambda s: "+".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_every_exact_schedule_gives_the_same_output(case, schedule):
    """P.V in fewer parts (the parts' int32 sums are the block's), V's keys in natural order (an exact permutation of
    an integer sum), other register splits: the same values, bit for bit."""
    b, hq, hk, lq, lk, d, causal = case
    q8, sq, k8, sk, v8t, sv = _operands(b, hq, hk, lq, lk, d, "cuda", seed=7)
    outs = [prefill_hopper.launch_ws(q8, sq, k8, sk, v8t, sv, torch.empty(b, lq, hq, d, device="cuda",
                                     dtype=torch.bfloat16), causal=causal, Lk=lk, **sch)
            for sch in ({}, schedule)]
    assert torch.equal(outs[0], outs[1])


def test_the_mma_key_order_puts_a_threads_score_keys_in_its_operand_slots():
    """Slot k = 16h + 4c + 2e + b of every 32 holds key 16h + 8e + 2c + b: the keys lane c holds in the score
    accumulator (2c, 2c + 1, 8 + 2c, ...), in order, are the A-operand slots it holds (4c..4c+3, 16 + 4c..)."""
    idx = prefill_hopper.mma_key_order(96)
    assert sorted(idx.tolist()) == list(range(96))
    for c in range(4):
        acc_keys = [8 * i + 2 * c + e for i in range(4) for e in range(2)]
        slots = [16 * h + 4 * c + j for h in range(2) for j in range(4)]
        assert [int(idx[32 + s]) - 32 for s in slots] == acc_keys


def test_schedule_switches_are_checked():
    assert prefill_hopper.schedule_constexprs() == prefill_hopper.schedule_constexprs(**prefill_hopper.SCHEDULE)
    with pytest.raises(ValueError, match="unknown schedule switch"):
        prefill_hopper.schedule_constexprs(pingpong=True)
    with pytest.raises(ValueError, match="1, 2 or 4"):
        prefill_hopper.schedule_constexprs(pv_parts=8)


def test_two_ctas_an_sm_are_the_16bit_pvs_default_at_head_dim_64_only():
    """ws_spec's launch: the 16-bit P.V at head_dim 64 in two CTAs an SM (64-key blocks, 80 launch registers, the
    serial order); every other head dim and the INT8 P.V in one; forcing two CTAs elsewhere is a clear error."""
    def spec(d, v_dtype, **schedule):
        z8 = torch.zeros(1, 1, 256, d, dtype=torch.int8)
        v = torch.zeros(1, 1, 256, d, dtype=v_dtype) if v_dtype != torch.int8 else z8.transpose(2, 3)
        return prefill_hopper.ws_spec(z8, torch.zeros(1, 1, 256), z8, torch.zeros(1, 1, 256), v,
                                      torch.zeros(1, 1, 2, d), torch.empty(1, 256, 1, d), causal=True, Lk=256,
                                      **schedule)[2]
    kw = spec(64, torch.bfloat16)
    assert (kw["BN"], kw["maxnreg"], kw["STAGES"]) == (64, 80, 4) and kw["FLAGS"] & prefill_hopper._PV_SERIAL_BIT
    one = spec(64, torch.bfloat16, two_ctas=False)
    assert one["BN"] == prefill_hopper.BLOCK_N and "maxnreg" not in one
    for d, v_dtype in ((128, torch.bfloat16), (256, torch.bfloat16), (64, torch.int8)):
        assert spec(d, v_dtype)["BN"] == prefill_hopper.BLOCK_N
    with pytest.raises(ValueError, match="two CTAs an SM run the 16-bit P.V at head_dim"):
        spec(128, torch.bfloat16, two_ctas=True)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_a_poisoned_key_poisons_exactly_the_rows_that_see_it(causal, d):
    """A NaN in K's token 400 (sk NaN): the INT8 P.V's rows are NaN by the scan of sk before the loop; the 16-bit
    P.V's by the NaN scores themselves (NaN p in the rows that see the key, 0 where masked), with no scan."""
    lq = lk = 700
    ops = _operands(1, 2, 1, lq, lk, 128, "cuda", poison=[(0, 0, 400)])
    ref = prefill.int8_flash_attention(*ops, causal=causal, _kernel="portable")
    if d == 128:
        out = prefill.int8_flash_attention(*ops, causal=causal, _kernel="hopper")
        assert torch.equal(out.isnan(), ref.isnan())
    half = _operands(1, 2, 1, lq, lk, d, "cuda", poison=[(0, 0, 400)], half=True)
    out = prefill_hopper.launch_ws(*half, torch.empty(1, lq, 2, d, device="cuda", dtype=torch.bfloat16),
                                   causal=causal, Lk=lk)
    assert torch.equal(out.isnan().any(-1), ref.isnan().any(-1))  # the same rows (head_dims may differ)
    assert out.isnan().any() and torch.equal(out.isnan().all(-1), out.isnan().any(-1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path (CPU); on sm_90 the GPU tests cover it")
def test_choosing_hopper_where_it_cannot_run_keeps_the_portable_kernel(monkeypatch):
    """TURBO_PREFILL_KERNEL=hopper is a preference: turbo_attention runs the portable kernel where the Gluon one
    cannot (here: the interpreter), with the same output, and keeps separate plans per choice."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    want = prefill.turbo_attention(q, k, v, causal=True)
    monkeypatch.setattr(prefill, "_KERNEL", ["hopper"])
    got = prefill.turbo_attention(q, k, v, causal=True)
    assert torch.equal(got, want)
    assert not any(p.hopper for p in prefill._PLANS.values())


TURBO_CASES = [(1, 8, 2, 333, 1021, 128, True), (2, 4, 4, 1000, 1000, 64, False), (1, 4, 1, 1, 4099, 128, True),
               (1, 4, 2, 1000, 2001, 256, True)]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", TURBO_CASES, ids=lambda c: "x".join(map(str, c)))
def test_turbo_attention_relaunches_the_gluon_kernel_bit_for_bit(case):
    """turbo_attention on the Gluon path: a plan's first call goes through Gluon's binder, the later ones relaunch
    from ``WsLaunch``'s memo (light descriptors; sk's rows padded to 4 by the plan, K's mean from split sums). Every
    call gives the same bits, as do the call with K's mean given and one writing into a given ``out``; the portable
    kernel's output (INT8 P.V, its own conversions) is close."""
    b, hq, hk, lq, lk, d, causal = case
    g = torch.Generator().manual_seed(lk)
    q, k, v = (torch.randn(b, h, L, d, generator=g).to(device="cuda", dtype=torch.bfloat16)
               for h, L in ((hq, lq), (hk, lk), (hk, lk)))
    with prefill.chosen_kernel("hopper"):
        outs = [prefill.turbo_attention(q, k, v, causal=causal) for _ in range(3)]
        plans = [p for p in prefill._PLANS.values() if p.ws is not None and p.shapes[0] == (b, hq, lq, d)]
        assert plans and all(p.ws.memo for p in plans), "the Gluon plan was not relaunched from its memo"
        assert all(p.v_op == torch.bfloat16 for p in plans), "the Gluon plan's P.V is not on 16-bit V"
        outs.append(prefill.turbo_attention(q, k, v, causal=causal, k_mean=reference.k_smooth_mean(k)))
        outs.append(prefill.turbo_attention(q, k, v, causal=causal, out=torch.empty_like(outs[0])))
    for i, o in enumerate(outs[1:], 1):
        assert torch.equal(o, outs[0]), f"call {i} differs"
    with prefill.chosen_kernel("portable"):
        port = prefill.turbo_attention(q, k, v, causal=causal)
    diff = (port.float() - outs[0].float()).abs()
    assert float(diff.max()) < 3e-2, float(diff.max())
