"""`<drafter>_hybrid`: each step drafts from the source that pays, suffix lookup or the trained drafter.

Per step the lookup's draft comes first (it costs next to nothing): its score is the number of
its tokens the target is expected to keep (`suffix.SuffixDraft.score`). The drafter's expected
kept tokens is what it kept on average over its own earlier steps (its running acceptance;
before its first step, `prior`), and its step costs its drafting time on top of the verify.
Until the times are measured lookup drafts where its score reaches the drafter's expected kept
tokens, else the drafter. From then on each step takes the choice of most tokens per second:

    lookup alone:   (1 + lookup score) / verify_s(its width)
    the drafter:    (1 + drafter's expected kept) / (verify_s(k + 1) + draft_s)
    no draft:       1 / verify_s(1)     (a plain step: where neither source pays for itself)

verify_s(w) is measured in this run per width w (drafts + 1): the time between the end of one
propose and the start of the next (the target's verify of that width and the engine's
bookkeeping). A width not yet timed is priced as the dearest timed width below it (a forward
never costs less for more tokens), or the cheapest timed one where none is below.

The drafter's draft is then cut to the length that pays (EAGLE-2's confidence, priced by this
machine): where it gives each token's probability (`DraftProposal.confidence`), the running
products of those are the expected kept tokens of each prefix, and the prefix of most
(1 + expected kept) / verify_s(length + 1) is verified; its drafting time is spent either way.

Lookup or no draft skips the drafter's forward. A skipped step's target hidden states are kept and
handed to the drafter, in order, at its next step, so its cache holds every committed position
exactly as if it had drafted every step (EAGLE-3, P-EAGLE and DFlash write an anchor per committed
position).

`sources` counts, over the drafter's life, the steps each choice took and the tokens the target
kept of them (the report's share of steps per source), and the drafter's tokens its cut dropped.
"""

from __future__ import annotations

import math
import time
from itertools import accumulate
from operator import mul

import torch

from specforge_lite.contract import DraftContext, DraftProposal
from specforge_lite.decoding.suffix import SuffixDrafter
from specforge_lite.decoding.tree import DraftTree

