"""kernels/launch.py: the binder-free relaunch keys on every fact Triton specialises on, and hands the
launcher the arguments ``JITFunction.run`` does (runtime ones, tensors as addresses, then the constexprs in
parameter order)."""

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from turbo_attn_hf.kernels import launch as launch_mod
from turbo_attn_hf.kernels.launch import LeanLaunch, _fact


def test_fact_reads_what_triton_specialises():
    a = torch.zeros(64, dtype=torch.float32)
    assert _fact(a, True) == (torch.float32, True, False)
    assert _fact(a[1:], True) == (torch.float32, False, False)  # 4-byte offset: not 16-byte aligned
    assert _fact(a.to(torch.int8), True)[0] == torch.int8
    assert _fact(32, True) != _fact(33, True) != _fact(1, True)
    assert _fact(32, True) == _fact(48, True)
    assert len({_fact(16, True), _fact(1 << 31, True), _fact(1 << 33, True)}) == 3  # i32, u32, i64
    assert _fact(32, False) == _fact(33, False) == _fact(1, False)  # do_not_specialize: the type only
    assert _fact(1.5, True) == _fact(2.5, True) and _fact(None, True) is type(None)


class _FakeKernel:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def launch_metadata(self, *a):
        return None

    def run(self, *a):
        self.calls.append(a)


class _FakeJit:
    """Parameters (x, n [do_not_specialize], BLOCK [constexpr], FLAG [constexpr, default True])."""

    def __init__(self):
        p = lambda name, ce=False, dns=False, default=None: SimpleNamespace(  # noqa: E731
            name=name, is_constexpr=ce, do_not_specialize=dns, default=default)
        self.params = [p("x"), p("n", dns=True), p("BLOCK", ce=True), p("FLAG", ce=True, default=True)]
        self.compiled = []

    def __getitem__(self, grid):
        def first_launch(*args, **kwargs):
            k = _FakeKernel()
            self.compiled.append((grid, args, kwargs, k))
            return k
        return first_launch


class _FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 7


@pytest.fixture
def gpu_path(monkeypatch):
    from triton.runtime.driver import driver
    monkeypatch.setattr(launch_mod, "interpreting", lambda: False)
    monkeypatch.setattr(driver, "_active", _FakeDriver())


def test_relaunch_skips_the_binder_and_passes_constexprs(gpu_path):
    fn = _FakeJit()
    lean = LeanLaunch(fn)
    x = torch.zeros(64)
    lean[(3, 2)](x, 5, BLOCK=16, num_warps=1)
    assert len(fn.compiled) == 1
    lean[(4, 1)](x, 9, BLOCK=16, num_warps=1)  # n is do_not_specialize: same kernel
    assert len(fn.compiled) == 1
    kernel = fn.compiled[0][3]
    # the tensor goes to the launcher as its address (no data_ptr / cuPointerGetAttribute there)
    assert kernel.calls == [(4, 1, 1, 7, "fn", "meta", None, None, None, x.data_ptr(), 9, 16, True)]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "constexpr", "option"])
def test_a_new_specialisation_compiles_through_triton(gpu_path, change):
    fn = _FakeJit()
    lean = LeanLaunch(fn)
    x = torch.zeros(64)
    lean[(1,)](x, 5, BLOCK=16, num_warps=1)
    args, kwargs = (x, 5), dict(BLOCK=16, num_warps=1)
    if change == "misaligned":
        args = (x[1:], 5)
    elif change == "dtype":
        args = (x.half(), 5)
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    else:
        kwargs["num_warps"] = 4
    lean[(1,)](*args, **kwargs)
    assert len(fn.compiled) == 2 and fn.compiled[0][3].calls == []


