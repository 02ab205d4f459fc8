"""eval/experiments/rounds_pooled.py: per-round ratios pooled over files, their intervals, the first decode step."""
import json

import pytest

from eval.experiments import rounds_pooled as rp


def _file(tmp_path, name, base_steps, turbo_steps, pool=None):
    rows = [{"config": "sdpa_dynamic", "batch": 1, "context": 1024, "decode_rounds_s": base_steps},
            {"config": "turbo_int4_eager", "batch": 1, "context": 1024, "decode_rounds_s": turbo_steps,
             "decode_step_med_rounds_s": turbo_steps, "decode_step_pool_s": pool}]
    p = tmp_path / name
    p.write_text(json.dumps({"rows": rows}))
    return str(p)


def test_pooled_ratios_are_per_round_and_span_files(tmp_path):
    a = _file(tmp_path, "a.json", [1.0, 2.0], [0.9, 2.2])
    b = _file(tmp_path, "b.json", [1.0], [1.0], pool=[3.0, 1.0, 1.0])  # one round of 3 clocked steps
    res = rp.pooled([a, b])
    s = res["ratios"]["turbo_int4_eager"]["decode_rounds_s"]
    assert s["rounds"] == 3 and s["median"] == pytest.approx(1.0)  # 0.9, 1.1, 1.0: paired within each round
    assert s["median_ci95"][0] <= s["median"] <= s["median_ci95"][1]
    assert s["frac_le_1"] == pytest.approx(2 / 3)
    assert "decode_step_med_rounds_s" not in res["ratios"]["turbo_int4_eager"]  # sdpa's row has none: no pairs
    (fs,) = res["first_steps"]
    assert (fs["first_step_ms"], fs["later_steps_ms"], fs["slow_later_steps"]) == (3000.0, 1000.0, 0.0)
    assert rp.gmean([0.5, 2.0]) == pytest.approx(1.0)


def test_step_ratios_split_the_first_step_from_the_later_ones():
    # one round of 3 clocked steps each: the base's first step is 1.5x its later ones, turbo's 3x
    base = {"decode_step_med_rounds_s": [1.0], "decode_step_pool_s": [3.0, 2.0, 2.0]}
    turbo = {"decode_step_med_rounds_s": [1.0], "decode_step_pool_s": [6.0, 2.0, 2.0]}
    r = rp.step_ratios(turbo, base)
    assert r["steps_mean"] == [pytest.approx(10 / 7)]
    assert r["later_steps_mean"] == [1.0] and r["later_steps_median"] == [1.0]
    assert r["steps_mean_first_as_base"] == [pytest.approx(1.0)]  # its first step as dear as the base's: a tie
    assert rp.step_ratios({"decode_step_pool_s": [1.0]}, base) == {}  # no rounds recorded: nothing paired
