"""Triton CPU interpreter (TRITON_INTERPRET=1): one place that says whether it is on, and the shims
that make Triton 3.6's interpreter compute what the GPU computes. Imported by every kernel module."""

from __future__ import annotations

import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), read through Triton."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os  # triton < 3.4 has no knobs

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device) -> bool:
    """Whether tensors on ``device`` run the Triton kernels (CUDA, or any device under the interpreter);
    otherwise callers take the PyTorch twin in ``reference.py``."""
    return device.type == "cuda" or interpreting()


def _interpreter_index_compat() -> None:
    """TRITON_INTERPRET=1 with NumPy >= 2.3: Triton 3.6's interpreter turns a runtime scalar (a 1-element
    array) into a Python int with ``int(arr)``, which NumPy now refuses, so ``for i in range(lo, hi, BN)``
    with runtime bounds fails. Re-register ``tensor.__index__`` to read the element. Interpreter only;
    idempotent."""
    if not interpreting():
        return
    try:
        import triton.runtime.interpreter as interp
    except ImportError:  # pragma: no cover
        return
    if getattr(interp, "_turbo_index_compat", False) or not hasattr(interp, "_patch_lang_tensor"):
        return
    orig = interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = _patch_lang_tensor
    interp._turbo_index_compat = True


def _unpatched_builder(flag: str):
    """The interpreter's ``InterpreterBuilder`` when the interpreter is on and the shim marked by ``flag`` is not
    installed yet, else None (the builder shims are idempotent)."""
    if not interpreting():
        return None
    try:
        import triton.runtime.interpreter as interp
    except ImportError:  # pragma: no cover
        return None
    builder = getattr(interp, "InterpreterBuilder", None)
    return None if builder is None or getattr(builder, flag, False) else builder


def _interpreter_exact_fma() -> None:
    """Triton 3.6's interpreter computes ``tl.math.fma`` as ``x * y + z`` in the operands' dtype (two
    roundings); the GPU's FFMA rounds once. Compute it in float64 and round once (``reference.fma``), so
    that the interpreter, the GPU and the reference agree. Interpreter only; idempotent."""
    builder = _unpatched_builder("_turbo_exact_fma")
    if builder is None:
        return
    import numpy as np
    import triton.runtime.interpreter as interp

    def create_fma(self, x, y, z):
        dt = z.data.dtype
        if dt == np.float32:
            out = (x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)).astype(dt)
        else:
            out = x.data * y.data + z.data
        return interp.TensorHandle(out, z.dtype.scalar)

    builder.create_fma = create_fma
    builder._turbo_exact_fma = True


def _interpreter_bf16_rne() -> None:
    """Triton 3.6's interpreter casts fp32 to bf16 by dropping the low 16 bits; the GPU (``cvt.rn.bf16.f32``) and
    PyTorch round to nearest even. Round the same way (the carry runs into the exponent; NaN stays a quiet NaN), so
    a kernel that emulates PyTorch's bf16 ops (``rope``) computes the same bits here; and widen bf16 to fp32 by the
    exact shift (the interpreter's own widening loses subnormals). Interpreter only; idempotent."""
    builder = _unpatched_builder("_turbo_bf16_rne")
    if builder is None:
        return
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            out = np.where(np.isnan(src.data), ((bits >> 16) | 0x40).astype(np.uint16), out)
            return interp.TensorHandle(out, dst_type.scalar)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            bits = np.ascontiguousarray(src.data).view(np.uint16).astype(np.uint32) << 16
            return interp.TensorHandle(bits.view(np.float32), dst_type.scalar)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_impl  # create_fp_trunc / create_fp_ext call self.cast_impl
    builder._turbo_bf16_rne = True


_interpreter_index_compat()
_interpreter_exact_fma()
_interpreter_bf16_rne()
