"""EAGLE-3 in the decoding engine: batch-1 chain drafting over a static KV cache."""

from __future__ import annotations


import logging

import torch
import torch.nn.functional as F

from specforge_lite.contract import DraftProposal
from specforge_lite.decoding.tree import DraftTree
from specforge_lite.decoding.verify import warp_probs
from specforge_lite.drafters.eagle3.model import Eagle3Drafter

log = logging.getLogger(__name__)


class StaticKV:
    """Preallocated keys/values [1, heads, capacity, D] written at explicit positions (slot =
    position), so a step's shapes never depend on how much is cached and rejected chain
    keys need no removal: a slot is read only by positions at or after it, and whatever
    reaches those positions again writes the slot first."""

    def __init__(self, heads: int, head_dim: int, capacity: int, like: torch.Tensor):
        self.k = like.new_zeros(1, heads, capacity, head_dim)
        self.v = like.new_zeros(1, heads, capacity, head_dim)
        self.slots = torch.arange(capacity, device=like.device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def grown(self, capacity: int) -> "StaticKV":
        bigger = StaticKV(self.k.shape[1], self.k.shape[3], capacity, self.k)
        bigger.k[:, :, :self.capacity] = self.k
        bigger.v[:, :, :self.capacity] = self.v
        return bigger


def _layer_rows(d: Eagle3Drafter, kv, embeds: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """The drafter layer over committed rows at `positions` [m]: embeds [1, m, H] of the
    tokens read, hidden [1, m, H] the fused target features; their keys join the cache;
    each row attends to every slot at or before its position."""
    layer = d.layers[0]
    attn = layer.self_attn
    x, residual = layer.attention_input(embeds, hidden)
    q, k, v = attn.project_at(x, positions[None])
    kv.k.index_copy_(2, positions, k)
    kv.v.index_copy_(2, positions, v)
    visible = kv.slots[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q, kv.k, kv.v, attn_mask=visible)
    return layer.finish(residual, attn.output(out))


class _Chain:
    """The drafting chain after the newest anchor: its keys and values stay here, never
    in the cache (they die with the proposal), and each step attends to the committed
    anchors (cache slots up to `anchor`) and the chain so far."""

    def __init__(self, d: Eagle3Drafter, kv, anchor: torch.Tensor):
        self.d, self.kv, self.anchor = d, kv, anchor
        self.keys, self.values = [kv.k], [kv.v]
        self.anchors_visible = kv.slots <= anchor  # [capacity]

    def step(self, token: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer on the draft `token` [1, 1] read after `hidden` [1, 1, H]: its output."""
        d = self.d
        layer = d.layers[0]
        attn = layer.self_attn
        x, residual = layer.attention_input(d.embed_tokens(token), hidden)
        position = self.anchor + len(self.keys)
        q, k, v = attn.project_at(x, position[None])
        self.keys.append(k)
        self.values.append(v)
        visible = torch.cat([self.anchors_visible, self.anchors_visible.new_ones(len(self.keys) - 1)])
        out = F.scaled_dot_product_attention(q, torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2),
                                             attn_mask=visible[None, :])
        return layer.finish(residual, attn.output(out))


def _greedy_chain(d: Eagle3Drafter, kv, hidden: torch.Tensor, anchor: torch.Tensor, k: int):
    """k greedy drafts (target-vocab ids [k]) chained from the newest anchor's output
    `hidden` [1, 1, H] at position `anchor` [1], and the drafter's probability of each [k]."""
    chain = _Chain(d, kv, anchor)
    tokens, confidence, hiddens = [], [], []
    for step in range(k):
        logits, chained = d.readout(hidden)
        best = logits[0, -1].argmax().view(1)
        token = d.d2t.index_select(0, best) + best  # an index tensor, not a Python int: no graph break
        tokens.append(token)
        confidence.append(torch.softmax(logits[0, -1].float(), dim=-1).index_select(0, best))
        hiddens.append(hidden)
        if step == k - 1:
            break
        hidden = chain.step(token.view(1, 1), chained)
    # The step inputs are returned only to keep them materialised: torch 2.13's inductor,
    # fusing a chain whose only output is the tokens, drafted a different third token than
    # eager mode (tests/unit/test_eagle3.py checks the compiled chain against eager).
    return torch.cat(tokens), torch.cat(confidence), torch.cat(hiddens, dim=1)


def _tree_candidates(d: Eagle3Drafter, kv, hidden: torch.Tensor, anchor: torch.Tensor, depth: int,
                     branch: int) -> tuple[torch.Tensor, ...]:
    """EAGLE-2's dynamic tree from the newest anchor's output `hidden` [1, 1, H] at position `anchor`
    [1], in tensor operations of fixed shapes only (one compiled graph drafts it, no Python between
    depths): the root's top-`branch` tokens are depth 1; at each further depth the `branch`
    candidates of highest cumulative log-probability go through the layer as one batch (each
    attending to the anchors, its ancestors and itself), and each gives its top `branch` children.
    Returns every candidate's (score [N], draft-vocab id [N], parent [N], -1 at depth 1) and the
    candidates in order of score, ties by index [N] (a child never outscores its parent, so the order
    is topological); N = b + (depth - 1) b^2 with b = min(branch, V_d)."""
    layer = d.layers[0]
    attn = layer.self_attn
    logits, chained = d.readout(hidden)
    b = min(branch, logits.shape[-1])
    scores, tokens = torch.log_softmax(logits[0, -1].float(), dim=-1).topk(b)
    parents = torch.full((b,), -1, dtype=torch.long, device=hidden.device)
    frontier = torch.arange(b, device=hidden.device)  # candidates expanded at this depth
    parent_rows = None  # each frontier node's parent's row among the expanded nodes
    inputs = chained.expand(1, b, -1)  # the hidden state each frontier node reads
    anchors_visible = (kv.slots <= anchor)[None, :].expand(b, -1)  # [b, capacity]
    seen = torch.zeros(0, 0, dtype=torch.bool, device=hidden.device)  # expanded nodes: ancestor-or-self
    own = torch.eye(b, dtype=torch.bool, device=hidden.device)
    keys, values = kv.k, kv.v
    for level in range(2, depth + 1):
        m = seen.shape[0]
        ancestors = seen[parent_rows] if parent_rows is not None else seen.new_zeros(b, m)
        rows = torch.cat([ancestors, own], dim=1)  # [b, m + b]
        seen = torch.cat([torch.nn.functional.pad(seen, (0, b)), rows])
        ids = d.draft_vocab.index_select(0, tokens.index_select(0, frontier))
        x, residual = layer.attention_input(d.embed_tokens(ids[None]), inputs)
        q, k, v = attn.project_at(x, (anchor + level - 1).expand(b)[None])
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        visible = torch.cat([anchors_visible, rows], dim=1)
        out = layer.finish(residual, attn.output(F.scaled_dot_product_attention(q, keys, values,
                                                                                attn_mask=visible[None])))
        logits, chained = d.readout(out)  # [1, b, V_d], [1, b, H]
        top, index = torch.log_softmax(logits[0].float(), dim=-1).topk(b)
        total = scores.index_select(0, frontier)[:, None] + top  # [b, b]
        first = scores.shape[0]
        scores = torch.cat([scores, total.flatten()])
        tokens = torch.cat([tokens, index.flatten()])
        parents = torch.cat([parents, frontier.repeat_interleave(b)])
        best = total.flatten().topk(b).indices
        frontier, parent_rows = first + best, m + best // b
        inputs = chained[:, best // b]
    order = torch.sort(scores, descending=True, stable=True).indices
    return scores, tokens, parents, order


def _tree_of(d: Eagle3Drafter, candidates: tuple[torch.Tensor, ...], nodes: int) -> DraftTree:
    """The `nodes` best candidates of `_tree_candidates` as a deterministic `DraftTree` of target ids."""
    scores, tokens, parents, order = (t.tolist() for t in candidates)
    tree, new = DraftTree(scores=[]), {-1: -1}
    for c in order[:nodes]:
        if parents[c] in new:  # always, unless rounding let a child outscore its parent
            new[c] = len(tree.tokens)
            tree.tokens.append(tokens[c])
            tree.parents.append(new[parents[c]])
            tree.scores.append(scores[c])
    tree.tokens = d.draft_vocab[torch.tensor(tree.tokens, dtype=torch.long, device=d.d2t.device)].tolist()
    return tree


def _dynamic_tree(d: Eagle3Drafter, kv, hidden: torch.Tensor, anchor: torch.Tensor, depth: int, branch: int,
                  nodes: int) -> DraftTree:
    """EAGLE-2's dynamic tree (`_tree_candidates`), its `nodes` best candidates (`_tree_of`)."""
    return _tree_of(d, _tree_candidates(d, kv, hidden, anchor, depth, branch), nodes)


class _CacheModule(torch.nn.Module):
    """Owns the drafter and the cache tensors as buffers (shared with the eager path, not
    copied): compiling it freezes the weights, while the buffers stay state that graphs
    write in place (a cache held any other way is frozen as a constant or copied)."""

    def __init__(self, drafter: Eagle3Drafter, kv: StaticKV):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("k", kv.k, persistent=False)
        self.register_buffer("v", kv.v, persistent=False)
        self.register_buffer("slots", kv.slots, persistent=False)


class _GreedyChain(_CacheModule):
    """`_greedy_chain` for a fixed k."""

    def __init__(self, drafter: Eagle3Drafter, kv: StaticKV, k: int):
        super().__init__(drafter, kv)
        self.num_drafts = k

    def forward(self, hidden: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _greedy_chain(self.drafter, self, hidden, anchor, self.num_drafts)


class _GreedyTree(_CacheModule):
    """`_tree_candidates` for a fixed depth and branch."""

    def __init__(self, drafter: Eagle3Drafter, kv: StaticKV, depth: int, branch: int):
        super().__init__(drafter, kv)
        self.depth, self.branch = depth, branch

    def forward(self, hidden: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _tree_candidates(self.drafter, self, hidden, anchor, self.depth, self.branch)


class _AnchorRows(_CacheModule):
    """The layer over newly committed positions: fused target features and the next tokens'
    embeddings in, the newest anchor's output [1, 1, H] out."""

    def forward(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        fused = d.fuse(aux.to(d.fc.weight.dtype))
        return _layer_rows(d, self, d.embed_tokens(next_tokens), fused, positions)[:, -1:]


class Eagle3DecodeDrafter:
    """EAGLE-3 in the decoding engine (batch 1, chain drafting).

    Each committed target position p becomes an anchor: the layer reads
    (embed(token[p+1]), fc(aux hidden at p)) and its key/value join the drafter's cache.
    Drafting then chains from the newest anchor: step j feeds the previous step's output
    hidden and its own draft token at position anchor + j, attending over the anchors
    and the chain so far, exactly as in the training-time test. Chain keys never enter
    the cache, so rejection needs no roll-back: the next call writes the anchors of
    whatever was accepted.

    `compile(k)` compiles the greedy k-step chain into one graph and 1..k+1 new anchors into
    another (frozen weights, autotuned products; on a CPU packages kept between runs,
    `runtime/graph_cache.py`), the engine's answer to Python and dispatch costs that
    dominate a small layer's step.
    """

    name = "eagle3"
    sequential = True

    def __init__(self, drafter: Eagle3Drafter, capacity: int = 512):
        self.drafter = drafter.eval()
        self.hidden_state_layers = tuple(drafter.config.aux_layer_ids)
        cfg = drafter.config
        self.kv = StaticKV(cfg.num_attention_heads, cfg.head_dim, capacity, drafter.fc.weight)
        self._chain_graph = None  # the compiled greedy chain, for compiled_k drafts
        self.compiled_k = None
        self._anchor_rows = _AnchorRows(drafter, self.kv)
        self._anchor_graph = None
        self._tree_graph, self.compiled_tree = None, None  # EAGLE-2's tree for (depth, branch): `compile_tree`
        self.graph_source = None  # "compiled" or "loaded" by `compile`
        self.reset()

    def reset(self) -> None:
        self.last_hidden = None  # layer output at the newest anchor

    def compile(self, k: int, capacity: int | None = None, cache_dir="default") -> float:
        """Build (or load) the graphs of the greedy k-step chain and of 1..k+1 new anchors (with
        a cache of `capacity` slots) now, outside any timing; returns the seconds it took.
        Weights are frozen and products autotuned, as for the target; on a CPU each graph is a
        package kept in `cache_dir` between runs (`runtime/graph_cache.py`)."""
        from torch.export import Dim

        from specforge_lite.runtime.graph_cache import compile_kept

        if capacity and capacity > self.kv.capacity:
            self.kv = self.kv.grown(capacity)
            self._anchor_rows = _AnchorRows(self.drafter, self.kv)
        weight, device = self.drafter.fc.weight, self.kv.k.device
        chain, chain_s, chain_how = compile_kept(
            "eagle3-chain", _GreedyChain(self.drafter, self.kv, k),
            [(weight.new_zeros(1, 1, self.drafter.config.hidden_size), torch.tensor([0], device=device))],
            state=("k", "v"), cache_dir=cache_dir)
        calls = [(weight.new_zeros(1, n, weight.shape[1]), torch.zeros(1, n, dtype=torch.long, device=device),
                  torch.arange(n, device=device)) for n in range(1, k + 2)]
        rows = Dim("rows", min=1, max=k + 1)
        anchors, anchors_s, anchors_how = compile_kept(
            "eagle3-anchors", self._anchor_rows, calls, state=("k", "v"),
            dynamic_shapes=({1: rows}, {1: rows}, {0: rows}), example=calls[1], cache_dir=cache_dir)
        self._chain_graph, self.compiled_k = chain, k
        self._anchor_graph = anchors
        self.graph_source = "loaded" if chain_how == anchors_how == "loaded" else "compiled"
        return chain_s + anchors_s

    def compile_tree(self, depth: int, branch: int, cache_dir="default") -> float:
        """Build (or load) the graph of EAGLE-2's tree of `depth` and `branch` (`_tree_candidates`)
        on the current cache, after `compile`; returns the seconds it took."""
        from specforge_lite.runtime.graph_cache import compile_kept

        example = (self.drafter.fc.weight.new_zeros(1, 1, self.drafter.config.hidden_size),
                   torch.tensor([0], device=self.kv.k.device))
        self._tree_graph, seconds, _ = compile_kept("eagle3-tree", _GreedyTree(self.drafter, self.kv, depth, branch),
                                                    [example], state=("k", "v"), cache_dir=cache_dir)
        self.compiled_tree = (depth, branch)
        return seconds

    def eager(self) -> None:
        """Drop the compiled graphs: draft with the eager module from here on (evaluate's fallback
        when the graphs accept nothing where the module does)."""
        self._chain_graph, self.compiled_k, self._anchor_graph, self.graph_source = None, None, None, None
        self._tree_graph, self.compiled_tree = None, None

    @torch.inference_mode()
    def propose_tree(self, ctx, depth: int, branch: int, nodes: int) -> DraftTree:
        """EAGLE-2's dynamic tree (`_dynamic_tree`), by its compiled graph where `compile_tree` built
        one for this depth and branch; greedy and sampled decoding verify the same deterministic tree
        (the target's rule takes q as point masses)."""
        self._write_anchors(ctx, depth)
        if depth == 0 or self.last_hidden is None:
            return DraftTree()
        anchor = torch.tensor([len(ctx.token_ids) - 2], device=self.last_hidden.device)
        if self.compiled_tree == (depth, branch) and self._anchor_graph is not None:  # the cache it was built on
            hidden = self.last_hidden.clone(memory_format=torch.contiguous_format)  # built for standalone inputs
            return _tree_of(self.drafter, self._tree_graph(hidden, anchor), nodes)
        return _dynamic_tree(self.drafter, self.kv, self.last_hidden, anchor, depth, branch, nodes)

    def _write_anchors(self, ctx, k: int) -> None:
        """The committed positions the target's last forward handed over become anchors
        (their keys join the cache); `last_hidden` is the newest one's output."""
        d = self.drafter
        ids = ctx.token_ids
        if len(ids) + k > self.kv.capacity:  # graphs hold the old cache: eager from here on
            if self.compiled_k is not None:
                log.warning("EAGLE-3 drafter: %d positions outgrow the compiled cache of %d; drafting eagerly",
                            len(ids) + k, self.kv.capacity)
            self.kv = self.kv.grown(2 * (len(ids) + k))
            self._anchor_rows = _AnchorRows(d, self.kv)
            self._chain_graph, self.compiled_k, self._anchor_graph = None, None, None
            self._tree_graph, self.compiled_tree = None, None
        aux = torch.cat([ctx.hidden_states[i] for i in self.hidden_state_layers], dim=-1)  # [1, n, 3H]
        n = aux.shape[1]
        if n:
            first = len(ids) - 1 - n  # anchor positions first .. len(ids) - 2
            device = aux.device
            next_tokens = torch.tensor([ids[first + 1:]], device=device)
            positions = torch.arange(first, len(ids) - 1, device=device)
            rows = self._anchor_rows
            if self._anchor_graph is not None and n <= self.compiled_k + 1:
                rows = self._anchor_graph
                # built for standalone inputs in the drafter's dtype (the target's may differ)
                aux = aux.to(d.fc.weight.dtype, copy=True, memory_format=torch.contiguous_format)
            self.last_hidden = rows(aux, next_tokens, positions)

    @torch.inference_mode()
    def propose(self, ctx, k: int):
        d = self.drafter
        ids = ctx.token_ids
        self._write_anchors(ctx, k)
        if k == 0 or self.last_hidden is None:
            return DraftProposal([])
        hidden = self.last_hidden
        anchor = torch.tensor([len(ids) - 2], device=hidden.device)
        if ctx.sampling.greedy:
            if k == self.compiled_k:  # the graph was built for a standalone [1, 1, H] input
                hidden = hidden.clone(memory_format=torch.contiguous_format)
                tokens, confidence, _ = self._chain_graph(hidden, anchor)
            else:
                tokens, confidence, _ = _greedy_chain(d, self.kv, hidden, anchor, k)
            return DraftProposal(tokens.tolist(), confidence=confidence.tolist())
        chain = _Chain(d, self.kv, anchor)
        tokens, probs = [], []
        for step in range(k):
            logits, chained = d.readout(hidden)
            full = logits.new_full((d.config.vocab_size,), float("-inf"))
            full[d.draft_vocab] = logits[0, -1]
            q = warp_probs(full, ctx.sampling)
            token = int(torch.multinomial(q, 1, generator=ctx.generator))
            probs.append(q)
            tokens.append(token)
            if step == k - 1:
                break
            hidden = chain.step(torch.tensor([[token]], device=hidden.device), chained)
        return DraftProposal(tokens, torch.stack(probs))

    def accept(self, num_accepted: int) -> None:
        pass  # the cache holds committed anchors only
