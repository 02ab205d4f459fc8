"""kernels/scratch.py: a plan's temporaries are reused on one stream, new on another, and bounded in size."""
import pytest
import torch

from turbo_attn_hf.kernels import scratch as S


def test_reused_on_the_same_stream(device):
    sc = S.Scratch((((2, 3), torch.int8), ((4,), torch.float32)), device)
    a = sc.get()
    b = sc.get()
    assert [t.shape for t in a] == [torch.Size((2, 3)), torch.Size((4,))] and [t.dtype for t in a] == [torch.int8,
                                                                                                     torch.float32]
    assert all(x is y for x, y in zip(a, b))


def test_budgets_and_release(device, monkeypatch):
    monkeypatch.setattr(S, "_held", [0])
    big = S.Scratch((((S.SCRATCH_MAX_BYTES + 1,), torch.int8),), device)
    assert big.get()[0] is not big.get()[0]  # over the per-set budget: allocated per call, never kept
    monkeypatch.setattr(S, "SCRATCH_TOTAL_BYTES", 100)
    kept = S.Scratch((((64,), torch.int8),), device)
    over = S.Scratch((((64,), torch.int8),), device)
    assert kept.get()[0] is kept.get()[0] and S._held[0] == 64
    assert over.get()[0] is not over.get()[0]  # the process budget is spent
    del kept
    assert S._held[0] == 0


@pytest.mark.gpu
def test_another_stream_gets_its_own_tensors():
    sc = S.Scratch((((8,), torch.float32),), torch.device("cuda"))
    a = sc.get()[0]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        b = sc.get()[0]
    assert b is not a and sc.get()[0] is a
