"""The ``turbo-attn`` console script (turbo_attn_hf/cli.py): dispatch, help, and one ``error:`` line + exit 2
for every bad input (no traceback)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from turbo_attn_hf import cli

REPO = Path(__file__).resolve().parents[2]


def _error_line(capsys) -> str:
    """The whole stderr, which must be exactly one ``error: ...`` line."""
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_lists_commands(capsys):
    assert cli.main([]) == 0
    text = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in text


def test_unknown_command(capsys):
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in _error_line(capsys)


def test_info(capsys):
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "turbo_int8" in text and "registered: True" in text and "int4" in text
    assert "prefill attention (auto): int8 here | sm_9x: exact (int8 from 16384 keys at head_dim 128" in text  # CPU
    assert "packed K (packed_k_bits auto): INT8 K + packed V for q/k-norm families (gemma3" in text
    assert "INT8 prefill kernel: auto (TURBO_PREFILL_KERNEL: auto, portable, hopper; auto = hopper" in text
    assert "prefill P.V: INT8 Q.K^T with P.V on V itself in 16 bits" in text and "bf16: INT8" in text  # CPU
    assert "two CTAs an SM at head_dim 64 (KV blocks of 64 keys)" in text
    assert "here at head_dim 128: portable (not a CUDA device)" in text  # this CPU machine
    assert "at head_dim 256, bf16: portable (not a CUDA device)" in text
    assert "rotary embedding (eager forwards): one launch (TURBO_ATTN_FUSED_ROPE=0: HF ops" in text


def test_info_help_prints_help(capsys):
    assert cli.main(["info", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: turbo-attn info") and "registered" not in out
    assert cli.main(["info", "--bogus"]) == 2
    _error_line(capsys)


@pytest.mark.parametrize("cmd", [c for c in cli.COMMANDS if c != "info"])
def test_subcommand_help_names_the_subcommand(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([cmd, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: turbo-attn {cmd} ")


# ---------------------------------------------------------------------------------------------- bad inputs
def _chat(*args) -> int:
    return cli.main(["chat", "--tiny", "--prompt", "hi", "--max-new-tokens", "2", "--no-compare", *args])


def test_missing_config_yaml(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert _chat("--preset", str(missing)) == 2
    err = _error_line(capsys)
    assert str(missing) in err and "does not exist" in err and "int4" in err


def test_malformed_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("bits: [4\nblock_size: 64\n")
    assert _chat("--preset", str(bad)) == 2
    err = _error_line(capsys)
    assert str(bad) in err and "not valid YAML" in err and "line" in err


def test_yaml_list_not_mapping(tmp_path, capsys):
    bad = tmp_path / "list.yaml"
    bad.write_text("- bits: 4\n- block_size: 64\n")
    assert _chat("--preset", str(bad)) == 2
    err = _error_line(capsys)
    assert str(bad) in err and "holds a list, not a mapping" in err


def test_yaml_bad_value(tmp_path, capsys):
    bad = tmp_path / "bits3.yaml"
    bad.write_text("bits: 3\n")
    assert _chat("--preset", str(bad)) == 2
    err = _error_line(capsys)
    assert str(bad) in err and "bits=3" in err


@pytest.mark.parametrize("dtype", ["int8", "float64", "nonsense"])
def test_unknown_dtype(dtype, capsys):
    assert _chat("--dtype", dtype) == 2
    err = _error_line(capsys)
    assert f"--dtype {dtype!r} is not supported" in err and "bfloat16" in err


def test_bad_device(capsys):
    assert _chat("--device", "gpu0") == 2
    assert "--device 'gpu0'" in _error_line(capsys)


def test_model_dir_without_config_json(tmp_path, capsys):
    (tmp_path / "README.md").write_text("not a model\n")
    assert cli.main(["chat", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = _error_line(capsys)
    assert "has no config.json" in err and "sentencepiece" not in err


def test_file_that_is_not_gguf(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"this is not a gguf file\n")
    assert cli.main(["chat", "--model", str(fake), "--prompt", "hi"]) == 2
    assert "is not a GGUF file" in _error_line(capsys)


def test_gguf_that_is_not_a_model(tmp_path, capsys):
    """A valid GGUF container without a supported model architecture (metadata only, no tensors)."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), arch="notamodel")
    w.add_name("metadata only")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert cli.main(["chat", "--model", str(path), "--prompt", "hi"]) == 2
    err = _error_line(capsys)
    assert "cannot load a causal LM" in err and "notamodel" in err


def test_gguf_file_missing_in_dir(tmp_path, capsys):
    assert cli.main(["chat", "--model", str(tmp_path), "--gguf-file", "x.gguf", "--prompt", "hi"]) == 2
    assert "--gguf-file 'x.gguf' is not a file" in _error_line(capsys)


def test_negative_max_new_tokens(capsys):
    assert cli.main(["chat", "--tiny", "--prompt", "hi", "--max-new-tokens", "-5"]) == 2
    assert "--max-new-tokens -5 must be >= 1" in _error_line(capsys)


def test_subcommand_config_error_is_one_line(tmp_path, capsys, monkeypatch):
    """Any subcommand: a TurboConfigError escaping its main() becomes ``error:`` + exit 2, not a traceback."""
    from turbo_attn_hf.config import TurboConfig
    from turbo_attn_hf.eval import calibrate_cli

    def main(argv):
        return TurboConfig.preset(str(tmp_path / "missing.yaml"))

    monkeypatch.setattr(calibrate_cli, "main", main)
    assert cli.main(["calibrate"]) == 2
    assert "missing.yaml" in _error_line(capsys)


def test_bugs_keep_their_traceback(monkeypatch):
    """Only user-input errors are shortened; anything else propagates."""
    from turbo_attn_hf.eval import plots

    def main(argv):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(plots, "main", main)
    with pytest.raises(ZeroDivisionError):
        cli.main(["plots"])


# ---------------------------------------------------------------------------------------------- as installed
def _script() -> str:
    path = shutil.which("turbo-attn", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                             os.environ.get("PATH", "")]))
    if path is None:
        pytest.skip("the turbo-attn console script is not installed (pip install -e .)")
    return path


def test_console_script_bad_dtype_subprocess():
    res = subprocess.run([_script(), "chat", "--tiny", "--prompt", "hi", "--dtype", "int8"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.startswith("error: --dtype 'int8'") and res.stderr.count("\n") == 1, res.stderr[-2000:]


def test_help_does_not_import_torch():
    """``turbo-attn --help`` starts without importing torch, transformers or triton."""
    code = ("import sys; from turbo_attn_hf.cli import main; main(['--help']); "
            "heavy = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]; "
            "print('HEAVY', heavy); sys.exit(1 if heavy else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
