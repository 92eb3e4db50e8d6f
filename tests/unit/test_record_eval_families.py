"""What the drafter-families record reads and checks, from the package it records with: the
equal-CPU table (the minutes each drafter was given, its steps at its pilot's seconds per step,
beside what it logged, from its real metrics.json layout), the drafter folders of a report, and
the DFlash issue's goals as benchmarks/goals.yaml states them (`records.goals`)."""

from __future__ import annotations

import json

import pytest
import yaml

from specforge_lite import SpecforgeError
from specforge_lite.records import goals, runs


def drafter_dir(root, name, steps, seconds, tokens):
    run = root / name / "train"
    (run / "drafter").mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"total_steps": steps, "tokens_seen": tokens,
                                                  "throughput": {"ranks": [{"seconds": seconds}]}}))
    return str(run / "drafter")


def test_equal_cpu_rows_give_steps_times_pilot_rate(tmp_path):
    dirs = {"eagle3": drafter_dir(tmp_path, "e", 459, 2136.0, 208523),
            "dflash": drafter_dir(tmp_path, "d", 674, 2036.0, 305607)}
    rows = runs.equal_cpu(dirs, ["eagle3=3.92", "dflash=2.67"], ["eagle3=1835"], 1)
    assert rows["eagle3"]["cpu_min_given"] == pytest.approx(459 * 3.92 / 60)
    assert rows["dflash"]["cpu_min_given"] == pytest.approx(674 * 2.67 / 60)
    assert rows["eagle3"]["train_min_logged"] == pytest.approx(2136.0 / 60)
    assert rows["eagle3"]["process_cpu_min"] == pytest.approx(1835 / 60) and rows["dflash"]["process_cpu_min"] is None
    assert rows["dflash"]["tokens"] == 305607


def test_a_malformed_or_unknown_pilot_is_one_error_line(tmp_path):
    """A SpecforgeError, which the record's `run(main)` prints in one line with exit 2."""
    dirs = {"eagle3": drafter_dir(tmp_path, "e", 10, 10.0, 100)}
    with pytest.raises(SpecforgeError, match="--pilot 'eagle3=fast': give NAME=SECONDS"):
        runs.equal_cpu(dirs, ["eagle3=fast"], [], 1)
    with pytest.raises(SpecforgeError, match="--pilot peagle: the evaluate decoded no drafter of that name"):
        runs.equal_cpu(dirs, ["peagle=3.5"], [], 1)


def test_extra_drafter_labels_are_folders_and_dflash_goals_follow_the_named_method(tmp_path):
    folder = drafter_dir(tmp_path, "d4", 665, 1800.0, 300000)
    report = {"settings": {"drafter_dirs": {"eagle3": "e/train/drafter", "medusa": None},
                           "extra_drafters": [f"dflash_b4:{folder}"]}}
    assert runs.drafter_folders(report) == {"eagle3": "e/train/drafter", "medusa": None, "dflash_b4": folder}
    entry = lambda ms, speed, ci: {"draft_ms_per_token": ms, "speedup": speed, "speedup_ci": ci}  # noqa: E731
    report["methods"] = {"eagle3": entry(1.8, 1.0, [0.95, 1.05]), "dflash_b4": entry(0.5, 1.1, [1.06, 1.14]),
                         "ngram": entry(0.02, 1.2, [1.1, 1.3])}
    dflash = goals.goals_of("eval_families_smollm2")["dflash"]
    found = goals.check(dflash, report, dflash="dflash_b4")
    cost = found["draft_cost_per_token_le_third_of_eagle3"]
    bound = dflash["draft_cost_per_token_le_third_of_eagle3"]["at_most"]
    assert cost["met"] is (0.5 / 1.8 <= bound) is True and cost["value"] == pytest.approx(0.5 / 1.8)
    assert str(bound) in cost["goal"]  # the verdict says what it was held to
    assert found["speedup_ahead_of_eagle3_apart"]["met"] is True
    assert found["stretch_ahead_of_ngram_apart"]["met"] is False
    assert goals.check(dflash, report, dflash="dflash") == {}  # no such method in this run


