"""K -> Q smoothing factors of ``rotate_qk = "smooth_hadamard"`` in one pass over K (issue 23: the rotation must
cost <= 3 % of the first prefill's store).

``s_c = sqrt(max_t |k_tc - mean_c|)`` over the finite tokens, normalised to geometric mean 1 per (batch, KV head)
and clamped to ``rotation.SMOOTH_RANGE`` (SmoothAttention, QServe §4.3, K-only; twin: ``rotation.smooth_scales``,
~12 full-size torch passes with fp32 temporaries, 0.33-0.64 ms per layer on an H100). Here one launch,
``_smooth_stats_kernel`` (grid: T-chunks x b*Hk x layers: a first prefill's queued layers make theirs together,
``smooth_factors_layers``):

* every program: per chunk and channel the sum, min and max of K over the tokens whose every channel is finite (a
  token with an inf/NaN is left out, as in the twin) and their count, into a partials workspace;
* the last program of a (b, h) to arrive (an arrival count, as the stats kernel's and the decode split's merge:
  ``store._stats_kernel``) finishes it (``_smooth_finish``): sums the chunks in chunk order,
  ``mean = sum / max(n, 1)``, ``amax = max(max - mean, mean - min)`` — equal to ``max_t |k_t - mean|`` in fp32,
  since a rounded subtraction is monotonic in each operand — then the twin's sqrt / clamp / geometric mean / clamp.
  A second launch for the finish cost 5.2 / 8.7 us at 1k / 4k tokens of an 8-KV-head layer (H200, PERF_NOTES
  session 33) besides its host launch.

The factors differ from the twin's only by the mean's summation order (tiles, then chunks) and by
``tl.log``/``tl.exp`` vs torch's (a few fp32 ulp; tests/kernels/test_smooth_factors.py states the tolerance).
No host sync; T is a runtime argument (no recompile per prompt length).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .device import current_cuda_device, on_device, sm_count
from .interpreter import use_triton
from .launch import LeanLaunch, lean
from .rotation import SMOOTH_RANGE, smooth_scales

__all__ = ["smooth_factors", "smooth_factors_layers", "smooth_factors_triton"]


@triton.jit
def _sum_min_max_init(BD: tl.constexpr):
    """Empty per-channel accumulators ``[BD]`` fp32: sum 0, min +inf, max -inf."""
    return tl.zeros([BD], tl.float32), tl.full([BD], float("inf"), tl.float32), tl.full([BD], float("-inf"), tl.float32)


@triton.jit(do_not_specialize=["T", "NSUB", "NC", "NL"])
def _smooth_stats_kernel(
    k, part, cnt, arrive, out, tbl, T, H, NC, NSUB, LO, HI, NL,
    stride_kb, stride_kh, stride_kt, stride_kd,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """grid (NC, b*H, NL): tokens ``[i_c*NSUB*BT, (i_c+1)*NSUB*BT)`` of (b, h) of layer j's ``k [b, H, T, D]`` (any
    strides; layer j's keys ``tbl[j]`` int64 elements after ``k``, read only when NL > 1) -> ``part[NL*b*H, NC, 3,
    BD]`` fp32 (finite tokens' sum, min, max per channel), ``cnt[NL*b*H, NC]`` int32 (their count), rows j*b*H +
    b*H + h; the last of a row's NC programs (``arrive[NL*b*H]`` int32, zero before the launch and after it) writes
    its factors ``out[NL*b*H, D]`` (``_smooth_finish``). One binary for one layer and for many (NL a runtime
    argument): a layer's factors are the same bits whether its first store was queued with others or not."""
    i_c, i_bh, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    if NL > 1:
        k += tl.load(tbl + i_l)
    i_bh = i_l * tl.num_programs(1) + i_bh  # the (layer, b, h) row: the same chunks as a launch of one layer
    o_d = tl.arange(0, BD)
    o_r = tl.arange(0, BT)
    m_d = o_d < D
    inf = float("inf")
    b_sum, b_min, b_max = _sum_min_max_init(BD)
    n_ok = tl.sum(tl.zeros([BT], tl.int32), 0)
    p_k = k + i_b * stride_kb + i_h * stride_kh + o_d[None, :].to(tl.int64) * stride_kd
    for j in range(NSUB):
        o_t = ((i_c * NSUB + j) * BT + o_r).to(tl.int64)
        m_t = o_t < T
        b_k = tl.load(p_k + o_t[:, None] * stride_kt, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        # a token is kept only when all D channels are finite (NaN compares false; padded channels load 0)
        m_ok = m_t & (tl.min((tl.abs(b_k) < inf).to(tl.int32), 1) == 1)
        m = m_ok[:, None]
        b_sum += tl.sum(tl.where(m, b_k, 0.0), 0)
        b_min = tl.minimum(b_min, tl.min(tl.where(m, b_k, inf), 0))
        b_max = tl.maximum(b_max, tl.max(tl.where(m, b_k, -inf), 0))
        n_ok += tl.sum(m_ok.to(tl.int32), 0)
    p_p = part + (i_bh.to(tl.int64) * NC + i_c) * (3 * BD) + o_d
    tl.store(p_p, b_sum)
    tl.store(p_p + BD, b_min)
    tl.store(p_p + 2 * BD, b_max)
    tl.store(cnt + i_bh.to(tl.int64) * NC + i_c, n_ok)
    # a barrier orders every thread's stores before the program's gpu-scope acq_rel atomic; the finisher reads the
    # partials from L2 (.cg)
    tl.debug_barrier()
    if tl.atomic_add(arrive + i_bh, 1, sem="acq_rel", scope="gpu") == NC - 1:
        tl.atomic_xchg(arrive + i_bh, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        _smooth_finish(i_bh.to(tl.int64), part, cnt, out, NC, LO, HI, D, BD, BC)


@triton.jit
def _smooth_finish(i_bh, part, cnt, out, NC, LO, HI, D: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr):
    """The NC chunks' partials of row ``i_bh`` (= b*H + h) -> ``out[i_bh, :D]`` fp32 factors
    (``rotation.smooth_scales``)."""
    o_d = tl.arange(0, BD)
    o_c = tl.arange(0, BC)
    m_d = o_d < D
    inf = float("inf")
    b_sum, b_min, b_max = _sum_min_max_init(BD)
    b_n = tl.zeros([BC], tl.int32)
    for c0 in range(0, NC, BC):
        m_c = (c0 + o_c) < NC
        p_p = part + (i_bh * NC + c0 + o_c)[:, None] * (3 * BD) + o_d[None, :]
        b_sum += tl.sum(tl.load(p_p, mask=m_c[:, None], other=0.0, cache_modifier=".cg"), 0)
        b_min = tl.minimum(b_min, tl.min(tl.load(p_p + BD, mask=m_c[:, None], other=inf, cache_modifier=".cg"), 0))
        b_max = tl.maximum(b_max, tl.max(tl.load(p_p + 2 * BD, mask=m_c[:, None], other=-inf, cache_modifier=".cg"),
                                         0))
        b_n += tl.load(cnt + i_bh * NC + c0 + o_c, mask=m_c, other=0, cache_modifier=".cg")
    n = tl.maximum(tl.sum(b_n, 0), 1).to(tl.float32)
    mean = b_sum / n
    # max_t |k_t - mean| exactly (monotonic rounding); >= 0, and 0 when no token is finite (min/max still +-inf)
    amax = tl.maximum(tl.maximum(b_max - mean, mean - b_min), 0.0)
    s = tl.maximum(tl.sqrt_rn(amax), LO * LO)  # the geometric mean must not see log(0)
    g = tl.exp(tl.sum(tl.where(m_d, tl.log(s), 0.0), 0) / D)
    s = tl.minimum(tl.maximum(s / g, LO), HI)
    tl.store(out + i_bh * D + o_d, s, mask=m_d)


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _chunking(T: int, rows: int, BD: int, sms: int, nsub: int | None = None) -> tuple[int, int, int, int]:
    """``(BT, BC, nsub, NC)``: tokens per tile (a ``[BT, BD]`` fp32 tile of 4K elements, 32 registers a thread;
    fixed, so no recompile per T), chunks the finisher sums per step, tiles per program and chunks per (b, h).
    Default ``nsub``: ~4 programs per SM, and at most 4 finisher steps — the finisher is one program of a (b, h)
    reading its row's partials serially: one KV head at 4k tokens of d 256 in 256 chunks took 81 us (H200,
    eval/PERF_NOTES.md session 34)."""
    BT = 4096 // BD
    BC = max(1, 4096 // BD)
    n_tiles = max(1, -(-T // BT))  # plain integer ceil: triton.cdiv is a constexpr function, microseconds a call
    if nsub is None:
        nsub = max(-(-n_tiles * rows // (4 * sms)), -(-n_tiles // (4 * BC)))
    nsub = max(1, min(int(nsub), n_tiles))
    return BT, BC, nsub, -(-n_tiles // nsub)


def smooth_factors_triton(k: torch.Tensor, nsub: int | None = None) -> torch.Tensor:
    """``rotation.smooth_scales(k)`` by one Triton launch: ``k [b, Hk, T, d]`` (any float dtype, any strides)
    -> ``s [b, Hk, d]`` fp32. ``nsub``: tiles of tokens per program (default: enough programs to fill the GPU)."""
    if k.dim() != 4:
        raise ValueError(f"keys must be [b, Hk, T, d], got shape {tuple(k.shape)}")
    return _launch(k, nsub, 1, None)


def smooth_factors_layers(keys: Sequence[torch.Tensor]) -> torch.Tensor:
    """``smooth_factors_triton`` of each of ``keys`` (layers' ``[b, Hk, T, d]`` keys of one shape, strides, dtype and
    device) by one launch -> ``[layers, b, Hk, d]`` fp32, each layer's bit for bit its own call's (the same chunks):
    a first prefill's queued layers (``turbo_attn_hf.first_prefill``) make their factors together, not in a
    latency-bound launch each (one KV head of 1k tokens: ~24 us a layer on an H200, PERF_NOTES session 38)."""
    k0 = keys[0]
    if len(keys) == 1:
        return smooth_factors_triton(k0).unsqueeze(0)
    if k0.dim() != 4 or any(k.shape != k0.shape or k.stride() != k0.stride() or k.dtype != k0.dtype
                            or k.device != k0.device for k in keys):
        raise ValueError("smooth_factors_layers takes [b, Hk, T, d] keys of one shape, strides, dtype and device")
    es = k0.element_size()
    offs = [k.data_ptr() - k0.data_ptr() for k in keys]
    if any(o % es for o in offs):
        raise ValueError("smooth_factors_layers: keys must lie whole elements apart")
    tbl = torch.tensor([o // es for o in offs], dtype=torch.int64)
    if k0.is_cuda:  # through pinned memory: a pageable copy would wait for the stream
        tbl = tbl.pin_memory().to(k0.device, non_blocking=True)
    return _launch(k0, None, len(keys), tbl)


def _launch(k: torch.Tensor, nsub: Optional[int], layers: int, tbl: Optional[torch.Tensor]) -> torch.Tensor:
    """The pass over ``k`` (``layers`` > 1: and the layers ``tbl`` places after it) -> factors ``[(layers,) b, Hk,
    d]``."""
    device = k.device
    # the call's plan by every fact it is derived from: the first store of each smooth_hadamard layer (same shape)
    # finds it, and with it the workspace's views and the launch's memo key (the workspace lookup alone took 27 us a
    # layer on the GPU host; eval/PERF_NOTES.md session 36)
    pkey = (k.shape, k.stride(), k.dtype, device, nsub, layers)
    plan = _PLANS.get(pkey)
    if plan is None or plan[0] is not _WORKSPACE.get(plan[1]):  # new, or the workspace regrew since
        if len(_PLANS) >= 256:  # many prompt lengths: planned again on demand
            _PLANS.clear()
        plan = _PLANS[pkey] = _plan(k, nsub, layers)
    _, _, (part, cnt, arrive, no_table), grid, scalars, kw, key, out_shape = plan
    out = torch.empty(out_shape, device=device, dtype=torch.float32)
    # the memo's key: the plan's facts and the device Triton launches on now (read per call)
    key += (current_cuda_device() if k.is_cuda else -1,)
    args = (k, part, cnt, arrive, out, no_table if tbl is None else tbl)
    with on_device(device):
        lean(_smooth_stats_kernel).launch_memo(_MEMO, key, grid, args, scalars, kw, LeanLaunch.hooks_active())
    return out


def _plan(k: torch.Tensor, nsub: int | None, layers: int = 1) -> tuple:
    """``(workspace, its key, its views, grid, scalars, constexprs, memo key, output shape)`` of a call on ``k``
    (and ``layers - 1`` more layers like it)."""
    b, H, T, D = k.shape
    BD = _pow2(D)
    # chunks by one layer's rows: a layer's factors do not depend on how many layers launch with it
    BT, BC, nsub, NC = _chunking(T, b * H, BD, sm_count(k.device) if nsub is None else 0, nsub)
    rows = layers * b * H
    views = _workspace(k.device, rows * NC * 3 * BD, rows * NC, rows)
    # one layer reads no table: an int64 view of the counters stands in (the same binary as a launch of many layers)
    views += (views[2][:64].view(torch.int64),)
    ws_key = _device_key(k.device)
    lo, hi = SMOOTH_RANGE
    strides = k.stride()
    # every fact Triton specialises on but the pointers' alignment (LeanLaunch.launch_memo checks that): the first
    # store of each smooth_hadamard layer relaunches without the per-argument facts and the binder
    key = (k.dtype, H, strides, D)
    return (_WORKSPACE[ws_key], ws_key, views, (NC, b * H, layers), (T, H, NC, nsub, lo, hi, layers, *strides),
            dict(D=D, BD=BD, BT=BT, BC=BC, num_warps=4), key, (b, H, D) if layers == 1 else (layers, b, H, D))


_MEMO: dict = {}  # LeanLaunch.launch_memo's kernels by the call's facts
_PLANS: dict = {}  # smooth_factors_triton's plans by the call's facts (_plan)
_WORKSPACE: dict = {}


def _device_key(device: torch.device) -> tuple:
    """``(type, index)`` of ``device``, a bare "cuda" read as the current one."""
    if device.type == "cuda" and device.index is None:
        return device.type, current_cuda_device()
    return device.type, device.index


def _workspace(device: torch.device, n_part: int, n_cnt: int, n_rows: int) -> tuple:
    """The pass's per-device workspace, grown on demand: partials (fp32) and token counts (int32), which each program
    writes before its arrival and the finisher reads after the last one, and the arrival counters (int32, zeroed;
    every launch leaves them at zero: each row's finisher resets its own). Launches on one device's stream run in
    order, so they share it; not for concurrent streams (as ``store.stats_workspace``). A regrown workspace is a new
    tuple: the plans holding the old one's views are made again."""
    key = _device_key(torch.device(device))
    ws = _WORKSPACE.get(key)
    want = (n_part, n_cnt, max(n_rows, 64))
    if ws is None or any(t.numel() < n for t, n in zip(ws, want)):
        size = want if ws is None else [max(n, t.numel()) for n, t in zip(want, ws)]
        dev = torch.device(*key) if key[1] is not None else torch.device(key[0])
        ws = _WORKSPACE[key] = (torch.empty(size[0], dtype=torch.float32, device=dev),
                                torch.empty(size[1], dtype=torch.int32, device=dev),
                                torch.zeros(size[2], dtype=torch.int32, device=dev))
    return ws[0][:n_part], ws[1][:n_cnt], ws[2]


def smooth_factors(k: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """K -> Q smoothing factors ``s [b, Hk, d]`` fp32 of keys ``k [b, Hk, T, d]``: the Triton pass where the
    caller's kernels run (``kernel``; default: CUDA or TRITON_INTERPRET=1), else (CPU, empty K, torch.compile
    tracing) the torch twin ``rotation.smooth_scales``."""
    if kernel is None:
        kernel = use_triton(k.device)
    fast = kernel and k.shape[2] > 0 and not torch.compiler.is_compiling()  # compile traces the twin
    return smooth_factors_triton(k) if fast else smooth_scales(k)
