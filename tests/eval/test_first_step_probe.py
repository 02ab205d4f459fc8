"""eval/experiments/first_step_probe.py on the CPU: a toy model's first and later decode steps, each reading present."""
import json

from eval.experiments import first_step_probe as fsp


def test_probe_reads_the_first_and_a_later_step(tmp_path):
    out = tmp_path / "p.json"
    assert fsp.main(["--tiny", "--layers", "2", "--shape", "1x64", "--configs", "sdpa_dynamic,turbo_int8_eager",
                     "--new-tokens", "4", "--later", "2", "--rounds", "2", "--out", str(out),
                     "--pstats", str(tmp_path)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["sdpa_dynamic", "turbo_int8_eager"]
    for r in rows:
        assert r["first_step_ms"] > 0 and r["later_step_ms"] > 0 and len(r["first_steps_ms"]) == 2
        assert len(r["gc"]["first"]["collections_by_generation"]) == 3
        assert set(r["cuda_api"]) == {"first", "later"}
        assert r["cprofile_diff"] and len(r["cprofile_diff"][0]) == 4
        assert r["cprofile_own_diff"] and len(r["cprofile_own_diff"][0]) == 4
        assert (tmp_path / f"{r['config']}_step0.pstats").exists() and (tmp_path / f"{r['config']}_step2.pstats").exists()


def test_profile_diff_orders_by_the_first_steps_excess():
    first = {"a": (2, 0.001, 0.005), "b": (1, 0.0, 0.001)}
    later = {"a": (1, 0.001, 0.001), "c": (1, 0.0, 0.002)}
    rows = fsp.profile_diff(first, later)
    assert [r[0] for r in rows] == ["a", "b", "c"] and rows[0][1] == 4000.0 and rows[0][3] == 1
