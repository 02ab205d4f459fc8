"""Test set-up: on a machine without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1).

Must run before triton is imported anywhere, hence at conftest import time.
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _interpret_nan_max_reductions_in_numpy():
    """The interpreter reduces with a combine function it does not know (our NaN-keeping ``_max_nan``) one element
    at a time in Python: 70-90 % of a model test's time. ``np.max`` is that reduction (NaN-propagating max), so it
    is used instead; ``tests/kernels/test_quant.py`` checks the two agree, NaN and Inf rows included."""
    if HAS_CUDA:
        return
    import numpy as np
    from triton.runtime import interpreter

    from turbo_attn_hf.kernels import quant

    ops = getattr(interpreter, "ReduceOps", None)
    if ops is None or not hasattr(ops, "min_max") or getattr(ops.apply_impl, "turbo_nan_max", False):
        return  # another Triton: its own (correct, slow) reduction stays
    generic = ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is quant._max_nan:
            return self.min_max(input[0], val_reduce_op=np.max)
        return generic(self, input)

    apply_impl.turbo_nan_max = True
    apply_impl.generic = generic
    ops.apply_impl = apply_impl


_interpret_nan_max_reductions_in_numpy()


def pytest_collection_modifyitems(config, items):
    # a kernel test taking the ``device`` fixture runs its kernels on CUDA where there is one: on the GPU machine
    # ``-m "gpu or device_kernels"`` selects both kinds (``-m gpu`` alone would leave these on no device at all)
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device_kernels)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Device for kernel tests: CUDA when present, else CPU tensors through the Triton interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
