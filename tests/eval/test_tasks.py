"""Chain-of-thought tasks: answer extraction on hand-written generations, prompt shapes, and the task
YAMLs loading from ../shared/data (or $TURBO_ATTN_DATA)."""

import json

import pytest

from turbo_attn_hf.eval import data as edata
from turbo_attn_hf.eval.tasks import utils as tu

DATA = edata.find_data_dir()
needs_data = pytest.mark.skipif(DATA is None, reason="needs ../shared/data or $TURBO_ATTN_DATA")


# ---------------------------------------------------------------------------------------------- GSM8K
@pytest.mark.parametrize(
    "text, want",
    [
        ("Janet has 16 eggs.\n16 - 3 - 4 = 9.\n9 * 2 = 18.\nThe answer is 18.\n", "18"),
        ("She pays $1,200 in total.\nThe answer is $1,200.", "1200"),
        ("The answer is 18.00 dollars", "18"),
        ("The answer is -3.", "-3"),
        ("It takes 2.5 hours.\nThe answer is 2.5.", "2.5"),
        # no "The answer is": the last number
        ("So 3 + 4 = 7 apples, and 7 * 2 = 14", "14"),
        # text after the next question is ignored
        ("5 + 5 = 10.\nThe answer is 10.\nQuestion: Tom has 3 cats. The answer is 3.", "10"),
        ("5 + 5 = 10\nQuestion: how many 99", "10"),
        # first "The answer is" wins
        ("The answer is 4. Wait, the answer is 5.", "4"),
        ("I do not know.", ""),
    ],
)
def test_extract_gsm8k(text, want):
    assert tu.extract_gsm8k(text) == want


def test_gsm8k_score_against_gold():
    doc = {"question": "q", "answer": "Some work <<2*3=6>>6.\n#### 1,234"}
    assert tu.gsm8k_gold(doc) == "1234"
    assert tu.score("gsm8k_cot", "The answer is 1,234.", doc)
    assert tu.score("gsm8k_cot", "The answer is 1234.0", doc)
    assert not tu.score("gsm8k_cot", "The answer is 1233.", doc)
    assert not tu.score("gsm8k_cot", "no number here", doc)


# ---------------------------------------------------------------------------------------------- AQuA
OPTS = ["A)5(√3 + 1)", "B)6(√3 + √2)", "C)7(√3 – 1)", "D)8(√3 – 2)", "E)None of these"]


@pytest.mark.parametrize(
    "text, ok",
    [
        ("t = 5(√3+1).\nThe answer is A).\n", True),
        ("The answer is (A).", True),
        ("So the answer is A)5(√3 + 1)", True),
        ("The answer is 5(√3 + 1).", True),  # the gold option's text alone
        ("The answer is B).", False),
        ("The answer is A) or B) or C) or D) or E)", False),  # lists every option
        ("The time is 5(√3 + 1) minutes.", False),  # no "answer is"
        ("The answer is C).\nQuestion: ... The answer is A).", False),  # cut at the next question
    ],
)
def test_aqua_scoring(text, ok):
    doc = {"options": OPTS, "correct": "A"}
    assert tu.score("aqua_cot", text, doc) is ok


def test_extract_aqua_text():
    assert tu.extract_aqua("blah\nThe answer is D).\nmore") == "D)."
    assert tu.extract_aqua("no answer") == ""


# ---------------------------------------------------------------------------------------------- BBH
@pytest.mark.parametrize(
    "text, target, ok",
    [
        ("not True = False. So the answer is False.", "False", True),
        ("So the answer is True.", "False", False),
        ("... So the answer is (B).", "(B)", True),
        ("... So the answer is (B) 12/14/1950.", "(B)", True),  # first option marker of the span
        ("... So the answer is (C).", "(B)", False),
        ("So the answer is 24.", "24", True),
        ("So the answer is ] ].", "] ]", True),
        ("So the answer is Yes.", "No", False),
        ("So the answer is no.", "no", True),
        ("So the Answer is valid.", "valid", True),  # case-insensitive marker
        ("I think it is False.", "False", False),  # no "the answer is"
        ("So the answer is abc def ghi.\nQ: next", "abc def ghi", True),
    ],
)
def test_bbh_scoring(text, target, ok):
    doc = {"input": "x", "target": target}
    assert tu.score("bbh_cot_x", text, doc) is ok


def test_extract_unknown_task_named_error():
    with pytest.raises(ValueError, match="no answer extraction for task 'mmlu'"):
        tu.extract("mmlu", "x", {})


