"""Draft trees: their shape and their flattening into one verify forward, as pure functions
(EAGLE-2, SpecInfer). What the target accepts of a tree is decided in `verify.py`.

A tree hangs below the pending token (the root: chosen by the target, not yet fed). Its N
nodes are numbered in topological order (a parent before its children); node i holds
`tokens[i]` and `parents[i]`, the index of its parent node or -1 for a child of the root.
A chain of k drafts is the tree whose node i has parent i - 1.

The verify forward feeds the root and the nodes as one row of N + 1 tokens: row 0 is the
root, row 1 + i node i. Row r sits at position context + depth(r) (the root's depth is 0)
and sees the context, the root and its own ancestors (`verify_layout`). Its logits are the
target's prediction after the path root..r. After acceptance the cache keeps the root and the
accepted path's rows (`path_rows`).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class TreeShape:
    """What a tree drafter may propose per step: paths of at most `depth` drafts, at most
    `branch` children per node, `nodes` nodes in all (EAGLE-2's depth, top-k, budget)."""

    depth: int
    branch: int
    nodes: int

    def __post_init__(self):
        if self.depth < 1 or self.branch < 1:
            raise ValueError(f"a tree needs depth >= 1 and branch >= 1, got depth {self.depth}, branch {self.branch}")
        if self.nodes < self.depth:
            raise ValueError(f"a tree of depth {self.depth} needs at least {self.depth} nodes, got {self.nodes}")


@dataclass
class DraftTree:
    """tokens: [N] draft ids; parents: [N] parent node index (-1 for the root's children),
    parents[i] < i. probs: None (deterministic children: q is a point mass on each) or
    [N, V], row i the law node i was drawn from (shared by its siblings).
    scores: optional [N] what the drafter ranked the nodes by (cumulative log-probability)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    scores: list[float] | None = None

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a tree needs one parent per token: {len(self.tokens)} tokens, "
                             f"{len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first (-1 = root)")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: torch.Tensor | None = None) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs)

    def children(self, node: int) -> list[int]:
        """The children of `node` (-1 = root) in index order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def depths(self) -> list[int]:
        """depth of each node: 1 for the root's children."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def find_child(self, node: int, token: int) -> int | None:
        for i, (parent, t) in enumerate(zip(self.parents, self.tokens)):
            if parent == node and t == token:
                return i
        return None

    def add_path(self, tokens: Sequence[int], budget: int | None = None) -> int:
        """Insert a continuation as a root path, sharing the nodes it already has (a trie);
        stops at `budget` nodes in all. Deterministic trees only. Returns the nodes added."""
        if self.probs is not None:
            raise ValueError("add_path builds deterministic trees (probs None)")
        node, added = -1, 0
        for token in tokens:
            child = self.find_child(node, token)
            if child is None:
                if budget is not None and len(self.tokens) >= budget:
                    break
                self.tokens.append(int(token))
                self.parents.append(node)
                if self.scores is not None:
                    self.scores.append(float("-inf"))
                child, added = len(self.tokens) - 1, added + 1
            node = child
        return added

    def merged(self, other: "DraftTree", budget: int) -> "DraftTree":
        """This tree, then `other`'s nodes (in order, sharing equal prefixes) while the
        budget lasts; a node whose parent did not fit is left out. Deterministic trees."""
        out = DraftTree(list(self.tokens[:budget]), list(self.parents[:budget]))
        where: dict[int, int] = {-1: -1}  # other's node -> out's node
        for i, (token, parent) in enumerate(zip(other.tokens, other.parents)):
            if parent not in where:
                continue
            child = out.find_child(where[parent], token)
            if child is None:
                if len(out) >= budget:
                    continue
                out.tokens.append(int(token))
                out.parents.append(where[parent])
                child = len(out) - 1
            where[i] = child
        return out

    def after_chain(self, chain: Sequence[int], budget: int) -> "DraftTree":
        """A mixed tree: `chain` (a lookup's match) first, then this tree's nodes beside it while
        the budget lasts (`merged`); this tree itself where the chain is empty."""
        return DraftTree.chain(chain).merged(self, budget) if chain else self

    def node_paths(self) -> list[tuple[int, ...]]:
        """vLLM's `speculative_token_tree` form: each node as the child ranks along its path."""
        rank = [len([j for j in range(i) if self.parents[j] == p]) for i, p in enumerate(self.parents)]
        return [tuple(rank[j] for j in self.path_to(i)) for i in range(len(self))]


def tree_from_position_logprobs(logprobs: torch.Tensor, branch: int, nodes: int,
                                token_map: torch.Tensor | None = None) -> DraftTree:
    """The tree of a parallel drafter (P-EAGLE, DFlash, Medusa), whose law at position j does not
    depend on the tokens drafted before it: node (j, r) is the r-th best token at position j,
    its score the sum of its path's log-probabilities.

    logprobs: [depth, V] log-probabilities per position (row j: drafts at depth j + 1; values
    above 0 count as 0, so a child never outscores its parent).
    The argmax chain (the drafter's greedy chain) always goes in, so greedy decoding never
    accepts less than with the chain; the rest of the `nodes` budget goes to the best-scoring
    nodes below it, each node expanded into its top-`branch` children at the next position.
    Nodes come sorted by score, ties by the order they were taken: a child never outscores its
    parent, so parents come first, and each node's first child is its best one (the first
    root path is the chain). token_map: [V] ids to emit for the columns (a reduced draft
    vocabulary's target ids), or None for the column indices themselves.
    Returns a deterministic DraftTree (probs None) with `scores`."""
    depth = logprobs.shape[0]
    if depth == 0 or nodes < 1:
        return DraftTree(scores=[])
    top, index = logprobs.float().topk(min(branch, logprobs.shape[-1]), dim=-1)
    top, index = top.clamp(max=0.0).tolist(), index.tolist()
    taken: list[tuple[float, int, int, int]] = []  # (score, position, rank, parent: index in taken)
    frontier: list[tuple[float, int, int, int, int]] = []  # heap of (-score, pushed, position, rank, parent)
    pushed = itertools.count()  # equal scores leave the heap in the order they entered

    def take(score: float, position: int, rank: int, parent: int, chain: bool) -> None:
        taken.append((score, position, rank, parent))
        if position + 1 < depth:  # its children, less the chain's own (taken already)
            for child_rank in range(1 if chain else 0, len(top[position + 1])):
                heapq.heappush(frontier, (-(score + top[position + 1][child_rank]), next(pushed),
                                          position + 1, child_rank, len(taken) - 1))

    for rank in range(1, len(top[0])):  # the root's other children
        heapq.heappush(frontier, (-top[0][rank], next(pushed), 0, rank, -1))
    score = 0.0
    for position in range(min(depth, nodes)):  # the argmax chain
        score += top[position][0]
        take(score, position, 0, position - 1, chain=True)
    while frontier and len(taken) < nodes:
        negative, _, position, rank, parent = heapq.heappop(frontier)
        take(-negative, position, rank, parent, chain=False)
    order = sorted(range(len(taken)), key=lambda i: (-taken[i][0], i))
    new = {-1: -1}
    for i in order:
        new[i] = len(new) - 1
    tokens = [index[taken[i][1]][taken[i][2]] for i in order]
    if token_map is not None:
        tokens = token_map[torch.tensor(tokens, dtype=torch.long, device=token_map.device)].tolist()
    return DraftTree(tokens, [new[taken[i][3]] for i in order], scores=[taken[i][0] for i in order])


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool over the root (row 0) and the nodes (row 1 + i): True where the
    column is the row itself or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, parent in enumerate(parents):
        row = 1 + i
        mask[row] = mask[1 + parent] if parent >= 0 else mask[0]
        mask[row, row] = True
    mask[0, 0] = True
    return mask


def verify_layout(tree: DraftTree, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify forward's positions and attention mask, for a cache holding `context`
    committed positions (the root goes at position `context`).

    Returns positions [N + 1] (context + depth, root depth 0) and mask [N + 1, context + N + 1]
    bool: True where row r may attend to cache slot c (slots 0..context-1 the context,
    context + r' the row r' of this forward)."""
    positions = torch.tensor([0] + tree.depths(), dtype=torch.long) + context
    rows = ancestor_mask(tree.parents)
    mask = torch.cat([torch.ones(len(tree) + 1, context, dtype=torch.bool), rows], dim=1)
    return positions, mask


def path_rows(path: Sequence[int]) -> list[int]:
    """The verify rows the accepted path keeps: the root (row 0) and its nodes (1 + i), the
    rows whose keys and values the cache keeps, moved down to contiguous slots."""
    return [0] + [1 + node for node in path]
