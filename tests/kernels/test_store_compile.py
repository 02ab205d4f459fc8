"""The rotating store kernels compile for sm_90 (Hopper) on a CPU-only machine: ``_store_tokens_kernel`` (a decode
token, the store's own launch) and ``_store_step_kernel`` (the static cache's step) with ``rotate_qk`` on, whose K
rotation is ``hadamard._rotate_keys`` — shared with the decode launch, which passes it one more (``RN``) argument;
these two take its default. As ``test_decode_compile.py``: the real compile pipeline for ``GPUTarget("cuda", 90,
32)`` in a subprocess (``sm90``)."""
import json
import sys

import sm90


def _compile(name):
    import triton
    from triton.backends.compiler import GPUTarget

    from turbo_attn_hf.kernels.rotation import rot_scale
    from turbo_attn_hf.kernels.store import _store_tokens_kernel
    from turbo_attn_hf.kernels.store_step import _store_step_kernel

    rot = dict(ROTATE=True, ROT_N=256, HAS_FACTOR=True, ROT_C=rot_scale(256))
    if name == "store_tokens":
        fn = _store_tokens_kernel
        sig = dict(k="*bf16", v="*bf16", sk="*fp32", mk="*fp32", sv="*fp32", kt="*i8", vt="*i8", flag="*i32",
                   smf="*fp32", slot="i32", T="i32", stride_kb="i32", stride_kh="i32", stride_kt="i32",
                   stride_vb="i32", stride_vh="i32", stride_vt="i32", H="i32", C="i32")
        cx = dict(D=256, BD=256, BT=1, HAS_MEAN=True, COUNT=True, **rot)
    else:
        fn = _store_step_kernel
        sig = dict(k="*bf16", v="*bf16", sk="*fp32", mk="*fp32", sv="*fp32", kt="*i8", vt="*i8", flag="*i32",
                   lens="*i32", arrive="*i32", overflow="*i32", smf="*fp32")
        for g in "012":
            sig.update({f"h{g}": "*i32", f"gk{g}": "*i8", f"gv{g}": "*u8", f"gks{g}": "*i8", f"gkz{g}": "*i8",
                        f"gvsz{g}": "*i8"})
        sig.update(CAP="i32", stride_kb="i32", stride_kh="i32", stride_vb="i32", stride_vh="i32")
        cx = dict(H=1, C=128, S0=0, D=256, BD=256, BS=64, BREC=64, H0=1, H1=0, BITS0=4, BITS1=4, BITS2=8, K8=True,
                  HAS_MEAN=True, COUNT=True, **rot)
    sig.update({k: "constexpr" for k in cx})
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cx)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, enable_fp_fusion=False))


def test_rotating_store_kernels_compile_for_sm90():
    sm90.run(__file__, [["store_tokens"], ["store_step"]], "rotating store kernel")


if __name__ == "__main__":
    sm90.main(_compile, json.loads(sys.argv[1]))
