"""P-EAGLE in the decoding engine: all k drafts of a step from one drafter forward (batch 1)."""

from __future__ import annotations

import torch

from specforge_lite.contract import DraftProposal
from specforge_lite.decoding.verify import warp_probs
from specforge_lite.drafters.eagle3.decode import KVBuffer
from specforge_lite.drafters.peagle.model import PEagleDrafter, attend


class PEagleDecodeDrafter:
    """P-EAGLE in the decoding engine (batch 1, parallel drafting).

    Each call runs the layers once over the rows [new committed anchors; k - 1 mask rows]:
    anchor p reads (embed(token[p+1]), fc(target features at p)) at position p; mask row d
    reads (embed(mask_token_id), fc(mask_hidden)) at position a + d after the newest anchor a.
    With causal attention over each layer's cache of committed anchors plus these rows, every
    row sees what its training entry sees (`model.parallel_attention_mask`). The newest
    anchor's output gives draft 0, mask row d gives draft d. The mask rows' keys are dropped
    afterwards, so rejection needs no roll-back.
    """

    name = "peagle"
    sequential = False  # one drafter forward per step whatever k

    def __init__(self, drafter: PEagleDrafter):
        self.drafter = drafter.eval()
        self.hidden_state_layers = tuple(drafter.config.aux_layer_ids)
        self.max_drafts = drafter.config.num_depths  # depths it was trained for
        self.reset()

    def reset(self) -> None:
        self.caches = [KVBuffer() for _ in self.drafter.layers]
        self.last_hidden = None  # final hidden of the newest anchor (a call that brings no new position)

    def _attention(self, layer_index: int, q, k, v):
        """New rows' keys join the layer's cache; causal over cache + new rows (`self.allowed`)."""
        cache = self.caches[layer_index]
        cache.append(k, v)
        keys, values = cache.view()
        return attend(q, keys, values, self.allowed, self.drafter.scale)

    @torch.inference_mode()
    def propose(self, ctx, k: int):
        d = self.drafter
        ids = ctx.token_ids
        aux = torch.cat([ctx.hidden_states[i] for i in self.hidden_state_layers], dim=-1)  # [1, n, 3H]
        n = aux.shape[1]
        k = min(k, self.max_drafts)
        masks = max(k - 1, 0) if (n or self.last_hidden is not None) else 0
        if n + masks:
            hidden = self._forward(ids, aux, masks)
            if n:
                self.last_hidden = hidden[:, n - 1:n]
        if k == 0 or self.last_hidden is None:
            return DraftProposal([])
        rows = torch.cat([self.last_hidden, hidden[:, n:]], dim=1) if masks else self.last_hidden
        logits = d.logits(rows[0])  # [k, V_d]: depths 0..k-1
        if ctx.sampling.greedy:
            best = logits.argmax(-1)
            return DraftProposal((best + d.d2t[best]).tolist())
        full = logits.new_full((k, d.config.vocab_size), float("-inf"))
        full[:, d.draft_vocab] = logits
        probs = torch.stack([warp_probs(row, ctx.sampling) for row in full])
        # the depths are drafted independently of each other: q_d does not depend on the draws before it
        tokens = [int(torch.multinomial(q, 1, generator=ctx.generator)) for q in probs]
        return DraftProposal(tokens, probs)

    def _forward(self, ids: list[int], aux: torch.Tensor, masks: int) -> torch.Tensor:
        """One pass of every layer over the new anchors and `masks` mask rows -> their final hidden
        [1, n + masks, H]. The inputs are `entry_inputs`' built directly (no per-row select)."""
        d = self.drafter
        n = aux.shape[1]
        device, dtype = d.fc.weight.device, d.fc.weight.dtype
        anchor = len(ids) - 2  # the newest committed position
        first = anchor + 1 - n
        embeds = d.embed_tokens(torch.tensor([ids[first + 1:] + [d.config.mask_token_id] * masks], device=device))
        features = aux.to(dtype)
        if masks:
            features = torch.cat([features, d.mask_hidden.to(dtype).expand(1, masks, -1)], dim=1)
        hidden = d.fuse(features)
        cos, sin = d.rotation(torch.arange(first, anchor + 1 + masks, device=device)[None], dtype)
        rows, total = n + masks, self.caches[0].length + n + masks
        self.allowed = torch.ones(1, rows, total, dtype=torch.bool, device=device).tril(total - rows)
        committed = [cache.length for cache in self.caches]
        for index in range(len(d.layers)):
            hidden = d.layer_forward(index, embeds, hidden, cos, sin, self._attention)
        for cache, length in zip(self.caches, committed):
            cache.length = length + n  # keep the anchors' keys, drop the mask rows'
        return hidden

    def accept(self, num_accepted: int) -> None:
        pass  # the caches hold committed anchors only
