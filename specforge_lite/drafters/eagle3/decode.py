"""EAGLE-3 in the decoding engine: batch-1 chain drafting over the drafter's own KV buffer."""

from __future__ import annotations

import math

import torch

from specforge_lite.contract import DraftProposal
from specforge_lite.decoding.verify import warp_probs
from specforge_lite.drafters.eagle3.model import Eagle3Drafter


class KVBuffer:
    """Growing per-sequence key/value store [1, heads, n, D] for batch-1 drafting."""

    def __init__(self):
        self.k = self.v = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        if self.k is None or self.length + n > self.k.shape[2]:
            size = max(256, 2 * (self.length + n))
            new_k = k.new_zeros(k.shape[0], k.shape[1], size, k.shape[3])
            new_v = v.new_zeros(new_k.shape)
            if self.k is not None:
                new_k[:, :, : self.length] = self.k[:, :, : self.length]
                new_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = new_k, new_v
        self.k[:, :, self.length: self.length + n] = k
        self.v[:, :, self.length: self.length + n] = v
        self.length += n

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]


class Eagle3DecodeDrafter:
    """EAGLE-3 in the decoding engine (batch 1, chain drafting).

    Each committed target position p becomes an anchor: the layer reads
    (embed(token[p+1]), fc(aux hidden at p)) and its key/value join the drafter's cache.
    Drafting then chains from the newest anchor: step j feeds the previous step's output
    hidden and its own draft token at position anchor + j, attending over the anchors
    and the chain so far, exactly as in the training-time test. Chain keys are dropped
    after each proposal, so rejection needs no roll-back: the next call brings the
    target's features for whatever was accepted.
    """

    name = "eagle3"
    sequential = True

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter.eval()
        self.hidden_state_layers = tuple(drafter.config.aux_layer_ids)
        self.scale = 1.0 / math.sqrt(drafter.config.head_dim)
        self.reset()

    def reset(self) -> None:
        self.cache = KVBuffer()
        self.last_hidden = None  # layer output at the newest anchor

    def _attend(self, x: torch.Tensor, positions: torch.Tensor, causal: bool) -> torch.Tensor:
        """Run the layer on new rows x [1, m, 2H]; their keys are appended to the cache."""
        attn = self.drafter.layers[0].self_attn
        q, k, v = attn.project(x, positions)
        self.cache.append(k, v)
        keys, values = self.cache.view()
        scores = (q @ keys.transpose(-1, -2)) * self.scale  # [1, h, m, S]
        m, total = q.shape[2], keys.shape[2]
        if causal and m > 1:
            allowed = torch.ones(m, total, dtype=torch.bool, device=x.device).tril(total - m)
            scores = scores.masked_fill(~allowed, float("-inf"))
        return attn.output(torch.softmax(scores, dim=-1) @ values)

    @torch.inference_mode()
    def propose(self, ctx, k: int):
        d = self.drafter
        layer = d.layers[0]
        ids = ctx.token_ids
        aux = torch.cat([ctx.hidden_states[i] for i in self.hidden_state_layers], dim=-1)  # [1, n, 3H]
        n = aux.shape[1]
        if n:
            first = len(ids) - 1 - n  # anchor positions first .. len(ids) - 2
            device = aux.device
            next_tokens = torch.tensor([ids[first + 1:]], device=device)
            fused = d.fuse(aux.to(d.fc.weight.dtype))
            x, residual = layer.attention_input(d.embed_tokens(next_tokens), fused)
            positions = torch.arange(first, len(ids) - 1, device=device)[None]
            out = layer.finish(residual, self._attend(x, positions, causal=True))
            self.last_hidden = out[:, -1:]
        if k == 0 or self.last_hidden is None:
            return DraftProposal([])
        context_length = self.cache.length
        hidden = self.last_hidden
        anchor = len(ids) - 2
        tokens, probs = [], []
        for step in range(k):
            logits, chained = d.readout(hidden)
            logits = logits[0, -1]  # [V_d]
            if ctx.sampling.greedy:
                best = logits.argmax()
                token = int(d.d2t[best] + best)
            else:
                full = logits.new_full((d.config.vocab_size,), float("-inf"))
                full[d.draft_vocab] = logits
                q = warp_probs(full, ctx.sampling)
                token = int(torch.multinomial(q, 1, generator=ctx.generator))
                probs.append(q)
            tokens.append(token)
            if step == k - 1:
                break
            x, residual = layer.attention_input(d.embed_tokens(torch.tensor([[token]], device=hidden.device)), chained)
            position = torch.tensor([[anchor + step + 1]], device=hidden.device)
            hidden = layer.finish(residual, self._attend(x, position, causal=False))
        self.cache.length = context_length  # drop the chain's keys
        return DraftProposal(tokens, torch.stack(probs) if probs else None)

    def accept(self, num_accepted: int) -> None:
        pass  # the cache holds committed anchors only