def test_launch_memo_relaunches_aligned_calls_of_one_key(gpu_path):
    """A memo hit (same caller key, every tensor 16-byte aligned) relaunches with the addresses and the scalars as
    given; a misaligned tensor takes an ordinary launch and never enters the memo; a new key compiles."""
    fn = _FakeJit()
    lean, memo = LeanLaunch(fn), {}
    x = torch.zeros(64)
    for n in (5, 6, 7):  # first call: Triton's path; second: LeanLaunch's key hit, memoised; third: the memo
        lean.launch_memo(memo, "key", (2,), (x,), (n,), dict(BLOCK=16, num_warps=1), False)
    assert len(fn.compiled) == 1 and list(memo) == ["key"]
    kernel = fn.compiled[0][3]
    assert kernel.calls[-1] == (2, 1, 1, 7, "fn", "meta", None, None, None, x.data_ptr(), 7, 16, True)
    lean.launch_memo(memo, "key", (2,), (x[1:],), (8,), dict(BLOCK=16, num_warps=1), False)
    assert len(fn.compiled) == 2 and memo["key"][0] is kernel  # the misaligned call compiled its own
    lean.launch_memo(memo, "other", (2,), (x,), (9,), dict(BLOCK=32, num_warps=1), False)
    assert len(fn.compiled) == 3


@triton.jit
def _add_one(x, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x + o, tl.load(x + o, mask=o < n) + 1, mask=o < n)


def test_interpreter_calls_the_jit_function():
    if not launch_mod.interpreting():
        pytest.skip("TRITON_INTERPRET=1 only")
    x = torch.zeros(8)
    LeanLaunch(_add_one)[(1,)](x, 5, BLOCK=8)
    assert x.tolist() == [1.0] * 5 + [0.0] * 3


def test_relaunch_calls_tritons_c_launcher_directly(monkeypatch):
    """A kernel whose launcher is Triton's CUDA one (no scratch) is relaunched through its C ``launch`` with the
    arguments ``CudaLauncher.__call__`` would pass, on the current device's raw stream; one with a global
    scratch buffer keeps ``kernel.run``."""
    from triton.runtime.driver import driver

    class CudaLauncher:  # the name is what the fast path checks, with its attributes
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = "coop", "pdl"

        def __init__(self):
            self.calls = []

        def launch(self, *a):
            self.calls.append(a)

    class CudaDriver(_FakeDriver):
        pass

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def __init__(self, run):
            self._run = run
            self.run_calls = []

        def run(self, *a):
            self.run_calls.append(a)

    monkeypatch.setattr(driver, "_active", CudaDriver())
    monkeypatch.setattr(launch_mod, "_raw_stream", lambda device: 100 + device)
    monkeypatch.setattr(launch_mod, "_cuda_device", lambda: 3)
    fast = Compiled(CudaLauncher())
    LeanLaunch.relaunch((fast, (16, True)), (4, 2), (1234, 9))
    assert fast._run.calls == [(4, 2, 1, 103, "fn", "coop", "pdl", None, None, "meta", None, None, None,
                                1234, 9, 16, True)]
    scratch = CudaLauncher()
    scratch.global_scratch_size = 128
    slow = Compiled(scratch)
    LeanLaunch.relaunch((slow, ()), (1,), (5,))
    assert scratch.calls == [] and slow.run_calls == [(1, 1, 1, 7, "fn", "meta", None, None, None, 5)]
    # bind + fire: the same launches, looked up once (the stream still read at each call)
    bound = LeanLaunch.bind((fast, (16, True)), (4, 2))
    monkeypatch.setattr(launch_mod, "_cuda_device", lambda: 5)
    LeanLaunch.fire(bound, (1234, 9))
    assert fast._run.calls[-1] == (4, 2, 1, 105, "fn", "coop", "pdl", None, None, "meta", None, None, None,
                                   1234, 9, 16, True)
    from eval.bench_store import count_launches

    assert count_launches(lambda: LeanLaunch.fire(bound, (1, 2)))["triton"] == 1  # tools that count launches see it
    LeanLaunch.fire(LeanLaunch.bind((slow, ()), (1,)), (6,))
    assert scratch.calls == [] and slow.run_calls[-1] == (1, 1, 1, 7, "fn", "meta", None, None, None, 6)
