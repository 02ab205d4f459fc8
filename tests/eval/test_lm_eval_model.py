"""The lm-eval model ``turbo-hf`` end to end on a tiny random Llama: our CoT tasks (2 examples each) and
lm-eval's built-in gsm8k / bbh with only their data files overridden (offline, ../shared/data)."""

import os
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from turbo_attn_hf.eval import data as edata  # noqa: E402
from turbo_attn_hf.eval import lm_eval_run  # noqa: E402

DATA = edata.find_data_dir()
pytestmark = pytest.mark.skipif(DATA is None, reason="needs ../shared/data or $TURBO_ATTN_DATA")
TASKS_DIR = str(Path(lm_eval_run.__file__).resolve().parent / "tasks")


def tiny_tokenizer(vocab_size: int = 1024):
    """Byte-level BPE trained in ~1 s on the prompt files (no Hub access): faithful decode, and the
    few-shot prompts come out at ~600-1300 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [edata.read_prompt("gsm8k"), edata.read_prompt("aqua")] + [
        edata.read_prompt(f"bbh/{t}") for t in edata.BBH_TASKS
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_llama(vocab_size: int, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.set_attn_implementation(attn)
    return model


def turbo_ready() -> bool:
    try:
        from turbo_attn_hf.lm_eval_model import turbo_registered

        import turbo_attn_hf

        return turbo_registered() and hasattr(turbo_attn_hf, "TurboCache") and hasattr(turbo_attn_hf, "set_turbo_config")
    except Exception:
        return False


# turbo_int8 when the backend has landed, sdpa otherwise (the lm-eval plumbing is the same)
IMPL = "turbo_int8" if turbo_ready() else "sdpa"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=TASKS_DIR, include_defaults=False, metadata={"data_dir": str(DATA)})


def make_lm(tok, preset="int8", batch_size=2):
    from turbo_attn_hf.lm_eval_model import TurboHFLM

    model = tiny_llama(len(tok), IMPL)
    return TurboHFLM(
        pretrained=model, tokenizer=tok, preset=preset, attn_implementation=IMPL, batch_size=batch_size,
        max_length=4096,
    )


def test_registered_name():
    from lm_eval.api.registry import get_model

    from turbo_attn_hf.lm_eval_model import TurboHFLM

    assert get_model("turbo-hf") is TurboHFLM


def test_bad_cache_mode_named_error(tok):
    from turbo_attn_hf.lm_eval_model import TurboHFLM

    with pytest.raises(ValueError, match="cache='nope'"):
        TurboHFLM(pretrained=tiny_llama(len(tok), "sdpa"), tokenizer=tok, attn_implementation="sdpa", cache="nope")


def test_cot_tasks_two_examples_end_to_end(tok, task_manager):
    """gsm8k_cot + aqua_cot + bbh_cot (27 tasks) x 2 examples, left-padded batches of 2, 4 new tokens."""
    lm = make_lm(tok)
    res = lm_eval.simple_evaluate(
        model=lm, tasks=["gsm8k_cot", "aqua_cot", "bbh_cot"], limit=2, task_manager=task_manager,
        gen_kwargs={"max_gen_toks": 4}, log_samples=True, bootstrap_iters=0,
    )
    names = set(res["results"])
    assert {"gsm8k_cot", "aqua_cot", "bbh_cot"} <= names
    assert sum(n.startswith("bbh_cot_") for n in names) == 27
    for n in ("gsm8k_cot", "aqua_cot", "bbh_cot_navigate"):
        assert 0.0 <= res["results"][n]["exact_match,none"] <= 1.0
        samples = res["samples"][n]
        assert len(samples) == 2
        # the few-shot prompt went in whole (the prompt column), and the generation came back
        assert samples[0]["arguments"][0][0] == samples[0]["doc"]["prompt"]
    n_batches = sum(lm.cache_types.values())
    assert n_batches >= 29  # one generate() per task at least (limit 2, batch 2)
    if IMPL == "turbo_int8":
        assert set(lm.cache_types) == {"TurboCache"}


@pytest.mark.skipif(not turbo_ready(), reason="turbo_int8 backend not registered yet")
def test_turbo_preset_applied(tok):
    lm = make_lm(tok, preset="int4")
    assert lm.turbo_config.name == "int4" and lm.turbo_config.bits == 4
    assert lm.get_model_info()["attn_implementation"] == "turbo_int8"


def test_builtin_tasks_with_local_data_files(tok, tmp_path):
    """lm-eval's own gsm8k and one bbh task (its 3-shot CoT variant) by including the built-in YAML and
    overriding only the data files."""
    from lm_eval.tasks import TaskManager

    inc = lm_eval_run.builtin_offline_include(["gsm8k", "bbh_cot_fewshot_navigate"], DATA, tmp_path)
    tm = TaskManager(include_path=str(inc), include_defaults=False)
    lm = make_lm(tok)
    res = lm_eval.simple_evaluate(
        model=lm, tasks=["gsm8k", "bbh_cot_fewshot_navigate"], limit=2, task_manager=tm,
        gen_kwargs={"max_gen_toks": 4}, bootstrap_iters=0,
    )
    assert "gsm8k" in res["results"] and "bbh_cot_fewshot_navigate" in res["results"]
    assert len(res["samples"]["gsm8k"]) == 2
    assert "Question:" in res["samples"]["gsm8k"][0]["arguments"][0][0]
