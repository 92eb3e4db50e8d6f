"""The evaluate stage: report schema through the real CLI on the tiny target, prompt
sets (JSONL with categories and two turns, the held-out split), sampling mode, and
config errors."""

from __future__ import annotations

import json

import pytest

from specforge_lite import SpecforgeError
from specforge_lite.stages import evaluate
from tests.conftest import compose, run_cli

METHOD_KEYS = {"tau", "tokens_per_s", "speedup", "per_position_acceptance", "identical_to_plain",
               "acceptance_rate", "draft_time_share", "verify_time_share", "overhead_ms_per_step", "per_category"}


def test_cli_smoke_run_writes_report(tmp_path):
    """The whole smoke pipeline (sample, train, evaluate, export) through the real CLI."""
    run_cli("run", "+recipe=smoke", f"run_dir={tmp_path}", check=True, timeout=600)
    out = tmp_path / "eval"
    for name in ("report.json", "report.md", "config.yaml", "versions.json", "acceptance_by_position.png",
                 "tau_by_category.png", "tokens_per_s.png"):
        assert (out / name).exists(), name
    report = json.loads((out / "report.json").read_text())
    assert set(report["methods"]) == {"plain", "eagle3", "ngram", "untrained_draft", "hf_generate",
                                      "hf_prompt_lookup", "hf_assisted"}
    for name, entry in report["methods"].items():
        assert METHOD_KEYS <= set(entry), name
        assert entry["identical_to_plain"] is True, name  # greedy, float32: lossless
        assert entry["tau"] >= 1.0 - 1e-9
    plain = report["methods"]["plain"]
    assert plain["tau"] == 1.0 and plain["speedup"] == 1.0
    assert len(report["methods"]["ngram"]["per_position_acceptance"]) == report["settings"]["num_draft_tokens"]
    assert isinstance(report["best_k"], int) and report["best_k_method"] == "eagle3"
    assert 1 <= report["best_k"] <= report["settings"]["num_draft_tokens"]
    assert report["prompts"] and all({"id", "category", "turns"} <= set(p) for p in report["prompts"])
    assert report["per_category_tau"]["heldout"]["plain"] == 1.0
    assert report["answers"] and {a["method"] for a in report["answers"]} == set(report["methods"])
    assert "| ngram |" in (out / "report.md").read_text()
    exported = json.loads((tmp_path / "export" / "export.json").read_text())
    assert exported["speculative_tokens"] == report["best_k"] and exported["strict_reload"] == "passed"


def write_prompts(path):
    rows = [{"id": f"w{i}", "category": "writing", "turns": [f"Write about topic {i}.", "Shorter, please."]}
            for i in range(3)]
    rows += [{"id": f"m{i}", "category": "math", "prompt": f"What is {i} + {i}? " * 3} for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def eval_cfg(tmp_path, *overrides):
    # these cases need no trained drafter: the smoke recipe's eagle3 choice of best k is lifted
    return compose(["+recipe=smoke", f"run_dir={tmp_path}", "stage=evaluate", "eval.max_new_tokens=12",
                    "eval.plots=false", "eval.best_k_method=null", *overrides])


def test_jsonl_prompts_categories_and_second_turns(tmp_path):
    dataset = write_prompts(tmp_path / "prompts.jsonl")
    cfg = eval_cfg(tmp_path, f"eval.dataset={dataset}", "eval.max_prompts=4",
                   "eval.methods=[ngram,hf_prompt_lookup,untrained_draft]", "eval.truncate_layers=2",
                   "eval.best_k_method=untrained_draft", "eval.num_draft_tokens=3")
    evaluate.run(cfg)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    # round robin over categories: two of each, in source order
    assert [p["id"] for p in report["prompts"]] == ["w0", "w1", "m0", "m1"]
    assert report["num_answers"] == 2 * 2 + 2 * 1  # writing prompts have two turns
    assert set(report["per_category_tau"]) == {"writing", "math"}
    assert list(report["methods"]) == ["plain", "ngram", "hf_prompt_lookup", "untrained_draft"]
    assert report["best_k_method"] == "untrained_draft"
    assert report["best_k"] == report["methods"]["untrained_draft"]["best_k"]["best_k"]
    assert all(m["identical_to_plain"] for m in report["methods"].values())
    assert {a["turn"] for a in report["answers"] if a["prompt_id"] == "w0"} == {1, 2}
    assert "writing" in (tmp_path / "eval" / "report.md").read_text()


def test_sampling_mode_reports_no_identity(tmp_path):
    dataset = write_prompts(tmp_path / "prompts.jsonl")
    cfg = eval_cfg(tmp_path, f"eval.dataset={dataset}", "eval.max_prompts=2", "eval.temperature=0.8",
                   "eval.top_p=0.9", "eval.methods=[ngram,untrained_draft,hf_generate]")
    evaluate.run(cfg)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    for entry in report["methods"].values():
        assert entry["identical_to_plain"] is None and entry["tau"] >= 1.0


def test_heldout_prompts_come_from_the_split(tmp_path):
    from specforge_lite.data.readers import read_conversations

    cfg = eval_cfg(tmp_path)
    records, _ = read_conversations(cfg.data.source)
    chosen = [records[1]["id"], records[4]["id"]]
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "split.json").write_text(json.dumps({"heldout_ids": chosen}))
    prompts = evaluate.load_prompts(cfg)
    assert [p["id"] for p in prompts] == chosen
    assert prompts[0]["turns"] == [m["content"] for m in records[1]["messages"] if m["role"] == "user"]


