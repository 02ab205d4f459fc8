"""eval.experiments.first_prefill_rotation (issue 23's cost per forward; the runs need a GPU) and its plot."""
import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "eval" / "results"


def test_the_shapes_are_configs_of_the_installed_transformers():
    """Each stand-in's config builds on the pinned and the newest transformers, with the layout the probe needs: one
    KV head and sliding layers for Gemma-3, q/k-norm model types (``rotate_qk: auto`` rotates them)."""
    import transformers

    from eval.experiments.first_prefill_rotation import SHAPES
    from turbo_attn_hf.config import QK_NORM_MODEL_TYPES

    for name, (cfg_cls, model_cls, kw) in SHAPES.items():
        cfg = getattr(transformers, cfg_cls)(**kw)
        assert hasattr(transformers, model_cls) and cfg.model_type in QK_NORM_MODEL_TYPES, name
        assert cfg.num_key_value_heads == kw["num_key_value_heads"] and cfg.head_dim == kw["head_dim"]


def test_plot_rotation_cost(tmp_path):
    """The committed session-41 files plot (prompt forwards and decode steps, the 3 % bar); rows without a ratio (the
    ``none`` and sdpa rows) are left out."""
    pytest.importorskip("matplotlib")
    from turbo_attn_hf.eval import plots

    files = sorted(RESULTS.glob("*_rotation*_s41_h200.json"))
    assert len(files) == 4
    rows = [r for f in files for sec in ("forward", "decode") for r in json.loads(f.read_text()).get(sec, [])]
    assert any(r.get("total_pct") is None for r in rows) and any(r.get("total_pct") is not None for r in rows)
    png = plots.plot_rotation_cost(files, tmp_path / "rot.png")
    assert png is not None and png.is_file() and png.stat().st_size > 1000


def test_kernel_times_sum_the_kernels_that_share_a_cut_name(monkeypatch):
    """torch's elementwise kernels of different functors share a long name prefix: cut to the key length they must be
    summed, not overwrite each other (the 60-character cut before session 43 lost ~27 % of a Gemma-3 decode step)."""
    import torch

    from eval.experiments import rotation_cost

    prefix = "void at::native::vectorized_elementwise_kernel<4, at::native::" + "x" * 60

    class Event:
        def __init__(self, key, us, kind="CUDA"):
            self.key, self.self_device_time_total = key, us
            self.device_type = type("DeviceType", (), {"name": kind})

    class Profile:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return [Event(prefix + "rsqrt", 30.0), Event(prefix + "pow", 10.0), Event("_decode_kernel", 50.0),
                    Event("aten::add", 99.0, kind="CPU")]

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    us = rotation_cost._kernel_us(lambda: None, n=2)
    assert us == {"_decode_kernel": 25.0, prefix[:100]: 20.0}
