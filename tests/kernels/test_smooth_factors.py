"""One-pass smoothing-factor kernels (``smooth_factors``) == the torch twin ``rotation.smooth_scales``.

Tolerance: relative 1e-5 on every factor. The kernel sums K per tile (tree), over tiles (in order) and over chunks
(tree), torch in its own order, so the mean differs by a few fp32 ulp of the channel's sum; amax = max - mean and
mean - min inherit that absolute error, the sqrt halves it, and tl.log/tl.exp vs torch's add ~1 ulp. Measured on
D 64/80/96/128/256 x T 1..1000 x 3 dtypes x 3 layouts x 3 chunkings (interpreter): <= 1.8e-6; 1e-5 leaves a
margin for the GPU's log/exp.
"""
import json
import sys

import pytest
import sm90
import torch

from turbo_attn_hf.kernels.rotation import SMOOTH_RANGE, smooth_scales
from turbo_attn_hf.kernels.smooth_factors import smooth_factors, smooth_factors_triton

RTOL = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _keys(b, H, T, D, dtype, layout, seed):
    """``[b, H, T, D]`` keys with per-channel offsets and spreads (outlier channels), in the given layout:
    "contig", "bthd" (the transposed view attention hands over) or "strided" (every other channel)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(D, generator=g) * 4 + 0.1
    spread[::17] *= 20  # outlier channels
    x = torch.randn(b, H, T, D, generator=g) * spread + torch.randn(D, generator=g)
    if layout == "bthd":
        return x.transpose(1, 2).contiguous().to(dtype).transpose(1, 2)
    if layout == "strided":
        big = torch.zeros(b, H, T, 2 * D)
        big[..., ::2] = x
        return big.to(dtype)[..., ::2]
    return x.to(dtype)


def _check(k, device, nsub=None):
    want = smooth_scales(k.cpu())
    got = smooth_factors_triton(k.to(device) if k.is_contiguous() else _same_view(k, device), nsub=nsub).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    err = ((got - want).abs() / want).flatten()
    i = int(err.argmax())
    assert err[i] <= RTOL, f"rel err {err[i].item():.3g} at flat index {i}: {got.flatten()[i]} vs {want.flatten()[i]}"
    return got


def _same_view(k, device):
    """``k`` on ``device`` with its strides (a non-contiguous view stays one)."""
    if device.type == "cpu":
        return k
    base = torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=device)
    base.copy_(k)
    return base


@pytest.mark.parametrize("b,H,T,D,dt,layout,nsub", [
    pytest.param(1, 2, 1, 64, "bf16", "contig", None, id="T1-D64-bf16"),
    pytest.param(2, 2, 63, 64, "fp16", "bthd", None, id="T63-D64-fp16-bthd"),
    pytest.param(1, 3, 111, 80, "bf16", "bthd", 1, id="T111-D80-bf16-bthd-nsub1"),
    pytest.param(2, 1, 65, 96, "fp32", "strided", None, id="T65-D96-fp32-strided"),
    pytest.param(1, 2, 200, 128, "bf16", "bthd", 2, id="T200-D128-bf16-bthd-nsub2"),
    pytest.param(1, 1, 1, 256, "fp32", "contig", None, id="T1-D256-fp32"),
    pytest.param(1, 1, 300, 256, "bf16", "contig", 1, id="T300-D256-bf16-NC19"),  # NC > the finish's 16-chunk tile
    pytest.param(1, 2, 37, 256, "fp16", "strided", None, id="T37-D256-fp16-strided"),
])
def test_matches_torch_twin(b, H, T, D, dt, layout, nsub, device):
    _check(_keys(b, H, T, D, DTYPES[dt], layout, seed=T * D + b), device, nsub)


@pytest.mark.parametrize("D", [64, 96, 128])
def test_nonfinite_tokens_left_out(D, device):
    k = _keys(2, 3, 70, D, torch.bfloat16, "bthd", seed=D)
    k[0, 0, 5, 3] = float("nan")
    k[0, 0, 69, D - 1] = float("inf")  # the last channel of the last token
    k[1, 2, 0, 0] = -float("inf")
    k[1, 1] = float("nan")  # a head with no finite token: every factor 1, as the twin
    got = _check(k, device, nsub=1)
    keep = [t for t in range(70) if t not in (5, 69)]
    assert torch.allclose(got[0, 0], smooth_scales(k[:1, :1, keep])[0, 0], rtol=RTOL)
    assert torch.allclose(got[1, 1], torch.ones(D), rtol=RTOL)
    assert torch.isfinite(got).all()


def test_zero_channel_gets_smallest_factor(device):
    k = _keys(1, 2, 50, 128, torch.bfloat16, "contig", seed=3)
    k[..., 9] = 0
    got = _check(k, device)
    assert got[..., 9].eq(SMOOTH_RANGE[0]).all()


def test_dispatch(device):
    """``smooth_factors`` takes the kernels where Triton runs (CUDA or the interpreter), the twin otherwise."""
    k = _keys(1, 1, 20, 64, torch.bfloat16, "contig", seed=5).to(device)
    assert torch.allclose(smooth_factors(k).cpu(), smooth_scales(k.cpu()), rtol=RTOL)


def test_one_launch_leaves_its_arrival_counters_at_zero(device):
    """The last program of each (b, h) finishes the factors (no second launch) and resets that row's arrival count:
    the next call, of another shape and chunking, starts from zero and matches the twin again."""
    from eval.bench_store import count_launches
    from turbo_attn_hf.kernels import smooth_factors as sf

    k1 = _keys(2, 3, 150, 64, torch.bfloat16, "bthd", seed=1)
    assert count_launches(lambda: _check(k1, device, nsub=1))["triton"] == 1  # NC 5 chunks for each of 6 rows
    arrive = sf._workspace(device, 0, 0, 0)[2]  # the counters the call used (a bare "cuda" device: the current one)
    assert int(arrive.abs().sum()) == 0
    _check(_keys(1, 2, 90, 128, torch.float16, "contig", seed=2), device, nsub=2)  # NC 2, rows 2
    assert int(arrive.abs().sum()) == 0


def test_a_call_reuses_its_plan_until_the_workspace_regrows(device):
    """A call of known facts reuses its plan (the workspace's views, grid, scalars): every smooth_hadamard layer of a
    prompt has them; a workspace regrown by another call since makes the plan again, on the new buffers."""
    from turbo_attn_hf.kernels import smooth_factors as sf

    sf._PLANS.clear()
    k = _keys(1, 2, 40, 64, torch.bfloat16, "contig", seed=3).to(device)
    _check(k, device)
    (plan,) = sf._PLANS.values()
    _check(k, device)
    assert list(sf._PLANS.values()) == [plan]
    ws = sf._WORKSPACE[plan[1]]
    sf._workspace(device, *(t.numel() + 1 for t in ws))  # another call's sizes: a new, larger workspace
    _check(k, device)
    (new,) = sf._PLANS.values()
    assert new is not plan and new[0] is sf._WORKSPACE[plan[1]] and new[2][0].data_ptr() == new[0][0].data_ptr()


def test_layers_in_one_launch_equal_each_layers_own_call(device):
    """``smooth_factors_layers``: a first prefill's queued layers (keys apart in memory, one shape and layout) in one
    launch, each layer's factors bit for bit its own call's (the same chunks and order); the counters left at zero."""
    from eval.bench_store import count_launches
    from turbo_attn_hf.kernels import smooth_factors as sf

    keys = [_same_view(_keys(1, 2, 150, 128, torch.bfloat16, "bthd", seed=10 + j), device) for j in range(3)]
    got = []
    assert count_launches(lambda: got.append(sf.smooth_factors_layers(keys)))["triton"] == 1
    assert got[0].shape == (3, 1, 2, 128)
    for j, k in enumerate(keys):
        own = sf.smooth_factors_triton(k)
        assert torch.equal(got[0][j], own), (j, (got[0][j] - own).abs().max().item())
    assert int(sf._workspace(device, 0, 0, 0)[2].abs().sum()) == 0
    one = sf.smooth_factors_layers(keys[:1])  # a flush that queued one layer of a plan
    assert one.shape == (1, 1, 2, 128) and torch.equal(one[0], got[0][0])
    with pytest.raises(ValueError, match="one shape"):
        sf.smooth_factors_layers([keys[0], keys[1][:, :, :100]])


def _compile(D):
    """``_smooth_stats_kernel`` for sm_90 (the arrival count's gpu-scope atomics and the finisher's .cg loads)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from turbo_attn_hf.kernels.smooth_factors import _smooth_stats_kernel

    sig = dict(k="*bf16", part="*fp32", cnt="*i32", arrive="*i32", out="*fp32", tbl="*i64", T="i32", H="i32",
               NC="i32", NSUB="i32", LO="fp32", HI="fp32", NL="i32", stride_kb="i32", stride_kh="i32",
               stride_kt="i32", stride_kd="i32")
    cx = dict(D=D, BD=D, BT=4096 // D, BC=4096 // D)
    sig.update({k: "constexpr" for k in cx})
    src = triton.compiler.ASTSource(fn=_smooth_stats_kernel, signature=sig, constexprs=cx)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def test_smooth_stats_kernel_compiles_for_sm90():
    sm90.run(__file__, [[128], [256]], "smoothing-factor kernel")


if __name__ == "__main__":
    sm90.main(_compile, json.loads(sys.argv[1]))


@pytest.mark.parametrize("T,rows,D", [(4096, 1, 256), (4096, 8, 128), (32768, 1, 256), (1024, 32, 64), (17, 1, 80)])
def test_default_chunking_bounds_the_finisher(T, rows, D):
    """The default chunking keeps the finisher's serial read short (at most 4 steps of BC chunks: 256 chunks of one
    KV head took 81 us on an H200) while covering every token once."""
    from turbo_attn_hf.kernels.smooth_factors import _chunking, _pow2

    BT, BC, nsub, NC = _chunking(T, rows, _pow2(D), 132)
    assert NC <= 4 * BC and (NC - 1) * nsub * BT < T <= NC * nsub * BT


_RELAUNCH_SCRIPT = r'''
import torch
from eval.experiments.host_step import install_stubs
install_stubs()
from turbo_attn_hf.kernels import smooth_factors as sf
from turbo_attn_hf.kernels.launch import LeanLaunch

seen = []
orig = LeanLaunch.relaunch
LeanLaunch.relaunch = staticmethod(lambda hit, grid, call: (seen.append((tuple(grid), list(call))), orig(hit, grid, call)))
k = torch.randn(1, 2, 300, 128, dtype=torch.bfloat16)
sf.smooth_factors_triton(k)
assert seen == [], seen  # the first call compiles (here: the stub) and memoises
sf.smooth_factors_triton(k[:, :, :200])  # another length, same facts: relaunched
assert len(seen) == 1 and seen[0][1][6] == 200, seen
ws = sf._WORKSPACE[("cpu", None)]
assert seen[0][1][1] == ws[0].data_ptr() and seen[0][1][2] == ws[1].data_ptr()  # the shared partials / counts
print("OK")
'''


def test_a_second_call_relaunches_on_the_shared_workspace():
    """The pass relaunches its memoised kernel (no per-argument facts, no binder: 24 -> 12.6 us of host a call with the
    launches stubbed, session 34) on a per-device partials workspace instead of two allocations a call."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the stubs replace the interpreter
    r = subprocess.run([sys.executable, "-c", _RELAUNCH_SCRIPT], cwd=Path(__file__).resolve().parents[2], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]
