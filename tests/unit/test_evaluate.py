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
               "acceptance_rate", "draft_time_share", "verify_time_share", "overhead_ms_per_step", "per_category",
               "tau_ci", "speedup_ci", "num_prompts", "num_tokens", "num_target_forwards"}


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
        # bootstrap intervals over the same prompts hold the point estimates (same ratios of sums)
        for key in ("tau", "speedup"):
            low, high = entry[f"{key}_ci"]
            assert low - 1e-9 <= entry[key] <= high + 1e-9, (name, key)
        assert entry["num_prompts"] == report["num_prompts"] and entry["num_tokens"] > 0
    plain = report["methods"]["plain"]
    assert plain["tau"] == 1.0 and plain["speedup"] == 1.0
    assert plain["tau_ci"] == [1.0, 1.0] and plain["speedup_ci"] == [1.0, 1.0]
    assert report["settings"]["bootstrap"] == {"resamples": 2000, "seed": 0, "level": 0.95}
    assert report["recommendation"]["clear_winner"] in (True, False)
    assert len(report["methods"]["ngram"]["per_position_acceptance"]) == report["settings"]["num_draft_tokens"]
    assert isinstance(report["best_k"], int) and report["best_k_method"] == "eagle3"
    assert 1 <= report["best_k"] <= report["settings"]["num_draft_tokens"]
    assert report["prompts"] and all({"id", "category", "turns"} <= set(p) for p in report["prompts"])
    assert report["per_category_tau"]["heldout"]["plain"] == 1.0
    assert report["answers"] and {a["method"] for a in report["answers"]} == set(report["methods"])
    assert {"num_forwards", "total_s"} <= set(report["answers"][0])
    markdown = (out / "report.md").read_text()
    assert "| ngram |" in markdown and "| tau [95% CI] |" in markdown and "prompts / tokens / forwards" in markdown
    exported = json.loads((tmp_path / "export" / "export.json").read_text())
    assert exported["speculative_tokens"] == report["best_k"] and exported["strict_reload"] == "passed"


def test_cli_smoke_run_with_a_bf16_target(tmp_path):
    """Every stage with the target in bf16 (the default on GPUs): training casts the bf16 features
    for the float32 drafter, evaluate reports the dtype it ran and the machine's rounding baseline,
    and export's strict reload passes."""
    run_cli("run", "+recipe=smoke", "target.dtype=bfloat16", f"run_dir={tmp_path}", check=True, timeout=600)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["dtype"] == "bfloat16"
    assert report["settings"]["engine"]["dtype"] == {"requested": "bfloat16", "used": "bfloat16",
                                                     "reason": "target.dtype=bfloat16"}
    assert all(entry["lossless"] for entry in report["methods"].values())
    baseline = report["rounding_baseline"]
    assert baseline["measured"] and baseline["dtype"] == "bfloat16"
    assert baseline["width"] == report["settings"]["num_draft_tokens"] + 1
    assert baseline["again"]["answers"] == report["num_answers"] and baseline["again"]["mismatch"] == 0
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert "in bfloat16 (target.dtype=bfloat16)" in markdown and "Rounding baseline (bfloat16): " in markdown
    exported = json.loads((tmp_path / "export" / "export.json").read_text())
    assert exported["strict_reload"] == "passed"


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
                   "eval.best_k_method=untrained_draft", "eval.num_draft_tokens=3", "eval.rounding_baseline=false")
    evaluate.run(cfg)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    # the rounding baseline skipped is said, not left out (the bf16 smoke run below measures it)
    assert report["rounding_baseline"]["measured"] is False
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert "Rounding baseline: not measured (eval.rounding_baseline=false)." in markdown
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


