"""eval/cot_table.py: the README table from fake lm-eval results + a fake fidelity.json (no model)."""

import json

import pytest

from turbo_attn_hf.eval import cot_table


def acc(a, n):
    return {"acc": a, "n": n}


def agree(a, n):
    return {"agree": a, "n": n}


LM = {
    "device": "NVIDIA H100", "date": "2026-11-22", "command": "python -m eval.lm_eval_run --merge a b",
    "tasks": ["gsm8k_cot", "aqua_cot", "bbh_cot"],
    "runs": {
        "eager-fp32": {"acc": {"gsm8k_cot": acc(0.30, 1319), "aqua_cot": acc(0.20, 254),
                               "bbh_cot": acc(0.25, 1080, ) | {"tasks": 27}}, "agree_vs_sdpa": {}, "complete": True},
        "sdpa": {"acc": {"gsm8k_cot": acc(0.31, 1319), "aqua_cot": acc(0.21, 254), "bbh_cot": acc(0.26, 1080)},
                 "agree_vs_eager_fp32": {"gsm8k_cot": agree(0.5, 1319), "aqua_cot": agree(0.4, 254),
                                         "bbh_cot": agree(0.6, 1080)}},
        "int8": {"acc": {"gsm8k_cot": acc(0.29, 1319), "aqua_cot": acc(0.22, 254), "bbh_cot": acc(0.24, 1080)},
                 "agree_vs_eager_fp32": {"gsm8k_cot": agree(0.45, 1319), "aqua_cot": agree(0.35, 254),
                                         "bbh_cot": agree(0.55, 1080)}},
        "int4": {"acc": {"gsm8k_cot": acc(0.10, 1319)}, "complete": False, "tasks_done": ["gsm8k_cot"],
                 "agree_vs_eager_fp32": {"gsm8k_cot": agree(0.2, 1319), "bbh_cot": agree(None, 0)}},
        "my_calibrated": {"acc": {"gsm8k_cot": acc(0.2, 1319)}},
    },
}


def tf(kl, top1, dppl):
    return {"kl": kl, "kl_max": 10 * kl, "top1": top1, "ppl": 3.5, "ppl_ref": 3.4, "dppl": dppl, "n_tokens": 1223}


FID = {
    "device": "NVIDIA H200", "date": "2026-11-21", "command": "python -m eval.fidelity ...", "n_texts": 12, "shots": 8,
    "chunk": 8,
    "teacher_forced": {
        "sdpa-bf16": {"prefill": tf(1e-3, 0.986, 0.003), "decode": tf(2e-3, 0.987, 0.0024)},
        "turbo-int8": {"prefill": tf(2.5e-3, 0.98, 0.008), "decode": tf(4e-3, 0.98, 0.005)},
        "turbo-mixed": {"prefill": tf(5e-3, 0.97, 0.01), "decode": tf(0.6, 0.77, 0.307)},
    },
}


SRC_A = {"dir": "a", "device": "NVIDIA H100", "date": "d1", "command": "c1"}
SRC_B = {"dir": "b", "device": "NVIDIA H100", "date": "d2", "command": "c2"}
for _name, _run in LM["runs"].items():
    _run["source"] = SRC_A if _name in ("eager-fp32", "sdpa") else SRC_B


def by_run(table):
    return {r["run"]: r for r in table["rows"]}


def test_rows_and_mapping():
    t = cot_table.build(LM, FID)
    assert [r["run"] for r in t["rows"]] == ["eager-fp32", "sdpa", "int8", "int4", "mixed", "my_calibrated"]
    rows = by_run(t)
    assert rows["sdpa"]["fidelity_impl"] == "sdpa-bf16" and rows["int4"]["fidelity_impl"] == "turbo-int4"
    assert rows["eager-fp32"]["reference"] and rows["eager-fp32"]["teacher_forced"] is None
    assert rows["sdpa"]["acc"]["GSM8K"] == {"acc": 0.31, "n": 1319}
    assert rows["int8"]["agree_vs_eager_fp32"]["BBH"] == {"agree": 0.55, "n": 1080}
    assert rows["int4"]["acc"]["AQuA"] is None and rows["int4"]["agree_vs_eager_fp32"]["BBH"] is None
    assert rows["int4"]["lm_eval_complete"] is False and rows["int4"]["teacher_forced"] is None
    s = rows["int8"]["teacher_forced"]
    assert s["kl"] == 4e-3 and s["kl_x_floor"] == pytest.approx(2.0) and s["top1"] == 0.98
    assert rows["sdpa"]["teacher_forced"]["kl_x_floor"] == pytest.approx(1.0)
    assert rows["mixed"]["acc"]["GSM8K"] is None and rows["mixed"]["teacher_forced"]["kl_x_floor"] == pytest.approx(300)
    assert by_run(cot_table.build(LM, FID, path="prefill"))["int8"]["teacher_forced"]["kl_x_floor"] == pytest.approx(2.5)
    assert t["fidelity"]["n_texts"] == 12 and t["fidelity"]["floor_kl"] == 2e-3
    assert [s["dir"] for s in t["lm_eval"]["sources"]] == ["a", "b"]
    assert t["lm_eval"]["sources"][1]["runs"] == ["int8", "int4", "my_calibrated"]

    md = cot_table.to_markdown(t)
    lines = md.splitlines()
    assert "| eager-fp32 | 30.0 (1319) | 20.0 (254) | 25.0 (1080) | ref | ref | ref | ref | ref | ref | ref |" in lines
    assert "| sdpa (floor) | 31.0 (1319) | 21.0 (254) | 26.0 (1080) | 50.0 / ref | 40.0 / ref | 60.0 / ref | 2.00e-03 | 1.00× | 98.70 | +0.24 |" in lines
    assert "| int8 | 29.0 (1319) | 22.0 (254) | 24.0 (1080) | 45.0 / – | 35.0 / – | 55.0 / – | 4.00e-03 | 2.00× | 98.00 | +0.50 |" in lines
    assert "| int4 (partial) | 10.0 (1319) | – | – | 20.0 / – | – / – | – / – | – | – | – | – |" in lines
    assert "| mixed | – | – | – | – / – | – / – | – / – | 6.00e-01 | 300× | 77.00 | +30.70 |" in lines
    assert "12 GSM8K texts" in md and "NVIDIA H200" in md


