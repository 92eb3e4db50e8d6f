"""DFlash in the decoding engine: a whole block of drafts from one drafter forward (batch 1)."""

from __future__ import annotations

import logging

import torch

from specforge_lite.contract import DraftProposal
from specforge_lite.decoding.tree import DraftTree, tree_from_position_logprobs
from specforge_lite.drafters.dflash.model import DFlashDrafter
from specforge_lite.drafters.eagle3.decode import StaticKV
from specforge_lite.drafters.vocab import sample_independent_rows

log = logging.getLogger(__name__)


class _Block(torch.nn.Module):
    """The context write and the block forward of one drafting call, on static context caches
    (per layer keys / values [1, kv_heads, capacity, D] at slot = position, held as buffers so
    a compiled graph writes them in place and freezes only the weights).

    The n newly committed positions' target features become context keys and values at their
    slots; the block rows [pending token, mask x (rows - 1)] at positions p .. p+rows-1 then
    run through every layer, each row seeing the context slots < p (all committed, since only
    committed positions are written and they are contiguous) and the rows of its own block
    (all of them, or those at or before it when causal). Slots >= p hold nothing a row reads,
    so a rejected draft needs no roll-back and a new prompt needs no clearing.
    """

    def __init__(self, drafter: DFlashDrafter, caches: list[StaticKV], drafts: int):
        super().__init__()
        self.drafter = drafter
        self.drafts = drafts  # the block rows read out (first..first+drafts-1); plain attributes, in the graph key
        self.first = 0 if drafter.config.sample_from_anchor else 1
        for index, cache in enumerate(caches):
            self.register_buffer(f"k{index}", cache.k, persistent=False)
            self.register_buffer(f"v{index}", cache.v, persistent=False)
        self.register_buffer("slots", caches[0].slots, persistent=False)

    def write(self, aux: torch.Tensor, context_positions: torch.Tensor) -> tuple[list, list]:
        """The context keys and values of the new committed positions into their slots; returns
        the caches (keys, values per layer)."""
        d = self.drafter
        keys = [getattr(self, f"k{i}") for i in range(len(d.layers))]
        values = [getattr(self, f"v{i}") for i in range(len(d.layers))]
        if aux.shape[1]:
            new = d.context_kv(d.context(aux), context_positions[None])
            for (k, v), key_cache, value_cache in zip(new, keys, values):
                key_cache.index_copy_(2, context_positions, k)
                value_cache.index_copy_(2, context_positions, v)
        return keys, values

    def forward(self, aux: torch.Tensor, context_positions: torch.Tensor, tokens: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (greedy drafts [drafts] as target ids, draft-vocab logits [drafts, V_d]) of the
        block rows read out (1..drafts; 0..drafts-1 with sample_from_anchor)."""
        d = self.drafter
        logits = d.logits(self.states(aux, context_positions, tokens, positions)[0, self.first:self.first + self.drafts])
        best = logits.argmax(-1)
        return best + d.d2t.index_select(0, best), logits

    def states(self, aux: torch.Tensor, context_positions: torch.Tensor, tokens: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """aux [1, n, A*H] features of the n new committed positions `context_positions` [n];
        block tokens [1, rows] at `positions` [rows]. Returns the block rows' last states [1, rows, H]."""
        d = self.drafter
        keys, values = self.write(aux, context_positions)
        rows = tokens.shape[1]
        context = self.slots[None, :] < positions[:1, None]  # [1, capacity]
        own = torch.ones(rows, rows, dtype=torch.bool, device=tokens.device)
        if d.config.causal:
            own = own.tril()
        allowed = torch.cat([context.expand(rows, -1), own], dim=1)[None]
        return d.block_hidden(tokens, positions[None], list(zip(keys, values)), allowed)


class DFlashDecodeDrafter:
    """DFlash in the decoding engine (batch 1, block drafting).

    Each call writes the target's hidden states of the newly committed positions into the
    context caches, then runs the block [pending token, mask x S-1] at positions p .. p+S-1
    (p = the pending token's position) through every layer once; block row j gives draft j
    (`_Block`). A non-causal drafter always runs the whole block it was trained on (its rows
    see each other, so a shorter block would change them); a causal one runs only the k + 1
    rows it needs (identical rows, fewer of them).

    `compile(k, capacity)` builds the frozen graph of a call that commits 1..k+1 positions
    and drafts k, as P-EAGLE, EAGLE-3 and the target do (on a CPU one package kept between
    runs, `runtime/graph_cache.py`); other shapes (the prompt, another k) run the same module
    eagerly on the same caches.
    """

    name = "dflash"
    sequential = False  # one drafter forward per step whatever k
    graph_name = "dflash-block"  # the kept graph's name (`runtime/graph_cache.py`)
    block_class = _Block

    def __init__(self, drafter: DFlashDrafter, capacity: int = 512):
        self.drafter = drafter.eval()
        self.hidden_state_layers = tuple(drafter.config.aux_layer_ids)
        self.first = 0 if drafter.config.sample_from_anchor else 1  # the first block row that drafts
        self.max_drafts = drafter.config.block_size - self.first
        self.limit_reason = (f"its block of {drafter.config.block_size}" +
                             ("" if drafter.config.sample_from_anchor else " less the anchor"))
        cfg = drafter.config
        self._use([StaticKV(cfg.num_key_value_heads, cfg.head_dim, capacity, drafter.fc.weight)
                   for _ in range(cfg.num_layers)])
        self.reset()

    def _use(self, caches: list[StaticKV]) -> None:
        """Draft on these caches from now on (eagerly until `compile` builds a graph over them)."""
        self.caches = caches
        self._blocks: dict[int, _Block] = {}  # the eager module per number of drafts read out
        self.graph, self.compiled_k, self.graph_source = None, None, None

    def _block(self, k: int) -> _Block:
        if k not in self._blocks:
            self._blocks[k] = self.block_class(self.drafter, self.caches, k)
        return self._blocks[k]

    @property
    def capacity(self) -> int:
        return self.caches[0].capacity

    def reset(self) -> None:
        self.length = 0  # slots 0..length-1 hold the committed context

    def compile(self, k: int, capacity: int | None = None, cache_dir="default") -> float:
        """Build (or load) the graph for k drafts after 1..k+1 newly committed positions, on a
        cache of `capacity` slots, now, outside any timing; returns the seconds it took."""
        from torch.export import Dim

        from specforge_lite.runtime.graph_cache import compile_kept

        k = min(k, self.max_drafts)
        if k == 0:
            return 0.0
        if (capacity or 0) > self.capacity:
            self._use([cache.grown(capacity) for cache in self.caches])
        block = self._block(k)
        weight, device = self.drafter.fc.weight, self.drafter.fc.weight.device
        rows = self._rows(k)
        calls = [(weight.new_zeros(1, n, weight.shape[1]), torch.arange(n, device=device),
                  torch.zeros(1, rows, dtype=torch.long, device=device), torch.arange(n, n + rows, device=device))
                 for n in range(1, k + 2)]
        new = Dim("new", min=1, max=k + 1)
        state = [name for name, _ in block.named_buffers() if name != "slots"]
        graph, seconds, self.graph_source = compile_kept(
            self.graph_name, block, calls, state=state, dynamic_shapes=({1: new}, {0: new}, None, None),
            example=calls[1], cache_dir=cache_dir)
        self.graph, self.compiled_k = graph, k
        return seconds

    def eager(self) -> None:
        """Drop the compiled graphs: draft with the eager module from here on (evaluate's fallback
        when the graphs accept nothing where the module does)."""
        self.graph, self.compiled_k, self.graph_source = None, None, None

    def _rows(self, k: int) -> int:
        return k + self.first if self.drafter.config.causal else self.drafter.config.block_size

    @torch.inference_mode()
    def propose(self, ctx, k: int) -> DraftProposal:
        d = self.drafter
        drafted = self._draft(ctx, k)
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
        """The best cumulative paths over the block rows' top-`branch` tokens (depth at most
        block_size - 1), from the same one forward as `propose` (`tree_from_position_logprobs`:
        the greedy chain is its first path). Greedy and sampled decoding verify the same
        deterministic tree. After a tree step the engine hands over the accepted path's hidden
        states only, so the context cache takes exactly what a chain step with those tokens gives."""
        drafted = self._draft(ctx, depth)
        if drafted is None:
            return DraftTree()
        logprobs = torch.log_softmax(drafted[1].float(), dim=-1)
        return tree_from_position_logprobs(logprobs, branch, nodes, self.drafter.draft_vocab)

    def _draft(self, ctx, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Write the newly committed positions into the context caches, then the block's output
        for k drafts (`_Block.forward`: greedy drafts [k] as target ids, draft-vocab logits [k, V_d];
        k capped at `max_drafts`), or None when k is 0 (the positions are still written)."""
        d = self.drafter
        cfg = d.config
        ids = ctx.token_ids
        pending = len(ids) - 1  # the anchor's position
        k = min(k, self.max_drafts)
        rows = self._rows(k) if k else 0
        if pending + rows > self.capacity:  # the graph holds the old caches: eager from here on
            if self.compiled_k is not None:
                log.warning("DFlash drafter: %d positions outgrow the compiled cache of %d; drafting eagerly",
                            pending + rows, self.capacity)
            self._use([cache.grown(2 * (pending + rows)) for cache in self.caches])
        device = d.fc.weight.device
        new = [ctx.hidden_states[i] for i in self.hidden_state_layers]
        aux = torch.cat(new, dim=-1) if new else d.fc.weight.new_zeros(1, 0, d.fc.weight.shape[1])
        n = aux.shape[1]
        context_positions = torch.arange(pending - n, pending, device=device)
        self.length = pending
        block = self._block(k)
        if k == 0:
            block.write(aux, context_positions)
            return None
        tokens = torch.tensor([[ids[-1]] + [cfg.mask_token_id] * (rows - 1)], device=device)
        positions = torch.arange(pending, pending + rows, device=device)
        if self.graph is not None and k == self.compiled_k and 1 <= n <= k + 1:
            # the graph was built for standalone inputs in the drafter's dtype (the target's may differ)
            return self.graph(aux.to(d.fc.weight.dtype, copy=True, memory_format=torch.contiguous_format),
                              context_positions, tokens, positions)
        return block(aux, context_positions, tokens, positions)

    def accept(self, num_accepted: int) -> None:
        pass  # the caches hold committed positions only
