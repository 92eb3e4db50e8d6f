"""Draft-tree math (`decoding/tree.py`): the verify layout against a tree built by hand,
greedy acceptance deep in a non-first branch, and a chi-square check that the
multi-candidate rejection rule keeps the target's law (and catches a wrong rule)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specforge_lite.decoding.tree import DraftTree, ancestor_mask, path_rows, verify_layout
from specforge_lite.decoding.verify import SamplingParams, greedy_accept, sample_accept
from tests.unit.test_verify import V, ToyLM, chi_square, exact_first_two

# root -> a(0) -> c(2) -> e(4)
#      -> b(1) -> d(3) -> f(5)
#              -> g(6)
HAND_TREE = DraftTree(tokens=[10, 11, 12, 13, 14, 15, 16], parents=[-1, -1, 0, 1, 2, 3, 1])


def test_layout_matches_a_tree_built_by_hand():
    positions, mask = verify_layout(HAND_TREE, context=5)
    assert positions.tolist() == [5, 6, 6, 7, 7, 8, 8, 7]
    rows = {  # row -> the tree rows it sees (0 = root, 1 + i = node i)
        0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 1, 3, 5], 6: [0, 2, 4, 6], 7: [0, 2, 7],
    }
    expected = torch.zeros(8, 5 + 8, dtype=torch.bool)
    expected[:, :5] = True
    for row, seen in rows.items():
        expected[row, [5 + s for s in seen]] = True
    assert torch.equal(mask, expected)
    assert torch.equal(ancestor_mask(HAND_TREE.parents), expected[:, 5:])


def test_a_chain_is_the_causal_layout():
    positions, mask = verify_layout(DraftTree.chain([7, 8, 9]), context=2)
    assert positions.tolist() == [2, 3, 4, 5]
    assert torch.equal(mask, torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2))


def test_bad_parents_are_refused():
    with pytest.raises(ValueError, match="parents must come first"):
        DraftTree([1, 2], [1, -1])
    with pytest.raises(ValueError, match="one parent per token"):
        DraftTree([1, 2], [-1])


def logits_choosing(choices: dict[int, int], rows: int = 8, vocab: int = 32) -> torch.Tensor:
    logits = torch.zeros(rows, vocab)
    for row, token in choices.items():
        logits[row, token] = 1.0
    return logits


def test_greedy_accepts_deep_in_a_non_first_branch():
    # the target picks b (11), then d (13), then f (15), then 20 after f
    logits = logits_choosing({0: 11, 2: 13, 4: 15, 6: 20})
    path, token = greedy_accept(HAND_TREE, logits)
    assert path == [1, 3, 5] and token == 20
    assert path_rows(path) == [0, 2, 4, 6]
    assert [HAND_TREE.tokens[i] for i in path] == [11, 13, 15]


def test_greedy_stops_at_the_first_miss_and_takes_the_target_token():
    logits = logits_choosing({0: 11, 2: 30})  # b accepted; neither d nor g is the target's choice
    assert greedy_accept(HAND_TREE, logits) == ([1], 30)
    assert greedy_accept(HAND_TREE, logits_choosing({0: 3})) == ([], 3)
    assert greedy_accept(DraftTree(), logits_choosing({0: 4}, rows=1)) == ([], 4)


def test_trie_insertion_merging_and_vllm_paths():
    tree = DraftTree.chain([1, 2, 3])
    assert tree.add_path([1, 2, 4]) == 1 and tree.parents == [-1, 0, 1, 1]
    assert tree.add_path([5, 6], budget=5) == 1 and tree.tokens == [1, 2, 3, 4, 5]
    merged = DraftTree.chain([1, 9]).merged(tree, budget=4)
    assert merged.tokens == [1, 9, 2, 3] and merged.parents == [-1, 0, 0, 2]
    assert HAND_TREE.node_paths() == [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0), (1, 1)]


# --------------------------------------------------------------------------- sampling law

def tree_of(ctx: tuple, draft: ToyLM | None, depth: int, branch: int, gen, iid: bool) -> DraftTree:
    """A full `branch`-ary draft tree of `depth` below ctx: children drawn independently
    from the draft law (iid) or its top-`branch` tokens (point masses); draft None = the
    tokens 0..branch-1 at every node (n-gram-like)."""
    tree = DraftTree(probs=None)
    probs, frontier = [], [(-1, ())]
    for _ in range(depth):
        nxt = []
        for parent, path in frontier:
            if draft is None:
                kids, q = list(range(branch)), None
            else:
                q = draft.probs(ctx + path)
                kids = (torch.multinomial(q, branch, replacement=True, generator=gen).tolist() if iid
                        else q.topk(branch).indices.tolist())
            for token in kids:
                tree.tokens.append(token)
                tree.parents.append(parent)
                probs.append(q)
                nxt.append((len(tree.tokens) - 1, path + (token,)))
        frontier = nxt
    if iid:
        tree.probs = torch.stack(probs)
    return tree


def first_two_tokens(target: ToyLM, draft: ToyLM | None, accept, gen, iid: bool, context=(0,)):
    out: list[int] = []
    while len(out) < 2:
        ctx = context + tuple(out)
        tree = tree_of(ctx, draft, depth=2, branch=2, gen=gen, iid=iid)
        rows = [ctx] + [ctx + tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(len(tree))]
        p = torch.stack([target.probs(r) for r in rows])
        path, token = accept(tree, p, gen)
        out += [tree.tokens[i] for i in path] + [token]
    return out[0], out[1]


def wrong_accept_without_residual(tree, p, gen):
    """A bug: every child is tried against the untouched p (no residual after a rejection)."""
    path, node = [], -1
    while True:
        law = p[node + 1]
        for child in tree.children(node):
            q = tree.probs[child] if tree.probs is not None else None
            x = tree.tokens[child]
            if float(torch.rand(1, generator=gen)) * (float(q[x]) if q is not None else 1.0) < float(law[x]):
                path.append(child)
                node = child
                break
        else:
            return path, int(torch.multinomial(law, 1, generator=gen))


CASES = {
    "top-b children": (SamplingParams(1.0), False, "draft"),
    "iid children": (SamplingParams(1.0), True, "draft"),
    "iid children, T=0.9, top_p=0.9": (SamplingParams(0.9, 0.9), True, "draft"),
    "fixed children (n-gram-like)": (SamplingParams(1.0), False, None),
}


@pytest.mark.parametrize("case", CASES)
def test_multi_candidate_rule_keeps_the_target_law(case):
    sampling, iid, drafter = CASES[case]
    target = ToyLM(11, 2.0, sampling)
    draft = ToyLM(12, 2.0, sampling) if drafter else None
    gen = torch.Generator().manual_seed(5)
    n = 12000
    counts = Counter(first_two_tokens(target, draft, sample_accept, gen, iid) for _ in range(n))
    stat, critical = chi_square(counts, exact_first_two(target), n)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: the tree's output law is not the target's"


@pytest.mark.parametrize("iid", [False, True])
def test_chi_square_catches_a_rule_without_residual(iid):
    sampling = SamplingParams(1.0)
    target, draft = ToyLM(11, 2.0, sampling), ToyLM(12, 2.0, sampling)
    gen = torch.Generator().manual_seed(5)
    n = 12000
    counts = Counter(first_two_tokens(target, draft, wrong_accept_without_residual, gen, iid) for _ in range(n))
    stat, critical = chi_square(counts, exact_first_two(target), n)
    assert stat > critical, f"the wrong rule went unnoticed (chi-square {stat:.1f} < {critical:.1f}, V={V})"


def test_a_rejected_point_mass_that_held_all_the_mass_leaves_the_law_whole(monkeypatch):
    """A target row whose whole (float-rounded, short of 1) mass sits on the drafted token x can
    still reject x (u * 1 >= p(x)); the residual is then empty, and the next token is drawn from
    the row as it was, not from a row the rejection zeroed in place (which raised)."""
    x, vocab = 3, 8
    target = torch.zeros(2, vocab)
    target[0, x] = 0.9999  # every other token 0: a rounded one-hot
    tree = DraftTree(tokens=[x], parents=[-1])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([0.99995]))
    path, token = sample_accept(tree, target)
    assert path == [] and token == x