def test_missing_inputs_give_dashes():
    only_fid = cot_table.build(None, FID)
    assert by_run(only_fid)["int8"]["acc"]["GSM8K"] is None
    md = cot_table.to_markdown(cot_table.build(LM, None))
    assert "| int8 | 29.0 (1319) | 22.0 (254) | 24.0 (1080) | 45.0 / – | 35.0 / – | 55.0 / – | – | – | – | – |" in md


def test_cli_reads_dirs_and_fidelity_file(tmp_path):
    # two lm_eval_run directories (merged on the fly) + fidelity.json -> cot_table.{json,md}
    for d, runs in (("a", {"eager-fp32": ["5", "3"], "sdpa": ["5", "4"]}), ("b", {"int8": ["5", "3"]})):
        p = tmp_path / d
        p.mkdir()
        (p / "results.json").write_text(json.dumps({
            "device": "NVIDIA H100", "date": "d", "command": f"c {d}", "tasks": ["gsm8k_cot"],
            "runs": {n: {"acc": {}, "complete": True} for n in runs}}))
        for n, answers in runs.items():
            (p / f"samples_{n}.jsonl").write_text("".join(
                json.dumps({"task": "gsm8k_cot", "doc_id": i, "answer": a, "correct": a == "5", "generation": a}) + "\n"
                for i, a in enumerate(answers)))
    fid = tmp_path / "fidelity.json"
    fid.write_text(json.dumps(FID))
    out = tmp_path / "table"
    t = cot_table.main(["--lm-eval", str(tmp_path / "a"), str(tmp_path / "b"), "--fidelity", str(fid), "--out", str(out)])
    rows = by_run(t)
    assert rows["sdpa"]["agree_vs_eager_fp32"]["GSM8K"] == {"agree": 0.5, "n": 2}
    assert rows["int8"]["agree_vs_eager_fp32"]["GSM8K"] == {"agree": 1.0, "n": 2}
    assert rows["int8"]["acc"]["GSM8K"] == {"acc": 0.5, "n": 2}
    saved = json.loads((out / "cot_table.json").read_text())
    assert saved["inputs"]["fidelity"] == str(fid) and len(saved["rows"]) == 5
    assert "| int8 | 50.0 (2) | – | – | 100.0 / 50.0 | – / – | – / – | 4.00e-03 | 2.00× | 98.00 | +0.50 |" in (out / "cot_table.md").read_text()
    # one directory: read as is
    t1 = cot_table.main(["--lm-eval", str(tmp_path / "a"), "--out", str(tmp_path / "t1")])
    assert by_run(t1)["sdpa"]["agree_vs_eager_fp32"]["GSM8K"] == {"agree": 0.5, "n": 2}  # from the samples
    assert t1["lm_eval"]["sources"] == [{"dir": str(tmp_path / "a"), "device": "NVIDIA H100", "date": "d",
                                         "command": "c a", "runs": ["eager-fp32", "sdpa"]}]
    with pytest.raises(SystemExit):
        cot_table.main(["--out", str(tmp_path / "t2")])


def test_full_gsm8k_accuracy_from_logs(tmp_path):
    log = tmp_path / "cot_int8.log"
    log.write_text("noise\n[int8] gsm8k_cot: 213.5 s for 1319 prompts, acc 2.7 %\n"
                   "[int8] aqua_cot: 45.8 s for 254 prompts, acc 20.9 %\n[sdpa] gsm8k_cot: 1.0 s for 400 prompts, acc 2.5 %\n")
    logs = cot_table.accuracy_from_logs([log])
    assert logs["int8"]["gsm8k_cot"] == [{"acc": pytest.approx(0.027), "n": 1319, "log": str(log)}]
    t = cot_table.build(LM, None, logs=logs)
    assert [e["n"] for e in by_run(t)["int8"]["gsm8k_all_logged"]] == [1319]
    assert by_run(t)["sdpa"]["gsm8k_all_logged"] == []  # 400 prompts: not the full set
    md = cot_table.to_markdown(t)
    assert "GSM8K all 1319 acc % (logs)" in md and "| 24.0 (1080) | 2.7 | 45.0 / – |" in md
