"""Confidence intervals of the evaluate report's ratio statistics, by bootstrap over prompts.

The resampling unit is the prompt: all turns (answers) of one prompt go in or out of a
resample together, because a second turn depends on the first. Every method is resampled
with the same prompt indices (a paired bootstrap), so a method's speedup and the ratio of
two methods' speeds compare the same prompts, as their point estimates do.

The statistics are recomputed on each resample exactly as `metrics.summarise` and the
evaluate stage compute the point estimates, ratios of sums over answers:

- tau = sum(tokens - 1) / sum(decoding target forwards);
- tokens/s = sum(tokens) / sum(wall seconds of the whole call, prefill included);
- speedup = method's tokens/s / plain's tokens/s. Under greedy decoding a lossless method
  emits plain's tokens, so this is plain's total time / the method's total time.

An interval is the (1 - level) / 2 and (1 + level) / 2 percentiles of the resampled
statistic (the percentile bootstrap). A resample whose denominator is zero (every answer
ended at its first token: no decoding forward) has no value and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class PromptTotals:
    """One method's answers summed per prompt: four float64 arrays of shape (P,), P prompts
    in the same order for every method of a report (so index i is the same prompt)."""

    tokens: np.ndarray  # tokens emitted, summed over the prompt's turns
    answers: np.ndarray  # answers (turns) of the prompt
    forwards: np.ndarray  # decoding target forwards (prefill excluded)
    total_s: np.ndarray  # wall seconds of the whole calls (prefill included)

    @property
    def num_prompts(self) -> int:
        return len(self.tokens)


def prompt_totals(rows: Iterable[Mapping]) -> dict[str, PromptTotals]:
    """Per-method `PromptTotals` from answer rows as in report.json's `answers`: dicts with
    `prompt_id`, `method`, `num_tokens`, `num_forwards`, `total_s`. Prompts are ordered by
    first appearance; answers sharing a `prompt_id` are one resampling unit. Every method
    must have answered every prompt (the evaluate stage runs all methods on all prompts)."""
    sums: dict[str, dict[int, np.ndarray]] = {}
    order: dict[str, int] = {}
    for row in rows:
        index = order.setdefault(row["prompt_id"], len(order))
        summed = sums.setdefault(row["method"], {}).setdefault(index, np.zeros(4))
        summed += (row["num_tokens"], 1, row["num_forwards"], row["total_s"])
    out = {}
    for method, per_prompt in sums.items():
        if missing := [prompt for prompt, i in order.items() if i not in per_prompt]:
            raise ValueError(f"method {method} has no answer for prompts {missing[:5]}")
        table = np.stack([per_prompt[i] for i in range(len(order))])
        out[method] = PromptTotals(*(table[:, j].copy() for j in range(4)))
    return out


def resample_indices(num_prompts: int, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> np.ndarray:
    """(resamples, num_prompts) int array: prompt indices drawn with replacement, the same for
    a given seed on every machine (numpy's PCG64)."""
    if num_prompts < 1 or resamples < 1:
        raise ValueError(f"need at least one prompt and one resample, got {num_prompts} and {resamples}")
    return np.random.default_rng(seed).integers(0, num_prompts, size=(resamples, num_prompts))


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, NaN where the denominator is zero."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1.0), np.nan)


def tau(totals: PromptTotals, indices: np.ndarray | None = None) -> np.ndarray:
    """tau over the prompts `indices` ((R, P) gives R values, None: all prompts once, a 0-d
    array): sum(tokens - 1 per answer) / sum(decoding forwards)."""
    idx = np.arange(totals.num_prompts) if indices is None else indices
    emitted = (totals.tokens - totals.answers)[idx].sum(axis=-1)
    return _ratio(emitted, totals.forwards[idx].sum(axis=-1))


def tokens_per_s(totals: PromptTotals, indices: np.ndarray | None = None) -> np.ndarray:
    """tokens/s over the prompts `indices` (as in `tau`): sum(tokens) / sum(wall seconds)."""
    idx = np.arange(totals.num_prompts) if indices is None else indices
    return _ratio(totals.tokens[idx].sum(axis=-1), totals.total_s[idx].sum(axis=-1))


def speed_ratio(method: PromptTotals, baseline: PromptTotals, indices: np.ndarray | None = None) -> np.ndarray:
    """`method`'s tokens/s over `baseline`'s, both over the same prompts `indices` (paired);
    with baseline = plain this is the report's speedup."""
    return _ratio(tokens_per_s(method, indices), tokens_per_s(baseline, indices))


def percentile_interval(samples: np.ndarray, level: float = DEFAULT_LEVEL) -> list[float] | None:
    """[low, high]: the (1 - level) / 2 and (1 + level) / 2 percentiles of the samples that
    have a value (NaN left out); None when none has."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    kept = np.asarray(samples, dtype=np.float64)
    kept = kept[~np.isnan(kept)]
    if not kept.size:
        return None
    low, high = np.percentile(kept, [50 * (1 - level), 50 * (1 + level)])
    return [float(low), float(high)]


def method_intervals(totals: Mapping[str, PromptTotals], baseline: str = "plain",
                     resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                     level: float = DEFAULT_LEVEL) -> dict[str, dict]:
    """Per method {"tau_ci": [lo, hi] | None, "speedup_ci": [lo, hi] | None, "num_prompts": P}.

    One set of resampled prompt indices, shape (resamples, P), serves every method and the
    baseline, so each speedup resample compares a method and the baseline on the same prompts.
    """
    num_prompts = totals[baseline].num_prompts
    indices = resample_indices(num_prompts, resamples, seed)
    base = totals[baseline]
    return {name: {"tau_ci": percentile_interval(tau(t, indices), level),
                   "speedup_ci": percentile_interval(speed_ratio(t, base, indices), level),
                   "num_prompts": t.num_prompts}
            for name, t in totals.items()}


def speed_ratio_interval(method: PromptTotals, other: PromptTotals, resamples: int = DEFAULT_RESAMPLES,
                         seed: int = DEFAULT_SEED, level: float = DEFAULT_LEVEL) -> list[float] | None:
    """Paired-bootstrap interval of `method`'s tokens/s over `other`'s: it excludes 1.0 when
    one is faster than the other on resamples of this prompt set at the given level."""
    return percentile_interval(speed_ratio(method, other, resample_indices(method.num_prompts, resamples, seed)),
                               level)


def bootstrap_settings(settings: Mapping | None) -> dict:
    """{"resamples", "seed", "level"} from a report's `settings["bootstrap"]` (defaults where absent)."""
    given = dict((settings or {}).get("bootstrap") or {})
    return {"resamples": int(given.get("resamples", DEFAULT_RESAMPLES)), "seed": int(given.get("seed", DEFAULT_SEED)),
            "level": float(given.get("level", DEFAULT_LEVEL))}
