"""``bench_decode --layer-step`` (the per-layer decode-step host cost, formerly eval/bench_layer_step.py): the
option parses, and on a machine without CUDA it stops with the benchmarks' one-line message and exit 2."""
import pytest
import torch

from turbo_attn_hf.eval import bench_decode


def test_layer_step_option_parses():
    args = bench_decode.build_parser().parse_args(["--layer-step", "--presets", "int4", "--out", "/tmp/x"])
    assert args.layer_step and args.presets == "int4" and args.out == "/tmp/x"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on a machine without CUDA")
def test_layer_step_refuses_cpu(capsys):
    with pytest.raises(SystemExit) as e:
        bench_decode.main(["--layer-step"])
    assert e.value.code == 2
    assert "bench_decode --layer-step needs a CUDA GPU" in capsys.readouterr().err