def test_methods_draft_their_own_k_in_one_evaluate(tmp_path):
    """eval.method_draft_tokens gives ngram k=2 and untrained_draft k=1 beside hf_prompt_lookup's
    eval.num_draft_tokens=3: each decodes, reports and estimates best k at its own k. suffix_tree
    without its chain method `suffix` among the methods still gets its lookup (it once called None)."""
    dataset = write_prompts(tmp_path / "prompts.jsonl")
    cfg = eval_cfg(tmp_path, f"eval.dataset={dataset}", "eval.max_prompts=2", "eval.max_turns=1",
                   "eval.methods=[ngram,hf_prompt_lookup,untrained_draft,suffix_tree]", "eval.truncate_layers=2",
                   "eval.suffix.samples=false",
                   "eval.best_k_method=untrained_draft", "eval.num_draft_tokens=3",
                   "eval.method_draft_tokens=[ngram:2,untrained_draft:1]")
    evaluate.run(cfg)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    methods = report["methods"]
    assert (methods["ngram"]["k"], methods["untrained_draft"]["k"], methods["hf_prompt_lookup"]["k"]) == (2, 1, 3)
    assert len(methods["ngram"]["per_position_acceptance"]) == 2
    assert len(methods["untrained_draft"]["per_position_acceptance"]) == 1
    # a draft model fills its k but near the answer's end: about one draft a step here (three without the setting)
    assert 0.5 < methods["untrained_draft"]["mean_draft_length"] <= 1.0
    assert methods["ngram"]["mean_draft_length"] <= 2.0
    assert [row["k"] for row in methods["untrained_draft"]["best_k"]["table"]] == [1]
    assert all(m["identical_to_plain"] for m in methods.values())
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert "k = 3 (ngram 2, untrained_draft 1)" in markdown
    # the acceptance table spans the widest k; a method at a smaller k shows "-" beyond it
    assert "| a1 | a2 | a3 |" in markdown
    assert [line for line in markdown.splitlines() if line.startswith("| untrained_draft |")][0].count(" - |") >= 2


def test_a_k_of_its_own_is_checked_at_the_door(tmp_path):
    for item, why in (("ngram:0", "integer >= 1"), ("ngram", "METHOD:K"), ("eagle3:1", "not one of eval.methods"),
                      ("hf_generate:2", "drafts eval.num_draft_tokens")):
        with pytest.raises(SpecforgeError, match=why):
            evaluate.run(eval_cfg(tmp_path, "eval.methods=[ngram,hf_generate]", f"eval.method_draft_tokens=[{item}]"))


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
    from specforge_lite.measurement.recommend import recommend

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
    # taus equal to two decimals are told apart with a third
    close = {"plain": methods["plain"], "ngram": _entry(1.4327, 13.0, 10.0), "eagle3": _entry(1.4341, 10.0, 10.0)}
    rec = recommend({"methods": close, "per_category_tau": {}})
    assert rec["deploy"] == "ngram"
    assert any(a.startswith("eagle3 has the highest tau (1.434 vs 1.433)") for a in rec["alternatives"])


def test_recommendation_when_medusa_or_nothing_wins(tmp_path):
    from specforge_lite.measurement.recommend import recommend

    from specforge_lite.drafters import medusa

    rec = recommend({"methods": {"plain": _entry(1.0, 10.0, 10.0), "medusa": _entry(2.0, 13.0, 10.0),
                                 "eagle3": _entry(1.8, 12.0, 10.0)}}, {"medusa": medusa.SERVING_NOTE})
    assert rec["deploy"] == "medusa"
    assert any("0.33 removed it" in a and "next fastest is eagle3 (1.20x)" in a for a in rec["alternatives"])
    rec = recommend({"methods": {"plain": _entry(1.0, 10.0, 10.0), "eagle3": _entry(1.2, 7.0, 10.0)}})
    assert rec["deploy"] == "plain" and "no drafter beats plain" in rec["reasons"][1]
    # suffix wins with a hybrid next: the sentence names the runner-up, not plain as "the next fastest" (issue 65)
    rec = recommend({"methods": {"plain": _entry(1.0, 10.0, 10.0), "suffix": _entry(1.5, 14.0, 10.0),
                                 "eagle3_hybrid": _entry(1.6, 13.0, 10.0)}})
    assert rec["deploy"] == "suffix" and rec["runner_up"] == "eagle3_hybrid"
    said = next(a for a in rec["alternatives"] if a.startswith("vLLM serves suffix decoding"))
    assert "the next fastest is eagle3_hybrid (1.30x), the fastest served as measured plain (1.00x)" in said, said
    # a hybrid is ours only: the report names the fastest method a serving engine runs (no tree, no hybrid)
    rec = recommend({"methods": {"plain": _entry(1.0, 10.0, 10.0), "eagle3_hybrid": _entry(2.0, 16.0, 10.0),
                                 "eagle3_tree": {**_entry(2.2, 15.0, 10.0), "tree": {"chain": "eagle3"}},
                                 "suffix": _entry(1.5, 13.0, 10.0), "eagle3": _entry(1.6, 12.0, 10.0)}})
    assert rec["deploy"] == "eagle3_hybrid"
    assert any("served by our engine only" in a and "the fastest method an engine serves is suffix (1.30x plain)" in a
               for a in rec["alternatives"])
    # a hybrid tree likewise; and the export's README carries the recommendation with those words
    import json

    from omegaconf import OmegaConf

    from specforge_lite.stages.export import recommendation_readme

    rec = recommend({"methods": {"plain": _entry(1.0, 10.0, 10.0), "suffix": _entry(1.5, 13.0, 10.0),
                                 "eagle3_hybrid_tree": {**_entry(2.2, 16.0, 10.0), "tree": {"chain": "eagle3_hybrid"}}}})
    assert rec["deploy"] == "eagle3_hybrid_tree"
    assert any("served by our engine only" in a and "the eagle3 drafter, each alone" in a for a in rec["alternatives"])
    (tmp_path / "eval").mkdir()
    assert recommendation_readme(OmegaConf.create({"run_dir": str(tmp_path)})) == ""  # no report
    (tmp_path / "eval" / "report.json").write_text(json.dumps({"recommendation": rec}))
    readme = recommendation_readme(OmegaConf.create({"run_dir": str(tmp_path)}))
    assert "recommends **eagle3_hybrid_tree**" in readme and "the fastest method an engine serves is suffix" in readme


