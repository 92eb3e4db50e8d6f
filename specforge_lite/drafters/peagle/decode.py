"""P-EAGLE in the decoding engine: all k drafts of a step from one drafter forward (batch 1)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from specforge_lite.contract import DraftProposal
from specforge_lite.decoding.tree import DraftTree, tree_from_position_logprobs
from specforge_lite.drafters.vocab import sample_independent_rows
from specforge_lite.drafters.eagle3.decode import StaticKV
from specforge_lite.drafters.peagle.model import PEagleDrafter

log = logging.getLogger(__name__)


class _Rows(torch.nn.Module):
    """Every layer once over the rows [new committed anchors; mask rows], on one static cache
    per layer (slot = position, held as buffers so a compiled graph writes them in place and
    freezes only the weights).

    Row keys are written at their positions and each row attends to the slots at or before
    its own: an anchor sees the anchors before it, mask row d (position a + d after the newest
    anchor a) sees every anchor and the mask rows before it, exactly the training mask
    (`model.parallel_attention_mask`). Mask rows' keys land in slots past the newest anchor;
    the next call writes those slots with its anchors before any row can read them, so
    rejection needs no roll-back.
    """

    def __init__(self, drafter: PEagleDrafter, caches: list[StaticKV]):
        super().__init__()
        self.drafter = drafter
        for index, cache in enumerate(caches):
            self.register_buffer(f"k{index}", cache.k, persistent=False)
            self.register_buffer(f"v{index}", cache.v, persistent=False)
        self.register_buffer("slots", caches[0].slots, persistent=False)

    def hidden(self, aux: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """aux [1, n, 3H] target features of the n new anchors, tokens [1, n + m] (each anchor's
        next token, then m mask ids), positions [n + m] -> final hidden [1, n + m, H]."""
        d = self.drafter
        dtype = d.fc.weight.dtype
        masks = tokens.shape[1] - aux.shape[1]
        features = aux.to(dtype)
        if masks:
            features = torch.cat([features, d.mask_hidden.to(dtype).expand(1, masks, -1)], dim=1)
        hidden, embeds = d.fuse(features), d.embed_tokens(tokens)
        cos, sin = d.rotation(positions[None], dtype)
        visible = self.slots[None, :] <= positions[:, None]

        def attention(index, q, k, v):
            keys, values = getattr(self, f"k{index}"), getattr(self, f"v{index}")
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=d.scale)

        for index in range(len(d.layers)):
            hidden = d.layer_forward(index, embeds, hidden, cos, sin, attention)
        return hidden

    def forward(self, aux: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """`hidden` with n >= 1, then the read-out: (newest anchor's hidden [1, 1, H], greedy
        drafts [1 + m] as target ids, draft-vocab logits [1 + m, V_d]) for depths 0..m."""
        d = self.drafter
        hidden = self.hidden(aux, tokens, positions)
        n = aux.shape[1]
        logits = d.logits(hidden[0, n - 1:])
        best = logits.argmax(-1)
        return hidden[:, n - 1:n], best + d.d2t.index_select(0, best), logits


class PEagleDecodeDrafter:
    """P-EAGLE in the decoding engine (batch 1, parallel drafting).

    Each call runs the layers once over the rows [new committed anchors; k - 1 mask rows]:
    anchor p reads (embed(token[p+1]), fc(target features at p)) at position p; mask row d
    reads (embed(mask_token_id), fc(mask_hidden)) at position a + d after the newest anchor a
    (`_Rows`). The newest anchor's output gives draft 0, mask row d gives draft d.

    `compile(k, capacity)` builds the frozen graph for 1..k+1 new anchors (what a
    verification can commit) with their k - 1 mask rows and the read-out, as EAGLE-3 and the
    target do (on a CPU one package kept between runs, `runtime/graph_cache.py`); other
    shapes (the prompt's anchors) run eagerly on the same caches.
    """

    name = "peagle"
    sequential = False  # one drafter forward per step whatever k

    def __init__(self, drafter: PEagleDrafter, capacity: int = 512):
        self.drafter = drafter.eval()
        self.hidden_state_layers = tuple(drafter.config.aux_layer_ids)
        self.max_drafts = drafter.config.num_depths  # depths it was trained for
        self.limit_reason = f"the {drafter.config.num_depths} depths it was trained for"
        self._build(capacity)
        self.reset()

    def _build(self, capacity: int) -> None:
        cfg, like = self.drafter.config, self.drafter.fc.weight
        self._use([StaticKV(cfg.num_attention_heads, cfg.head_dim, capacity, like) for _ in self.drafter.layers])

    def _use(self, caches: list[StaticKV]) -> None:
        """Draft on these caches from now on (eagerly until `compile` builds graphs over them)."""
        self.caches = caches
        self.rows = _Rows(self.drafter, caches)
        self.graph, self.compiled_k, self.graph_source = None, None, None

    @property
    def capacity(self) -> int:
        return self.caches[0].capacity

    def reset(self) -> None:
        self.last_hidden = None  # final hidden of the newest anchor (a call that brings no new position)

    def compile(self, k: int, capacity: int | None = None, cache_dir="default") -> float:
        """Build (or load) the graph for k drafts (1..k+1 new anchors) on a cache of `capacity`
        slots now, outside any timing; returns the seconds it took (on a CPU one package kept
        between runs, `runtime/graph_cache.py`)."""
        from torch.export import Dim

        from specforge_lite.runtime.graph_cache import compile_kept

        k = min(k, self.max_drafts)
        self._build(max(capacity or 0, self.capacity))
        weight, device = self.drafter.fc.weight, self.drafter.fc.weight.device
        calls = [(weight.new_zeros(1, n, weight.shape[1]), torch.zeros(1, n + k - 1, dtype=torch.long, device=device),
                  torch.arange(n + k - 1, device=device)) for n in range(1, k + 2)]
        rows = Dim("rows", min=1, max=k + 1)
        state = [name for name, _ in self.rows.named_buffers() if name != "slots"]
        graph, seconds, self.graph_source = compile_kept(
            "peagle-rows", self.rows, calls, state=state,
            dynamic_shapes=({1: rows}, {1: rows + (k - 1)}, {0: rows + (k - 1)}), example=calls[1],
            cache_dir=cache_dir)
        self.graph, self.compiled_k = graph, k
        return seconds

    def eager(self) -> None:
        """Drop the compiled graphs: draft with the eager module from here on (evaluate's fallback
        when the graphs accept nothing where the module does)."""
        self.graph, self.compiled_k, self.graph_source = None, None, None

    @torch.inference_mode()
    def propose(self, ctx, k: int):
        d = self.drafter
        drafted = self._draft(ctx, min(k, self.max_drafts))
        if drafted is None:
            return DraftProposal([])
        drafts, logits = drafted
        if ctx.sampling.greedy:  # each row's probability of its draft: the hybrid's cut reads it
            confidence = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
            return DraftProposal(drafts.tolist(), confidence=confidence.tolist())
        tokens, probs = sample_independent_rows(logits, d.draft_vocab, d.config.vocab_size, ctx.sampling,
                                                ctx.generator)
        return DraftProposal(tokens, probs)

    @torch.inference_mode()
    def propose_tree(self, ctx, depth: int, branch: int, nodes: int) -> DraftTree:
        """The best cumulative paths over the depths' top-`branch` tokens, from the same one
        forward as `propose` (`tree_from_position_logprobs`: the greedy chain is its first path).
        Greedy and sampled decoding verify the same deterministic tree. The caches take the
        committed anchors as in a chain step: after a tree step the engine hands over the
        accepted path's rows only, so the next call writes them at their positions."""
        drafted = self._draft(ctx, min(depth, self.max_drafts))
        if drafted is None:
            return DraftTree()
        logprobs = torch.log_softmax(drafted[1].float(), dim=-1)
        return tree_from_position_logprobs(logprobs, branch, nodes, self.drafter.draft_vocab)

    def _draft(self, ctx, k: int):
        """Write the new committed anchors into the caches, then (greedy drafts [k] as target ids,
        draft-vocab logits [k, V_d]) for depths 0..k-1, or None when k is 0 or there is nothing
        to draft from."""
        d = self.drafter
        ids = ctx.token_ids
        if len(ids) + k > self.capacity:  # graphs hold the old caches: eager from here on
            if self.compiled_k is not None:
                log.warning("P-EAGLE drafter: %d positions outgrow the compiled cache of %d; drafting eagerly",
                            len(ids) + k, self.capacity)
            self._use([cache.grown(2 * (len(ids) + k)) for cache in self.caches])
        aux = torch.cat([ctx.hidden_states[i] for i in self.hidden_state_layers], dim=-1)  # [1, n, 3H]
        n = aux.shape[1]
        masks = max(k - 1, 0)
        if k == 0 or (n == 0 and self.last_hidden is None):
            if n:  # anchors still enter the caches for later calls
                self.last_hidden = self._run(aux, ids, 0)[0]
            return None
        if n:
            self.last_hidden, drafts, logits = self._run(aux, ids, masks)
            return drafts, logits
        # no new position: mask rows after the newest anchor, draft 0 from its stored output
        anchor = len(ids) - 2
        tokens = torch.full((1, masks), d.config.mask_token_id, device=aux.device)
        hidden = self.rows.hidden(aux, tokens, torch.arange(anchor + 1, anchor + 1 + masks, device=aux.device))
        logits = d.logits(torch.cat([self.last_hidden, hidden], dim=1)[0])
        best = logits.argmax(-1)
        return best + d.d2t[best], logits

    def _run(self, aux: torch.Tensor, ids: list[int], masks: int):
        """`_Rows` over the n new anchors (positions up to the newest committed one, len(ids) - 2)
        and `masks` mask rows, compiled when a graph has this shape."""
        d = self.drafter
        n = aux.shape[1]
        device = aux.device
        first = len(ids) - 1 - n
        tokens = torch.tensor([ids[first + 1:] + [d.config.mask_token_id] * masks], device=device)
        positions = torch.arange(first, first + n + masks, device=device)
        if self.graph is not None and masks == self.compiled_k - 1 and n <= self.compiled_k + 1:
            # the graphs were built for standalone inputs in the drafter's dtype (the target's may differ)
            return self.graph(aux.to(d.fc.weight.dtype, copy=True, memory_format=torch.contiguous_format),
                              tokens, positions)
        return self.rows(aux, tokens, positions)

    def accept(self, num_accepted: int) -> None:
        pass  # the caches hold committed anchors only
