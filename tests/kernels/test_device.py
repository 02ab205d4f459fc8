"""on_device: Triton launches go to the tensors' GPU, not the current one (layers spread by device_map)."""
import contextlib

import torch

from turbo_attn_hf.kernels import device as D


def test_switches_only_to_another_cuda_device(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def fake_device(dev):
        entered.append(dev)
        yield

    monkeypatch.setattr(D, "current_cuda_device", lambda: 0)  # the C read on_device uses
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    for dev in (torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda")):
        with D.on_device(dev):
            pass
    assert entered == []
    with D.on_device(torch.device("cuda", 1)):
        assert entered == [torch.device("cuda", 1)]


def test_tensor_guard_switches_only_to_another_cuda_device(monkeypatch):
    """on_tensor_device: the same rule from a tensor's own device index (no torch.device made per call)."""
    entered = []

    @contextlib.contextmanager
    def fake_device(dev):
        entered.append(dev)
        yield

    class FakeCuda:  # a CUDA tensor's two facts the guard reads
        is_cuda = True

        def __init__(self, i):
            self.i = i

        def get_device(self):
            return self.i

    monkeypatch.setattr(D, "current_cuda_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    for t in (torch.zeros(1), FakeCuda(0)):
        with D.on_tensor_device(t):
            pass
    assert entered == []
    with D.on_tensor_device(FakeCuda(1)):
        assert entered == [1]
