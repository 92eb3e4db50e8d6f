"""`<drafter>_hybrid`: each step drafts from the source that pays, suffix lookup or the trained drafter.

Per step the lookup's draft comes first (it costs next to nothing): its score is the number of
its tokens the target is expected to keep (`suffix.SuffixDraft.score`). The drafter's expected
kept tokens is what it kept on average over its own earlier steps (its running
acceptance; before its first step, `prior`), and its step costs its drafting time on top of the
verify. Until both times are measured lookup drafts where its score reaches the drafter's expected
kept tokens; from then on lookup drafts alone, and the drafter's forward is skipped, where

    (1 + lookup score) / verify_s  >=  (1 + drafter's expected kept) / (verify_s + draft_s)

(tokens per second of the two choices, both times measured in this run: the drafter's propose
calls, and the time between the end of one propose and the start of the next, which is the verify
and the engine's bookkeeping). A skipped step's target hidden states are kept and handed to the
drafter, in order, at its next step, so its cache holds every committed position exactly as if it
had drafted every step (EAGLE-3, P-EAGLE and DFlash write an anchor per committed position).

`sources` counts, over the drafter's life, the steps each source drafted and the tokens the
target kept of them (the report's share of steps per source).
"""

from __future__ import annotations

import time

import torch

from specforge_lite.contract import DraftContext, DraftProposal
from specforge_lite.decoding.suffix import SuffixDrafter

LOOKUP, DRAFTER = "lookup", "drafter"


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
        self.between_s, self.between_calls = 0.0, 0
        self.reset()

    def clear_sources(self) -> None:
        self.sources = {LOOKUP: {"steps": 0, "accepted": 0}, DRAFTER: {"steps": 0, "accepted": 0}}

    def reset(self) -> None:
        self.drafter.reset()
        self.lookup.reset()
        self.pending: dict[int, list[torch.Tensor]] = {}  # skipped steps' hidden states, in order
        self.ended = None  # when the last propose of this answer returned
        self.used = None

    def _drafter_pays_less(self, lookup_score: float) -> bool:
        """Whether lookup's draft alone is worth at least the drafter's, in tokens per second."""
        expected = self.kept / self.steps if self.steps else self.prior
        if not self.between_calls or not self.drafter_calls:  # no times yet: the surer of the two drafts
            return lookup_score >= expected
        verify_s = self.between_s / self.between_calls
        draft_s = self.draft_s / self.drafter_calls
        return (1 + lookup_score) / verify_s >= (1 + expected) / (verify_s + draft_s)

    def _hand_over(self, ctx: DraftContext) -> DraftContext:
        """ctx with the skipped steps' hidden states before this step's (the positions in order)."""
        if not self.pending:
            return ctx
        hidden = {layer: torch.cat([*self.pending[layer], ctx.hidden_states[layer]], dim=1)
                  for layer in self.hidden_state_layers}
        self.pending = {}
        return DraftContext(token_ids=ctx.token_ids, num_prompt_tokens=ctx.num_prompt_tokens, hidden_states=hidden,
                            sampling=ctx.sampling, generator=ctx.generator)

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        if k == 0:  # the drafter still sees every committed position; nothing is counted
            self.used = None
            return self.drafter.propose(self._hand_over(ctx), 0)
        start = time.perf_counter()
        if self.ended is not None:
            self.between_s += start - self.ended
            self.between_calls += 1
        lookup = self.lookup.best(ctx, k)
        if lookup.tokens and self._drafter_pays_less(lookup.score):
            for layer in self.hidden_state_layers:
                self.pending.setdefault(layer, []).append(ctx.hidden_states[layer])
            self.used = LOOKUP
            proposal = DraftProposal(lookup.tokens[:k])
        else:
            self.used = DRAFTER
            proposal = self.drafter.propose(self._hand_over(ctx), k)
            self.draft_s += time.perf_counter() - start
            self.drafter_calls += 1
        self.ended = time.perf_counter()
        return proposal

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
