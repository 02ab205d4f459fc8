"""The Gluon Hopper prefill kernel (kernels/prefill_hopper.py) compiles for sm_90 on a CPU-only machine, through
Triton's real pipeline (Gluon -> TTGIR -> LLVM -> PTX -> ptxas), so CI notices when a Triton release stops compiling
it (issue 20: Gluon's API moves between releases). Each case also checks the code for what the design rests on: both
dots on 8-bit wgmma (P.V on a 16-bit wgmma for a 16-bit V), TMA loads in the producer, and the producer handing its
registers to the consumers (in the PTX: the SASS listing Triton keeps is cut short for a kernel this long). Runs in a
subprocess without TRITON_INTERPRET (``sm90.py``); this file doubles as its script."""
import json
import sys

import pytest

import sm90

# (head_dim, causal, schedule): the default schedule and each switch the GPU tests run, across the four shapes
CONFIGS = [(128, True, {}), (128, False, {"pv_parts": 2, "i2f": True}), (64, True, {"pv_parts": 1}),
           (64, False, {"pv_parts": 1, "i2f": False, "keys_permuted": False}),
           (128, True, {"v_dtype": "bfloat16"}), (64, False, {"v_dtype": "float16"}),  # P.V on 16-bit V
           (256, True, {"v_dtype": "bfloat16"}),  # head_dim 256: only on 16-bit V, in the serial order
           (64, True, {"v_dtype": "bfloat16", "two_ctas": False})]  # d 64's 16-bit P.V in one CTA an SM


def _compile(d, causal, schedule):
    from turbo_attn_hf.eval.experiments.gluon_sass import compile_sm90, ptxas_infos, sass_counts
    from turbo_attn_hf.kernels import prefill_hopper as ph

    from turbo_attn_hf.kernels.reference import PV_HALF_BLOCK_N

    cubin, ptx = compile_sm90(d, causal, **schedule)  # ptxas built the cubin from the PTX
    two = "v_dtype" in schedule and d in PV_HALF_BLOCK_N and schedule.get("two_ctas") is not False
    bn = PV_HALF_BLOCK_N[d] if two else ph.BLOCK_N
    checks = [("8-bit wgmma", f"wgmma.mma_async.sync.aligned.m64n{bn}k32.s32.s8.s8"),
              ("TMA loads", "cp.async.bulk.tensor"), ("register hand-over", "setmaxnreg.dec")]
    v = {"bfloat16": "bf16", "float16": "f16"}.get(schedule.get("v_dtype"))
    if v:  # P.V on V itself: a 16-bit wgmma with P from registers
        checks.append(("16-bit P.V wgmma", f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.{v}.{v}"))
    for what, pattern in checks:
        if pattern not in ptx:
            raise AssertionError(f"no {what} ({pattern}) in the PTX")
    if two:  # two CTAs of 3 warpgroups an SM: 64K registers and 228 KB of shared memory between them
        regs = sass_counts(cubin)[0]
        if not (0 < regs * 384 * 2 <= 65536 and compile_sm90.shared * 2 <= 228 * 1024 - 2048):
            raise AssertionError(f"two CTAs an SM do not fit: {regs} registers, {compile_sm90.shared} B shared")
    serial = [line for line in ptxas_infos(ptx) if "C7512" in line]
    if serial:  # the kernel would run, every MMA waited for where it is issued
        raise AssertionError(f"ptxas serializes the wgmma: {serial[0]}")


def test_the_gluon_prefill_kernel_compiles_for_sm90():
    from turbo_attn_hf.kernels import prefill_hopper

    if not prefill_hopper.gluon_available():
        pytest.skip("Gluon of a tested Triton release is not installed")
    sm90.run(__file__, CONFIGS, "Gluon prefill kernel (head_dim, causal, schedule)")


if __name__ == "__main__":
    sm90.main(_compile, json.loads(sys.argv[1]))
