"""eval/lm_eval_run.py bookkeeping without a model: results written after every task of every run (a call
killed mid-run keeps what it finished), and --merge of several result directories (agreement from samples)."""

import json
from collections import Counter

import pytest

lm_eval = pytest.importorskip("lm_eval")

from turbo_attn_hf.eval import lm_eval_run  # noqa: E402

DOC_G = {"question": "q", "answer": "x\n#### 5", "prompt": "p"}
DOC_B = {"input": "i", "target": "(B)", "prompt": "p"}


class FakeLM:
    def __init__(self, preset):
        self.preset = preset
        self.turbo_config = None
        self.cache_types = Counter({"DynamicCache": 1})


def fake_samples(task, texts, doc):
    return [{"doc_id": i, "doc": doc, "resps": [[t]]} for i, t in enumerate(texts)]


def test_results_written_after_each_task_and_kept_when_killed(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_evaluate(model, tasks, limit, **kw):
        (task,) = tasks
        calls.append((model.preset, task, limit))
        if model.preset == "int8" and task == "bbh_cot":
            raise KeyboardInterrupt("killed by the time limit")  # like a kill: not an ordinary error
        if task == "gsm8k_cot":
            ans = "5" if model.preset == "sdpa" else "7"
            return {"samples": {"gsm8k_cot": fake_samples(task, [f"The answer is {ans}.", "The answer is 6."], DOC_G)}}
        return {"samples": {
            "bbh_cot_snarks": fake_samples(task, ["So the answer is (B).", "So the answer is (A)."], DOC_B),
            "bbh_cot_navigate": fake_samples(task, ["So the answer is (B)."], DOC_B),
        }}

    monkeypatch.setattr(lm_eval, "simple_evaluate", fake_evaluate)
    monkeypatch.setattr(lm_eval_run, "_task_manager", lambda include, data_dir: None)
    monkeypatch.setattr(lm_eval_run, "_load_model", lambda args, device: (None, None))
    monkeypatch.setattr(lm_eval_run, "_make_lm", lambda preset, args, tok, model, device: FakeLM(preset))

    out = tmp_path / "call1"
    with pytest.raises(KeyboardInterrupt):
        lm_eval_run.main(["--model", "fake", "--presets", "sdpa,int8,int4", "--tasks", "gsm8k_cot,bbh_cot",
                          "--limit", "2", "--limit-bbh", "1", "--device", "cpu", "--out", str(out)])
    assert calls == [("sdpa", "gsm8k_cot", 2), ("sdpa", "bbh_cot", 1), ("int8", "gsm8k_cot", 2), ("int8", "bbh_cot", 1)]

    res = json.loads((out / "results.json").read_text())
    assert res["planned_runs"] == ["sdpa", "int8", "int4"]
    assert list(res["runs"]) == ["sdpa", "int8"]
    sdpa, int8 = res["runs"]["sdpa"], res["runs"]["int8"]
    assert sdpa["complete"] is True and sdpa["tasks_done"] == ["gsm8k_cot", "bbh_cot"]
    assert sdpa["acc"]["gsm8k_cot"] == {"acc": 0.5, "n": 2}
    assert sdpa["acc"]["bbh_cot"] == {"acc": 2 / 3, "n": 3, "tasks": 2}
    assert set(sdpa["task_wall_s"]) == {"gsm8k_cot", "bbh_cot"} and sdpa["wall_s"] >= 0
    # the killed run keeps its finished task, marked partial, with its agreement vs sdpa on that task
    assert int8["complete"] is False and int8["tasks_done"] == ["gsm8k_cot"]
    assert int8["agree_vs_sdpa"]["gsm8k_cot"] == {"agree": 0.5, "n": 2}
    assert int8["agree_vs_sdpa"]["bbh_cot"] == {"agree": None, "n": 0}

    rows = [json.loads(x) for x in (out / "samples_sdpa.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and set(rows[0]) == {"task", "doc_id", "answer", "correct", "generation"}
    assert rows[0] == {"task": "gsm8k_cot", "doc_id": 0, "answer": "5", "correct": True,
                       "generation": "The answer is 5."}
    assert len((out / "samples_int8.jsonl").read_text().splitlines()) == 2
    assert not (out / "samples_int4.jsonl").exists()
    assert not list(out.glob("*.tmp"))
    md = (out / "results.md").read_text()
    assert "| int8 (partial: gsm8k_cot) |" in md and "| sdpa |" in md
    printed = capsys.readouterr().out
    assert "[sdpa] gsm8k_cot:" in printed and "=== run sdpa:" in printed


def write_dir(d, runs: dict, samples: dict, device="NVIDIA H100", tasks=("gsm8k_cot", "bbh_cot"), max_gen_toks=None):
    """A result directory as lm_eval_run writes it: results.json + samples_<run>.jsonl."""
    d.mkdir(parents=True)
    res = {"date": f"2026-11-2{len(str(d)) % 10}", "device": device, "command": f"python -m eval.lm_eval_run --out {d}",
           "versions": {}, "tasks": list(tasks), "runs": runs,
           "args": {"model": "m", "limit": None, "limit_bbh": 40, "max_gen_toks": max_gen_toks}}
    (d / "results.json").write_text(json.dumps(res))
    for name, rows in samples.items():
        with open(d / f"samples_{name}.jsonl", "w") as f:
            for task, doc_id, answer, correct in rows:
                f.write(json.dumps({"task": task, "doc_id": doc_id, "answer": answer, "correct": correct,
                                    "generation": f"... {answer}"}) + "\n")
    return d


def rows(gsm, bbh):
    """Samples rows from answer lists: gsm8k gold "5", bbh gold "(B)" (snarks: 2 docs, navigate: the rest)."""
    out = [("gsm8k_cot", i, a, a == "5") for i, a in enumerate(gsm)]
    out += [("bbh_cot_snarks" if i < 2 else "bbh_cot_navigate", i, a, a == "(B)") for i, a in enumerate(bbh)]
    return out


@pytest.fixture
def dirs(tmp_path):
    run = {"acc": {}, "complete": True}
    a = write_dir(tmp_path / "a", {"eager-fp32": run, "sdpa": run}, {
        "eager-fp32": rows(["5", "5", "3", "4"], ["(B)", "(A)", "(B)"]),
        "sdpa": rows(["5", "5", "3", "9"], ["(B)", "(B)", "(B)"]),
    })
    b = write_dir(tmp_path / "b", {"int8": run, "int4": {"acc": {}, "complete": False, "tasks_done": ["gsm8k_cot"]}}, {
        "int8": rows(["5", "1", "3", "4"], ["(B)", "(A)", "(A)"]),
        "int4": rows(["0", "0", "0", "4"], []),
    }, device="NVIDIA H200")
    c = write_dir(tmp_path / "c", {"int4": run}, {"int4": rows(["5", "5", "0", "4"], ["(B)", "(A)", "(B)"])},
                  max_gen_toks=8)
    return a, b, c


def test_merge_recomputes_agreement_from_samples(dirs, tmp_path):
    a, b, c = dirs
    out = tmp_path / "merged"
    res = lm_eval_run.main(["--merge", str(a), str(b), "--out", str(out)])
    runs = res["runs"]
    assert list(runs) == ["eager-fp32", "sdpa", "int8", "int4"]
    # accuracy from the samples
    assert runs["sdpa"]["acc"]["gsm8k_cot"] == {"acc": 0.5, "n": 4}
    assert runs["sdpa"]["acc"]["bbh_cot"] == {"acc": 1.0, "n": 3, "tasks": 2}
    assert runs["int8"]["acc"]["bbh_cot"]["acc"] == pytest.approx(1 / 3)
    # agreement vs eager-fp32: sdpa 3/4 gsm8k, 2/3 bbh; int8 3/4, 2/3
    assert runs["sdpa"]["agree_vs_eager_fp32"]["gsm8k_cot"] == {"agree": 0.75, "n": 4}
    assert runs["sdpa"]["agree_vs_eager_fp32"]["bbh_cot"]["agree"] == pytest.approx(2 / 3)
    assert runs["int8"]["agree_vs_eager_fp32"]["gsm8k_cot"] == {"agree": 0.75, "n": 4}
    assert runs["int8"]["agree_vs_eager_fp32"]["bbh_cot"]["agree"] == pytest.approx(2 / 3)
    # vs sdpa: int8 gsm8k 5/5,1/5,3/3,4/9 -> 0.5; bbh (B)(B),(A)(B),(A)(B) -> 1/3
    assert runs["int8"]["agree_vs_sdpa"]["gsm8k_cot"] == {"agree": 0.5, "n": 4}
    assert runs["int8"]["agree_vs_sdpa"]["bbh_cot"]["agree"] == pytest.approx(1 / 3)
    assert "agree_vs_sdpa" not in runs["sdpa"] and "agree_vs_eager_fp32" not in runs["eager-fp32"]
    assert runs["eager-fp32"]["agree_vs_sdpa"]["gsm8k_cot"] == {"agree": 0.75, "n": 4}
    # the partial int4 has no bbh samples: no bbh agreement
    assert runs["int4"]["agree_vs_eager_fp32"]["bbh_cot"] == {"agree": None, "n": 0}
    # provenance
    assert runs["int8"]["source"]["dir"] == str(b) and runs["int8"]["source"]["device"] == "NVIDIA H200"
    assert [s["dir"] for s in res["merged_from"]] == [str(a), str(b)]
    assert res["device"] == "NVIDIA H100 / NVIDIA H200"
    assert "--merge" in res["command"]
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["runs"]["int8"]["agree_vs_sdpa"]["gsm8k_cot"]["agree"] == 0.5
    assert (out / "samples_int4.jsonl").exists() and (out / "samples_eager-fp32.jsonl").exists()
    md = (out / "results.md").read_text()
    assert "Merged from:" in md and f"- int8: `{b}`, NVIDIA H200" in md

    # a complete run replaces a partial one (either order); a merged dir merges again
    res2 = lm_eval_run.main(["--merge", str(out), str(c), "--out", str(tmp_path / "m2")])
    assert res2["runs"]["int4"]["complete"] is True and res2["runs"]["int4"]["source"]["dir"] == str(c)
    assert res2["runs"]["int8"]["source"]["dir"] == str(b)  # kept through the first merge
    assert res2["runs"]["int4"]["agree_vs_eager_fp32"]["gsm8k_cot"] == {"agree": 0.75, "n": 4}
    res3, _ = lm_eval_run.merge([c, b])
    assert res3["runs"]["int4"]["source"]["dir"] == str(c)
    assert "the calls differ in --max-gen-toks: ['8', 'None']" in res3["merge_notes"]
    assert not any("differ" in n for n in res["merge_notes"])


def test_merge_needs_results(tmp_path):
    with pytest.raises(FileNotFoundError, match="results.json"):
        lm_eval_run.merge([tmp_path])
    with pytest.raises(SystemExit):
        lm_eval_run.main(["--presets", "sdpa"])  # neither --model nor --merge


def test_merge_unites_a_run_split_by_task(tmp_path):
    # sdpa's GSM8K in one call, its BBH in another: one sdpa run with both tasks, agreement over both
    run = {"acc": {}, "complete": True}
    g = rows(["5", "5", "3", "9"], [])
    b_ = [r for r in rows([], ["(B)", "(B)", "(A)"])]
    a = write_dir(tmp_path / "a", {"eager-fp32": run, "sdpa": run},
                  {"eager-fp32": rows(["5", "5", "3", "4"], ["(B)", "(A)", "(B)"]), "sdpa": g})
    b = write_dir(tmp_path / "b", {"sdpa": run}, {"sdpa": b_}, tasks=("bbh_cot",))
    res = lm_eval_run.main(["--merge", str(a), str(b), "--out", str(tmp_path / "m")])
    sdpa = res["runs"]["sdpa"]
    assert sdpa["acc"]["gsm8k_cot"] == {"acc": 0.5, "n": 4} and sdpa["acc"]["bbh_cot"]["n"] == 3
    assert sdpa["agree_vs_eager_fp32"]["gsm8k_cot"] == {"agree": 0.75, "n": 4}
    assert sdpa["agree_vs_eager_fp32"]["bbh_cot"]["agree"] == pytest.approx(1 / 3)
    assert [s["dir"] for s in sdpa["sources"]] == [str(a), str(b)]
