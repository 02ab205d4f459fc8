"""The Gluon Hopper prefill kernel compiled for sm_90 on a CPU-only machine (issue 20): registers, spill stores and
loads, and the SASS instruction counts by opcode, per head_dim / causal / schedule, so a change to the kernel's
instructions a block can be counted before a GPU session measures it. Runs Triton's real pipeline (Gluon -> PTX ->
ptxas) and the ``cuobjdump`` / ``nvdisasm`` that ship with Triton; needs no GPU and no TRITON_INTERPRET.

    python -m eval.experiments.gluon_sass [--dims 128,64] [--causal 0,1] [--schedules '{};{"pv_parts":1}']
        [--v int8,bfloat16] [--top 16]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile


def compile_sm90(d: int, causal: bool, v_dtype: str = "int8", **schedule):
    """(cubin bytes, ptx) of ``_int8_attn_fwd_ws_kernel`` for sm_90 at head_dim ``d``; ``v_dtype``: "int8" (V^T,
    INT8 P.V) or "bfloat16" / "float16" (P.V on 16-bit V); ``schedule``: ``ws_spec``'s switches (``pv_parts``,
    ...)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from turbo_attn_hf.kernels import prefill_hopper as ph

    b, hq, hk, L = 1, 4, 2, 256
    q8, k8 = torch.zeros(b, hq, L, d, dtype=torch.int8), torch.zeros(b, hk, L, d, dtype=torch.int8)
    v8t = (torch.zeros(b, hk, d, L, dtype=torch.int8) if v_dtype == "int8"
           else torch.zeros(b, hk, L, d, dtype=getattr(torch, v_dtype)))
    sq, sk, sv = torch.zeros(b, hq, L), torch.zeros(b, hk, L), torch.zeros(b, hk, L // ph.BLOCK_N, d)
    out = torch.empty(b, L, hq, d, dtype=torch.bfloat16)
    _, scalars, kw = ph.ws_spec(q8, sq, k8, sk, v8t, sv, out, causal=causal, Lk=L, **schedule)
    fn = ph._int8_attn_fwd_ws_kernel
    args = list(ph.descriptors(q8, k8, v8t, sk, sv, kw["BN"])) + [sq, sk, out] + list(scalars)
    sig = {p.name: mangle_type(a) for p, a in zip(fn.params, args)}
    options = {k: kw[k] for k in ("num_warps", "maxnreg") if k in kw}  # compile options, not constexprs
    cx = {k: v for k, v in kw.items() if k not in options}
    sig.update({k: "constexpr" for k in cx})
    k = triton.compile(GluonASTSource(fn, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                       options=options)
    compile_sm90.shared = k.metadata.shared  # bytes of shared memory a program (dynamic)
    return k.asm["cubin"], k.asm["ptx"]


def ptxas_infos(ptx: str) -> list[str]:
    """ptxas's ``-v`` info and warning lines for the PTX (sm_90a), e.g. C7512 when it serializes every wgmma of the
    kernel (an accumulator in flight that it cannot keep in registers)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    return [line.strip() for line in (res.stdout + res.stderr).splitlines() if line.strip()]


def sass_counts(cubin: bytes) -> tuple[int, collections.Counter]:
    """(registers, opcode counts) of a cubin, through the ``cuobjdump`` and ``nvdisasm`` Triton ships."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    regs = int(m.group(1)) if (m := re.search(r"REG:(\d+)", usage)) else -1
    ops = collections.Counter()
    for line in sass.splitlines():
        line = line.strip()
        if line.startswith("/*") and "*/" in line:
            toks = [t for t in line.split("*/", 1)[1].strip().rstrip(";").split() if not t.startswith("@")]
            if toks:
                ops[toks[0].split(".")[0]] += 1
    return regs, ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--schedules", default="{}", help="JSON objects of launch_ws switches, joined by ';'")
    ap.add_argument("--v", default="int8", help="V operand dtypes: int8 (INT8 P.V), bfloat16, float16")
    ap.add_argument("--top", type=int, default=16)
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("gluon_sass: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    for d in map(int, a.dims.split(",")):
        for causal in map(int, a.causal.split(",")):
            for sched, v in ((sc, v) for sc in map(json.loads, a.schedules.split(";")) for v in a.v.split(",")):
                cubin, ptx = compile_sm90(d, bool(causal), v, **sched)
                regs, ops = sass_counts(cubin)
                maxnreg = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
                serial = any("C7512" in line for line in ptxas_infos(ptx))
                print(f"d {d} causal {causal} V {v} {json.dumps(sched)}: {sum(ops.values())} SASS instructions, "
                      f"shared memory {compile_sm90.shared} B, "
                      f"kernel registers {regs}, setmaxnreg {maxnreg}, spill stores {ops['STL']} / loads {ops['LDL']}"
                      f"{', WGMMA SERIALIZED (ptxas C7512)' if serial else ''}")
                print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(a.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