def _timed_report(seconds: dict[str, list[float]], tokens: int = 21, forwards: dict[str, int] | None = None) -> dict:
    """A report as build_report writes it, by hand: per method the wall seconds of its answer
    to each prompt (every answer `tokens` long), entries and intervals from the same rows."""
    from specforge_lite.measurement import stats

    rows = [{"prompt_id": f"p{i}", "method": name, "num_tokens": tokens,
             "num_forwards": (forwards or {}).get(name, tokens - 1), "total_s": s}
            for name, per_prompt in seconds.items() for i, s in enumerate(per_prompt)]
    totals = stats.prompt_totals(rows)
    intervals = stats.method_intervals(totals, resamples=1000, seed=0)
    plain_rate = float(stats.tokens_per_s(totals["plain"]))
    methods = {name: {**_entry(float(stats.tau(t)), float(stats.tokens_per_s(t)), plain_rate),
                      **intervals[name], "num_tokens": int(t.tokens.sum()), "num_target_forwards": int(t.forwards.sum())}
               for name, t in totals.items()}
    return {"methods": methods, "answers": rows, "num_prompts": len(seconds["plain"]),
            "settings": {"num_draft_tokens": 2, "bootstrap": {"resamples": 1000, "seed": 0, "level": 0.95}}}


def test_recommendation_says_no_clear_winner_when_the_paired_interval_includes_one():
    from specforge_lite.measurement.recommend import recommend

    # eagle3 and ngram trade places prompt by prompt; neither is clearly ahead of plain either
    report = _timed_report({"plain": [2.0] * 6, "eagle3": [1.0, 3.0, 1.0, 3.0, 1.0, 2.9],
                            "ngram": [3.0, 1.0, 3.0, 1.0, 2.95, 1.0]}, forwards={"eagle3": 10, "ngram": 12})
    rec = recommend(report)
    assert rec["deploy"] == "eagle3" and rec["runner_up"] == "ngram"
    assert rec["clear_winner"] is False and rec["speed_ratio_ci"][0] < 1.0 < rec["speed_ratio_ci"][1]
    assert any(r.startswith("no clear winner between eagle3 and ngram on this prompt set: the 95% interval of "
                            "eagle3's speed over ngram's") and "6 prompts, paired bootstrap" in r
               for r in rec["reasons"])
    assert any(r.startswith("the gain of eagle3 over plain decoding is not clear") for r in rec["reasons"])
    assert rec["reasons"][0].startswith("eagle3: highest measured speed")  # the fields kept their meaning

    # a drafter ahead of plain on average, but not on every resample: one sentence says both
    rec = recommend(_timed_report({"plain": [2.0] * 6, "eagle3": [1.0, 2.5, 1.2, 2.6, 1.9, 2.4]}))
    assert rec["runner_up"] == "plain" and rec["clear_winner"] is False
    assert [r for r in rec["reasons"] if "not clear" in r] == [
        next(r for r in rec["reasons"] if r.startswith("no clear winner between eagle3 and plain decoding on this "
                                                       "prompt set: the gain over plain decoding is not clear"))]

    # plain fastest by a hair: the drafter's gain (a loss here) is not clear either way
    rec = recommend(_timed_report({"plain": [2.0] * 6, "ngram": [1.5, 2.6, 1.6, 2.5, 1.7, 2.2]}))
    assert rec["deploy"] == "plain" and rec["clear_winner"] is False
    assert "no drafter beats plain" in rec["reasons"][1]
    assert rec["reasons"][2].startswith("no clear winner between plain decoding and ngram on this prompt set: "
                                        "the gain of ngram over plain decoding is not clear")
    assert len(rec["reasons"]) == 3