def test_every_goal_kind_on_a_hand_made_report():
    """Bounds, ratios (plain, gain, tau beyond one token), point and interval comparisons, the
    best of the rest, the recommendation; a goal whose methods are absent is left out."""
    report = {"methods": {"plain": {"tau": 1.0, "tokens_per_s": 50.0},
                          "a": {"tau": 2.5, "speedup": 1.4, "speedup_ci": [1.3, 1.5], "tokens_per_s": 70.0,
                                "best_k": {"expected_speedup": 1.6}},
                          "b": {"tau": 2.0, "speedup": 1.2, "speedup_ci": [1.1, 1.35], "tokens_per_s": 60.0,
                                "best_k": {"expected_speedup": None}}},
              "recommendation": {"deploy": "a"}}
    specs = {"tau_ge_2": {"method": "a", "measure": "tau", "at_least": 2},
             "ratio": {"method": "b", "measure": "tau", "over": "a", "at_most": 0.8},
             "gain": {"method": "a", "measure": "tau", "gain_over": "b", "at_least": 0.3},
             "excess": {"method": "a", "measure": "tau", "excess_over": "b", "at_least": 1.5},
             "ahead": {"method": "a", "measure": "best_k.expected_speedup", "ahead_of": "b"},
             "apart": {"method": "a", "measure": "speedup", "apart_from": "b"},
             "fastest": {"method": "a", "measure": "tokens_per_s", "ahead_of_all": ["plain"]},
             "deploys": {"deploy": "a"},
             "deploys_one": {"deploy_one_of": ["b", "a", "c"]},
             "deploys_other": {"deploy_one_of": ["b"]},
             "deploys_absent": {"deploy_one_of": ["c"]},
             "{each}_tau": {"for_each": ["a", "b"], "method": "{each}", "measure": "tau", "at_least": 2.2},
             "absent": {"method": "c", "measure": "tau", "at_least": 1}}
    found = goals.check(specs, report)
    assert found["tau_ge_2"] == {"value": 2.5, "met": True, "goal": "a tau >= 2"}
    assert found["ratio"]["value"] == pytest.approx(0.8) and found["ratio"]["met"] is True
    assert found["gain"]["value"] == pytest.approx(0.25) and found["gain"]["met"] is False
    assert found["excess"]["value"] == pytest.approx(1.5) and found["excess"]["met"] is True
    assert found["ahead"] == {"value": [1.6, None], "met": False, "goal": "a best_k.expected_speedup above b's"}
    assert found["apart"]["met"] is False  # 1.3 is not above 1.35
    assert found["fastest"]["value"] == [70.0, 60.0] and found["fastest"]["met"] is True
    assert found["deploys"]["met"] is True
    assert found["deploys_one"] == {"value": "a", "met": True, "goal": "the report deploys one of b, a"}
    assert found["deploys_other"]["met"] is False and "deploys_absent" not in found
    assert (found["a_tau"]["met"], found["b_tau"]["met"]) == (True, False)
    assert "absent" not in found
    assert goals.check_value({"x": {"value": "batched / one", "at_least": 3}}, "x", 2.5)["x"]["met"] is False
    assert goals.lines({"tau_ge_2": found["tau_ge_2"]}) == ["- tau_ge_2: 2.50 -> met (a tau >= 2)"]


def test_every_goals_entry_reads_and_a_missing_one_falls_back(tmp_path):
    """benchmarks/goals.yaml is a mapping of results file -> goals; an unknown file name gets the
    record's own entry; a goal that says nothing to check is one error."""
    assert goals.goals_of("eval_no_such_run", "eval_eagle_smollm2") == goals.goals_of("eval_eagle_smollm2")
    assert goals.goals_of("eval_no_such_run") == {}

    def specs(node):  # the goals of an entry, inside its groups
        for value in node.values():
            if isinstance(value, dict) and ("measure" in value or "value" in value or "deploy" in value
                                            or "deploy_one_of" in value):
                yield value
            elif isinstance(value, dict):
                yield from specs(value)

    table = yaml.safe_load(goals.GOALS.read_text())
    found = [spec for entry in table.values() for spec in specs(entry)]
    assert found and all(any(kind in spec for kind in goals.KINDS) for spec in found)
    bad = tmp_path / "goals.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(SpecforgeError, match="mapping of results file name"):
        goals.goals_of("x", path=bad)
    with pytest.raises(SpecforgeError, match="say what it checks"):
        goals.check({"g": {"method": "a", "measure": "tau"}}, {"methods": {"a": {"tau": 1.0}}})
