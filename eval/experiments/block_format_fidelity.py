"""Teacher-forced fidelity of the 4/2-bit decode path with finer packed-block groups (issue 23, CPU reference).

``error_budget.py`` (session 14) found int4's decode error split about equally between the 4-bit K and V blocks and
predicted, from each layer's attention output in isolation, ~5.2x the floor's KL with K in 32-token groups and V
in 32-channel groups. This reads the whole model (``eval.fidelity``, errors compounding through the layers) before
a format is written: the reference pack twin (``pack_blocks_ref``) also keeps each block's INT8 values restored
from a finer grouping, and the reference decode twin reads those instead of the stored codes.

Variants (comma list, ``--groups``):

* ``v<N>``: V per token in groups of N channels (now: one group of head_dim);
* ``k<N>``: K per channel in groups of N tokens (now: one group of block_size);
* ``v8`` / ``k8``: V / K blocks kept INT8 (their 4-bit packing left out);
* ``kfrac<F>``: K's integer step ``scale_int = ceil(span / (2**bits - 1))`` in steps of 1/F instead (a fixed-point
  scale with log2(F) fractional bits, the same int8 byte: F = 4 holds a 4-bit block's largest step, 254 / 15);
* ``vrest``: V restored with today's grouping: the control of the ``v`` variants, whose restored V tiles take the
  INT8 tiles' route (P quantized without the token scale, as error_budget's ``vgrp``).

A restored tile is found again by its packed bytes, scales and zeros (a block is packed once and read every
step). Only the decode reads change: the stored codes, the prefill and the INT8 buffer are today's.

    OMP_NUM_THREADS=1 python -m eval.experiments.block_format_fidelity --groups k32,v32 -- --model .carry/gemma/full \
        --gguf-file gemma-3-270m-q4_k_m.gguf --gguf-dense --presets int4 --modes decode --limit 4 --chunk 8 \
        --answers 0 --data-dir ../shared/data --out /tmp/fid_k32v32

Whole texts: a prompt cut to 512 tokens packs few blocks (the INT8 window holds the sink, the recent blocks and the
tail), so the 4-bit blocks would carry little of the context.
"""

from __future__ import annotations

import torch

from eval.experiments.patched_fidelity import run
from turbo_attn_hf.kernels import reference as R

_RESTORED: dict = {}  # (packed, scale, zero bytes of one tile) -> its INT8 values restored from the finer groups


def _key(packed: torch.Tensor, sc: torch.Tensor, zero: torch.Tensor) -> bytes:
    return b"|".join(t.contiguous().numpy().tobytes() for t in (packed, sc, zero))


def _regroup(pack, x8: torch.Tensor, bits: int, axis: int, n: int) -> torch.Tensor:
    """``x8 [N, R, C]`` restored after ``pack`` (``pack_blocks_ref``'s integer quantization) in groups of ``n``
    along ``axis`` (the reduced axis) instead of one group: ``[N, R, C]`` float."""
    N = x8.shape[0]
    x = x8 if axis == 0 else x8.transpose(1, 2)  # reduced axis first: [N, L, M]
    L = x.shape[1]
    xs = x.reshape(N * (L // n), n, x.shape[2])
    packed, sc, mn = pack(xs, bits, 0)
    out = R.unpack_blocks_ref(packed, sc, mn, bits, 0).float().reshape(N, L, x.shape[2])
    return out if axis == 0 else out.transpose(1, 2)


def _frac_restore(x8: torch.Tensor, bits: int, frac: int) -> torch.Tensor:
    """K tiles ``x8 [N, BS, D]`` restored from codes whose per-channel step is a multiple of ``1 / frac`` (min/max over
    the block's tokens; the code bound keeps a restore within 127 as ``pack_blocks_ref``'s does)."""
    x = x8.float()
    mn, mx = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    top = 2 ** bits - 1
    step = torch.clamp(torch.ceil(frac * (mx - mn) / top), min=1) / frac
    code = torch.minimum(torch.floor((x - mn) / step + 0.5).clamp(0, top), torch.floor((127 - mn) / step))
    return code * step + mn


def install(groups: list[str]) -> None:
    v_n = k_n = k_frac = None
    keep_v8 = keep_k8 = vrest = False
    for g in groups:
        if g.startswith("kfrac") and g[5:].isdigit():
            k_frac = int(g[5:])
        elif g == "v8":
            keep_v8 = True
        elif g == "k8":
            keep_k8 = True
        elif g == "vrest":
            vrest = True
        elif g[:1] in "vk" and g[1:].isdigit():
            v_n, k_n = (int(g[1:]), k_n) if g[0] == "v" else (v_n, int(g[1:]))
        else:
            raise SystemExit(f"block_format_fidelity: unknown group variant {g!r} (v<N>, k<N>, kfrac<F>, v8, k8, "
                             "vrest)")
    pack = R.pack_blocks_ref
    tiles = R._group_tiles_ref

    def pack_blocks_ref(x8, bits, axis):
        packed, sc, mn = pack(x8, bits, axis)
        N, Rr, C = x8.shape
        if Rr == C:
            raise SystemExit("block_format_fidelity: head_dim == block_size: K and V tiles look alike; use a model "
                             "whose head_dim differs from the block size (Gemma-3: 256)")
        is_v = Rr > C  # V tiles [d, BS], K tiles [BS, d]
        keep8, n = (keep_v8, v_n or (Rr if vrest else None)) if is_v else (keep_k8, k_n)
        frac = None if is_v else k_frac
        if not (keep8 or n or frac):
            return packed, sc, mn
        rest = x8.float() if keep8 else _frac_restore(x8, bits, frac) if frac else _regroup(pack, x8, bits, axis, n)
        for i in range(N):
            _RESTORED[_key(packed[i], sc[i], mn[i])] = rest[i]
        return packed, sc, mn

    def restored(packed, sc, zero, t):
        """Block ``t``'s restored values of every (batch row, head) ``[b, H, R, C]``, as packed in those tensors."""
        b, h = packed.shape[:2]
        return torch.stack([torch.stack([_RESTORED[_key(packed[bi, hi, t], sc[bi, hi, t], zero[bi, hi, t])]
                                         for hi in range(h)]) for bi in range(b)])

    def group_tiles_ref(grp, k_tail, v_tail, n_tail, bs, n_sink=0):
        for t, (j, k8, vc, vs, vz, kz) in enumerate(tiles(grp, k_tail, v_tail, n_tail, bs, n_sink)):
            if t < grp.n_blocks and grp.bits != 8:
                if k_n or keep_k8 or k_frac:
                    k8 = restored(grp.k, grp.k_scale, grp.k_zero, t)
                if v_n or keep_v8 or vrest:  # V tiles [d, BS] stored; the decode reads [BS, d] with scale 1, zero 0
                    vc = restored(grp.v, grp.v_scale, grp.v_zero, t).transpose(-1, -2)
                    vs, vz = torch.ones_like(vs), torch.zeros_like(vz)
            yield j, k8, vc, vs, vz, kz

    R.pack_blocks_ref = pack_blocks_ref
    R._group_tiles_ref = group_tiles_ref


def main(argv=None):
    return run(argv, __doc__.splitlines()[0], "--groups",
               "comma list: v<N>, k<N>, kfrac<F>, v8, k8, vrest (empty: today's format)", install)


if __name__ == "__main__":
    main()
