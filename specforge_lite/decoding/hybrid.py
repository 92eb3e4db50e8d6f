"""`<drafter>_hybrid`: each step drafts from the source that pays, suffix lookup or the trained drafter.

Per step the lookup's draft comes first (it costs next to nothing), then `policy.SourcePolicy`
picks lookup's draft, the drafter's, or none (a plain step) by expected tokens per second: each
source's expected kept tokens (lookup's own score calibrated by what the target kept of its
earlier drafts; the drafter's kept tokens per step), learned in this run from a prior worth a few
steps and raised by an exploration bonus (UCB1) so that no source is locked out by a bad start,
over the step's cost: the target's verify forward at that width, as the engine measures and reports
it (`observe_verify`), plus the drafter's drafting time for its own. The drafter is priced at the
widths it verified after its cut. What was learned is forgotten after the warm-up
(`clear_sources`, `clear_hybrid_sources`) and when the drafter starts drafting another way (`eager`, `reset_estimates`);
the measured times are kept.

The drafter's draft is then cut to the length that pays (EAGLE-2's confidence, priced by this
machine): where it gives each token's probability (`DraftProposal.confidence`), the running
products of those are the expected kept tokens of each prefix, and the prefix of most
(1 + expected kept) / verify_s(length + 1) is verified; its drafting time is spent either way.

Lookup or no draft skips the drafter's forward. A skipped step's target hidden states are kept
(copies: a compiled target overwrites its outputs at its next forward) and handed to the drafter,
in order, at its next step, so its cache holds every committed position exactly as if it had
drafted every step (EAGLE-3, P-EAGLE and DFlash write an anchor per committed position). Such a
catching-up call is not taken as the drafter's drafting time while calls without catch-up are timed.

`sources` counts, since the last `clear_sources`, the steps each choice took and the tokens the
target kept of them (the report's share of steps per source), and the drafter's tokens its cut dropped.
"""

from __future__ import annotations

import math
import time
from itertools import accumulate
from operator import mul

import torch

from specforge_lite.contract import DraftContext, DraftProposal
from specforge_lite.decoding.cost import CostModel
from specforge_lite.decoding.policy import DRAFTER, LOOKUP, PLAIN_STEP, SourcePolicy
from specforge_lite.decoding.suffix import SuffixDrafter
from specforge_lite.decoding.tree import DraftTree


def cut_length(gains: list[float], verify_s) -> int:
    """How many of the leading drafts to verify: the L (0..len(gains)) of most (1 + the sum of the
    first L `gains`) / verify_s(L + 1), each gain the tokens one more draft adds to what the step is
    expected to keep (a chain's running products of confidence; a tree node's path probability)."""
    best, best_rate, expected = 0, 1 / verify_s(1), 0.0
    for length, gain in enumerate(gains, start=1):
        expected += gain
        rate = (1 + expected) / verify_s(length + 1)
        if rate > best_rate:
            best, best_rate = length, rate
    return best


