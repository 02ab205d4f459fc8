"""eval.experiments.block_format_fidelity: its patched reference twins read today's blocks bit for bit when the
variant asks for today's grouping, and finer groups restore the cache's INT8 values more closely."""
import pytest
import torch

from turbo_attn_hf.cache import TurboLayer
from turbo_attn_hf.config import TurboConfig
from turbo_attn_hf.eval.experiments import block_format_fidelity as B
from turbo_attn_hf.kernels import interpreter, reference as R

_TWINS = (R.pack_blocks_ref, R._group_tiles_ref)  # unpatched: each case installs its variant over these


def _decode(groups, monkeypatch):
    """One int4 layer (head_dim 128, block 64: 4 blocks packed), its decode output with ``groups`` installed, on
    the PyTorch twins (the experiment's path: CPU without the interpreter)."""
    monkeypatch.setattr(interpreter, "interpreting", lambda: False)
    monkeypatch.setattr(R, "pack_blocks_ref", _TWINS[0])
    monkeypatch.setattr(R, "_group_tiles_ref", _TWINS[1])
    monkeypatch.setattr(B, "_RESTORED", {})
    if groups is not None:
        B.install(groups)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 520, 128, generator=g).bfloat16() for _ in range(2))
    layer = TurboLayer(TurboConfig.preset("int4"), 0, 1)
    layer.update(k, v)
    assert layer.groups[0].bits == 4 and layer.groups[0].n_blocks >= 4
    q = torch.randn(1, 4, 1, 128, generator=g).bfloat16()
    kk, vv = layer.update(k[:, :, :1], v[:, :, :1])
    return layer.attention(q, kk, vv).float(), len(B._RESTORED)


def test_todays_grouping_reads_todays_blocks(monkeypatch):
    base, _ = _decode(None, monkeypatch)
    same_k, n = _decode(["k64"], monkeypatch)  # K in groups of the whole block: today's K
    assert n > 0 and torch.equal(same_k, base)


@pytest.mark.parametrize("v", ["v32", "v8"])
def test_finer_v_groups_move_the_output_toward_the_int8_cache(v, monkeypatch):
    rest, _ = _decode(["vrest"], monkeypatch)  # today's V values, by the restored route
    finer, _ = _decode([v], monkeypatch)
    exact, _ = _decode(["v8"], monkeypatch)  # V as the INT8 buffer held it before packing
    assert not torch.equal(finer, rest)
    assert (finer - exact).norm() <= (rest - exact).norm()


def test_square_tiles_are_refused(monkeypatch):
    monkeypatch.setattr(R, "pack_blocks_ref", _TWINS[0])
    monkeypatch.setattr(R, "_group_tiles_ref", _TWINS[1])
    B.install(["v32"])
    with pytest.raises(SystemExit, match="head_dim == block_size"):
        R.pack_blocks_ref(torch.zeros(2, 64, 64, dtype=torch.int8), 4, 0)


@pytest.mark.parametrize("k", ["k32", "k8"])
def test_finer_k_groups_move_the_output_toward_the_int8_cache(k, monkeypatch):
    today, _ = _decode(["k64"], monkeypatch)
    finer, _ = _decode([k], monkeypatch)
    exact, _ = _decode(["k8"], monkeypatch)
    assert not torch.equal(finer, today) or k == "k8"
    assert (finer - exact).norm() <= (today - exact).norm()


def test_frac_restore_with_integer_steps_is_todays_restore():
    """``kfrac1`` is today's integer step: the same restored values as ``pack_blocks_ref`` + ``unpack_blocks_ref``
    (round half up, the code bound at 127 included); finer steps restore closer."""
    g = torch.Generator().manual_seed(0)
    x8 = (torch.randn(6, 64, 128, generator=g) * 30).round().clamp(-127, 127).to(torch.int8)
    x8[0, :, :4] = 127 - torch.arange(64)[:, None] % 3  # groups at the top of the range: the bound applies
    x8[1, :, :4] = torch.arange(64)[:, None] % 7  # narrow spans: the integer step's ceil costs most
    today = R.unpack_blocks_ref(*R.pack_blocks_ref(x8, 4, 0), 4, 0).float()
    assert torch.equal(B._frac_restore(x8, 4, 1), today)
    frac = B._frac_restore(x8, 4, 4)
    assert frac.max() <= 127 and (frac - x8.float()).norm() < (today - x8.float()).norm()
