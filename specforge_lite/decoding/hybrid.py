"""`<drafter>_hybrid`: each step drafts from the source that pays, suffix lookup or the trained drafter.

Per step the lookup's draft comes first (it costs next to nothing): its score is the number of
its tokens the target is expected to keep (`suffix.SuffixDraft.score`). The drafter's expected
kept tokens is what it kept on average over its own earlier steps (its running
acceptance; before its first step, `prior`), and its step costs its drafting time on top of the
verify. Until the times are measured lookup drafts where its score reaches the drafter's expected
kept tokens, else the drafter. From then on each step takes the choice of most tokens per second:

    lookup alone:   (1 + lookup score) / verify_s[lookup]
    the drafter:    (1 + drafter's expected kept) / (verify_s[drafter] + draft_s)
    no draft:       1 / verify_s[none]     (a plain step: where neither source pays for itself)

each time measured in this run: the drafter's propose calls, and per choice the time between the
end of one propose and the start of the next (the verify of that choice's width and the engine's
bookkeeping; a choice not yet timed is priced at the cheapest step timed). Lookup or no draft
skips the drafter's forward. A skipped step's target hidden states are kept and handed to the
drafter, in order, at its next step, so its cache holds every committed position exactly as if it
had drafted every step (EAGLE-3, P-EAGLE and DFlash write an anchor per committed position).

`sources` counts, over the drafter's life, the steps each choice took and the tokens the target
kept of them (the report's share of steps per source).
"""

from __future__ import annotations

import time

import torch

from specforge_lite.contract import DraftContext, DraftProposal
from specforge_lite.decoding.suffix import SuffixDrafter

LOOKUP, DRAFTER, NONE = "lookup", "drafter", "none"


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
        self.between = {choice: [0.0, 0] for choice in (LOOKUP, DRAFTER, NONE)}  # verify seconds, steps
        self.reset()

    def clear_sources(self) -> None:
        self.sources = {choice: {"steps": 0, "accepted": 0} for choice in (LOOKUP, DRAFTER, NONE)}

    def reset(self) -> None:
        self.drafter.reset()
        self.lookup.reset()
        self.pending: dict[int, list[torch.Tensor]] = {}  # skipped steps' hidden states, in order
        self.ended = None  # when the last propose of this answer returned
        self.used = None

    def _choose(self, lookup_score: float | None) -> str:
        """LOOKUP, DRAFTER or NONE: the most expected tokens per second (the module's rule)."""
        expected = self.kept / self.steps if self.steps else self.prior
        timed = {c: seconds / n for c, (seconds, n) in self.between.items() if n}
        if not timed or not self.drafter_calls:  # no times yet: the surer of the two drafts
            return LOOKUP if lookup_score is not None and lookup_score >= expected else DRAFTER
        cheapest = min(timed.values())
        rates = {DRAFTER: (1 + expected) / (timed.get(DRAFTER, cheapest) + self.draft_s / self.drafter_calls),
                 NONE: 1 / timed.get(NONE, cheapest)}
        if lookup_score is not None:
            rates[LOOKUP] = (1 + lookup_score) / timed.get(LOOKUP, cheapest)
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

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        if k == 0:  # the drafter still sees every committed position; nothing is counted
            self.used = None
            return self.drafter.propose(self._hand_over(ctx), 0)
        start = time.perf_counter()
        if self.ended is not None and self.used is not None:  # the verify of the previous step's choice
            self.between[self.used][0] += start - self.ended
            self.between[self.used][1] += 1
        lookup = self.lookup.best(ctx, k)
        self.used = self._choose(lookup.score if lookup.tokens else None)
        if self.used == DRAFTER:
            proposal = self.drafter.propose(self._hand_over(ctx), k)
            self.draft_s += time.perf_counter() - start
            self.drafter_calls += 1
        else:  # the drafter's forward is skipped: it gets this step's hidden states at its next one
            for layer in self.hidden_state_layers:
                self.pending.setdefault(layer, []).append(ctx.hidden_states[layer])
            proposal = DraftProposal(lookup.tokens[:k] if self.used == LOOKUP else [])
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
