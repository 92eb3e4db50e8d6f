"""Bootstrap intervals of the evaluate report (specforge_lite/measurement/stats.py): seeded,
paired over prompts, recomputing the report's ratio-of-sums statistics on each resample."""

from __future__ import annotations

import numpy as np
import pytest

from specforge_lite.measurement import stats


def _rows(method, tokens, forwards, seconds, turns=1):
    """Answer rows of one method as report.json writes them, `turns` answers per prompt
    (each turn gets an equal share of the prompt's numbers)."""
    return [{"prompt_id": f"p{i}", "method": method, "num_tokens": t / turns, "num_forwards": f / turns,
             "total_s": s / turns} for i, (t, f, s) in enumerate(zip(tokens, forwards, seconds))
            for _ in range(turns)]


def _two_prompts():
    # prompt 0: the method needs half plain's forwards and time; prompt 1: the same as plain
    rows = _rows("plain", [11, 11], [10, 10], [1.0, 2.0]) + _rows("fast", [11, 11], [5, 10], [0.5, 2.0])
    return stats.prompt_totals(rows)


def test_hand_checked_two_prompt_case():
    """Two prompts give three distinct resamples: {0,0}, {0,1} (either order) and {1,1}."""
    totals = _two_prompts()
    fast, plain = totals["fast"], totals["plain"]
    assert float(stats.tau(fast)) == pytest.approx(20 / 15)  # (10 + 10) / (5 + 10)
    assert float(stats.speed_ratio(fast, plain)) == pytest.approx((22 / 2.5) / (22 / 3.0))
    # tau: {0,0} -> 2, {0,1} -> 4/3, {1,1} -> 1; speedup: {0,0} -> 2, {0,1} -> 1.2, {1,1} -> 1.
    # {0,0} and {1,1} each have probability 1/4 > 2.5%, so the 95% interval is [1, 2] for both
    intervals = stats.method_intervals(totals)
    assert intervals["fast"] == {"tau_ci": [1.0, 2.0], "speedup_ci": [1.0, 2.0], "num_prompts": 2}
    assert intervals["plain"] == {"tau_ci": [1.0, 1.0], "speedup_ci": [1.0, 1.0], "num_prompts": 2}


def test_paired_resampling_uses_the_same_prompts_for_both_methods():
    totals = _two_prompts()
    indices = stats.resample_indices(2, 500, seed=3)
    ratios = stats.speed_ratio(totals["fast"], totals["plain"], indices)
    # unpaired draws would also give e.g. fast on {0,0} against plain on {1,1}: (22/1) / (22/4) = 4
    assert set(np.round(ratios, 9)) == {1.0, 1.2, 2.0}
    # each resample's ratio is the one computed from that resample's prompts alone
    for row, ratio in zip(indices[:20], ratios[:20]):
        assert ratio == pytest.approx(float(stats.speed_ratio(totals["fast"], totals["plain"], row)))
    # the interval of a pair's speed ratio draws the same prompts as the report's speedup interval
    assert (stats.speed_ratio_interval(totals["fast"], totals["plain"], 300, 7)
            == stats.method_intervals(totals, resamples=300, seed=7)["fast"]["speedup_ci"])


def test_deterministic_by_seed():
    assert np.array_equal(stats.resample_indices(24, 100, seed=5), stats.resample_indices(24, 100, seed=5))
    assert not np.array_equal(stats.resample_indices(24, 100, seed=5), stats.resample_indices(24, 100, seed=6))
    totals = _random_totals(np.random.default_rng(0), 24)
    assert stats.method_intervals(totals, seed=1) == stats.method_intervals(totals, seed=1)


def test_identical_prompts_give_a_zero_width_interval_at_the_point_estimate():
    rows = _rows("plain", [65] * 8, [64] * 8, [0.8] * 8) + _rows("eagle3", [65] * 8, [32] * 8, [0.5] * 8)
    totals = stats.prompt_totals(rows)
    intervals = stats.method_intervals(totals)
    assert intervals["eagle3"]["tau_ci"] == [2.0, 2.0]
    speedup = float(stats.speed_ratio(totals["eagle3"], totals["plain"]))
    assert intervals["eagle3"]["speedup_ci"] == [speedup, speedup] and speedup == pytest.approx(1.6)
    assert intervals["plain"]["tau_ci"] == [1.0, 1.0] and intervals["plain"]["speedup_ci"] == [1.0, 1.0]


def _random_totals(rng, num_prompts):
    tokens = rng.integers(20, 129, num_prompts)
    plain_s = tokens * rng.uniform(0.02, 0.04, num_prompts)
    forwards = np.ceil((tokens - 1) / rng.uniform(1.0, 3.0, num_prompts))
    rows = (_rows("plain", tokens, tokens - 1, plain_s, turns=2)
            + _rows("draft", tokens, forwards, plain_s * rng.uniform(0.5, 1.3, num_prompts), turns=2))
    return stats.prompt_totals(rows)


@pytest.mark.parametrize("seed", range(5))
def test_point_estimate_lies_inside_the_interval(seed):
    totals = _random_totals(np.random.default_rng(seed), 24)
    intervals = stats.method_intervals(totals, seed=seed)["draft"]
    low, high = intervals["tau_ci"]
    assert low < float(stats.tau(totals["draft"])) < high
    low, high = intervals["speedup_ci"]
    assert low < float(stats.speed_ratio(totals["draft"], totals["plain"])) < high
    # a higher level gives a wider interval
    wide = stats.method_intervals(totals, seed=seed, level=0.99)["draft"]["tau_ci"]
    assert wide[0] <= intervals["tau_ci"][0] and wide[1] >= intervals["tau_ci"][1]


def test_turns_of_a_prompt_are_one_resampling_unit():
    rows = [{"prompt_id": "a", "method": "plain", "num_tokens": 9, "num_forwards": 8, "total_s": 1.0},
            {"prompt_id": "b", "method": "plain", "num_tokens": 5, "num_forwards": 4, "total_s": 0.5},
            {"prompt_id": "a", "method": "plain", "num_tokens": 3, "num_forwards": 2, "total_s": 0.25}]
    plain = stats.prompt_totals(rows)["plain"]
    assert plain.num_prompts == 2
    assert plain.tokens.tolist() == [12, 5] and plain.answers.tolist() == [2, 1]
    assert plain.forwards.tolist() == [10, 4] and plain.total_s.tolist() == [1.25, 0.5]
    with pytest.raises(ValueError, match="no answer for prompts"):
        stats.prompt_totals(rows + [{"prompt_id": "a", "method": "ngram", "num_tokens": 9, "num_forwards": 4,
                                     "total_s": 1.0}])


def test_no_decoding_forward_gives_no_interval():
    rows = _rows("plain", [1, 1], [0, 0], [0.1, 0.1])  # every answer ended at its first token
    assert stats.method_intervals(stats.prompt_totals(rows))["plain"]["tau_ci"] is None
    assert stats.percentile_interval(np.array([np.nan, 1.0, 3.0]), 0.5) == [1.5, 2.5]
    with pytest.raises(ValueError, match="level"):
        stats.percentile_interval(np.array([1.0]), 95)


def test_bootstrap_settings_defaults_and_report_values():
    assert stats.bootstrap_settings(None) == {"resamples": 2000, "seed": 0, "level": 0.95}
    given = {"bootstrap": {"resamples": 500, "seed": 3, "level": 0.9}}
    assert stats.bootstrap_settings(given) == {"resamples": 500, "seed": 3, "level": 0.9}
