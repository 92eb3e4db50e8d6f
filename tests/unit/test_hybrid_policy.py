"""The hybrid's choice rule (decoding/policy.py): its pure parts on identities and hand-counted
cases, the policy on simulated steps of sources whose acceptance is set by hand (a drafter with a bad
start, a lookup whose score lies), and the real HybridDrafter in the real engine loop on the tiny
target with fitted stub sources: an oracle (it drafts the target's own greedy continuation, so it is
kept) against a source that never drafts or is never kept."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from specforge_lite.contract import DraftProposal
from specforge_lite.decoding.engine import generate_plain, generate_speculative, generate_tree
from specforge_lite.decoding.hybrid import HybridDrafter, clear_hybrid_sources
from specforge_lite.decoding.cost import CostModel
from specforge_lite.decoding.policy import DRAFTER, LOOKUP, PLAIN_STEP, SourcePolicy, exploration_bonus, pseudo_mean
from specforge_lite.decoding.suffix import SuffixDraft
from specforge_lite.decoding.tree import DraftTree, TreeShape


def test_the_estimates_pure_parts():
    # a prior worth `weight` observations: the prior alone, then the data's mean as they outnumber it
    assert pseudo_mean(1.0, 3.0, 0.0, 0) == 1.0 and pseudo_mean(1.0, 3.0, 2.0, 1) == pytest.approx(5 / 4)
    assert pseudo_mean(1.0, 3.0, 3e6, 1e6) == pytest.approx(3.0, rel=1e-5)
    # UCB1: no bonus before any step; it grows with the steps a source sits out, shrinks as it is measured
    assert exploration_bonus(1.0, 0, 3.0) == 0.0
    assert exploration_bonus(1.0, 100, 3.0) > exploration_bonus(1.0, 10, 3.0)
    assert exploration_bonus(1.0, 100, 30.0) < exploration_bonus(1.0, 100, 3.0)
    assert exploration_bonus(2.0, 7, 4.0) == pytest.approx(2.0 * math.sqrt(math.log(8) / 4))
    # a width not timed: the dearest timed width below it, else the cheapest timed; nothing timed: None
    costs = timed_costs({1: 0.008, 3: 0.010, 4: 0.012})
    assert costs.seconds(2) == 0.008 and costs.seconds(9) == 0.012 and costs.seconds(3) == 0.010
    assert timed_costs({3: 0.010}).seconds(1) == 0.010 and CostModel().seconds(1) is None


def timed_costs(seconds: dict[int, float]) -> CostModel:
    costs = CostModel()
    for width, s in seconds.items():
        costs.observe(width, s)
    return costs


def test_the_cost_model_starts_from_the_measured_curve_and_learns_the_loops_scale():
    """The report's curve prices every width before the loop times any; a timed width is its mean, and
    the widths not timed follow the curve scaled by how the timed ones compared with it."""
    costs = CostModel({1: 0.010, 2: 0.011, 4: 0.013})
    assert costs.known and costs.seconds(2) == pytest.approx(0.011) and costs.seconds(3) == pytest.approx(0.011)
    assert costs.seconds(16) == pytest.approx(0.013)  # past the curve: its dearest width below
    costs.observe(1, 0.020)  # the loop pays twice what the curve's tight repeats measured
    assert costs.seconds(1) == pytest.approx(0.020) and costs.seconds(4) == pytest.approx(0.026)
    costs.observe(2, 0.011)  # timed at the curve's own price: the scale is the mean of 2 and 1
    assert costs.seconds(2) == pytest.approx(0.011) and costs.seconds(4) == pytest.approx(0.013 * 1.5)


def test_each_choice_is_priced_by_its_expected_tokens_per_second():
    """Hand-set timings and counts, no exploration (the rates alone)."""
    policy = SourcePolicy(prior_accepted=1.0, prior_weight=3.0, explore=0.0)
    # no times: every width costs the same and drafting nothing, so the surer draft wins
    assert policy.choose(1.5, 3, 4, 3) == LOOKUP and policy.choose(0.5, 3, 4, 3) == DRAFTER
    assert policy.choose(None, 0, 4, 3) == DRAFTER
    # hand-set: a verify time for widths 1, 3 and 4 (the wider, the dearer) and one drafting call
    policy.costs.timed = {1: [0.008, 1], 3: [0.010, 1], 4: [0.024, 2]}
    policy.observe_draft(0.004, catch_up=False)
    policy.observe_draft(1.0, catch_up=True)  # a call that also wrote skipped steps' anchors: not its price
    assert policy.draft_s() == 0.004
    # the drafter kept 1 of its 5 pseudo-steps' worth: its rate falls below a plain step's
    policy.record(DRAFTER, 0, 4)
    policy.record(DRAFTER, 0, 4)
    assert policy.rates(None, 0, 4, 3) == pytest.approx({DRAFTER: 1.6 / 0.016, PLAIN_STEP: 125.0})
    assert policy.choose(None, 0, 4, 3) == PLAIN_STEP
    # a 2-token lookup scored 0.3, its scores so far held (ratio 1): it beats a plain step, 0.2 does not
    assert policy.choose(0.3, 2, 4, 3) == LOOKUP and policy.choose(0.2, 2, 4, 3) == PLAIN_STEP
    # lookup kept none of what its scores predicted: its ratio falls below 1 and 0.3 no longer pays
    policy.record(LOOKUP, 0, 3, score=3.0)
    assert policy.lookup_ratio() == pytest.approx(0.5) and policy.choose(0.3, 2, 4, 3) == PLAIN_STEP
    # the drafter priced at the width it verified after its cut (3), not at k + 1
    policy.reset_estimates()
    assert policy.costs.timed and policy.draft_s() == 0.004  # the times outlive the estimates
    policy.record(DRAFTER, 1, 3)
    assert policy.rates(None, 0, 4, 3)[DRAFTER] == pytest.approx((1 + 4 / 4) / 0.014)
    # never more kept than the drafter can draft (its own max_drafts)
    policy.drafter_accepted = 100.0
    assert policy.rates(None, 0, 4, 1)[DRAFTER] == pytest.approx(2 / 0.014)


def _simulate(policy: SourcePolicy, steps: int, drafter_accepted, lookup: tuple[float, int] | None,
              verify=lambda width: 0.010 + 0.004 * (width - 1), draft_s: float = 0.004) -> Counter:
    """`steps` steps of k = 3 chosen by `policy`, each source keeping what the hand-set rule says
    (drafter_accepted(n): what the drafter's n-th step keeps; lookup: (its score, what it keeps), or no
    draft); the costs simulated, widths 1 and 4 and a drafting call timed beforehand (as after a
    warm-up). Returns the steps per choice."""
    policy.observe_verify(1, verify(1))
    policy.observe_verify(4, verify(4))
    policy.observe_draft(draft_s, catch_up=False)
    chosen, drafter_steps = Counter(), 0
    for _ in range(steps):
        choice = policy.choose(lookup[0] if lookup else None, 3 if lookup else 0, 4, 3)
        kept, width = {DRAFTER: (drafter_accepted(drafter_steps), 4), LOOKUP: (lookup and lookup[1], 4),
                       PLAIN_STEP: (0, 1)}[choice]
        if choice == DRAFTER:
            drafter_steps += 1
            policy.observe_draft(draft_s, catch_up=False)
        policy.observe_verify(width, verify(width))
        policy.record(choice, kept, width, lookup[0] if choice == LOOKUP else 0.0)
        chosen[choice] += 1
    return chosen


def test_a_drafter_whose_prior_does_not_pay_is_explored_and_then_chosen():
    """The prior says the drafter's step ((1 + 1) / 26 ms) loses to a plain step (1 / 10 ms); it keeps
    all 3 drafts: exploration tries it, the estimate learns it, it takes the steps."""
    chosen = _simulate(SourcePolicy(prior_accepted=1.0, prior_weight=3.0, explore=1.0), 200, lambda n: 3, lookup=None)
    assert chosen[DRAFTER] >= 180, chosen


def test_a_drafter_with_a_bad_start_is_not_locked_out():
    """A cheaper drafter ((1 + 1) / 15 ms by its prior against a plain step's 1 / 10 ms) keeps
    nothing on its first 2 steps, then all 3 drafts: it keeps the steps."""
    chosen = _simulate(SourcePolicy(), 200, lambda n: 0 if n < 2 else 3, lookup=None,
                       verify=lambda width: 0.010 + 0.001 * (width - 1), draft_s=0.002)
    assert chosen[DRAFTER] >= 180, chosen


def test_a_drafter_never_kept_is_left_for_lookup_that_is():
    """Lookup scores its draft 2 and the target keeps all 3 of it; the drafter's drafts are never kept."""
    chosen = _simulate(SourcePolicy(), 200, lambda n: 0, lookup=(2.0, 3))
    assert chosen[LOOKUP] >= 190 and chosen[DRAFTER] <= 5, chosen


def test_a_lookup_whose_score_lies_is_calibrated_by_what_it_kept():
    """Lookup scores its draft 3 but nothing of it is kept; the drafter keeps all 3 of its drafts."""
    chosen = _simulate(SourcePolicy(), 200, lambda n: 3, lookup=(3.0, 0))
    assert chosen[DRAFTER] >= 170 and chosen[LOOKUP] <= 20, chosen


class _Oracle:
    """A drafter stub fitted to the target: it drafts the target's own greedy answer from where the
    context stands (the answers given by prompt), wrong on its first `wrong_first` calls."""

    name, hidden_state_layers, sequential = "oracle", (), False

    def __init__(self, answers: dict[tuple, list[int]], wrong_first: int = 0, vocab: int = 2):
        self.answers, self.wrong_left, self.vocab = answers, wrong_first, vocab
        self.eager_calls = 0

    def truth(self, ctx, n: int) -> list[int]:
        done = len(ctx.token_ids) - ctx.num_prompt_tokens  # answer tokens already committed
        truth = self.answers[tuple(ctx.token_ids[:ctx.num_prompt_tokens])][done:done + n]
        if self.wrong_left > 0 and truth:
            self.wrong_left -= 1
            truth = [(truth[0] + 1) % self.vocab] + truth[1:]
        return truth

    def reset(self):
        pass

    def accept(self, n):
        pass

    def eager(self):
        self.eager_calls += 1

    def propose(self, ctx, k):
        return DraftProposal(self.truth(ctx, k))

    def propose_tree(self, ctx, depth, branch, nodes):
        return DraftTree.chain(self.truth(ctx, depth))


class _Lookup:
    """A lookup stub: no draft at all (`answers` None), or the target's own answer scored `score`."""

    def __init__(self, answers: dict[tuple, list[int]] | None = None, score: float = 1.0):
        self.oracle, self.score = _Oracle(answers) if answers else None, score

    def reset(self):
        pass

    def best(self, ctx, k):
        if self.oracle is None or k == 0:
            return SuffixDraft([])
        return SuffixDraft(self.oracle.truth(ctx, k), 1, self.score, "request")


def _answers(model, count: int, new_tokens: int) -> dict[tuple, list[int]]:
    """Plain greedy answers of `count` prompts with no repeats (the token after the prompt first)."""
    import torch

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (10,), generator=g).tolist() for _ in range(count)]
    return {tuple(p): generate_plain(model, p, new_tokens).tokens for p in prompts}


