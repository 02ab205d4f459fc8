"""eval/experiments/p_f16_accuracy.py (issue 20): the fp16-P emulation runs on the reference, touches only the
block's exp2 (the reference's torch is restored), and changes the output by less than the quantization itself."""
import json

from turbo_attn_hf.eval.experiments import p_f16_accuracy as exp
from turbo_attn_hf.kernels import reference


def test_fp16_p_emulation_is_close_to_fp32_p(tmp_path):
    out = tmp_path / "p.json"
    assert exp.main(["--lens", "64", "--heads", "1", "--head-dim", "64", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dist"], r["p"]) for r in rows] == [(d, p) for d in ("normal", "uniform", "fa3_outlier")
                                                   for p in ("fp32", "fp16")]
    for f32, f16 in zip(rows[::2], rows[1::2]):
        assert abs(f16["mre"] - f32["mre"]) < 0.1 * f32["mre"]
    assert reference.torch.__name__ == "torch"  # the proxy is gone
