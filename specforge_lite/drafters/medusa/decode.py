"""Medusa in the decoding engine: one chain of each head's top token per step, or a tree of
the heads' best cumulative paths."""

from __future__ import annotations

import torch

from specforge_lite.contract import DraftProposal
from specforge_lite.decoding.tree import DraftTree, tree_from_position_logprobs
from specforge_lite.decoding.verify import warp_probs
from specforge_lite.drafters.medusa.model import MedusaHeads


class _GreedyHeads(torch.nn.Module):
    """The first k heads' top tokens (target ids [k]) from one hidden state [H]."""

    def __init__(self, heads: MedusaHeads, k: int):
        super().__init__()
        self.heads, self.num_heads = heads, k

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        heads = self.heads
        best = torch.stack([lm_head(block(h)).argmax()
                            for block, lm_head in list(zip(heads.blocks, heads.lm_heads))[:self.num_heads]])
        return heads.token_map.index_select(0, best)


class MedusaDecodeDrafter:
    """Medusa in the decoding engine (batch 1, a chain of each head's top token).

    After every target forward the last committed position t has hidden state h[t]
    (the final-norm output, HF hidden-state index -1); the pending token x[t+1] came from
    the target's lm_head and head i proposes x[t+2+i]. In sampling mode head i's token is
    drawn from its own warped distribution, which keeps rejection sampling exact (the
    proposal q may be any distribution that does not depend on the target's draws).
    At most `num_heads` tokens per step; nothing to roll back. `compile(k)` makes the
    greedy read-out of the k heads one frozen graph (`runtime/compile.py`'s mechanism).
    """

    name = "medusa"
    sequential = False
    hidden_state_layers = (-1,)

    def __init__(self, heads: MedusaHeads):
        self.heads = heads.eval()
        self.full_vocab = heads.config.draft_vocab_size == heads.config.vocab_size
        self.graph, self.compiled_k, self.graph_source = None, None, None

    def compile(self, k: int, capacity: int | None = None, cache_dir="default") -> float:
        """Build (or load) the graph of k greedy heads now, outside any timing; returns the
        seconds it took (on a CPU a package kept between runs, `runtime/graph_cache.py`)."""
        from specforge_lite.runtime.graph_cache import compile_kept

        k = min(k, self.heads.config.num_heads)
        weight = self.heads.lm_heads[0].weight
        example = (weight.new_zeros(self.heads.config.hidden_size),)
        graph, seconds, self.graph_source = compile_kept("medusa-heads", _GreedyHeads(self.heads, k), [example],
                                                         cache_dir=cache_dir)
        self.graph, self.compiled_k = graph, k
        return seconds

    def eager(self) -> None:
        """Drop the compiled graphs: draft with the eager module from here on (evaluate's fallback
        when the graphs accept nothing where the module does)."""
        self.graph, self.compiled_k, self.graph_source = None, None, None

    def reset(self) -> None:
        pass

    def _last_hidden(self, ctx) -> torch.Tensor | None:
        """The newest committed position's final-norm hidden state [H], or None before any."""
        hidden = ctx.hidden_states.get(-1)
        if hidden is None or hidden.shape[1] == 0:
            return None
        return hidden[0, -1].to(self.heads.lm_heads[0].weight.dtype)

    def _head_logits(self, h: torch.Tensor, k: int) -> list[torch.Tensor]:
        """The first k heads' draft-vocab logits [V_d] from hidden state h [H]."""
        return [lm_head(block(h)) for block, lm_head in list(zip(self.heads.blocks, self.heads.lm_heads))[:k]]

    @torch.inference_mode()
    def propose(self, ctx, k: int):
        k = min(k, self.heads.config.num_heads)
        h = self._last_hidden(ctx)
        if k == 0 or h is None:
            return DraftProposal([])
        if ctx.sampling.greedy and k == self.compiled_k:  # the graph was built for a standalone [H] input
            return DraftProposal(self.graph(h.clone()).tolist())
        tokens, probs = [], []
        for logits in self._head_logits(h, k):
            if ctx.sampling.greedy:
                tokens.append(int(self.heads.token_map[logits.argmax()]))
                continue
            full = logits if self.full_vocab else logits.new_full((self.heads.config.vocab_size,), float("-inf"))
            if not self.full_vocab:
                full[self.heads.token_map] = logits
            q = warp_probs(full, ctx.sampling)
            tokens.append(int(torch.multinomial(q, 1, generator=ctx.generator)))
            probs.append(q)
        return DraftProposal(tokens, torch.stack(probs) if probs else None)

    @torch.inference_mode()
    def propose_tree(self, ctx, depth: int, branch: int, nodes: int) -> DraftTree:
        """Medusa's sparse tree: the best cumulative paths over the heads' top-`branch` tokens
        (head i at depth i + 1, depth at most num_heads; `tree_from_position_logprobs`, whose
        first path is the greedy chain). Greedy and sampled decoding verify the same
        deterministic tree. The heads read only the newest committed position, so the tree
        step needs no roll-back."""
        depth = min(depth, self.heads.config.num_heads)
        h = self._last_hidden(ctx)
        if depth == 0 or h is None:
            return DraftTree()
        logprobs = torch.log_softmax(torch.stack(self._head_logits(h, depth)).float(), dim=-1)
        return tree_from_position_logprobs(logprobs, branch, nodes, self.heads.token_map)

    def accept(self, num_accepted: int) -> None:
        pass


