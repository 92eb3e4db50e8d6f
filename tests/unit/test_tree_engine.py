"""Tree verification in the engine on the tiny random Llama: greedy identity with plain
decoding for every tree drafter (Hugging Face's forward and the static one), the KV cache
after a path accepted deep in a non-first branch, a planted acceptance bug caught by the
identity check, and EAGLE-3's dynamic tree against its chain."""

from __future__ import annotations

import pytest
import torch

from specforge_lite.contract import DraftContext, DraftProposal
from specforge_lite.decoding import verify as verifier
from specforge_lite.decoding.drafters import MixedTreeDrafter, NgramDrafter
from specforge_lite.decoding.engine import TargetRunner, generate_plain, generate_speculative, generate_tree
from specforge_lite.decoding.tree import DraftTree, TreeShape, verify_layout
from specforge_lite.decoding.verify import SamplingParams
from specforge_lite.runtime.fast_engine import FastEngine
from tests.unit.test_eagle3 import tiny_drafter
from tests.unit.test_engine import prompts


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target[0]


class BranchyStub:
    """A tree whose first branch is always wrong: at each depth the first child is the target's
    token + 1, the second the target's own greedy token (from `reference`) with, below it,
    the same pattern, so every accepted path runs through second children."""

    name = "branchy"
    hidden_state_layers: tuple[int, ...] = ()
    sequential = False

    def __init__(self, reference: list[int], vocab: int):
        self.reference, self.vocab, self.accepted = reference, vocab, []

    def reset(self):
        self.accepted = []

    def propose_tree(self, ctx: DraftContext, depth: int, branch: int, nodes: int) -> DraftTree:
        done = len(ctx.token_ids) - ctx.num_prompt_tokens
        tree, parent = DraftTree(), -1
        for token in self.reference[done:done + depth]:
            if len(tree) + 2 > nodes:
                break
            tree.tokens += [(token + 1) % self.vocab, token]
            tree.parents += [parent, parent]
            parent = len(tree) - 1
        return tree

    def accept(self, num_accepted: int) -> None:
        self.accepted.append(num_accepted)


def runners(target):
    yield "hf", TargetRunner(target)
    yield "static", FastEngine(target, 256).runner()


@pytest.mark.parametrize("which", ["hf", "static"])
def test_greedy_tree_decoding_is_plain_decoding(target, which):
    vocab = target.config.vocab_size
    runner = dict(runners(target))[which]
    shape = TreeShape(depth=4, branch=3, nodes=9)
    for prompt in prompts(4, seed=3):
        plain = generate_plain(target, prompt, 24, runner=runner).tokens
        stub = BranchyStub(plain + [0] * 8, vocab)
        tree = generate_tree(target, stub, prompt, 24, shape, runner=runner)
        assert tree.tokens == plain
        assert max(tree.accepted_lengths) == 4  # whole second-branch paths were kept
        repeat = prompt + prompt[:5]  # n-gram matches exist, right or wrong
        plain = generate_plain(target, repeat, 24, runner=runner).tokens
        for drafter in (NgramDrafter(), MixedTreeDrafter(NgramDrafter(2), NgramDrafter(3))):
            assert generate_tree(target, drafter, repeat, 24, shape, runner=runner).tokens == plain


def test_eagle3_trees_are_lossless_and_branch_one_is_the_chain(tiny_target):
    from specforge_lite.drafters.eagle3.decode import Eagle3DecodeDrafter

    target = tiny_target[0]
    decode = Eagle3DecodeDrafter(tiny_drafter(tiny_target, 64), capacity=128)
    accepted = {"chain": 0, "tree": 0}
    for prompt in prompts(3, seed=5):
        plain = generate_plain(target, prompt, 20).tokens
        chain = generate_speculative(target, decode, prompt, 20, 3)
        assert chain.tokens == plain
        accepted["chain"] += sum(chain.accepted_lengths)
        for drafter in (decode, MixedTreeDrafter(decode, NgramDrafter())):
            tree = generate_tree(target, drafter, prompt, 20, TreeShape(4, 3, 10))
            assert tree.tokens == plain and max(tree.draft_lengths) <= 10
            accepted["tree"] += sum(tree.accepted_lengths)
        same = generate_tree(target, decode, prompt, 20, TreeShape(3, 1, 3))
        assert same.accepted_lengths == chain.accepted_lengths  # a one-branch tree drafts the chain
    assert all(accepted.values()), accepted  # identity with drafts accepted, not only rejected
    # the dynamic tree holds the chain's first two drafts as a root path, its first child first
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (12,)).tolist()
    hidden = {layer: torch.randn(1, 11, 64) for layer in decode.hidden_state_layers}
    ctx = DraftContext(token_ids=ids, num_prompt_tokens=11, hidden_states=hidden)
    drafts = decode.propose(ctx, 2).tokens
    tree = decode.propose_tree(ctx, 3, 4, 4 + 16 + 16)
    assert len(tree) == 36 and max(tree.depths()) == 3 and tree.tokens[0] == drafts[0]
    assert tree.find_child(0, drafts[1]) is not None
    assert tree.scores == sorted(tree.scores, reverse=True)


