"""The static TurboCache's decode step as two ``torch.library`` custom ops, so torch.compile traces a decode step
without a graph break and CUDA graphs capture it (HF's ``cache_implementation="static"`` + ``CompileConfig``).

* ``turbo_attn::store_step``: one token per row into a layer's storage, lengths on the device
  (``kernels.store_step.store_step``); mutates the INT8 buffer, the packed groups, ``lens`` and the counters.
* ``turbo_attn::decode_step``: attention of the step's query over that storage (``kernels.decode`` with
  ``lens=``: the split plan is made for the capacity, the kernel reads the lengths).

The storage goes in as explicit tensors (a layer's groups flattened: per group ``heads, k, v, k_scale, k_zero,
v_sz``, INT8 groups repeating ``k`` for the three they do not have) — not through Python objects — so the
ops are opaque, functional-enough nodes for inductor. On a CPU without the Triton interpreter the ops run the
PyTorch store and ``reference.turbo_decode_ref`` on host copies of the lengths (CPU: no graph to capture).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .kernels.device import on_tensor_device
from .kernels.interpreter import use_triton
from .kernels.pack import PackedKV

__all__ = ["flatten_groups", "unflatten_groups"]

_PER_GROUP = 6


def flatten_groups(groups: list) -> tuple[list, list]:
    """``(tensors, bits)`` of a layer's ``PackedKV`` list, as the ops take them."""
    ts, bits = [], []
    for g in groups:
        ts += [g.heads, g.k, g.v] + [t if t is not None else g.k for t in (g.k_scale, g.k_zero, g.v_sz)]
        bits.append(g.bits)
    return ts, bits


def unflatten_groups(ts: List[torch.Tensor], bits: List[int], n_blocks: int = 0) -> list:
    out = []
    for i, b in enumerate(bits):
        heads, k, v, ks, kz, vsz = ts[_PER_GROUP * i:_PER_GROUP * (i + 1)]
        if b == 8:
            ks = kz = vsz = None
        out.append(PackedKV(b, heads, k, v, ks, kz, n_blocks=n_blocks, v_sz=vsz))
    return out


@torch.library.custom_op("turbo_attn::store_step", mutates_args=("k_tail", "v_tail", "group_tensors", "lens",
                                                                  "counters", "nonfinite"))
def store_step(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, k_mean: Optional[torch.Tensor],
               v_scale: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, group_tensors: List[torch.Tensor],
               group_bits: List[int], n_sink: int, lens: torch.Tensor, counters: torch.Tensor,
               nonfinite: torch.Tensor, qk_smooth: Optional[torch.Tensor], rotate: bool) -> None:
    """Store one token ``k, v [b, H, 1, D]``; ``lens = [n_blocks, n_tail]``; ``counters`` int32 ``[2]``: arrival
    (zero between calls), overflow steps; ``nonfinite`` int32 ``[1]``: stored vectors with an inf/NaN;
    ``rotate``: K is the caller's, rotated into the stored basis on the way in (``qk_smooth``: its factors)."""
    groups = unflatten_groups(group_tensors, group_bits)
    if use_triton(k.device):
        from .kernels.store_step import store_step as launch

        with on_tensor_device(k):  # Triton launches on the current device (a compiled step sets none for us)
            launch(k, v, k_scale, k_mean, v_scale, k_tail, v_tail, groups, n_sink, lens, counters[0:1],
                   counters[1:2], nonfinite=nonfinite, rotate=rotate, qk_smooth=qk_smooth)
        return
    if rotate:
        from .kernels.reference import rotate_keys_ref

        k = rotate_keys_ref(k, qk_smooth)
    _store_step_host(k, v, k_scale, k_mean, v_scale, k_tail, v_tail, groups, n_sink, lens, counters, nonfinite)


@store_step.register_fake
def _(k, v, k_scale, k_mean, v_scale, k_tail, v_tail, group_tensors, group_bits, n_sink, lens, counters, nonfinite,
      qk_smooth, rotate):
    return None


