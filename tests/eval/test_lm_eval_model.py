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


def tiny_llama(vocab_size: int, attn: str, dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation(attn)
    return model


def turbo_ready() -> bool:
    try:
        from turbo_attn_hf.lm_eval_model import turbo_registered

        import turbo_attn_hf

        return turbo_registered() and hasattr(turbo_attn_hf, "TurboCache") and hasattr(turbo_attn_hf, "set_turbo_config")
    except Exception:
        return False


# The full-task runs use sdpa on CPU: the Triton interpreter needs ~150 s for one 2 x 1091-token prefill of
# the tiny model (measured 2026-11-22), so turbo_int8 goes through lm-eval on short prompts here, and
# through the full few-shot tasks when CUDA is present (the same test picks turbo_int8 there).
HAS_CUDA = torch.cuda.is_available()
IMPL = "turbo_int8" if (HAS_CUDA and turbo_ready()) else "sdpa"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=TASKS_DIR, include_defaults=False, metadata={"data_dir": str(DATA)})


def make_lm(tok, preset="int8", batch_size=2, impl=None, dtype=None):
    from turbo_attn_hf.lm_eval_model import TurboHFLM

    impl = impl or IMPL
    # bf16 matmuls are slow on CPU: the sdpa plumbing runs in fp32 there (turbo_int8 needs bf16/fp16)
    if dtype is None:
        dtype = torch.float32 if (impl == "sdpa" and not HAS_CUDA) else torch.bfloat16
    model = tiny_llama(len(tok), impl, dtype)
    if HAS_CUDA:
        model = model.cuda()
    return TurboHFLM(
        pretrained=model, tokenizer=tok, preset=preset, attn_implementation=impl, batch_size=batch_size,
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


def _cot_two_examples(tok, task_manager, impl):
    lm = make_lm(tok, impl=impl)
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
    # 2 + 2 + 27 x 2 prompts in batches of 2: GSM8K and AQuA share stop sequences (2 batches), the 27 BBH
    # subtasks share theirs and batch together (27 batches)
    assert n_batches >= 29
    if impl == "turbo_int8":
        assert set(lm.cache_types) == {"TurboCache"}


def test_cot_tasks_two_examples_end_to_end(tok, task_manager):
    """gsm8k_cot + aqua_cot + bbh_cot (27 tasks) x 2 examples, left-padded batches of 2, 4 new tokens
    (sdpa on CPU; turbo_int8 + TurboCache on a GPU machine)."""
    _cot_two_examples(tok, task_manager, IMPL)


@pytest.mark.skipif(not turbo_ready(), reason="turbo_int8 backend not registered yet")
def test_turbo_through_lm_eval_short_prompts(tok):
    """turbo_int8 through lm-eval's request API: left-padded generate_until batches run with a TurboCache
    (checked on every call), loglikelihood goes through the prefill path and stays close to sdpa."""
    from lm_eval.api.instance import Instance

    ctxs = ["Question: 2 + 3 = ?\nLet's think step by step\n", "Q: not True is\nA: Let's think step by step.\n",
            "Question: Tom has 3 cats and 4 dogs. How many pets does he have?\nLet's think step by step\n"]
    gen = [Instance("generate_until", {}, (c, {"until": ["\nQuestion:"], "max_gen_toks": 3, "do_sample": False}), i)
           for i, c in enumerate(ctxs)]
    lm = make_lm(tok, preset="int4", batch_size=3, impl="turbo_int8")
    outs = lm.generate_until(gen)
    assert len(outs) == 3 and all(isinstance(o, str) for o in outs)
    assert set(lm.cache_types) == {"TurboCache"} and sum(lm.cache_types.values()) == 1

    ll_req = [Instance("loglikelihood", {}, (c, " The answer is 5."), i) for i, c in enumerate(ctxs)]
    ll_turbo = [x[0] for x in lm.loglikelihood(ll_req)]
    ll_sdpa = [x[0] for x in make_lm(tok, batch_size=3, impl="sdpa", dtype=torch.bfloat16).loglikelihood(ll_req)]
    # same weights (seeded); lm-eval sums bf16 log-probs, so at |ll| ~ 42 the resolution is 0.25 (one bf16
    # ulp). Measured |turbo - sdpa| <= 0.25 (one ulp, -42.25 vs -42.5); bound: 3 ulps
    for a, b in zip(ll_turbo, ll_sdpa):
        assert abs(a - b) <= 0.75, (ll_turbo, ll_sdpa)


@pytest.mark.skipif(not turbo_ready(), reason="turbo_int8 backend not registered yet")
def test_turbo_preset_applied(tok):
    lm = make_lm(tok, preset="int4", impl="turbo_int8")
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
    assert len({s["doc_id"] for s in res["samples"]["gsm8k"]}) == 2  # one sample per doc and filter
    assert "Question:" in res["samples"]["gsm8k"][0]["arguments"][0][0]


def test_runner_collect_agreement_markdown():
    """The runner's bookkeeping on hand-made lm-eval sample records (no model)."""
    doc_g = {"question": "q", "answer": "x\n#### 5", "prompt": "p"}
    doc_b = {"input": "i", "target": "(B)", "prompt": "p"}

    def res(texts_g, texts_b):
        return {"samples": {
            "gsm8k_cot": [{"doc_id": i, "doc": doc_g, "resps": [[t]]} for i, t in enumerate(texts_g)],
            "bbh_cot_snarks": [{"doc_id": i, "doc": doc_b, "resps": [[t]]} for i, t in enumerate(texts_b)],
        }}

    acc_a, ans_a = lm_eval_run.collect(res(["The answer is 5.", "The answer is 6."], ["So the answer is (B).", "x"]))
    acc_b, ans_b = lm_eval_run.collect(res(["The answer is 5.", "The answer is 7."], ["So the answer is (B).", "y"]))
    assert acc_a["gsm8k_cot"] == {"acc": 0.5, "n": 2}
    assert acc_a["bbh_cot"]["acc"] == 0.5 and acc_a["bbh_cot"]["n"] == 2 and acc_a["bbh_cot"]["tasks"] == 1
    ag = lm_eval_run.agreement(ans_a, ans_b, ["gsm8k_cot", "bbh_cot"])
    assert ag["gsm8k_cot"] == {"agree": 0.5, "n": 2}
    assert ag["bbh_cot"] == {"agree": 1.0, "n": 2}  # "" == "" for the two answer-less generations
    result = {"device": "cpu", "date": "d", "command": "c", "tasks": ["gsm8k_cot", "bbh_cot"],
              "runs": {"sdpa": {"acc": acc_b}, "int4": {"acc": acc_a, "agree_vs_sdpa": ag}}}
    md = lm_eval_run.to_markdown(result)
    assert "| int4 | 50.0 (n=2) | 50.0 (n=2) | 50.0 | 100.0 |" in md
    assert lm_eval_run.run_name("configs/x_calibrated.yaml") == "x_calibrated"