LOOKUP, DRAFTER, NONE = "lookup", "drafter", "none"


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
    def __init__(self, drafter, lookup: SuffixDrafter, prior: float = 1.0):
        self.drafter, self.lookup, self.prior = drafter, lookup, prior
        self.name = f"{drafter.name}_hybrid"
        self.hidden_state_layers = drafter.hidden_state_layers
        self.sequential = drafter.sequential
        self.clear_sources()
        # measured over the drafter's life (a machine's costs and a drafter's acceptance hold across answers)
        self.kept, self.steps = 0, 0  # the drafter's own steps
        self.draft_s, self.drafter_calls = 0.0, 0
        self.verify: dict[int, list] = {}  # width -> [seconds, steps]
        self.reset()

    def clear_sources(self) -> None:
        self.sources = {choice: {"steps": 0, "accepted": 0} for choice in (LOOKUP, DRAFTER, NONE)}
        self.sources[DRAFTER]["cut"] = 0  # drafted tokens the cut left unverified

    def reset(self) -> None:
        self.drafter.reset()
        self.lookup.reset()
        self.pending: dict[int, list[torch.Tensor]] = {}  # skipped steps' hidden states, in order
        self.ended = None  # when the last propose of this answer returned
        self.used, self.width = None, None

    def verify_s(self, width: int) -> float | None:
        """This run's mean seconds per step of `width` (the module's rule for a width not timed)."""
        timed = {w: seconds / n for w, (seconds, n) in self.verify.items() if n}
        if not timed:
            return None
        if width in timed:
            return timed[width]
        below = [s for w, s in timed.items() if w < width]
        return max(below) if below else min(timed.values())

    def _choose(self, lookup_score: float | None, lookup_len: int, k: int) -> str:
        """LOOKUP, DRAFTER or NONE: the most expected tokens per second (the module's rule)."""
        expected = self.kept / self.steps if self.steps else self.prior
        if not self.verify or not self.drafter_calls:  # no times yet: the surer of the two drafts
            return LOOKUP if lookup_score is not None and lookup_score >= expected else DRAFTER
        rates = {DRAFTER: (1 + expected) / (self.verify_s(k + 1) + self.draft_s / self.drafter_calls),
                 NONE: 1 / self.verify_s(1)}
        if lookup_score is not None:
            rates[LOOKUP] = (1 + lookup_score) / self.verify_s(lookup_len + 1)
        return max(rates, key=rates.get)

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
        if proposal.confidence is None or not self.verify or not proposal.tokens:
            return proposal
        length = cut_length(list(accumulate(proposal.confidence[:len(proposal.tokens)], mul)), self.verify_s)
        self.sources[DRAFTER]["cut"] += len(proposal.tokens) - length
        probs = proposal.probs[:length] if proposal.probs is not None else None
        return DraftProposal(proposal.tokens[:length], probs, proposal.confidence[:length])

    def _step(self, ctx: DraftContext, k: int, drafter_width: int):
        """The verify of the previous step's width is timed; lookup's draft and this step's choice."""
        start = time.perf_counter()
        if self.ended is not None and self.used is not None:
            timed = self.verify.setdefault(self.width, [0.0, 0])
            timed[0] += start - self.ended
            timed[1] += 1
        lookup = self.lookup.best(ctx, k)
        self.used = self._choose(lookup.score if lookup.tokens else None, len(lookup.tokens[:k]), drafter_width)
        if self.used != DRAFTER:  # the drafter's forward is skipped: it gets these hidden states at its next one
            for layer in self.hidden_state_layers:
                self.pending.setdefault(layer, []).append(ctx.hidden_states[layer])
        return start, lookup.tokens[:k]

    def _drafted(self, start: float, width: int) -> None:
        if self.used == DRAFTER:
            self.draft_s += time.perf_counter() - start
            self.drafter_calls += 1
        self.width = width
        self.ended = time.perf_counter()

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        if k == 0:  # the drafter still sees every committed position; nothing is counted
            self.used = None
            return self.drafter.propose(self._hand_over(ctx), 0)
        start, lookup = self._step(ctx, k, k + 1)
        proposal = DraftProposal(lookup if self.used == LOOKUP else [])
        if self.used == DRAFTER:
            proposal = self._cut(self.drafter.propose(self._hand_over(ctx), k))
        self._drafted(start, len(proposal.tokens[:k]) + 1)
        return proposal

    def propose_tree(self, ctx: DraftContext, depth: int, branch: int, nodes: int) -> DraftTree:
        """`<drafter>_hybrid_tree`: the same choice each step, the drafter's option being its tree
        pruned to the nodes that pay (their path probabilities priced as a chain's confidences)
        with lookup's draft beside it (a mixed tree, lookup's chain first)."""
        if depth == 0:
            self.used = None
            return self.drafter.propose_tree(self._hand_over(ctx), 0, branch, nodes)
        start, lookup = self._step(ctx, depth, nodes + 1)
        tree = DraftTree.chain(lookup) if self.used == LOOKUP else DraftTree()
        if self.used == DRAFTER:
            tree = self._pruned(self.drafter.propose_tree(self._hand_over(ctx), depth, branch, nodes))
            tree = DraftTree.chain(lookup).merged(tree, nodes) if lookup else tree
        self._drafted(start, len(tree) + 1)
        return tree

    def _pruned(self, tree: DraftTree) -> DraftTree:
        """The drafter's tree cut to its first nodes that pay (the module's rule), where it scores
        them (cumulative log-probabilities, best first) and this run has verify times."""
        if tree.scores is None or not self.verify or not len(tree):
            return tree
        keep = cut_length([math.exp(score) for score in tree.scores], self.verify_s)
        self.sources[DRAFTER]["cut"] += len(tree) - keep
        probs = tree.probs[:keep] if tree.probs is not None else None
        return DraftTree(tree.tokens[:keep], tree.parents[:keep], probs, tree.scores[:keep])

    def accept(self, num_accepted: int) -> None:
        if self.used is None:
            self.drafter.accept(num_accepted)
            return
        self.sources[self.used]["steps"] += 1
        self.sources[self.used]["accepted"] += num_accepted
        if self.used == DRAFTER:
            self.kept += num_accepted
            self.steps += 1
            self.drafter.accept(num_accepted)


def clear_sources(drafters) -> None:
    """Zero the source counts of the hybrids among `drafters` (after a warm-up)."""
    for drafter in drafters:
        if isinstance(drafter, HybridDrafter):
            drafter.clear_sources()
