"""DFlash in the decoding engine: a whole block of drafts from one drafter forward (batch 1)."""

from __future__ import annotations

import torch

from specforge_lite.contract import DraftProposal
from specforge_lite.decoding.tree import DraftTree, tree_from_position_logprobs
from specforge_lite.drafters.vocab import sample_independent_rows
from specforge_lite.drafters.dflash.model import DFlashDrafter


class ContextCache:
    """Per layer, the context keys and values [1, kv_heads, capacity, D] at slot = position.

    Only committed positions enter (the target's hidden states of what it accepted), so a
    rejected draft never reaches the cache and nothing is rolled back."""

    def __init__(self, drafter: DFlashDrafter, capacity: int):
        cfg, like = drafter.config, drafter.fc.weight
        shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = [like.new_zeros(shape) for _ in range(cfg.num_layers)]
        self.v = [like.new_zeros(shape) for _ in range(cfg.num_layers)]
        self.length = 0  # slots 0..length-1 hold the context

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def grow(self, capacity: int) -> None:
        for cache in (self.k, self.v):
            for i, old in enumerate(cache):
                cache[i] = torch.cat([old, old.new_zeros(*old.shape[:2], capacity - old.shape[2], old.shape[3])], 2)

    def write(self, first: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = kv[0][0].shape[2]
        if first + n > self.capacity:
            self.grow(2 * (first + n))
        for layer, (k, v) in enumerate(kv):
            self.k[layer][:, :, first:first + n] = k
            self.v[layer][:, :, first:first + n] = v
        self.length = first + n

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, :self.length], v[:, :, :self.length]) for k, v in zip(self.k, self.v)]


class DFlashDecodeDrafter:
    """DFlash in the decoding engine (batch 1, block drafting).

    Each call first turns the target's hidden states of the newly committed positions into
    context keys and values (`ContextCache`), then runs the block [pending token, mask x S-1]
    at positions p .. p+S-1 (p = the pending token's position) through every layer once; block
    row j gives draft j. A non-causal drafter always runs the whole block it was trained on
    (its rows see each other, so a shorter block would change them); a causal one runs only
    the k + 1 rows it needs (identical rows, fewer of them).
    """

    name = "dflash"
    sequential = False  # one drafter forward per step whatever k

    def __init__(self, drafter: DFlashDrafter, capacity: int = 512):
        self.drafter = drafter.eval()
        self.hidden_state_layers = tuple(drafter.config.aux_layer_ids)
        self.max_drafts = drafter.config.block_size - 1
        self.cache = ContextCache(drafter, capacity)

    def reset(self) -> None:
        self.cache.length = 0

    @torch.inference_mode()
    def propose(self, ctx, k: int) -> DraftProposal:
        d = self.drafter
        logits = self._block_logits(ctx, k)
        if logits is None:
            return DraftProposal([])
        if ctx.sampling.greedy:
            best = logits.argmax(-1)
            return DraftProposal((best + d.d2t[best]).tolist())
        tokens, probs = sample_independent_rows(logits, d.draft_vocab, d.config.vocab_size, ctx.sampling,
                                                ctx.generator)
        return DraftProposal(tokens, probs)

    @torch.inference_mode()
    def propose_tree(self, ctx, depth: int, branch: int, nodes: int) -> DraftTree:
        """The best cumulative paths over the block rows' top-`branch` tokens (depth at most
        block_size - 1), from the same one forward as `propose` (`tree_from_position_logprobs`:
        the greedy chain is its first path). Greedy and sampled decoding verify the same
        deterministic tree. After a tree step the engine hands over the accepted path's hidden
        states only, so the context cache takes exactly what a chain step with those tokens gives."""
        logits = self._block_logits(ctx, depth)
        if logits is None:
            return DraftTree()
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return tree_from_position_logprobs(logprobs, branch, nodes, self.drafter.draft_vocab)

    def _block_logits(self, ctx, k: int) -> torch.Tensor | None:
        """Write the newly committed positions' context keys and values, then the draft-vocab
        logits [k, V_d] of block rows 1..k (k capped at block_size - 1), or None when k is 0."""
        d = self.drafter
        cfg = d.config
        ids = ctx.token_ids
        pending = len(ids) - 1  # the anchor's position
        new = [ctx.hidden_states[i] for i in self.hidden_state_layers]
        n = new[0].shape[1] if new else 0
        if n:
            first = pending - n
            positions = torch.arange(first, pending, device=d.fc.weight.device)[None]
            self.cache.write(first, d.context_kv(d.context(torch.cat(new, dim=-1)), positions))
        k = min(k, self.max_drafts)
        if k == 0:
            return None
        rows = k + 1 if cfg.causal else cfg.block_size
        device = d.fc.weight.device
        tokens = torch.tensor([[ids[-1]] + [cfg.mask_token_id] * (rows - 1)], device=device)
        positions = torch.arange(pending, pending + rows, device=device)[None]
        allowed = torch.ones(1, rows, self.cache.length + rows, dtype=torch.bool, device=device)
        if cfg.causal:
            allowed[0, :, self.cache.length:] = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
        hidden = d.block_hidden(tokens, positions, self.cache.view(), allowed)
        return d.logits(hidden[0, 1:k + 1])  # [k, V_d]

    def accept(self, num_accepted: int) -> None:
        pass  # the cache holds committed positions only
