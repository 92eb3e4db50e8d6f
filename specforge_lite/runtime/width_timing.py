"""Timing target forwards by width, and the rule for when such a timing may change a default.

`time_forwards` times several runners (forwards: dtypes, engines) in rounds: each round times
every (runner, width) once, in an order rotated round by round, so a drift of the machine's speed
while measuring (another process, a clock change) lands on every candidate alike instead of on
whichever was timed while it lasted. Per runner it keeps the median ms of each width and the
noise of its total: the interquartile range of the per-round totals over their median.

The rule (`clearly_faster`): a candidate replaces the default only where its total over the
widths is lower by more than `margin(noise)` = max(MIN_MARGIN, NOISE_FACTOR x the noise of the
two). Why: a difference the same measurement's own noise can make is no difference, and choosing
on it flips the choice from run to run (issue 64: a dtype kept by a lead far inside the noise
measured in the same process, and an engine choice that changed between two runs).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable

# the least relative lead that changes a default, however quiet the machine measured
MIN_MARGIN = 0.05
# a lead must exceed this many times the measured relative spread
NOISE_FACTOR = 2.0
MARGIN_RULE = (f"a candidate replaces the default only when its total is lower by more than "
               f"max({MIN_MARGIN:.0%}, {NOISE_FACTOR:g} x the measured noise)")


def time_forwards(runners: dict, context: list[int], widths: Iterable[int], rounds: int,
                  clock: Callable[[], float] = time.perf_counter) -> dict:
    """Median ms of one forward of each width after `context`, per runner, timed in interleaved rounds.

    runners: name -> a runner (`reset()`, `forward(ids, last_only=...)`, `crop(n)`, `_sync()`, and
    optionally `rolls_back`: `back_to_context`), each with a cache of its own (interleaving must
    not hand one cache between runners). One warm-up round, then `rounds` timed ones; round r
    starts r places further along the list of (runner, width) pairs. Returns {"ms": {name: {width:
    median ms}}, "noise": {name: the interquartile range of its per-round totals over their
    median}, "rounds": rounds}."""
    widths = sorted({int(w) for w in widths})
    for runner in runners.values():
        runner.reset()
        runner.forward(context, last_only=True)
    ids = {w: [context[i % len(context)] for i in range(w)] for w in widths}
    pairs = [(name, w) for name in runners for w in widths]
    times: dict = {name: {w: [] for w in widths} for name in runners}
    for round_index in range(rounds + 1):  # round 0 warms up
        shift = round_index % len(pairs)
        for name, w in pairs[shift:] + pairs[:shift]:
            runner = runners[name]
            start = clock()
            runner.forward(ids[w])
            runner._sync()
            elapsed = clock() - start
            back_to_context(runner, context)
            if round_index:
                times[name][w].append(1e3 * elapsed)
    ms = {name: {w: statistics.median(t) for w, t in by_width.items()} for name, by_width in times.items()}
    noise = {name: relative_spread([sum(by_width[w][r] for w in widths) for r in range(rounds)])
             for name, by_width in times.items()}
    return {"ms": ms, "noise": noise, "rounds": rounds}


def back_to_context(runner, context: list[int]) -> None:
    """Take a runner's cache back to `context` after a timed forward, untimed: cropped, or where the
    cache cannot be rolled back (a recurrent state: `TargetRunner.rolls_back`) built anew from it."""
    if getattr(runner, "rolls_back", True):
        runner.crop(len(context))
    else:
        runner.reset()
        runner.forward(context, last_only=True)


def relative_spread(values: list[float]) -> float:
    """The interquartile range of `values` over their median (0 for fewer than two)."""
    if len(values) < 2 or statistics.median(values) <= 0:
        return 0.0
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return (high - low) / statistics.median(values)


def margin(noise: float) -> float:
    """The relative lead a candidate needs over the default (the module's rule)."""
    return max(MIN_MARGIN, NOISE_FACTOR * noise)


def clearly_faster(candidate_ms: Iterable[float], default_ms: Iterable[float], noise: float) -> bool:
    """Whether the candidate's total beats the default's by more than `margin(noise)`."""
    return sum(candidate_ms) < (1.0 - margin(noise)) * sum(default_ms)


def keep_or_replace(timing: dict, default: str) -> str:
    """The name `timing` (`time_forwards`) picks: the fastest runner clearly faster than `default`
    (`clearly_faster`, with the larger noise of the two), else `default`."""
    ms, noise = timing["ms"], timing["noise"]
    winners = [name for name in ms if name != default and
               clearly_faster(ms[name].values(), ms[default].values(), max(noise[name], noise[default]))]
    return min(winners, key=lambda name: sum(ms[name].values())) if winners else default


def timing_line(timing: dict) -> str:
    """`name a/b ms (noise n%)` per runner, for a log line and a report's reason."""
    return "; ".join(f"{name} " + "/".join(f"{v:.2f}" for v in by_width.values())
                     + f" ms (noise {timing['noise'][name]:.1%})" for name, by_width in timing["ms"].items())
