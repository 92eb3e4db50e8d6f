"""Suffix decoding: drafts from the longest earlier occurrence of the context's suffix, in the request
itself and in a corpus of the target's own earlier answers (the samples the sample stage wrote).

Where n-gram lookup proposes what followed the latest match of at most a few tokens, suffix
decoding matches as long a suffix as it can (up to `max_depth` tokens) and, among all the places
that suffix occurred, follows the most frequent continuation token by token: each token's
probability is its share of the continuations still matching, and the draft stops where the
product of those shares falls below `min_prob` or at `eval.suffix.factor` times the match's length (a long
match earns a long draft). The score of a draft is the sum of those running products, the
number of its tokens the target is expected to keep; between the request's own draft and the
corpus's the higher score wins. (Suffix decoding as Arctic Inference describes it: a per-request
tree and a global one, the draft length adapted to the match; written here over sorted suffixes
and an incremental n-gram index instead of explicit trees.)
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from specforge_lite.contract import DraftContext, DraftProposal
from specforge_lite.decoding.request_index import RequestIndex
from specforge_lite.decoding.tree import DraftTree

log = logging.getLogger(__name__)

SEPARATOR = -1  # between corpus sequences: never matched, never drafted


@dataclass(frozen=True)
class SuffixDraft:
    """A draft, the length of the match it grew from and its score (expected tokens kept)."""

    tokens: list[int]
    match_len: int = 0
    score: float = 0.0
    source: str = "none"


def most_frequent_continuation(array: np.ndarray, starts: np.ndarray, k: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation, token by token, from the corpus positions `starts` (the
    index of the token after each occurrence of the match): (tokens, score = sum of the running
    products of each token's share of the continuations still matching)."""
    tokens, cumulative, score = [], 1.0, 0.0
    for _ in range(k):
        starts = starts[starts < len(array)]
        following = array[starts]
        following = following[following != SEPARATOR]
        if not len(following):
            break
        values, counts = np.unique(following, return_counts=True)
        best = int(np.argmax(counts))
        cumulative *= counts[best] / len(following)
        if cumulative < min_prob:
            break
        token = int(values[best])
        tokens.append(token)
        score += cumulative
        starts = starts[array[starts] == token] + 1
    return tokens, score


def most_frequent_tree(array: np.ndarray, starts: np.ndarray, depth: int, branch: int, nodes: int,
                min_prob: float) -> tuple[DraftTree, float]:
    """The continuations from `starts` as a deterministic draft tree grown best first: of the
    candidate nodes, the one of highest running product (its share of the continuations times
    its parent's product) joins the tree next and offers its own `branch` most frequent next
    tokens as candidates, down to `min_prob`; at most `nodes` nodes and `depth` levels. Returns
    (tree, score = sum of the nodes' products: the tokens the target is expected to keep)."""
    tree, score, order, candidates = DraftTree(), 0.0, itertools.count(), []

    def offer(parent: int, product: float, level: int, where: np.ndarray) -> None:
        if level == depth:
            return
        where = where[where < len(array)]
        following = array[where]
        kept = following != SEPARATOR
        following, where = following[kept], where[kept]
        if not len(following):
            return
        values, counts = np.unique(following, return_counts=True)
        for i in np.argsort(-counts, kind="stable")[:branch]:
            share = product * counts[i] / len(following)
            if share < min_prob:
                break
            heapq.heappush(candidates, (-share, next(order), parent, int(values[i]), level + 1,
                                        where[following == values[i]] + 1))

    offer(-1, 1.0, 0, starts)
    while candidates and len(tree) < nodes:
        negative, _, parent, token, level, where = heapq.heappop(candidates)
        tree.tokens.append(token)
        tree.parents.append(parent)
        score -= negative
        offer(len(tree) - 1, -negative, level, where)
    return tree, score


def draft_length(match_len: int, k: int, draft_per_match: float) -> int:
    """`draft_per_match` draft tokens per matched token (`eval.suffix.factor`, Arctic's max_spec_factor), 1..k."""
    return max(1, min(k, math.ceil(draft_per_match * match_len)))


def grown_at_longest_match(index, context: Sequence[int], grow):
    """`grow(match length, the positions after each occurrence)` -> (draft, score) at the longest
    match of `context`'s suffix in `index` (a `CorpusIndex` or a `request_index.RequestIndex`)
    where it grows a non-empty draft: (match length, draft, score), or None."""
    for length, continuations in index.matches(context):
        grown, score = grow(length, np.asarray(continuations, dtype=np.int64))
        if len(grown):
            return length, grown, score
    return None