def _store_step_host(k, v, k_scale, k_mean, v_scale, k_tail, v_tail, groups, n_sink, lens, counters,
                     nonfinite) -> None:
    """The same step in PyTorch on host lengths (CPU without the interpreter)."""
    from .kernels.pack import quantize_int8

    nb, nt = (int(x) for x in lens.tolist())
    C = k_tail.shape[2]
    bs = groups[0].block_size
    full = nt + 1 == C
    if full and nb >= groups[0].capacity:
        counters[1] += 1
        return
    nonfinite += (~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))).sum().to(torch.int32)
    k_tail[:, :, nt:nt + 1] = quantize_int8(k, k_scale, k_mean)
    v_tail[:, :, :, nt:nt + 1] = quantize_int8(v, v_scale).transpose(-1, -2)
    if not full:
        lens[1] = nt + 1
        return
    k8 = k_tail[:, :, n_sink:n_sink + bs]
    v8 = v_tail[:, :, :, n_sink:n_sink + bs].transpose(-1, -2)
    for g in groups:
        g.n_blocks = nb
        idx = g.heads.long()
        g.append(k8.index_select(1, idx), v8.index_select(1, idx))
    k_tail[:, :, n_sink:C - bs] = k_tail[:, :, n_sink + bs:C].clone()
    v_tail[:, :, :, n_sink:C - bs] = v_tail[:, :, :, n_sink + bs:C].clone()
    lens[0] = nb + 1
    lens[1] = C - bs


@torch.library.custom_op("turbo_attn::decode_step", mutates_args=())
def decode_step(q: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, k_scale: torch.Tensor,
                v_scale: torch.Tensor, k_mean: Optional[torch.Tensor], group_tensors: List[torch.Tensor],
                group_bits: List[int], n_sink: int, lens: torch.Tensor, key_valid: Optional[torch.Tensor],
                scale: float, causal: bool, window: int, softcap: float, softmax: str,
                sas_threshold: float, qk_smooth: Optional[torch.Tensor], rotate: bool) -> torch.Tensor:
    """``[b, Lq, HQ, D]`` attention of ``q [b, HQ, Lq, D]`` over a static layer's storage (``window`` 0 / ``softcap``
    0.0: none); ``key_valid [b, >= kv_len]`` bool or None; ``rotate``: K is stored rotated, the unrotated query
    is rotated in the kernel (``qk_smooth``: the factors)."""
    kw = dict(scale=scale, causal=causal, window=window or None, softcap=softcap or None, n_sink=n_sink,
              softmax=softmax, sas_threshold=sas_threshold, rotate=rotate, qk_smooth=qk_smooth)
    if use_triton(q.device):
        from .kernels.decode import turbo_decode_attention

        groups = unflatten_groups(group_tensors, group_bits)
        with on_tensor_device(q):
            return turbo_decode_attention(q, groups, k_tail, v_tail, 0, k_scale, v_scale, k_mean,
                                          key_valid=key_valid, lens=lens, **kw)
    from .kernels.reference import turbo_decode_ref

    nb, nt = (int(x) for x in lens.tolist())
    groups = unflatten_groups(group_tensors, group_bits, n_blocks=nb)
    if key_valid is not None:
        key_valid = key_valid[:, :nb * groups[0].block_size + nt]
    return turbo_decode_ref(q, groups, k_tail, v_tail, nt, k_scale, v_scale, k_mean, key_valid=key_valid, **kw)


@decode_step.register_fake
def _(q, k_tail, v_tail, k_scale, v_scale, k_mean, group_tensors, group_bits, n_sink, lens, key_valid, scale, causal,
      window, softcap, softmax, sas_threshold, qk_smooth, rotate):
    b, hq, lq, d = q.shape
    return q.new_empty(b, lq, hq, d)
