"""The compiled tree-verify graph (`target_package.TreeVerify`) on the tiny random Llama: its
logits equal the eager tree forward's and transformers' for a hand-built tree padded to the
node budget, greedy tree decoding on it is plain decoding, and a path accepted deep in a
non-first branch leaves the cache a chain forward of that path would have written. Both
ways a graph is built: the AOTInductor package (a CPU's) and `torch.compile` (a GPU's)."""

from __future__ import annotations

import pytest
import torch

from specforge_lite.contract import DraftContext
from specforge_lite.decoding.drafters import MixedTreeDrafter, NgramDrafter
from specforge_lite.decoding.engine import TargetRunner, generate_plain, generate_tree
from specforge_lite.decoding.tree import DraftTree, TreeShape, path_rows, verify_layout
from specforge_lite.decoding.verify import greedy_accept
from specforge_lite.runtime.fast_engine import FastEngine
from tests.unit.test_engine import prompts
from tests.unit.test_tree_engine import BranchyStub

LAYERS = (0, 1, 2)  # embeddings, the first layer, the last (after the final norm)
NODES = 9  # the node budget: one graph of 10 rows


@pytest.fixture(scope="module")
def target(two_layer_target):
    """Two layers: the tree's rules do not depend on depth; its chain package is test_fast_target's."""
    return two_layer_target


@pytest.fixture(scope="module", params=["packaged", "torch_compile"])
def compiled(request, target):
    """A compiled engine with the tree-verify graph, one per way of building it."""
    packaged = request.param == "packaged"
    # torch.compile builds a graph per chain width, and the tree-verify graph is the one under test:
    # width 1 only there (the package serves 1..16 at once, and its one-branch trees run width 4)
    engine = FastEngine(target, capacity=128, hidden_layers=LAYERS, max_width=4 if packaged else 1,
                        compiled=True, packaged=packaged, tree_width=NODES + 1)
    engine.compile()
    assert engine._tree_graph is not None and engine.tree_graph_source in ("compiled", "loaded")
    return engine


@pytest.fixture
def counted(compiled, monkeypatch):
    """The compiled engine, counting the calls of its tree-verify graph."""
    calls = []
    graph = compiled._tree_graph
    monkeypatch.setattr(compiled, "_tree_graph", lambda *args: calls.append(args[0].shape[0]) or graph(*args))
    return compiled, calls


def hand_tree() -> DraftTree:
    """Six nodes (under the budget of nine: four padding rows), three branches at the root."""
    return DraftTree([11, 12, 13, 14, 15, 16], [-1, -1, 0, 2, 1, -1])


def test_tree_graph_equals_eager_and_transformers(target, counted):
    engine, calls = counted
    prompt = prompts(1, seed=2)[0]
    tree = hand_tree()
    positions, mask = verify_layout(tree, len(prompt))
    tokens = [7] + tree.tokens
    outputs = {}
    runners = {"hf": TargetRunner(target, LAYERS), "eager": FastEngine(target, 128, LAYERS).runner(LAYERS),
               "graph": engine.runner(LAYERS)}
    for name, runner in runners.items():
        runner.reset()
        runner.forward(prompt)
        outputs[name] = runner.forward_tree(tokens, positions, mask)
        assert runner.length == len(prompt) + len(tokens)
    assert calls == [NODES + 1]  # padded to the budget
    logits, hidden = outputs["graph"]
    assert logits.shape == (len(tokens), target.config.vocab_size)
    for reference in ("eager", "hf"):
        want_logits, want_hidden = outputs[reference]
        torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-4)
        for layer in LAYERS:
            assert hidden[layer].shape == want_hidden[layer].shape
            torch.testing.assert_close(hidden[layer], want_hidden[layer], atol=2e-5, rtol=1e-4)


def test_greedy_tree_decoding_on_the_graph_is_plain_decoding(target, counted):
    engine, calls = counted
    runner = engine.runner()
    shape = TreeShape(depth=4, branch=3, nodes=NODES)
    for prompt in prompts(4, seed=3):
        plain = generate_plain(target, prompt, 24, runner=TargetRunner(target)).tokens
        stub = BranchyStub(plain + [0] * 8, target.config.vocab_size)
        assert generate_tree(target, stub, prompt, 24, shape, runner=runner).tokens == plain
        repeat = prompt + prompt[:5]  # n-gram matches exist, right or wrong
        plain = generate_plain(target, repeat, 24, runner=TargetRunner(target)).tokens
        for drafter in (NgramDrafter(), MixedTreeDrafter(NgramDrafter(2), NgramDrafter(3))):
            assert generate_tree(target, drafter, repeat, 24, shape, runner=runner).tokens == plain
    assert calls and set(calls) == {NODES + 1}  # branching trees ran the graph, at the budget's width


def test_a_deep_non_first_branch_commits_exactly_its_path(target, counted):
    engine, calls = counted
    prompt = prompts(1, seed=7)[0]
    plain = generate_plain(target, prompt, 6, runner=TargetRunner(target)).tokens
    pending = plain[0]
    # root -> [x, right0 -> [y, right1 -> [z, right2]]]: six nodes, the accepted path through second children
    tree = BranchyStub(plain, target.config.vocab_size).propose_tree(
        DraftContext(token_ids=prompt + [pending], num_prompt_tokens=len(prompt)), 3, 2, 6)
    runner = engine.runner(LAYERS)
    runner.reset()
    runner.forward(prompt)
    positions, mask = verify_layout(tree, len(prompt))
    logits, _ = runner.forward_tree([pending] + tree.tokens, positions, mask)
    assert calls == [NODES + 1]
    path, token = greedy_accept(tree, logits)
    assert path == [1, 3, 5] and token == plain[4]
    runner.keep_rows(len(prompt), path_rows(path))
    kept = len(prompt) + 4
    assert runner.length == kept
    # the cache a chain forward of the same path writes (the eager static forward)
    chain = FastEngine(target, 128, LAYERS)
    chain.runner().reset()
    chain.forward(prompt)
    chain.forward([pending] + [tree.tokens[i] for i in path])
    for got, want in zip(engine.module.layers, chain.module.layers):
        torch.testing.assert_close(got.k_cache[:, :, :kept], want.k_cache[:, :, :kept], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got.v_cache[:, :, :kept], want.v_cache[:, :, :kept], atol=2e-5, rtol=1e-4)
    after, _ = runner.forward([token])  # the next forward reads the compacted cache
    fresh = TargetRunner(target)
    fresh.reset()
    expected, _ = fresh.forward(prompt + plain[:4] + [token])
    torch.testing.assert_close(after[-1], expected[-1], atol=2e-5, rtol=1e-4)


def test_chains_and_trees_past_the_budget_keep_their_forwards(target, counted):
    """An empty or one-branch tree runs the chain graph of its width (no padding); a tree wider
    than the graph, the module eagerly: both agree with transformers."""
    engine, calls = counted
    prompt = prompts(1, seed=4)[0]
    widest = DraftTree.chain(list(range(3, 2 + engine.max_width)))  # the widest chain graph's rows
    for tree in (DraftTree(), widest, DraftTree(list(range(20, 32)), [-1] * 12)):
        positions, mask = verify_layout(tree, len(prompt))
        got_runner, want_runner = engine.runner(), TargetRunner(target)
        for runner in (got_runner, want_runner):
            runner.reset()
            runner.forward(prompt)
        got, _ = got_runner.forward_tree([9] + tree.tokens, positions, mask)
        want, _ = want_runner.forward_tree([9] + tree.tokens, positions, mask)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert calls == []
