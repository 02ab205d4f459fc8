"""The decode kernel compiles for sm_90 (Hopper) on a CPU-only machine, for a grid of supported configurations.

The CPU tests run the kernels under TRITON_INTERPRET=1, which accepts shapes that Triton's NVIDIA backend
rejects (e.g. an 8-bit ``tl.dot`` with a reduction axis K < 32: head_dim 64 at 2 bits gave folded Q·Kᵀ dots of
K = 16 packed bytes and failed on the GPU only, with SmolLM2-135M). Here the kernel goes through the real
compile pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas cubin) for ``GPUTarget("cuda", 90, 32)``; no GPU is
needed. ``triton.jit`` returns interpreter functions when TRITON_INTERPRET=1 is set (tests/conftest.py does on
CPU), so the compiles run in a subprocess without it (this file doubles as its script).
"""
import json
import sys

import sm90

# (D, bits, G, Lq, block, variant), bits an int or a pair (two groups in one launch): head_dim 64/80/96/128/256 x bits 2/4/8 x GQA 1..8 (3 and 7 included) x
# one token and a chunk; block 16 (P·V dot padded) and 32 (no fold); the restoring loop; no split; masks.
# Cold compile ~75 s in all on 2 CPU cores (the M = 64-row chunk at D 128 alone took 51 s: left out).
CONFIGS = [
    (64, 2, 3, 1, 64, "fold"),  # SmolLM2-135M mixed: folded K dot would be K = 16 -> restoring loop
    (64, 4, 3, 1, 64, "fold"),  # SmolLM2-135M int4
    (64, 2, 3, 5, 64, "fold"),  # a chunk: M = 15 rows
    (64, 4, 3, 1, 64, "restore"),
    (80, 2, 7, 1, 64, "fold"),
    (96, 4, 1, 1, 64, "nosplit"),
    (128, 2, 4, 1, 64, "fold"),
    (128, 4, 8, 2, 64, "masks"),  # a chunk: M = 16 rows
    (128, 4, 7, 1, 32, "fold"),  # block 32: folded P·V would be K = 16 -> restoring loop
    (64, 8, 3, 1, 16, "fold"),  # block 16: P·V dot padded to K = 32
    (64, 2, 5, 2, 16, "fold"),
    (256, 2, 2, 1, 64, "fold"),
    (128, (4, 2), 4, 1, 64, "fold"),  # mixed: INT4 + INT2 heads, one launch
    (64, (4, 2), 3, 1, 64, "fold"),  # SmolLM2-135M mixed: the INT2 half takes the restoring loop
    (128, (4, 2), 4, 1, 64, "lens"),  # a static cache in a CUDA graph: lengths and shares on the device
    (128, 4, 4, 1, 64, "lens"),
    (128, 4, 4, 1, 64, "rotate"),  # rotate_qk: the query's smoothing factor and Hadamard butterfly in the prologue
    (96, 4, 3, 5, 64, "rotate"),  # blocks of 32 (block-diagonal), a chunk: M = 15 rows
    (128, (4, 2), 4, 1, 64, "store"),  # an eager decode step: the new token stored by the decode launch
    (64, 8, 3, 1, 64, "store"),
    (256, 4, 4, 1, 64, "rotate-store"),  # Gemma-3's heads: the token's K rotated (mul.rn) and stored by the launch
    (256, 4, 4, 1, 64, "gemma"),  # Gemma-3-270M's eager step: INT8 K blocks, window, softcap, rotated, stored token
    (256, 4, 4, 1, 64, "k8"),  # INT8 K + INT4 V blocks (issue 23: Gemma-3's shape), masks and softcap on
    (128, (4, 2), 4, 1, 64, "k8"),
    (64, 2, 3, 1, 16, "k8"),  # block 16: the restoring loop over INT8 K
]


def _compile(D, bits, G, Lq, BS, variant):
    """Compile ``_decode_kernel`` as the launcher would launch it (turbo_decode_attention) for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    from turbo_attn_hf.kernels.decode import _decode_kernel, _merge_chunk, _pow2
    from turbo_attn_hf.kernels.rotation import rot_scale, rotation_block

    bits0, bits1 = (bits, bits) if isinstance(bits, int) else bits  # a pair: one launch for two bit groups
    sig = dict(q="*bf16", sk="*fp32", mk="*fp32", kt="*i8", vt="*i8", sv="*fp32", qsm="*fp32", kvalid="*i8", o="*bf16",
               po="*fp32", pml="*fp32", cnt="*i32", lens="*i32", kn="*bf16", vn="*bf16", nf="*i32")
    for g, bg in (("0", bits0), ("1", bits1)):
        code = "*i8" if bg == 8 else "*u8"
        sig.update({"heads" + g: "*i32", "kp" + g: "*i8" if variant in ("k8", "gemma") else code, "ks" + g: "*i8",
                    "kz" + g: "*i8", "vp" + g: code, "vsz" + g: "*i8"})
    for name in ("n_blocks", "n_tail", "n_sink", "tail_cap", "Lq", "kv_len", "kv_row", "T0", "TPS0", "TPS1", "S0", "S1",
                 "N_M", "B", "window"):
        sig[name] = "i32"
    for name in ("softcap", "sas_thr", "qscale"):
        sig[name] = "fp32"
    for name in ("stride_qb", "stride_qh", "stride_ql"):
        sig[name] = "i32"
    for g in ("0", "1"):
        for name in ("kb", "kh", "sb", "sh", "vb", "vh", "vsb", "vsh"):
            sig[f"stride_{name}{g}"] = "i32"
    for name in ("nkb", "nkh", "nvb", "nvh"):
        sig[f"stride_{name}"] = "i32"
    for name in ("H0", "H1", "HK"):
        sig[name] = "i32"
    BD, M = _pow2(D), G * Lq
    BM = min(64, max(4, _pow2(M)))
    split = variant != "nosplit"
    masks = variant in ("masks", "lens", "k8", "gemma")
    rotate = variant in ("rotate", "rotate-store", "gemma")
    store = variant in ("store", "rotate-store", "gemma")
    cx = dict(G=G, D=D, BD=BD, BS=BS, BM=BM, BITS0=bits0, BITS1=bits1, TWO_GROUPS=not isinstance(bits, int),
              K8=variant in ("k8", "gemma"),
              IS_CAUSAL=True, HAS_WINDOW=masks, HAS_SOFTCAP=masks,
              HAS_MEAN=True, HAS_KVALID=masks, USE_SAS=masks, SPLIT=split, FUSED_MERGE=split,
              FOLD=variant != "restore", USE_ASM=True, SC=_merge_chunk(8, BM, BD, 1), LENS=variant == "lens",
              ROTATE=rotate, ROT_N=rotation_block(D) if rotate else 1, HAS_FACTOR=rotate,
              ROT_C=rot_scale(rotation_block(D)) if rotate else 1.0, STORE=store, COUNT=store)
    sig.update({k: "constexpr" for k in cx})
    src = triton.compiler.ASTSource(fn=_decode_kernel, signature=sig, constexprs=cx)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, num_stages=2))


def test_decode_kernel_compiles_for_sm90():
    sm90.run(__file__, CONFIGS, "decode kernel (D, bits, G, Lq, block, variant)")


if __name__ == "__main__":
    sm90.main(_compile, json.loads(sys.argv[1]))
