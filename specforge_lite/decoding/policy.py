"""How a hybrid picks each step's source (`hybrid.py`): suffix lookup's draft, the trained drafter's, or none.

Each choice is scored by the tokens a step of it is expected to emit per second, and the step takes
the highest score:

    lookup:   (1 + min(score * ratio_upper, its drafts)) / verify_s(its drafts + 1)
    drafter:  (1 + min(kept_upper, its drafts)) / (verify_s at the widths it verifies + draft_s)
    none:     1 / verify_s(1)     (a plain step: where neither source pays for itself)

What a source keeps is learned in this run with a prior worth `prior_weight` steps (pseudo-counts):

- the drafter's expected kept tokens per step is `pseudo_mean(prior_accepted, prior_weight, accepted, steps)`;
- lookup scores its own draft (`suffix.SuffixDraft.score`, its expected kept tokens), calibrated by
  the ratio of what the target kept of lookup's drafts to what their scores predicted: a prior of 1
  worth `prior_weight` predicted tokens, `pseudo_mean(1, prior_weight, kept, predicted)`.

Neither estimate locks its source out after a bad start: each is raised by an exploration bonus
(UCB1) `explore * sqrt(ln(steps + 1) / (prior_weight + source's steps))`, which grows while a source
goes unmeasured and shrinks as it is measured (a source not chosen is otherwise never measured).

verify_s(w) is the cost model's price of a verify of width w (drafts + 1, `cost.CostModel`): the
mean of the verify forwards of that width the engine reported (`observe_verify`), else the measured
curve the evaluate starts it from, scaled to what the loop paid, else the dearest priced width
below; with no price at all every width costs the same and drafting nothing (the surer draft wins). The drafter is priced at
the widths it verified after its draft was cut (before its first step: its full width), and draft_s
is its mean drafting call, the calls that also wrote the anchors of skipped steps (catch-up) left out
while any call without catch-up is timed.

`reset_estimates` forgets what the sources kept (after the warm-up, or when the drafter changes how
it drafts, e.g. compiled to eager); the machine's times are kept.
"""

from __future__ import annotations

import math
from collections import Counter

from specforge_lite.decoding.cost import CostModel

# the choices (PLAIN_STEP: no draft, a plain step; its report key is "none")
LOOKUP, DRAFTER, PLAIN_STEP = "lookup", "drafter", "none"


def pseudo_mean(prior: float, weight: float, total: float, count: float) -> float:
    """The mean of `count` observations summing to `total`, with `prior` counted as `weight` more."""
    return (prior * weight + total) / (weight + count)


def exploration_bonus(explore: float, steps: int, measured: float) -> float:
    """UCB1's bonus: `explore * sqrt(ln(steps + 1) / measured)`, `measured` the source's pseudo-count
    plus its own steps, `steps` the steps of every source since the estimates were reset."""
    return explore * math.sqrt(math.log(steps + 1) / measured)


class SourcePolicy:
    """The choice rule (the module's docstring) and what it learns from the steps it chose."""

    def __init__(self, prior_accepted: float = 1.0, prior_weight: float = 3.0, explore: float = 1.0,
                 costs: CostModel | None = None):
        self.prior_accepted, self.prior_weight, self.explore = prior_accepted, prior_weight, explore
        # the machine's costs: kept across resets of the estimates
        self.costs = costs or CostModel()  # verify forwards by width
        self.draft = {"clean": [0.0, 0], "catch_up": [0.0, 0]}  # drafter calls without / with skipped anchors
        self.reset_estimates()

    def reset_estimates(self) -> None:
        """Forget what each source kept and how wide the drafter verified; keep the times."""
        self.steps = 0  # steps of every choice since the reset
        self.drafter_accepted, self.drafter_steps = 0.0, 0
        self.drafter_widths: Counter = Counter()  # width verified after the cut -> steps
        self.lookup_accepted, self.lookup_scored, self.lookup_steps = 0.0, 0.0, 0

    # what the engine and the hybrid measure
    def observe_verify(self, width: int, seconds: float) -> None:
        self.costs.observe(width, seconds)

    def observe_draft(self, seconds: float, catch_up: bool) -> None:
        timed = self.draft["catch_up" if catch_up else "clean"]
        timed[0] += seconds
        timed[1] += 1

    def record(self, choice: str, accepted: int, width: int, score: float = 0.0) -> None:
        """A step of `choice` verified `width` (drafts + 1) and the target kept `accepted` drafts;
        `score` what lookup predicted for its draft."""
        self.steps += 1
        if choice == DRAFTER:
            self.drafter_accepted += accepted
            self.drafter_steps += 1
            self.drafter_widths[width] += 1
        elif choice == LOOKUP:
            self.lookup_accepted += accepted
            self.lookup_scored += score
            self.lookup_steps += 1

    # the estimates
    def verify_s(self, width: int) -> float | None:
        return self.costs.seconds(width)

    def draft_s(self) -> float:
        """The drafter's mean call, catch-up calls only while no call without catch-up is timed."""
        seconds, calls = self.draft["clean"] if self.draft["clean"][1] else self.draft["catch_up"]
        return seconds / calls if calls else 0.0

    def drafter_expected(self) -> float:
        """The drafter's expected kept tokens per step, exploration bonus included."""
        measured = self.prior_weight + self.drafter_steps
        return (pseudo_mean(self.prior_accepted, self.prior_weight, self.drafter_accepted, self.drafter_steps)
                + exploration_bonus(self.explore, self.steps, measured))

    def lookup_ratio(self) -> float:
        """Lookup's kept tokens per token its score predicts (prior 1), exploration bonus included."""
        measured = self.prior_weight + self.lookup_steps
        ratio = pseudo_mean(1.0, self.prior_weight, self.lookup_accepted, self.lookup_scored)  # prior: scores hold
        return ratio + exploration_bonus(self.explore, self.steps, measured)

    def rates(self, lookup_score: float | None, lookup_drafts: int, drafter_width: int,
              drafter_drafts: int) -> dict[str, float]:
        """Expected tokens per second of each choice open this step (the module's rule): lookup
        where it has a draft of `lookup_drafts` tokens scored `lookup_score`; the drafter at most
        `drafter_drafts` kept of a verify `drafter_width` wide before any of its steps is measured."""
        timed = self.costs.known
        cost = self.verify_s if timed else (lambda width: 1.0)
        rates = {}
        if lookup_score is not None and lookup_drafts:
            expected = min(lookup_score * self.lookup_ratio(), lookup_drafts)
            rates[LOOKUP] = (1 + expected) / cost(lookup_drafts + 1)
        if drafter_drafts:
            widths = self.drafter_widths or {drafter_width: 1}
            verify_s = sum(cost(w) * n for w, n in widths.items()) / sum(widths.values())
            drafting = self.draft_s() if timed else 0.0
            rates[DRAFTER] = (1 + min(self.drafter_expected(), drafter_drafts)) / (verify_s + drafting)
        rates[PLAIN_STEP] = 1 / cost(1)
        return rates

    def choose(self, lookup_score: float | None, lookup_drafts: int, drafter_width: int, drafter_drafts: int) -> str:
        """LOOKUP, DRAFTER or PLAIN_STEP: the most expected tokens per second (ties: the cheaper draft first)."""
        rates = self.rates(lookup_score, lookup_drafts, drafter_width, drafter_drafts)
        return max(rates, key=rates.get)
