"""eval/bench_store.py --dry-run: the CPU set-up of the GPU benchmark (interpreter, tiny shapes)."""
import json


def test_bench_store_dry_run(tmp_path):
    from eval.bench_store import main

    assert main(["--dry-run", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_store_dryrun.json").read_text())["rows"]
    assert len(rows) == 24
    for r in rows:
        if r["fused"]:
            # the first prefill's store: stats (K mean, scales, head choice) + store, nothing else
            assert r["triton_launches"] == 2 and r["launches"] == 2 and r["host_syncs"] == 0, r
        else:
            assert r["launches"] > 20, r