class HybridDrafter:
    def __init__(self, drafter, lookup: SuffixDrafter, prior: float = 1.0, prior_weight: float = 3.0,
                 explore: float = 1.0, costs: CostModel | None = None):
        self.drafter, self.lookup = drafter, lookup
        self.name = f"{drafter.name}_hybrid"
        self.hidden_state_layers = drafter.hidden_state_layers
        self.sequential = drafter.sequential
        # the drafter's own limit on drafts (DFlash's block, P-EAGLE's depths); lookup drafts up to k
        self.drafter_limit = getattr(drafter, "max_drafts", None)
        self.policy = SourcePolicy(prior, prior_weight, explore, costs)  # over the drafter's life: times kept
        self.clear_sources()
        self.reset()

    def clear_sources(self) -> None:
        """Zero the source counts and forget what the sources kept (after a warm-up); times are kept."""
        self.sources = {choice: {"steps": 0, "accepted": 0} for choice in (LOOKUP, DRAFTER, PLAIN_STEP)}
        self.sources[DRAFTER]["cut"] = 0  # drafted tokens the cut left unverified
        self.policy.reset_estimates()

    def reset_estimates(self) -> None:
        """Forget what the sources kept (the drafter now drafts another way); times are kept."""
        self.policy.reset_estimates()

    def eager(self) -> None:
        """The drafter drafts with its eager module from here on (evaluate's fallback): what it kept
        when compiled says nothing of it now."""
        if hasattr(self.drafter, "eager"):
            self.drafter.eager()
        self.reset_estimates()

    def start_costs_from(self, curve: dict[int, float]) -> None:
        """Price the verify widths not yet timed from the evaluate's measured curve (`cost.CostModel`)."""
        self.policy.costs.start_from(curve)

    def observe_verify(self, width: int, seconds: float) -> None:
        """The engine's measured verify forward of `width` (drafts + 1)."""
        self.policy.observe_verify(width, seconds)

    def reset(self) -> None:
        self.drafter.reset()
        self.lookup.reset()
        self.pending: dict[int, list[torch.Tensor]] = {}  # skipped steps' hidden states (copies), in order
        # this step's choice (None: a step of no choice, k = 0, which is not counted), its width and lookup's score
        self.choice, self.width, self.score = None, None, 0.0

    def verify_s(self, width: int) -> float | None:
        """The price of a verify of `width` (`cost.CostModel`'s rule)."""
        return self.policy.verify_s(width)

    def _hand_over(self, ctx: DraftContext) -> DraftContext:
        """ctx with the skipped steps' hidden states before this step's (the positions in order)."""
        if not self.pending:
            return ctx
        hidden = {layer: torch.cat([*self.pending[layer], ctx.hidden_states[layer]], dim=1)
                  for layer in self.hidden_state_layers}
        self.pending = {}
        return DraftContext(token_ids=ctx.token_ids, num_prompt_tokens=ctx.num_prompt_tokens, hidden_states=hidden,
                            sampling=ctx.sampling, generator=ctx.generator)

    def _cut(self, proposal: DraftProposal) -> DraftProposal:
        """The drafter's proposal cut to the length that pays (the module's rule), where it says
        each token's probability and this run has verify times."""
        if proposal.confidence is None or not self.policy.costs.known or not proposal.tokens:
            return proposal
        length = cut_length(list(accumulate(proposal.confidence[:len(proposal.tokens)], mul)), self.verify_s)
        self.sources[DRAFTER]["cut"] += len(proposal.tokens) - length
        probs = proposal.probs[:length] if proposal.probs is not None else None
        return DraftProposal(proposal.tokens[:length], probs, proposal.confidence[:length])

    def _step(self, ctx: DraftContext, k: int, drafter_width: int, drafter_drafts: int) -> list[int]:
        """Lookup's draft and this step's choice; a step that skips the drafter keeps its hidden states."""
        lookup = self.lookup.best(ctx, k)
        tokens = lookup.tokens[:k]
        self.score = lookup.score if tokens else 0.0
        self.choice = self.policy.choose(lookup.score if tokens else None, len(tokens), drafter_width, drafter_drafts)
        if self.choice != DRAFTER:  # the drafter's forward is skipped: it gets these hidden states at its next one
            for layer in self.hidden_state_layers:
                self.pending.setdefault(layer, []).append(ctx.hidden_states[layer].clone())
        return tokens

    def _drafted(self, draft):
        """The drafter's call on this step's context (its skipped steps' states first), timed."""
        catch_up, start = bool(self.pending), time.perf_counter()
        out = draft()
        self.policy.observe_draft(time.perf_counter() - start, catch_up)
        return out

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        if k == 0:  # the drafter still sees every committed position; nothing is counted
            self.choice = None
            return self.drafter.propose(self._hand_over(ctx), 0)
        drafts = min(k, self.drafter_limit) if self.drafter_limit is not None else k
        lookup = self._step(ctx, k, drafts + 1, drafts)
        proposal = DraftProposal(lookup if self.choice == LOOKUP else [])
        if self.choice == DRAFTER:
            proposal = self._cut(self._drafted(lambda: self.drafter.propose(self._hand_over(ctx), k)))
        self.width = len(proposal.tokens[:k]) + 1
        return proposal

    def propose_tree(self, ctx: DraftContext, depth: int, branch: int, nodes: int) -> DraftTree:
        """`<drafter>_hybrid_tree`: the same choice each step, the drafter's option being its tree
        pruned to the nodes that pay (their path probabilities priced as a chain's confidences)
        with lookup's draft beside it (a mixed tree, lookup's chain first)."""
        if depth == 0:
            self.choice = None
            return self.drafter.propose_tree(self._hand_over(ctx), 0, branch, nodes)
        lookup = self._step(ctx, depth, nodes + 1, depth)
        tree = DraftTree.chain(lookup) if self.choice == LOOKUP else DraftTree()
        if self.choice == DRAFTER:
            tree = self._pruned(self._drafted(lambda: self.drafter.propose_tree(self._hand_over(ctx), depth,
                                                                                branch, nodes)))
            tree = tree.after_chain(lookup, nodes)
        self.width = len(tree) + 1
        return tree

    def _pruned(self, tree: DraftTree) -> DraftTree:
        """The drafter's tree cut to its first nodes that pay (the module's rule), where it scores
        them (cumulative log-probabilities, best first) and this run has verify times."""
        if tree.scores is None or not self.policy.costs.known or not len(tree):
            return tree
        keep = cut_length([math.exp(score) for score in tree.scores], self.verify_s)
        self.sources[DRAFTER]["cut"] += len(tree) - keep
        probs = tree.probs[:keep] if tree.probs is not None else None
        return DraftTree(tree.tokens[:keep], tree.parents[:keep], probs, tree.scores[:keep])

    def accept(self, num_accepted: int) -> None:
        if self.choice is None:
            self.drafter.accept(num_accepted)
            return
        self.sources[self.choice]["steps"] += 1
        self.sources[self.choice]["accepted"] += num_accepted
        self.policy.record(self.choice, num_accepted, self.width, self.score)
        if self.choice == DRAFTER:
            self.drafter.accept(num_accepted)


def clear_hybrid_sources(drafters) -> None:
    """Zero the source counts of the hybrids among `drafters` and forget what their sources kept
    (after a warm-up: the timed runs learn afresh, on the machine's times measured so far)."""
    for drafter in drafters:
        if isinstance(drafter, HybridDrafter):
            drafter.clear_sources()
