"""Compiling kernels for sm_90 (Hopper) on a CPU-only machine, shared by the ``*_compile`` tests.

``triton.jit`` returns interpreter functions under TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU), so a test
runs its compiles in a subprocess without it: the test file itself as the script, ``main(compile_one, cases)`` in its
``__main__`` block, ``run(test_file, cases)`` in the test."""
import json
import os
import subprocess
import sys

import pytest


def probe():
    """None if a trivial kernel compiles for sm_90 here, else the reason it cannot."""
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget

        @triton.jit
        def _copy(x, y):
            tl.store(y + tl.arange(0, 16), tl.load(x + tl.arange(0, 16)))

        triton.compile(triton.compiler.ASTSource(fn=_copy, signature=dict(x="*fp32", y="*fp32")),
                       target=GPUTarget("cuda", 90, 32))
        return None
    except Exception as e:  # noqa: BLE001 - any failure means "cannot compile for sm_90 on this machine"
        return f"{type(e).__name__}: {str(e)[-300:]}"


def main(compile_one, cases) -> None:
    """The subprocess: ``compile_one(*case)`` for every case; prints ``{"results": {case: None | the error}}`` (every
    failing case with its innermost cause: Triton's message names only the call site), or ``{"unavailable": why}``."""
    reason = probe()
    if reason is not None:
        print(json.dumps({"unavailable": reason}))
        return
    res = {}
    for c in cases:
        try:
            compile_one(*c)
            res[repr(tuple(c))] = None
        except Exception as e:  # noqa: BLE001 - report every failing configuration, not only the first
            causes = []
            while e is not None:
                causes.append(f"{type(e).__name__}: {str(e)[-600:]}")
                e = e.__cause__
            res[repr(tuple(c))] = "\n  raised in ".join(reversed(causes))
    print(json.dumps({"results": res}))


def run(test_file: str, cases, what: str, timeout: int = 900) -> None:
    """Run ``test_file`` as the compile subprocess over ``cases``; skip where sm_90 cannot be compiled here, fail
    naming every case that does not compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, test_file, json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"compile subprocess failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    out = json.loads(lines[-1])
    if "unavailable" in out:
        pytest.skip(f"cannot compile Triton kernels for sm_90 on this machine: {out['unavailable']}")
    failed = {k: v for k, v in out["results"].items() if v is not None}
    assert not failed, f"{what} fails to compile for sm_90:\n" + "\n".join(f"{k}: {v}" for k, v in failed.items())
