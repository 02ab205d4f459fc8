"""Test set-up: on a machine without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1).

Must run before triton is imported anywhere, hence at conftest import time.
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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
