"""Trees from the parallel drafters (P-EAGLE, DFlash, Medusa): the best-paths construction
over independent per-position log-probabilities (`tree_from_position_logprobs`) on a hand-built
example and against a brute-force search; greedy identity with plain decoding through
`generate_tree`, accepted paths through non-first branches included; each drafter's state
after a tree step equal to a fresh drafter's fed the same committed tokens; a chi-square on
a vocab-8 target for P-EAGLE's sampled trees; the tree methods open at the door."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite.drafters.methods import method_problems, tree_methods
from specforge_lite.contract import DraftContext
from specforge_lite.decoding import verify as verifier
from specforge_lite.decoding.drafters import MixedTreeDrafter, NgramDrafter, can_branch
from specforge_lite.decoding.engine import TargetRunner, generate_plain, generate_speculative, generate_tree
from specforge_lite.decoding.tree import DraftTree, TreeShape, tree_from_position_logprobs
from specforge_lite.decoding.verify import SamplingParams
from specforge_lite.drafters import dflash, medusa, peagle
from tests.unit import test_dflash, test_medusa, test_peagle
from tests.unit.test_engine import prompts
from tests.conftest import assert_same_law, tokens_2_3_law


# --------------------------------------------------------------------------- the construction

# position 1: a 0.55, b 0.35; position 2: 1 0.5, 2 0.4; position 3: 0 0.9, 1 0.05 (vocab 4, branch 2)
HAND = torch.tensor([[0.55, 0.35, 0.05, 0.05], [0.05, 0.5, 0.4, 0.05], [0.9, 0.05, 0.03, 0.02]]).log()


def test_best_paths_by_hand():
    # path probabilities: 0 .55, 1 .35, 0-1 .275, 0-1-0 .2475, 0-2 .22, 0-2-0 .198, 1-1 .175, 1-2 .14
    tree = tree_from_position_logprobs(HAND, branch=2, nodes=7)
    assert tree.tokens == [0, 1, 1, 0, 2, 0, 1]
    assert tree.parents == [-1, -1, 0, 2, 0, 4, 1]
    assert tree.probs is None
    assert [round(math.exp(s), 4) for s in tree.scores] == [0.55, 0.35, 0.275, 0.2475, 0.22, 0.198, 0.175]
    assert [tree.tokens[i] for i in tree.path_to(3)] == HAND.argmax(-1).tolist()  # the chain
    assert tree.children(0) == [2, 4] and tree.children(-1) == [0, 1]  # best child first
    # a budget of 5 drops the two weakest; a budget of the depth keeps the chain, although the
    # root's second child (.35) outscores the chain's last two nodes
    five = tree_from_position_logprobs(HAND, branch=2, nodes=5)
    assert five.tokens == tree.tokens[:5] and five.parents == tree.parents[:5]
    three = tree_from_position_logprobs(HAND, branch=2, nodes=3)
    assert three.tokens == [0, 1, 0] and three.parents == [-1, 0, 1]
    # one branch is the chain; a token map renames the columns; no depth, no tree
    assert tree_from_position_logprobs(HAND, 1, 9).tokens == [0, 1, 0]
    assert tree_from_position_logprobs(HAND, 2, 3, torch.tensor([10, 11, 12, 13])).tokens == [10, 11, 10]
    assert len(tree_from_position_logprobs(HAND[:0], 2, 3)) == 0


@pytest.mark.parametrize("seed", range(4))
def test_best_paths_against_brute_force(seed):
    """Against every node of the full branch-ary tree: the chain is in, each node's parent came
    before it, scores are cumulative and sorted, and no node left out (whose parent is in)
    outscores a node taken beside the chain."""
    gen = torch.Generator().manual_seed(seed)
    depth, branch, nodes = 4, 3, 11
    logprobs = torch.log_softmax(torch.randn(depth, 20, generator=gen) * 2, dim=-1)
    tree = tree_from_position_logprobs(logprobs, branch, nodes)
    assert len(tree) == nodes and max(tree.depths()) == depth
    assert all(parent < i for i, parent in enumerate(tree.parents))
    assert tree.scores == sorted(tree.scores, reverse=True)
    top = logprobs.topk(branch, dim=-1).indices.tolist()
    paths = [tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(len(tree))]
    for path, score in zip(paths, tree.scores):
        assert path[-1] in top[len(path) - 1]
        assert score == pytest.approx(sum(float(logprobs[j, t]) for j, t in enumerate(path)), abs=1e-5)
    chain = tuple(logprobs.argmax(-1).tolist())
    assert all(chain[:j] in paths for j in range(1, depth + 1)) and paths[0] == chain[:1]
    taken = set(paths)
    weakest = min(s for p, s in zip(paths, tree.scores) if p != chain[:len(p)])
    for j in range(depth):  # every candidate whose parent is in the tree
        for parent in [()] + [p for p in paths if len(p) == j]:
            if len(parent) != j:
                continue
            for t in top[j]:
                child = parent + (t,)
                if child not in taken:
                    assert sum(float(logprobs[i, c]) for i, c in enumerate(child)) <= weakest + 1e-6


# --------------------------------------------------------------------------- the drafters

# full draft vocabularies: the tiny target's greedy tokens mostly lie outside the 64 most frequent ids
def peagle_decoder(tiny_target):
    vocab = tiny_target[0].config.vocab_size
    return peagle.decoder(test_peagle.tiny_drafter(tiny_target, randomise=0.02, draft_vocab_size=vocab))


def dflash_decoder(tiny_target):
    vocab = tiny_target[0].config.vocab_size
    return dflash.decoder(test_dflash.tiny_drafter(tiny_target, draft_vocab_size=vocab))


def medusa_decoder(tiny_target):
    return medusa.decoder(test_medusa.build(tiny_target, heads=3))


DECODERS = {"peagle": peagle_decoder, "dflash": dflash_decoder, "medusa": medusa_decoder}


def off_first_branch(tree: DraftTree, path: list[int]) -> bool:
    """Whether the accepted path leaves the first child somewhere (a sibling of it was first)."""
    return any(tree.children(tree.parents[node])[0] != node for node in path)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_trees_are_plain_decoding(tiny_target, name, monkeypatch):
    model = tiny_target[0]
    drafter = DECODERS[name](tiny_target)
    assert can_branch(drafter)
    real, off_first = verifier.greedy_accept, []

    def recording(tree, logits):
        path, token = real(tree, logits)
        off_first.append(off_first_branch(tree, path))
        return path, token
    monkeypatch.setattr(verifier, "greedy_accept", recording)
    for i, prompt in enumerate(prompts(4, seed=11)):
        plain = generate_plain(model, prompt, 20).tokens
        chain = generate_speculative(model, drafter, prompt, 20, 3)
        assert chain.tokens == plain
        for shape in (TreeShape(3, 2, 6), TreeShape(3, 4, 5)):  # 4 + 16 + 64 nodes pruned to 5
            tree = generate_tree(model, drafter, prompt, 20, shape)
            assert tree.tokens == plain and max(tree.draft_lengths) <= shape.nodes
        if i < 2:
            mixed = generate_tree(model, MixedTreeDrafter(drafter, NgramDrafter()), prompt, 20, TreeShape(3, 2, 6))
            assert mixed.tokens == plain
            one = generate_tree(model, drafter, prompt, 20, TreeShape(3, 1, 3))
            assert one.accepted_lengths == chain.accepted_lengths  # a one-branch tree drafts the chain
    assert any(off_first), f"{name}: no accepted path left the first branch; the check proves nothing"


class Reference:
    """Beside the drafter under test, a fresh drafter of the same weights fed the whole committed
    context at once (the target's hidden states of every committed position, as after a prefill):
    its tree must be the tree the incrementally fed drafter proposes after any accepted path."""

    def __init__(self, drafter, fresh, target):
        self.drafter, self.fresh, self.target = drafter, fresh, target
        self.name, self.hidden_state_layers = drafter.name, drafter.hidden_state_layers
        self.sequential, self.compared = drafter.sequential, 0

    def reset(self):
        self.drafter.reset()

    def propose_tree(self, ctx, depth, branch, nodes):
        tree = self.drafter.propose_tree(ctx, depth, branch, nodes)
        runner = TargetRunner(self.target, self.hidden_state_layers)
        runner.reset()
        _, hidden = runner.forward(ctx.token_ids[:-1])
        self.fresh.reset()
        again = self.fresh.propose_tree(DraftContext(ctx.token_ids, ctx.num_prompt_tokens, hidden), depth, branch,
                                        nodes)
        assert (tree.tokens, tree.parents) == (again.tokens, again.parents)
        torch.testing.assert_close(torch.tensor(tree.scores or []), torch.tensor(again.scores or []), atol=1e-4,
                                   rtol=1e-4)
        self.compared += len(ctx.token_ids) > ctx.num_prompt_tokens + 1  # after a step
        return tree

    def accept(self, num_accepted):
        self.drafter.accept(num_accepted)


@pytest.mark.parametrize("name", ["peagle", "dflash", "medusa"])
def test_a_tree_step_leaves_the_drafter_as_a_chain_of_its_path_would(tiny_target, name):
    model = tiny_target[0]
    drafter = Reference(DECODERS[name](tiny_target), DECODERS[name](tiny_target), model)
    for prompt in prompts(2, seed=13):
        plain = generate_plain(model, prompt, 16).tokens
        assert generate_tree(model, drafter, prompt, 16, TreeShape(3, 3, 7)).tokens == plain
    assert drafter.compared > 4


def test_trees_keep_to_each_drafters_depth(tiny_target):
    """P-EAGLE drafts as deep as its trained depths, DFlash block_size - 1, Medusa its heads."""
    ids = prompts(1, seed=2)[0]
    runner = TargetRunner(tiny_target[0], (1, 3, 4, -1))
    runner.reset()
    _, hidden = runner.forward(ids)
    ctx = DraftContext(ids + [7], len(ids), hidden)
    for name, most in (("peagle", 4), ("dflash", 3), ("medusa", 3)):
        tree = DECODERS[name](tiny_target).propose_tree(ctx, 6, 2, 40)
        assert max(tree.depths()) == most and len(tree) == 2 ** (most + 1) - 2, name
        assert len(DECODERS[name](tiny_target).propose_tree(ctx, 0, 2, 40)) == 0


# --------------------------------------------------------------------------- sampling law

def test_sampled_peagle_trees_keep_the_target_law():
    """Tokens 2 and 3 (the first tree step: depth 2, two children a node) of the real engine with
    a P-EAGLE drafter on a vocab-8 target: chi-square against the target's exact law."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                         initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(config).eval()
    cfg = test_peagle.options(draft_vocab_size=8, aux_layer_ids=[0, 1, 2], mask_token_id=7)
    draft = peagle.build(cfg, target, torch.ones(8))
    with torch.no_grad():
        for layer in draft.layers:
            layer.self_attn.o_proj.weight.normal_(0, 0.3)
        draft.mask_hidden.normal_(0, 1.0)
    sampling, prompt, vocab = SamplingParams(0.8, 0.95), [1, 2, 3], 8
    exact = tokens_2_3_law(target, prompt, sampling, vocab)
    gen = torch.Generator().manual_seed(0)
    drafter = peagle.decoder(draft)
    n, shape, deep = 800, TreeShape(2, 2, 4), 0
    counts: Counter = Counter()
    for _ in range(n):
        out = generate_tree(target, drafter, prompt, 4, shape, sampling, (), gen)
        counts[tuple(out.tokens[1:3])] += 1
        deep += out.accepted_lengths[0] == 2
    assert_same_law(counts, exact, n)
    assert sum(counts.values()) == n and len(counts) > 10 and deep > 0  # whole paths were accepted too


# --------------------------------------------------------------------------- the door

def test_the_parallel_drafters_tree_methods_are_offered():
    trees = set(tree_methods())
    methods = [f"{name}{kind}" for name in ("peagle", "dflash", "medusa") for kind in ("_tree", "_mixed_tree")]
    assert set(methods) <= trees and "distilled_tree" not in trees
    eval_cfg = OmegaConf.create({"methods": ["plain", *methods], "tree": {"depth": 5, "branch": 4, "nodes": 8},
                                 "best_k_method": None, "extra_drafters": []})
    assert method_problems(eval_cfg) == []
