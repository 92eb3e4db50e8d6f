"""benchmarks/records/record_families.py's equal-CPU table: the minutes each drafter was given
(its steps at its pilot's seconds per step) beside what it logged, from its real metrics.json layout."""

from __future__ import annotations

import json

import pytest

from benchmarks.records import record_families
from specforge_lite import SpecforgeError


def drafter_dir(root, name, steps, seconds, tokens):
    run = root / name / "train"
    (run / "drafter").mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"total_steps": steps, "tokens_seen": tokens,
                                                  "throughput": {"ranks": [{"seconds": seconds}]}}))
    return str(run / "drafter")


def test_equal_cpu_rows_give_steps_times_pilot_rate(tmp_path):
    dirs = {"eagle3": drafter_dir(tmp_path, "e", 459, 2136.0, 208523),
            "dflash": drafter_dir(tmp_path, "d", 674, 2036.0, 305607)}
    rows = record_families.equal_cpu(dirs, ["eagle3=3.92", "dflash=2.67"], ["eagle3=1835"], 1)
    assert rows["eagle3"]["cpu_min_given"] == pytest.approx(459 * 3.92 / 60)
    assert rows["dflash"]["cpu_min_given"] == pytest.approx(674 * 2.67 / 60)
    assert rows["eagle3"]["train_min_logged"] == pytest.approx(2136.0 / 60)
    assert rows["eagle3"]["process_cpu_min"] == pytest.approx(1835 / 60) and rows["dflash"]["process_cpu_min"] is None
    assert rows["dflash"]["tokens"] == 305607


def test_a_malformed_or_unknown_pilot_is_one_error_line(tmp_path):
    """`fail` raises SpecforgeError, which benchmarks.common.run prints in one line with exit 2."""
    dirs = {"eagle3": drafter_dir(tmp_path, "e", 10, 10.0, 100)}
    with pytest.raises(SpecforgeError, match="--pilot 'eagle3=fast': give NAME=SECONDS"):
        record_families.equal_cpu(dirs, ["eagle3=fast"], [], 1)
    with pytest.raises(SpecforgeError, match="--pilot peagle: the evaluate decoded no drafter of that name"):
        record_families.equal_cpu(dirs, ["peagle=3.5"], [], 1)


def test_extra_drafter_labels_are_folders_and_dflash_goals_follow_the_named_method(tmp_path):
    folder = drafter_dir(tmp_path, "d4", 665, 1800.0, 300000)
    report = {"settings": {"drafter_dirs": {"eagle3": "e/train/drafter", "medusa": None},
                           "extra_drafters": [f"dflash_b4:{folder}"]}}
    assert record_families.drafter_folders(report) == {"eagle3": "e/train/drafter", "medusa": None, "dflash_b4": folder}
    entry = lambda ms, speed, ci: {"draft_ms_per_token": ms, "speedup": speed, "speedup_ci": ci}  # noqa: E731
    methods = {"eagle3": entry(1.8, 1.0, [0.95, 1.05]), "dflash_b4": entry(0.5, 1.1, [1.06, 1.14]),
               "ngram": entry(0.02, 1.2, [1.1, 1.3])}
    goals = record_families.dflash_goals(methods, "dflash_b4")
    assert goals["draft_cost_per_token_le_third_of_eagle3"]["met"] is True  # 0.5 / 1.8 <= 1/3
    assert goals["speedup_ahead_of_eagle3_apart"]["met"] is True
    assert goals["stretch_ahead_of_ngram_apart"]["met"] is False
    assert record_families.dflash_goals(methods, "dflash") == {}  # no such method in this run
