"""Whether the machine slowed down under a run: another process on the cores makes OpenMP threads
wait on each other (shared/REFERENCE.md section 10, "Contention"), and timings taken then are not
figures. A run compares its own rate with its start.

`DriftWatch` follows a stream (training's seconds per token, window by window); `drifted` judges a
finished series (evaluate's plain one-token forward, prompt by prompt). Both compare the median of
a recent window with the median of the first `start` samples, and speak once the ratio passes
`factor`: the medians keep one slow sample from speaking, and the factor asks for a slowdown of the
kind contention makes, not the spread of a quiet run.
"""

from __future__ import annotations

import statistics

FACTOR = 2.0  # how far beyond its own start a rate must fall to be named
START = 3  # samples that make the start
WINDOW = 3  # recent samples whose median is compared with it


class DriftWatch:
    """A stream of costs (seconds per unit, higher is slower); `add` returns a line the first time
    the recent median passes FACTOR x the start, and again only after it came back below it."""

    def __init__(self, what: str, factor: float = FACTOR, start: int = START, window: int = WINDOW):
        self.what, self.factor, self.start, self.window = what, factor, start, window
        self.samples: list[float] = []
        self.slow = False
        self.worst = 1.0  # the largest ratio seen, for the run's summary

    def add(self, cost: float) -> str | None:
        self.samples.append(cost)
        if len(self.samples) < self.start + self.window:
            return None
        base = statistics.median(self.samples[:self.start])
        ratio = statistics.median(self.samples[-self.window:]) / base if base > 0 else 1.0
        self.worst = max(self.worst, ratio)
        if ratio < self.factor:
            self.slow = False
            return None
        if self.slow:
            return None
        self.slow = True
        return (f"{self.what} is {ratio:.1f}x slower than at its start: another process is probably using these "
                f"cores, and timings taken now are not this machine's")


def drifted(costs: list[float], what: str, factor: float = FACTOR, start: int = START,
            window: int = WINDOW) -> dict | None:
    """A finished series' drift: None on a steady run, else {"ratio", "first", "text"} with the worst
    recent-median ratio to the start and the first sample (0-based) of the window that passed `factor`."""
    watch, first = DriftWatch(what, factor, start, window), None
    for index, cost in enumerate(costs):
        if watch.add(cost) and first is None:  # the window's first sample that is itself that slow
            base = statistics.median(costs[:start])
            first = next(j for j in range(index - window + 1, index + 1) if costs[j] >= factor * base)
    if first is None:
        return None
    return {"ratio": round(watch.worst, 2), "first": first,
            "text": f"{what} slowed to {watch.worst:.1f}x its start from sample {first + 1} of {len(costs)} on: "
                    "another process was probably using these cores; the figures of that stretch are not this "
                    "machine's"}