def test_recommendation_names_a_clear_winner():
    from specforge_lite.measurement.recommend import recommend

    report = _timed_report({"plain": [2.0, 2.2, 1.8, 2.1], "eagle3": [1.0, 1.1, 0.9, 1.0],
                            "ngram": [1.5, 1.6, 1.4, 1.5]}, forwards={"eagle3": 8, "ngram": 12})
    rec = recommend(report)
    assert rec["deploy"] == "eagle3" and rec["runner_up"] == "ngram" and rec["clear_winner"] is True
    assert rec["speed_ratio_ci"][0] > 1.0
    assert any(r.startswith("eagle3 is clearly faster than ngram: the 95% interval") for r in rec["reasons"])
    assert not any("not clear" in r or "no clear winner" in r for r in rec["reasons"])
    # reports without per-answer timings (written before intervals) get no verdict
    assert recommend({"methods": report["methods"]})["clear_winner"] is None


def test_methods_table_shows_intervals_and_counts():
    from specforge_lite.measurement.report import methods_table

    report = _timed_report({"plain": [2.0, 2.2, 1.8, 2.1], "eagle3": [1.0, 1.1, 0.9, 1.0]}, forwards={"eagle3": 8})
    for entry in report["methods"].values():
        entry.update({"acceptance_rate": None, "per_position_acceptance": [], "draft_time_share": None,
                      "overhead_ms_per_step": None, "identical_answers": "4/4"})
    table = methods_table(report)
    header, _, plain, eagle3 = table.splitlines()
    assert "| tau [95% CI] |" in header and "| speedup [95% CI] | prompts / tokens / forwards |" in header
    tau_ci, speedup_ci = report["methods"]["eagle3"]["tau_ci"], report["methods"]["eagle3"]["speedup_ci"]
    assert f"| eagle3 | 2.50 [{tau_ci[0]:.2f}, {tau_ci[1]:.2f}] |" in eagle3
    assert f"x [{speedup_ci[0]:.2f}, {speedup_ci[1]:.2f}] | 4 / 84 / 32 |" in eagle3
    assert "| plain | 1.00 [1.00, 1.00] |" in plain and "| 1.00x [1.00, 1.00] | 4 / 84 / 80 |" in plain
    # a report written before intervals existed still renders
    for entry in report["methods"].values():
        del entry["tau_ci"], entry["speedup_ci"], entry["num_prompts"]
    assert "| eagle3 | 2.50 |" in methods_table(report)


def test_report_names_the_target_forward_and_where_its_graphs_came_from():
    from specforge_lite.measurement.report import _engine_sentence

    assert _engine_sentence(None) == ""
    loaded = _engine_sentence({"requested": "auto", "used": "compiled", "compile_s": 1.84, "graph": "loaded"})
    assert loaded == (" Target forward: `compiled` (eval.engine=auto), its graphs loaded from the graph cache "
                      "in 1.8 s before timing.")
    built = _engine_sentence({"requested": "compiled", "used": "compiled", "compile_s": 138.2, "graph": "compiled"})
    assert built == " Target forward: `compiled`, its graphs compiled in 138.2 s before timing."
    assert _engine_sentence({"requested": "hf", "used": "hf", "compile_s": None}) == " Target forward: `hf`."
    untuned = _engine_sentence({"requested": "compiled", "used": "compiled", "compile_s": 20.0, "graph": "compiled",
                                "autotune": False})
    assert untuned == (" Target forward: `compiled`, its graphs compiled in 20.0 s before timing "
                       "(SPECFORGE_LITE_AUTOTUNE=0: inductor's default kernels, not autotuned ones).")