# ---------------------------------------------------------------------------------------------- prompts
def test_prompt_shapes():
    assert edata.gsm8k_prompt("Q?", "P\n") == "P\n\nQuestion: Q?\nLet's think step by step\n"
    assert edata.aqua_prompt("Q?", ["A)1", "B)2"], "P\n") == "P\n\nQuestion: Q?\nOption:\nA)1\nB)2\nLet's think step by step\n"
    assert edata.bbh_prompt("In?", "P") == "P\n\nQ: In?\nA: Let's think step by step.\n"
    assert edata.gsm8k_gold_cot("a <<1+1=2>>2 b\n#### 2") == "a 2 b\nThe answer is 2.\n"


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv(edata.ENV_VAR, str(tmp_path))
    assert edata.find_data_dir() == tmp_path.resolve()
    assert edata.find_data_dir(tmp_path / "..") == tmp_path.parent.resolve()  # argument wins
    monkeypatch.setenv(edata.ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(edata.DataNotFoundError, match="TURBO_ATTN_DATA"):
        edata.find_data_dir()
    monkeypatch.setenv(edata.ENV_VAR, str(tmp_path))
    with pytest.raises(edata.DataNotFoundError, match="gsm8k/test.jsonl not found"):
        edata.load_gsm8k()


@needs_data
def test_local_data_counts_and_gold_prompts():
    assert len(edata.load_gsm8k(DATA)) == 1319
    assert len(edata.load_aqua(DATA)) == 254
    assert sum(len(edata.load_bbh(t, DATA)) for t in edata.BBH_TASKS) == 6511
    # the 8-shot exemplars score as right under our own extraction (a check of the extractors)
    gsm = edata.read_prompt("gsm8k", DATA).strip().split("\n\n")
    assert len(gsm) == 8 and all(tu.extract_gsm8k(ex.split("Let's think step by step\n")[1]) for ex in gsm)
    for t in edata.BBH_TASKS:
        shots = edata.read_prompt(f"bbh/{t}", DATA).split("\n\nQ: ")[1:]
        assert len(shots) == 3, t
        for s in shots:
            assert tu.extract_bbh(s.split("A: Let's think step by step.")[1]) != "", t


# ---------------------------------------------------------------------------------------------- YAMLs
@needs_data
def test_task_yamls_load_from_local_data():
    lm_eval = pytest.importorskip("lm_eval")  # noqa: F841
    from pathlib import Path

    from lm_eval.tasks import TaskManager

    tasks_dir = Path(tu.__file__).resolve().parent
    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False, metadata={"data_dir": str(DATA)})
    r = tm.load(["gsm8k_cot", "aqua_cot", "bbh_cot"])
    tasks = r["tasks"]
    assert "bbh_cot" in r["groups"] and len([t for t in tasks if t.startswith("bbh_cot_")]) == 27
    expect = {"gsm8k_cot": 1319, "aqua_cot": 254, "bbh_cot_navigate": 250, "bbh_cot_snarks": 178}
    for name, n in expect.items():
        t = tasks[name]
        docs = list(t.test_docs())
        assert len(docs) == n, name
        assert t.config.generation_kwargs["max_gen_toks"] == 256
        assert t.config.generation_kwargs["do_sample"] is False
    g = tasks["gsm8k_cot"]
    doc = next(iter(g.test_docs()))
    ctx = g.doc_to_text(doc)
    assert ctx.startswith("Question: There are 15 trees") and ctx.endswith(
        f"\n\nQuestion: {doc['question']}\nLet's think step by step\n")
    assert ctx.count("Question:") == 9
    assert g.config.generation_kwargs["until"] == ["\nQuestion:"]
    a = tasks["aqua_cot"]
    adoc = next(iter(a.test_docs()))
    assert a.doc_to_text(adoc).endswith("Option:\n" + "\n".join(adoc["options"]) + "\nLet's think step by step\n")
    b = tasks["bbh_cot_navigate"]
    bdoc = next(iter(b.test_docs()))
    assert b.doc_to_text(bdoc).endswith(f"\n\nQ: {bdoc['input']}\nA: Let's think step by step.\n")
    assert b.doc_to_text(bdoc).count("\nA: Let's think step by step.") == 4
    # process_results on the gold text of a doc scores 1
    assert g.process_results(doc, [f"The answer is {tu.gsm8k_gold(doc)}."])["exact_match"] == 1.0
    assert a.process_results(adoc, [f"The answer is {adoc['correct']})."])["exact_match"] == 1.0
    assert b.process_results(bdoc, [f"So the answer is {bdoc['target']}."])["exact_match"] == 1.0
    json.dumps(doc)  # rows stay plain JSON (logged samples)
