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