class CorpusIndex:
    """Sorted suffixes (their first `max_depth` tokens) of a corpus of token sequences: the longest
    suffix of a context found in it and where it occurred, by binary search."""

    def __init__(self, sequences: Iterable[Sequence[int]], max_depth: int = 16):
        flat: list[int] = []
        for seq in sequences:
            flat.extend(int(t) for t in seq)
            flat.append(SEPARATOR)
        self.array = np.asarray(flat, dtype=np.int64)
        self.max_depth = max_depth
        n = len(self.array)
        padded = np.concatenate([self.array, np.full(max_depth, SEPARATOR, dtype=np.int64)])
        heads = np.stack([padded[d:d + n] for d in range(max_depth)], axis=1)  # each suffix's first tokens
        starts = np.nonzero(self.array != SEPARATOR)[0]
        order = np.lexsort(heads[starts].T[::-1]) if len(starts) else starts
        self.starts = starts[order]  # suffix start positions, in lexicographic order of their heads
        self.keys = [tuple(row) for row in heads[self.starts].tolist()]

    @property
    def num_tokens(self) -> int:
        return int((self.array != SEPARATOR).sum())

    def occurrences(self, pattern: Sequence[int]) -> np.ndarray:
        """Start positions of `pattern` (at most max_depth tokens) in the corpus."""
        key = tuple(int(t) for t in pattern)
        lo = bisect.bisect_left(self.keys, key)
        hi = bisect.bisect_left(self.keys, key + (math.inf,))
        return self.starts[lo:hi]

    def matches(self, context: Sequence[int]):
        """(length, the positions after each occurrence) of the context's suffixes found in the
        corpus, longest first (at most max_depth tokens)."""
        for length in range(min(self.max_depth, len(context)), 0, -1):
            starts = self.occurrences(context[-length:])
            if len(starts):
                yield length, starts + length


class SuffixDrafter:
    """`suffix`: the better-scoring of the request's own draft and the corpus's (the target's
    earlier answers; an empty corpus drafts from the request alone). Deterministic (no q)."""

    name = "suffix"
    hidden_state_layers: tuple[int, ...] = ()
    sequential = False

    def __init__(self, corpus: CorpusIndex | None = None, max_depth: int = 16, draft_per_match: float = 1.0,
                 min_prob: float = 0.1):
        self.corpus, self.max_depth, self.draft_per_match, self.min_prob = corpus, max_depth, draft_per_match, min_prob
        self.last = SuffixDraft([])
        self.reset()

    def reset(self) -> None:
        self.request = RequestIndex(self.max_depth)

    def _sources(self, ctx: DraftContext):
        """(name, index, its tokens) of the request (indexed up to `ctx`) and the corpus."""
        self.request.extend(ctx.token_ids)
        yield "request", self.request, self.request.array
        if self.corpus is not None:
            yield "corpus", self.corpus, self.corpus.array

    def best(self, ctx: DraftContext, k: int) -> SuffixDraft:
        """The draft `propose` would make, with its match length, score and source."""
        drafts = [SuffixDraft([])]
        for source, index, array in self._sources(ctx) if k else ():
            def chain(length, continuations):
                return most_frequent_continuation(array, continuations, draft_length(length, k, self.draft_per_match),
                                                  self.min_prob)
            if found := grown_at_longest_match(index, ctx.token_ids, chain):
                drafts.append(SuffixDraft(found[1], found[0], found[2], source))
        return max(drafts[1:] or drafts, key=lambda d: (d.score, len(d.tokens)))

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        self.last = self.best(ctx, k)
        return DraftProposal(self.last.tokens[:k])

    def propose_tree(self, ctx: DraftContext, depth: int, branch: int, nodes: int) -> DraftTree:
        """`suffix_tree`: each source's counts grown into a tree from its longest match with a
        continuation (`most_frequent_tree`); the higher-scoring source's tree first, the other's nodes
        beside it while the budget lasts."""
        grown = []
        for _, index, array in self._sources(ctx) if depth else ():
            def tree(length, continuations):
                return most_frequent_tree(array, continuations, draft_length(length, depth, self.draft_per_match),
                                          branch, nodes, self.min_prob)
            if found := grown_at_longest_match(index, ctx.token_ids, tree):
                grown.append((found[2], found[1]))
        if not grown:
            return DraftTree()
        grown.sort(key=lambda g: -g[0])
        tree = grown[0][1]
        for _, other in grown[1:]:
            tree = tree.merged(other, nodes)
        return tree

    def accept(self, num_accepted: int) -> None:
        pass  # the index follows the committed tokens


def lookup_factory(scfg, answers: list[list[int]] | None) -> Callable[..., SuffixDrafter]:
    """New `suffix` drafters with `eval.suffix`'s settings (`scfg`), one per method that drafts with
    lookup, over one corpus of the target's `answers` indexed once (none: each request alone);
    `make("arctic_suffix")`: Arctic Inference's own cache over the same answers and settings."""
    corpus = CorpusIndex(answers, scfg.max_depth) if answers else None
    log.info("suffix decoding: %s", f"each request and {corpus.num_tokens} tokens of the target's sampled answers"
             if corpus else "each request's own tokens (no samples of this target)")

    def make(kind: str = "suffix"):
        if kind == "arctic_suffix":
            from specforge_lite.decoding.arctic import ArcticSuffixDrafter

            return ArcticSuffixDrafter(answers or None, scfg.max_depth, scfg.factor, scfg.min_prob)
        return SuffixDrafter(corpus, scfg.max_depth, scfg.factor, scfg.min_prob)
    return make
