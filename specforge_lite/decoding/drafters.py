"""The engine's own drafters: n-gram lookup and a draft model used as it is.

Both implement `contract.Drafter`. Trained drafters (EAGLE-3, Medusa, the distilled
draft model) live in `specforge_lite/drafters/` and reach the engine through their
module's `decoder`; this package imports nothing from there.

`BUILTIN` maps an eval method name to the function building it from the run config.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from specforge_lite import SpecforgeError
from specforge_lite.contract import DraftContext, DraftProposal, Drafter  # noqa: F401  (the interface, re-exported)
from specforge_lite.decoding.request_index import RequestIndex
from specforge_lite.decoding.tree import DraftTree
from specforge_lite.decoding.verify import warp_probs
from specforge_lite.runtime.fast_engine import FastEngine
from specforge_lite.runtime.hf_runner import cache_kwargs, crop_cache, rollback_cache
from specforge_lite.runtime.static_llama import unsupported_reason
from specforge_lite.targets.surgery import load_untrained_draft

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- n-gram

class NgramDrafter:
    """Prompt lookup: find the latest n-gram of the context earlier in the prompt or
    the generated text and propose the tokens that followed it.

    n-gram sizes are tried from `max_n` down to `min_n`; for one size the most recent
    occurrence wins (`prefer="last"`, the default: on SmolLM2's MT-Bench answers it
    gives a few percent more tokens per forward) or the earliest (`prefer="first"`,
    Hugging Face's prompt-lookup rule). The n-gram index is built incrementally, so a
    proposal costs O(max_n) dictionary look-ups however long the context is.
    """

    name = "ngram"
    hidden_state_layers: tuple[int, ...] = ()
    sequential = False

    def __init__(self, max_n: int = 3, min_n: int = 1, prefer: str = "last"):
        if not 1 <= min_n <= max_n:
            raise SpecforgeError(f"ngram sizes need 1 <= ngram_min <= ngram_max, got {min_n}..{max_n}")
        if prefer not in ("first", "last"):
            raise SpecforgeError(f"ngram prefer must be 'first' or 'last', got {prefer!r}")
        self.max_n, self.min_n = max_n, min_n
        self.prefer_first = prefer == "first"
        self.reset()

    # occurrences kept per n-gram for trees: the first and the latest ones
    MATCHES = 8

    def reset(self) -> None:
        self.index = RequestIndex(self.max_n, self.min_n, keep=self.MATCHES)

    def _matches(self, ids: list[int]):
        """Positions after the context's n-grams' occurrences, longest n first, preferred occurrence first."""
        for _, after in self.index.matches(ids):
            yield from (after if self.prefer_first else reversed(after))

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        ids = ctx.token_ids
        for start in self._matches(ids):
            return DraftProposal(ids[start:start + k])
        return DraftProposal([])

    def propose_tree(self, ctx: DraftContext, depth: int, branch: int, nodes: int) -> DraftTree:
        """Up to `branch` distinct continuations of `depth` tokens, from the matches in
        `propose`'s order, as one trie of at most `nodes` nodes (the first is `propose`'s chain)."""
        ids, tree, seen = ctx.token_ids, DraftTree(), set()
        for start in self._matches(ids) if depth else ():
            continuation = tuple(ids[start:start + depth])
            if continuation in seen:
                continue
            seen.add(continuation)
            tree.add_path(continuation, budget=nodes)
            if len(seen) == branch or len(tree) == nodes:
                break
        return tree

    def accept(self, num_accepted: int) -> None:
        pass  # stateless beyond the committed tokens


class ReplayDrafter:
    """Proposes a known answer's next tokens (plain decoding's own answer to the same prompt). Its
    speculative decode verifies at width k + 1 what plain decoded at width 1, so wherever the two
    answers part, only the forward's width (its rounding) parted them: the evaluate's rounding
    baseline (`identity.rounding_baseline`)."""

    name = "plain_replay"
    hidden_state_layers: tuple[int, ...] = ()
    sequential = False

    def __init__(self, num_prompt_tokens: int, answer: list[int]):
        self.num_prompt_tokens, self.answer = num_prompt_tokens, list(answer)

    def reset(self) -> None:
        pass

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        done = len(ctx.token_ids) - self.num_prompt_tokens  # answer tokens committed so far
        if ctx.token_ids[self.num_prompt_tokens:] != self.answer[:done]:
            return DraftProposal([])  # parted from the answer: nothing left to replay
        return DraftProposal(self.answer[done:done + k])

    def accept(self, num_accepted: int) -> None:
        pass


# --------------------------------------------------------------------------- mixed trees

class MixedTreeDrafter:
    """A tree drafter's tree with n-gram lookup's continuation beside it: the match's chain
    first (when the context has one), then the drafter's nodes in its own order while the
    node budget lasts (`DraftTree.merged`). Copy-heavy answers favour the match, free
    text the drafter; the target keeps whichever path it agrees with."""

    def __init__(self, drafter, ngram: NgramDrafter):
        self.drafter, self.ngram = drafter, ngram
        self.name = f"{drafter.name}+ngram"
        self.hidden_state_layers = drafter.hidden_state_layers
        self.sequential = drafter.sequential

    def reset(self) -> None:
        self.drafter.reset()
        self.ngram.reset()

    def propose_tree(self, ctx: DraftContext, depth: int, branch: int, nodes: int) -> DraftTree:
        tree = self.drafter.propose_tree(ctx, depth, branch, nodes)  # always: it sees every position
        return tree.after_chain(self.ngram.propose(ctx, depth).tokens, nodes)

    def accept(self, num_accepted: int) -> None:
        self.drafter.accept(num_accepted)


def can_branch(drafter) -> bool:
    """Whether a drafter proposes trees (`contract.Drafter`'s optional `propose_tree`)."""
    return callable(getattr(drafter, "propose_tree", None))


# --------------------------------------------------------------------------- draft model

class DraftModelDrafter:
    """Any Hugging Face causal LM with the target's vocabulary, run autoregressively
    with its own KV cache; the cache is cropped back to the accepted prefix."""

    name = "untrained_draft"
    hidden_state_layers: tuple[int, ...] = ()
    sequential = True

    def __init__(self, model):
        self.model = model
        self.runner = None  # a compiled static-cache runner once `compile` built one
        self.graph_source = None  # "compiled" or "loaded" by `compile`
        self.reset()

    def reset(self) -> None:
        if self.runner is not None:  # the static cache of `compile`
            self.runner.reset()
        else:
            self.cache = rollback_cache(self.model.config)  # sliding-window layers keep every position
        self.cached = 0  # tokens in self.cache (a prefix of the committed tokens)
        self.last_k = 0
        self.base = 0

    def compile(self, k: int, capacity: int | None = None) -> float:
        """Run the draft model on the target's own fast forward (`runtime/fast_engine.py`): a
        static cache of `capacity` positions and compiled graphs of widths 1 and 2 (what a
        call feeds after the prompt). Returns the seconds compiling took; 0.0 and eager
        drafting for a model the static forward does not cover."""
        reason = unsupported_reason(self.model.config)
        if reason or not capacity:
            log.info("%s: drafting eagerly (%s)", self.name, reason or "no cache capacity given")
            return 0.0
        engine = FastEngine(self.model, capacity, (), max_width=2, compiled=True)
        seconds = engine.compile()
        self.runner, self.graph_source = engine.runner(), engine.graph_source
        self.reset()
        return seconds

    def eager(self) -> None:
        """Drop the compiled graphs: draft with the eager module from here on (evaluate's fallback
        when the graphs accept nothing where the module does)."""
        self.runner, self.graph_source = None, None
        self.reset()

    def _next_logits(self, feed: list[int]) -> torch.Tensor:
        if self.runner is not None:
            return self.runner.forward(feed, last_only=True)[0][-1]
        return self.model(input_ids=torch.tensor([feed], device=self.model.device), use_cache=True,
                          logits_to_keep=1, **cache_kwargs(self.model, self.cache)).logits[0, -1]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        ids = ctx.token_ids
        self.base, self.last_k = len(ids), k
        if k == 0:
            return DraftProposal([])
        feed = ids[self.cached:]  # the prompt on the first call, then the 1-2 tokens added since
        tokens, probs, confidence = [], [], []
        for _ in range(k):
            logits = self._next_logits(feed)
            if ctx.sampling.greedy:
                token = int(logits.argmax())
                confidence.append(float(torch.softmax(logits.float(), dim=-1)[token]))
            else:
                q = warp_probs(logits, ctx.sampling)
                token = int(torch.multinomial(q, 1, generator=ctx.generator))
                probs.append(q)
            tokens.append(token)
            feed = [token]
        self.cached = len(ids) + k - 1  # the last draft token was never fed
        return DraftProposal(tokens, torch.stack(probs) if probs else None, confidence or None)

    def accept(self, num_accepted: int) -> None:
        keep = self.base + min(num_accepted, max(self.last_k - 1, 0))
        if keep < self.cached:
            if self.runner is not None:
                self.runner.crop(keep)
            else:
                crop_cache(self.cache, keep)
            self.cached = keep


# --------------------------------------------------------------------------- building

def build_ngram(cfg, target) -> NgramDrafter:
    return NgramDrafter(max_n=cfg.eval.ngram_max, min_n=cfg.eval.ngram_min, prefer=cfg.eval.ngram_prefer)


def build_untrained_draft(cfg, target) -> DraftModelDrafter:
    return DraftModelDrafter(load_untrained_draft(cfg.eval, target))


# Method name -> builder(cfg, target model) -> Drafter: the decoders that need no training
BUILTIN: dict[str, Callable] = {
    "ngram": build_ngram,
    "untrained_draft": build_untrained_draft,  # eval.untrained_draft_path or a truncated target copy
}
