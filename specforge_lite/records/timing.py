"""Timing for the benchmarks and the GPU check: wall seconds, the median in ms, and modes
interleaved round by round (a shared machine drifts: one round compares the modes under one load)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """fn's result and its wall seconds."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def median_ms(seconds: list[float]) -> float:
    """The median of timings in seconds, in milliseconds (robust to a noisy shared CPU)."""
    return 1e3 * statistics.median(seconds)


def interleaved(modes: dict[str, Callable[[], int]], rounds: int, baseline: str) -> tuple[dict, dict]:
    """Every mode once per round, in turn. A mode returns what it made (tokens). Returns
    ({mode: [count, seconds] over all rounds}, {mode: [its rate / the baseline's rate, per round]})."""
    totals = {name: [0, 0.0] for name in modes}
    ratios: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(rounds):
        rates = {}
        for name, fn in modes.items():
            count, seconds = timed(fn)
            totals[name][0] += count
            totals[name][1] += seconds
            rates[name] = count / seconds
            print(f"{name}: {count} tokens in {seconds:.1f} s ({rates[name]:.1f} tokens/s)", flush=True)
        for name in modes:
            ratios[name].append(rates[name] / rates[baseline])
    return totals, ratios
