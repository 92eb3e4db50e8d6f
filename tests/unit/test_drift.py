"""A busy machine is named: a rate compared with its own start (runtime/drift.py)."""

from __future__ import annotations

from specforge_lite.runtime.drift import DriftWatch, drifted


def test_a_steady_or_noisy_series_is_not_named():
    steady = [1.0, 1.1, 0.9, 1.2, 0.95, 1.3, 1.0, 1.4, 0.9, 1.5]  # noise up to 1.5x, no window median near 2x
    assert drifted(steady, "x") is None
    watch = DriftWatch("x")
    assert not any(watch.add(cost) for cost in steady) and watch.worst < 2.0


def test_a_slowdown_is_named_once_with_where_it_began():
    costs = [1.0] * 6 + [3.0] * 6 + [1.0] * 6 + [4.0] * 4
    found = drifted(costs, "plain decoding's one-token forward")
    assert found["first"] == 6 and found["ratio"] == 4.0
    assert found["text"].startswith("plain decoding's one-token forward slowed to 4.0x its start from sample 7 of 22")
    watch, lines = DriftWatch("training's time per token"), []
    for cost in costs:
        if line := watch.add(cost):
            lines.append(line)
    # once when it slows, quiet while slow, again after it recovered and slowed a second time
    assert len(lines) == 2 and lines[0].startswith("training's time per token is 3.0x slower than at its start")


def test_one_slow_sample_is_not_a_drift():
    assert drifted([1.0, 1.0, 1.0, 10.0, 1.0, 1.0, 1.0], "x") is None