def _run(model, hybrid, answers, new_tokens: int, tree: bool = False) -> None:
    for prompt, plain in answers.items():
        if tree:
            out = generate_tree(model, hybrid, list(prompt), new_tokens, TreeShape(3, 1, 3))
        else:
            out = generate_speculative(model, hybrid, list(prompt), new_tokens, 3)
        assert out.tokens == plain


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_through_the_engine_a_drafter_kept_after_a_bad_start_takes_the_steps(tiny_target, tree):
    """An oracle drafter wrong on its first 2 calls, a lookup that never drafts: the hybrid keeps
    choosing the drafter (the engine reports each verify's measured seconds) on most steps."""
    model, _ = tiny_target
    answers = _answers(model, 3, 24)
    hybrid = HybridDrafter(_Oracle(answers, wrong_first=2, vocab=model.config.vocab_size), _Lookup())
    _run(model, hybrid, answers, 24, tree)
    steps = {source: counts["steps"] for source, counts in hybrid.sources.items()}
    assert hybrid.policy.costs.timed and steps[DRAFTER] >= 0.8 * sum(steps.values()), steps
    assert hybrid.sources[DRAFTER]["accepted"] > 0


def test_through_the_engine_a_drafter_never_kept_is_left_for_a_lookup_that_is(tiny_target):
    model, _ = tiny_target
    answers = _answers(model, 3, 24)
    never = {prompt: [(t + 1) % model.config.vocab_size for t in plain] for prompt, plain in answers.items()}
    hybrid = HybridDrafter(_Oracle(never), _Lookup(answers, score=1.0))
    _run(model, hybrid, answers, 24)
    steps = {source: counts["steps"] for source, counts in hybrid.sources.items()}
    assert steps[LOOKUP] >= 0.8 * sum(steps.values()) and steps[DRAFTER] <= 0.1 * sum(steps.values()), steps


def test_what_was_learned_is_forgotten_after_the_warm_up_and_an_eager_switch_but_not_the_times(tiny_target):
    model, _ = tiny_target
    answers = _answers(model, 1, 12)
    drafter = _Oracle(answers, vocab=model.config.vocab_size)
    hybrid = HybridDrafter(drafter, _Lookup())
    _run(model, hybrid, answers, 12)
    assert hybrid.policy.drafter_steps and hybrid.policy.steps
    times = {width: list(timed) for width, timed in hybrid.policy.costs.timed.items()}
    clear_hybrid_sources([hybrid, drafter])
    assert hybrid.policy.steps == hybrid.policy.drafter_steps == 0 and hybrid.sources[DRAFTER]["steps"] == 0
    assert hybrid.policy.costs.timed == times and times
    _run(model, hybrid, answers, 12)
    hybrid.eager()  # forwarded to the drafter, and its estimates reset
    assert drafter.eager_calls == 1 and hybrid.policy.drafter_steps == 0 and hybrid.policy.costs.timed
