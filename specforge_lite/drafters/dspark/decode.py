"""DSpark in the decoding engine: DFlash's block forward (`dflash/decode.py`: the context caches,
the compiled graph), then the rows read out in order, each row's logits biased by the Markov
head from the token drafted at the row before (the anchor for the first), and each drafted
token's confidence from the confidence head (`DraftProposal.confidence`: what the hybrid's
draft-length cut prices a draft by)."""

from __future__ import annotations

import heapq
import itertools

import torch

from specforge_lite.contract import DraftProposal
from specforge_lite.decoding.tree import DraftTree
from specforge_lite.drafters.dflash.decode import DFlashDecodeDrafter, _Block
from specforge_lite.drafters.dspark.model import DSparkDrafter
from specforge_lite.drafters.vocab import sample_independent_rows


class _SparkBlock(_Block):
    """The block forward of one drafting call; returns (draft-vocab logits without the Markov bias
    [drafts, V_d] of the rows read out, the normed hidden states [first + drafts, H] of the rows
    up to the last one read out: the heads read them, and an rnn head steps through row 0 too)."""

    def forward(self, aux, context_positions, tokens, positions):
        d = self.drafter
        normed = d.norm(self.states(aux, context_positions, tokens, positions)[0, :self.first + self.drafts])
        return d.lm_head(normed[self.first:]), normed


class DSparkDecodeDrafter(DFlashDecodeDrafter):
    """DSpark (batch 1): one block forward, then k small Markov steps, one per drafted token."""

    name = "dspark"
    graph_name = "dspark-block"
    block_class = _SparkBlock

    def __init__(self, drafter: DSparkDrafter, capacity: int = 512):
        super().__init__(drafter, capacity)
        self.confidence_source = "head" if drafter.confidence_head is not None else "softmax"

    def _start(self, normed: torch.Tensor, anchor: int) -> torch.Tensor | None:
        """The rnn state after the rows that draft nothing (row 0 when the anchor row does not draft)."""
        head, state = self.drafter.markov_head, None
        emb = head.embed(torch.tensor([anchor], device=normed.device))
        for row in range(self.first):
            state = head.step(emb, normed[row:row + 1], state)[1]
        return state

    def _law(self, base, normed, row: int, previous: int, state):
        """Row `row`'s biased logits [1, V_d] after the target id `previous`, the state after the row
        and the previous token's Markov embedding [1, r]."""
        head = self.drafter.markov_head
        emb = head.embed(torch.tensor([previous], device=base.device))
        bias, state = head.step(emb, normed[row:row + 1], state)
        return base[row - self.first:row - self.first + 1] + bias, state, emb

    def _confidence(self, logits, normed_row, emb, best) -> float:
        d = self.drafter
        if self.confidence_source == "head" and d.confidence_head is not None:
            return float(torch.sigmoid(d.confidence_head(normed_row, emb).float())[0])
        return float(torch.softmax(logits.float(), dim=-1)[0, best])

    @torch.inference_mode()
    def propose(self, ctx, k: int) -> DraftProposal:
        drafted = self._draft(ctx, k)
        if drafted is None:
            return DraftProposal([])
        base, normed = drafted
        d, previous = self.drafter, ctx.token_ids[-1]
        vocab = d.draft_vocab  # a property that builds the map: once per step, not per row
        state = self._start(normed, previous)
        tokens, laws, confidence = [], [], []
        for row in range(self.first, self.first + base.shape[0]):
            logits, state, emb = self._law(base, normed, row, previous, state)
            if ctx.sampling.greedy:
                best = int(logits.argmax(-1))
                previous = int(vocab[best])
                confidence.append(self._confidence(logits, normed[row:row + 1], emb, best))
            else:
                drawn, law = sample_independent_rows(logits, vocab, d.config.vocab_size, ctx.sampling, ctx.generator)
                previous = drawn[0]
                laws.append(law)
            tokens.append(previous)
        if ctx.sampling.greedy:
            return DraftProposal(tokens, confidence=confidence)
        return DraftProposal(tokens, torch.cat(laws))

    @torch.inference_mode()
    def propose_tree(self, ctx, depth: int, branch: int, nodes: int) -> DraftTree:
        """The best cumulative paths, each node's children drawn from the law after its own token
        (the Markov bias follows the path), the greedy chain first; a deterministic tree as
        `tree_from_position_logprobs` builds for DFlash, whose rows do not depend on the path."""
        drafted = self._draft(ctx, depth)
        if drafted is None or nodes < 1:
            return DraftTree(scores=[])
        base, normed = drafted
        last = self.first + base.shape[0] - 1
        vocab = self.drafter.draft_vocab.tolist()
        taken: list[tuple[float, int, int]] = []  # (score, target id, parent index in taken)
        frontier: list = []  # heap of (-score, pushed, row, target id, parent index, state)
        pushed = itertools.count()

        def children(row: int, previous: int, state, score: float, parent: int) -> tuple:
            """Push all but the best of `row`'s top-`branch` tokens after `previous`; return the best
            (score, target id, the state after the row)."""
            logits, state, _ = self._law(base, normed, row, previous, state)
            top, index = torch.log_softmax(logits.float(), -1)[0].topk(min(branch, logits.shape[-1]))
            ranked = [(score + min(float(v), 0.0), vocab[int(i)]) for v, i in zip(top, index)]
            for child_score, token in ranked[1:]:
                heapq.heappush(frontier, (-child_score, next(pushed), row, token, parent, state))
            return ranked[0] + (state,)

        row, previous, state, score, parent = self.first, ctx.token_ids[-1], self._start(normed, ctx.token_ids[-1]), \
            0.0, -1
        while row <= last and len(taken) < nodes:  # the greedy chain
            score, previous, state = children(row, previous, state, score, parent)
            taken.append((score, previous, parent))
            row, parent = row + 1, len(taken) - 1
        while frontier and len(taken) < nodes:
            negative, _, row, token, parent, state = heapq.heappop(frontier)
            taken.append((-negative, token, parent))
            if row < last:  # its children join the frontier; the best one too
                best = children(row + 1, token, state, -negative, len(taken) - 1)
                heapq.heappush(frontier, (-best[0], next(pushed), row + 1, best[1], len(taken) - 1, best[2]))
        order = sorted(range(len(taken)), key=lambda i: (-taken[i][0], i))
        new = {-1: -1, **{old: place for place, old in enumerate(order)}}
        return DraftTree([taken[i][1] for i in order], [new[taken[i][2]] for i in order],
                         scores=[taken[i][0] for i in order])
