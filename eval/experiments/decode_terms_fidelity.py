"""Teacher-forced fidelity of the decode path with one of its 8-bit roundings removed (issue 23, CPU reference).

``error_budget.py`` splits the attention output's error per layer in isolation; this runs the whole model
(``eval.fidelity``, errors compounding through the layers) with the reference decode twin patched, to read what
a kernel variant would buy in KL / top-1 before it is written:

* ``q``: the decode query ``q' = q * s_k`` kept as float codes (``prepare_query_ref`` without the rounding;
  a bf16/fp32 Q.K on dequantized K codes in the kernel);
* ``p``: the P.V weights ``w = p * s_t`` kept unrounded (``pv_tile_ref`` without ``w8``'s rounding; a 16-bit P
  with dequantized V codes in the kernel).

Only the reference's decode path changes (the CPU path without ``TRITON_INTERPRET``); prefill is untouched.

    OMP_NUM_THREADS=1 python -m eval.experiments.decode_terms_fidelity --exact q,p -- --model .carry/gemma/full \
        --gguf-file gemma-3-270m-q4_k_m.gguf --gguf-dense --presets int8 --limit 4 --chunk 8 --answers 0 \
        --data-dir ../shared/data --out /tmp/fid_qp
"""

from __future__ import annotations

import torch

from eval.experiments.patched_fidelity import run
from turbo_attn_hf.kernels import reference as R

TERMS = ("q", "p")


def _exact_query(prepare):
    """``prepare_query_ref`` with its one rounding, ``_symmetric_int8`` of ``q'``, swapped for the unrounded codes
    while it runs (the same step ``amax / 127``; the other twins keep theirs)."""
    def unrounded(x, amax, dim):
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        return x * inv.unsqueeze(dim)

    def prepare_query(*args, **kwargs):
        rounded, R._symmetric_int8 = R._symmetric_int8, unrounded
        try:
            return prepare(*args, **kwargs)
        finally:
            R._symmetric_int8 = rounded

    return prepare_query


def _exact_p(p, vc, vs, vz):
    w = p * vs[..., None, :]
    pc = (w.to(torch.float64) @ vc.to(torch.float64)).to(torch.float32)
    return pc + (p * vz[..., None, :]).sum(-1)[..., None]


def install(terms) -> None:
    bad = set(terms) - set(TERMS)
    if bad:
        raise SystemExit(f"decode_terms_fidelity: unknown term(s) {sorted(bad)}; choose from {', '.join(TERMS)}")
    if "q" in terms:
        R.prepare_query_ref = _exact_query(R.prepare_query_ref)
    if "p" in terms:
        R.pv_tile_ref = _exact_p


def main(argv=None):
    return run(argv, __doc__.splitlines()[0], "--exact",
               "comma list of decode terms left unrounded: q, p (empty: none)", install)


if __name__ == "__main__":
    main()
