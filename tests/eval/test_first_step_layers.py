"""eval/experiments/first_step_layers.py on the CPU (launches stubbed, in a subprocess: the stubs patch Triton for the
whole process): each step's time per layer and its update / attention split are read."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_layer_loop_reads_each_step_of_a_new_cache(tmp_path):
    out = tmp_path / "l.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the stubs replace the interpreter
    r = subprocess.run([sys.executable, "-m", "eval.experiments.first_step_layers", "--layers", "2", "--heads",
                        "4,2,64", "--context", "96", "--steps", "3", "--reps", "2", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    d = json.loads(out.read_text())
    assert len(d["us_per_layer"]) == 3 and all(t > 0 for t in d["us_per_layer"])
    assert all(len(s) == 2 and min(s) > 0 for s in d["update_attention_us"])
