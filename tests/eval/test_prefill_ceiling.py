"""eval.experiments.prefill_ceiling: the arithmetic of issue 20's ceiling table on a hand-made bench row."""
import json

import pytest

from eval.experiments import prefill_ceiling as pc


def _rows(t_c, t_k, t_t, d=128, causal=False):
    shape = dict(d=d, L=4096, batch=4, heads=16, causal=causal)
    return [dict(shape, provider=p, ms=ms) for p, ms in
            (("sdpa_cudnn", t_c), ("kernel_hopper", t_k), ("turbo_hopper", t_t))]


def test_efficiencies_and_what_the_bar_needs():
    flops = 4 * 4 * 16 * 4096 ** 2 * 128
    floor_c = flops / pc.PEAK_BF16 * 1e3  # ms
    floor_k = (flops / 2 / pc.PEAK_INT8 + flops / 2 / pc.PEAK_BF16) * 1e3
    assert floor_k == pytest.approx(0.75 * floor_c, rel=1e-3)
    (r,) = pc.ceiling_rows(_rows(2 * floor_c, 2 * floor_k, 2 * floor_k + 0.1))
    assert r["eff_cudnn"] == pytest.approx(0.5) and r["eff_kernel"] == pytest.approx(0.5)
    assert r["passes_ms"] == pytest.approx(0.1) and r["bar"] == 1.2
    need = 2 * floor_c / 1.2
    assert r["need_kernel_ms_no_passes"] == pytest.approx(need)
    assert r["need_eff"] == pytest.approx(floor_k / (need - 0.1))
    assert pc.ceiling_rows(_rows(1, 1, 1, d=64))[0]["bar"] == 1.0


def test_passes_past_the_bar_need_an_infinite_efficiency_and_missing_providers_are_skipped():
    (r,) = pc.ceiling_rows(_rows(1.0, 0.5, 2.0))
    assert r["need_eff"] == float("inf")
    assert pc.ceiling_rows(_rows(1.0, 0.5, 2.0)[:2]) == []


def test_cli_writes_json_and_names_a_file_without_the_providers(tmp_path, capsys):
    src = tmp_path / "b.json"
    src.write_text(json.dumps(dict(rows=_rows(1.0, 0.9, 1.0), tree="abc")))
    pc.main([str(src), "--out", str(tmp_path / "o.json")])
    assert "| 128, 4k full | 1.2 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "o.json").read_text())["source_tree"] == "abc"
    src.write_text(json.dumps(dict(rows=_rows(1.0, 0.9, 1.0)[:1])))
    with pytest.raises(SystemExit, match="no row with sdpa_cudnn"):
        pc.main([str(src)])
