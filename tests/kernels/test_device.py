"""on_device / on_tensor_device: Triton launches go to the tensors' GPU, not the current one (layers spread by
device_map)."""
import contextlib

import pytest
import torch

from turbo_attn_hf.kernels import device as D


@pytest.fixture
def entered(monkeypatch):
    """The devices a guard switched to (``torch.cuda.device`` recorded); device 0 is current."""
    seen = []

    @contextlib.contextmanager
    def fake_device(dev):
        seen.append(dev)
        yield

    monkeypatch.setattr(D, "current_cuda_device", lambda: 0)  # the C read the guards use
    monkeypatch.setattr(D, "several_gpus", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    return seen


def test_switches_only_to_another_cuda_device(entered):
    for dev in (torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda")):
        with D.on_device(dev):
            pass
    assert entered == []
    with D.on_device(torch.device("cuda", 1)):
        assert entered == [torch.device("cuda", 1)]


class _FakeCuda:
    """The two facts of a CUDA tensor ``on_tensor_device`` reads."""

    is_cuda = True

    def __init__(self, index):
        self.index = index

    def get_device(self):
        return self.index


def test_tensor_guard_switches_only_to_another_cuda_device(entered):
    """The same rule from a tensor's own device index (no torch.device made per call)."""
    for t in (torch.zeros(1), _FakeCuda(0)):
        with D.on_tensor_device(t):
            pass
    assert entered == []
    with D.on_tensor_device(_FakeCuda(1)):
        assert entered == [1]


def test_one_gpu_reads_no_device(entered, monkeypatch):
    """With one visible GPU the current device is the tensors': no device read, no switch."""
    def no_read():
        raise AssertionError("a guard read the current device with one GPU")

    monkeypatch.setattr(D, "several_gpus", lambda: False)
    monkeypatch.setattr(D, "current_cuda_device", no_read)
    with D.on_device(torch.device("cuda", 0)), D.on_tensor_device(_FakeCuda(0)):
        pass
    assert entered == []


def test_guards_trace_whole_under_torch_compile(monkeypatch):
    """Inside a compiled region the guards read no device: the C read (``torch._C._cuda_getDevice``) is not
    traceable, and one graph break per call split HF's compiled decode step into ~6 CUDA graphs a layer (H200,
    session 23; ``several_gpus`` did it again in session 24). fullgraph=True raises on any break; the device read and
    the device count are made to raise as they would in a trace."""
    import torch._dynamo

    def untraceable():
        raise AssertionError("the guard read the current device inside a compiled region")

    def device_count():
        raise AssertionError("the guard counted devices inside a compiled region (torch.cuda.device_count: a break)")

    monkeypatch.setattr(D, "current_cuda_device", untraceable)
    monkeypatch.setattr(D, "several_gpus", device_count)

    def step(x):
        with D.on_device(torch.device("cuda", 1)):
            with D.on_tensor_device(x):
                return x + 1

    torch._dynamo.reset()
    try:
        out = torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2))
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, torch.full((2,), 2.0))
