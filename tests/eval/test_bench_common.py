"""eval.bench_common helpers that the GPU experiments lean on, checked on the CPU."""
import json


def test_row_log_rewrites_its_file_after_every_row(tmp_path, capsys):
    """A GPU command cut by its time limit keeps the rows it measured (two sweeps lost theirs in session 33)."""
    from eval.bench_common import RowLog

    path = tmp_path / "sweep.json"
    log = RowLog(path, {"machine": {"device": "cpu"}})
    log.add("store", {"L": 1024, "total_us": 30.9})
    assert json.loads(path.read_text()) == {"machine": {"device": "cpu"}, "store": [{"L": 1024, "total_us": 30.9}]}
    log.add("store", {"L": 4096, "total_us": 91.8})
    log.add("decode", {"ctx": 4096})
    data = json.loads(path.read_text())
    assert [r["L"] for r in data["store"]] == [1024, 4096] and data["machine"] == {"device": "cpu"}
    assert data["decode"] == [{"ctx": 4096}]
    assert capsys.readouterr().out.count("\n") == 3  # each row printed as it comes
