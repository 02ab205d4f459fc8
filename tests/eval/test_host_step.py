"""eval/experiments/host_step.py on the CPU (launches stubbed, in a subprocess: the stubs patch Triton for the whole
process): ``--per-step`` reads each decode step of new caches and its update / attention split."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_per_step_reads_each_step_of_a_new_cache(tmp_path):
    out = tmp_path / "h.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the stubs replace the interpreter
    r = subprocess.run([sys.executable, "-m", "eval.experiments.host_step", "--presets", "int4", "--layers", "2",
                        "--heads", "4,2,64", "--context", "96", "--steps", "3", "--reps", "2", "--per-step",
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    row, = json.loads(out.read_text())["rows"]
    assert len(row["step_us_per_layer"]) == 3 and all(t > 0 for t in row["step_us_per_layer"])
    assert all(len(sp) == 2 and min(sp) > 0 for sp in row["step_update_attention_us"])
    assert row["decode_us_per_layer"] > 0  # the steady loop's reading is still made