def test_compiled_drafting_that_proposes_otherwise_falls_back_to_eager(tiny_target, tmp_path):
    """A drafter whose compiled graphs propose otherwise than its eager module on the first prompt
    drafts eagerly from then on and the report's engine line calls it a defect; a graph that is
    fine is kept. The drafter: the target itself as a draft model (every eager draft accepted), its
    compiled runner planted with a fault that makes every draft wrong."""
    from specforge_lite.measurement import checks
    from specforge_lite.decoding.drafters import DraftModelDrafter
    from specforge_lite.decoding.engine import generate_speculative
    from specforge_lite.measurement.report import _engine_sentence
    from specforge_lite.decoding.verify import SamplingParams
    import torch

    model, _ = tiny_target
    sampling = SamplingParams(0.0, 1.0)
    drafters = {"good": DraftModelDrafter(model), "broken": DraftModelDrafter(model)}
    for drafter in drafters.values():
        assert drafter.compile(3, capacity=128) >= 0 and drafter.runner is not None
    real = drafters["broken"].runner.forward
    drafters["broken"].runner.forward = lambda feed, last_only=False: (-real(feed, last_only)[0], None)

    def decoder(name):
        return lambda ids, n, seed: generate_speculative(model, drafters[name], ids, n, 3, sampling, [],
                                                          torch.Generator().manual_seed(seed))

    decoders = {name: decoder(name) for name in drafters}
    ids = list(range(5, 17))
    assert sum(decoders["broken"](ids, 12, 0).accepted_lengths) == 0
    info = {"used": "compiled", "requested": "compiled", "drafters_graph": {"good": "compiled", "broken": "compiled"},
            "drafters_compile_s": {"good": 1.0, "broken": 1.0}}
    checks.compiled_drafting(decoders, drafters, info, ids, 12, 0)
    assert info["drafters_graph"] == {"good": "compiled", "broken": "eager"}
    assert drafters["good"].runner is not None and drafters["broken"].runner is None
    assert "DEFECT" in info["drafters_fallback"]["broken"] and "good" not in info["drafters_fallback"]
    good, broken = info["drafters_agreement"]["good"], info["drafters_agreement"]["broken"]
    assert good[0] == good[1] > 0 and broken[0] == 0 < broken[1], info["drafters_agreement"]
    assert sum(decoders["broken"](ids, 12, 0).accepted_lengths) > 0
    assert "broken eager (DEFECT: its compiled drafting graphs proposed what its eager module proposes on 0 of" \
        in _engine_sentence(info)


def test_the_cost_curve_says_how_much_the_widest_forward_costs():
    from specforge_lite.measurement.report import _engine_sentence, flatness

    assert flatness({1: 10.0, 2: 10.5, 16: 13.0}) == " The widest, t=16, costs 1.30x the one-token forward."
    assert flatness({"1": 20.0, "16": 50.0}).startswith(" The widest, t=16, costs 2.50x")
    assert flatness({1: 10.0}) == ""
    measured = {"requested": "auto", "used": "bfloat16", "reason": "the faster of the two on this CPU (...)"}
    assert _engine_sentence({"requested": "static", "used": "static", "dtype": measured}) == (
        " Target forward: `static` in bfloat16 (target.dtype=auto: the faster of the two on this CPU (...)).")


def test_best_k_method_must_be_a_chain_of_our_engine(tmp_path):
    """A tree method, plain or a Hugging Face decoder has no per-position chain acceptance to
    estimate best k from: refused at the door instead of a report saying best k = None."""
    from specforge_lite.drafters.methods import method_problems

    for method in ("ngram_tree", "plain", "hf_prompt_lookup"):
        cfg = eval_cfg(tmp_path, "eval.methods=[plain,ngram,ngram_tree,hf_prompt_lookup]",
                       f"eval.best_k_method={method}")
        problems = method_problems(cfg.eval)
        assert len(problems) == 1 and problems[0].startswith(f"eval.best_k_method='{method}' has no best k"), problems
        assert "(ngram)" in problems[0]
    assert not method_problems(eval_cfg(tmp_path, "eval.methods=[plain,ngram,suffix]",
                                        "eval.best_k_method=suffix").eval)