@pytest.mark.parametrize("which", ["hf", "static"])
def test_a_deep_non_first_branch_commits_exactly_its_path(target, which):
    runner = dict(runners(target))[which]
    prompt = prompts(1, seed=7)[0]
    plain = generate_plain(target, prompt, 6, runner=runner).tokens
    pending, right = plain[0], plain[1:4]
    # root -> [x, right0 -> [y, right1 -> [z, right2]]], wrong siblings first at every depth
    tree = BranchyStub(plain, target.config.vocab_size).propose_tree(
        DraftContext(token_ids=prompt + [pending], num_prompt_tokens=len(prompt)), 3, 2, 6)
    runner.reset()
    runner.forward(prompt)
    positions, mask = verify_layout(tree, len(prompt))
    logits, _ = runner.forward_tree([pending] + tree.tokens, positions, mask)
    path, token = verifier.greedy_accept(tree, logits)
    assert path == [1, 3, 5] and token == plain[4]
    runner.keep_rows(len(prompt), [0, 2, 4, 6])
    assert runner.length == len(prompt) + 4
    after, _ = runner.forward([token])  # the next forward reads the compacted cache
    fresh = TargetRunner(target)
    fresh.reset()
    expected, _ = fresh.forward(prompt + [pending] + right + [token])
    torch.testing.assert_close(after[-1], expected[-1], atol=1e-4, rtol=1e-4)
    if which == "hf":
        for got, want in zip(runner.cache.layers, fresh.cache.layers):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def accept_a_sibling(tree, logits):
    """A planted bug: where the target's choice is among a node's children, accept the first
    child (a sibling the target did not choose)."""
    choices, path, node = logits.argmax(dim=-1).tolist(), [], -1
    while True:
        kids = tree.children(node)
        if not any(tree.tokens[c] == choices[node + 1] for c in kids):
            return path, choices[node + 1]
        path.append(kids[0])
        node = kids[0]


def test_the_identity_check_catches_a_sibling_accepted(target, monkeypatch):
    prompt = prompts(1, seed=3)[0]
    plain = generate_plain(target, prompt, 16).tokens
    stub = BranchyStub(plain + [0] * 8, target.config.vocab_size)
    shape = TreeShape(3, 2, 6)
    assert generate_tree(target, stub, prompt, 16, shape).tokens == plain
    monkeypatch.setattr(verifier, "greedy_accept", accept_a_sibling)
    assert generate_tree(target, stub, prompt, 16, shape).tokens != plain


def test_sampled_tree_decoding_runs_and_stays_in_vocabulary(target):
    prompt = prompts(1, seed=9)[0]
    gen = torch.Generator().manual_seed(0)
    out = generate_tree(target, MixedTreeDrafter(NgramDrafter(), NgramDrafter(1)), prompt + prompt, 24,
                        TreeShape(3, 2, 6), SamplingParams(1.0), generator=gen)
    assert len(out.tokens) == 24 and all(0 <= t < target.config.vocab_size for t in out.tokens)
    assert out.num_forwards == len(out.accepted_lengths) and out.tau >= 1.0


def test_ngram_offers_several_continuations():
    ids = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 1, 2]
    ctx = DraftContext(token_ids=ids, num_prompt_tokens=len(ids))
    ngram = NgramDrafter(max_n=2)
    assert ngram.propose(ctx, 3) == DraftProposal([3, 7, 1])
    tree = ngram.propose_tree(ctx, 2, 3, 8)
    assert tree.tokens == [3, 7, 4, 8, 9] and tree.parents == [-1, 0, -1, 2, 0]
    assert NgramDrafter(max_n=2, prefer="first").propose_tree(ctx, 2, 2, 8).tokens == [3, 9, 4, 8]