def test_select_prompts_round_robin():
    prompts = [{"id": str(i), "category": c} for i, c in enumerate("aaabbc")]
    assert [p["id"] for p in evaluate.select_prompts(prompts, 4)] == ["0", "1", "3", "5"]
    assert evaluate.select_prompts(prompts, None) == prompts


def test_unknown_method_is_a_user_error(tmp_path):
    with pytest.raises(SpecforgeError, match="eval.methods"):
        evaluate.run(eval_cfg(tmp_path, "eval.methods=[plain,medusa_typo]"))
    with pytest.raises(SpecforgeError, match="best_k_method"):
        evaluate.run(eval_cfg(tmp_path, "eval.methods=[ngram]", "eval.best_k_method=untrained_draft"))


def _entry(tau, rate, plain_rate, identical=True, per_category=None):
    return {"tau": tau, "tokens_per_s": rate, "speedup": rate / plain_rate, "identical_to_plain": identical,
            "per_category": per_category or {}}


def test_recommendation_follows_the_numbers():
    from specforge_lite.decoding.report import recommend

    cat = lambda s: {"writing": {"speedup": s}, "extraction": {"speedup": s}}  # noqa: E731
    methods = {"plain": _entry(1.0, 10.0, 10.0, per_category=cat(1.0)),
               "ngram": _entry(1.3, 11.0, 10.0, per_category={"writing": {"speedup": 0.9},
                                                             "extraction": {"speedup": 2.0}}),
               "eagle3": _entry(2.6, 14.0, 10.0, per_category=cat(1.4)),
               "distilled": _entry(3.1, 12.0, 10.0, per_category=cat(1.2)),
               "broken": _entry(4.0, 40.0, 10.0, identical=False)}
    rec = recommend({"methods": methods, "per_category_tau": {"writing": {}, "extraction": {}}})
    assert rec["deploy"] == "eagle3"  # fastest lossless one; `broken` changed the output
    assert "14.0 tokens/s" in rec["reasons"][0] and "1.40x" in rec["reasons"][0]
    assert any(a.startswith("distilled has the highest tau (3.10 vs 2.60)") for a in rec["alternatives"])
    assert any(a.startswith("for extraction prompts ngram is faster (2.00x vs 1.40x") for a in rec["alternatives"])
    assert not any("writing" in a for a in rec["alternatives"])


def test_recommendation_when_medusa_or_nothing_wins():
    from specforge_lite.decoding.report import recommend

    from specforge_lite.drafters import medusa

    rec = recommend({"methods": {"plain": _entry(1.0, 10.0, 10.0), "medusa": _entry(2.0, 13.0, 10.0),
                                 "eagle3": _entry(1.8, 12.0, 10.0)}}, {"medusa": medusa.SERVING_NOTE})
    assert rec["deploy"] == "medusa"
    assert any("0.33 removed it" in a and "next fastest is eagle3 (1.20x)" in a for a in rec["alternatives"])
    rec = recommend({"methods": {"plain": _entry(1.0, 10.0, 10.0), "eagle3": _entry(1.2, 7.0, 10.0)}})
    assert rec["deploy"] == "plain" and "no drafter beats plain" in rec["reasons"][1]
