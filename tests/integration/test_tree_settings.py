"""`eval.tree` and the tree methods at the door: a bad shape, a node budget below the depth or
over the target's context, a tree for a method that cannot branch and tree methods without a
tree are each refused with one line and exit status 2, before anything is written."""

from __future__ import annotations

import pytest

from specforge_lite.drafters.methods import chain_methods, known, tree_base, tree_methods
from tests.integration.test_bad_inputs import assert_user_error, cli, written

TREES = ["eval.methods=[plain,ngram,ngram_tree]", "eval.best_k_method=ngram"]

CASES = [
    (["eval.tree.depth=0"], "eval.tree.depth=0: must be >= 1"),
    (["eval.tree.branch=0"], "eval.tree.branch=0: must be >= 1"),
    (["eval.tree.depth=6", "eval.tree.nodes=4"],
     "eval.tree.nodes=4 is below eval.tree.depth=6: a tree of depth 6 needs at least 6 nodes"),
    # the tiny Llama's context is 2048 positions: a budget that far is refused by its own bound first
    # (a small context: test_a_tree_and_an_answer_over_a_small_context_are_refused)
    (["eval.tree.nodes=2047"], "eval.tree.nodes=2047: must be <= 64"),
    (["eval.methods=[plain,distilled,distilled_tree]", "eval.best_k_method=distilled"],
     "eval.methods: distilled_tree: distilled drafts chains only (cannot branch); the tree methods are ngram_tree"),
    (["eval.tree=null"], "has tree methods but eval.tree is null"),
    (["eval.methods=[plain,ngram_mixed_tree]", "eval.best_k_method=null"],
     "eval.methods: ngram_mixed_tree: ngram's trees are ngram_tree (a mixed tree joins"),
    (["eval.methods=[plain,suffix,suffix_mixed_tree]", "eval.best_k_method=null"],
     "eval.methods: suffix_mixed_tree: suffix's trees are suffix_tree"),
    # a serving engine's method is not shaped by eval.tree (it passed the door and failed later: issue 65)
    (["eval.methods=[plain,vllm_eagle3_tree]", "eval.best_k_method=null"],
     "eval.methods: vllm_eagle3_tree: vllm_eagle3 runs in another engine, which eval.tree does not shape"),
    (["eval.methods=[plain,llamacpp_ngram_tree]", "eval.best_k_method=null"],
     "eval.methods: llamacpp_ngram_tree: llamacpp_ngram runs in another engine"),
    # work bounded at the door (issue 52: a tree of 1000 / 1000 / 1000 passed and made no progress,
    # timing a target forward at every width up to 1001)
    (["eval.tree.depth=1000", "eval.tree.branch=1000", "eval.tree.nodes=1000"],
     "eval.tree.nodes=1000: must be <= 64 (the drafts one step verifies"),
    (["eval.tree.branch=9"], "eval.tree.branch=9 is above eval.tree.nodes=8: no node of a tree of 8 nodes has more "
                             "children, so give at most 8"),
    (["eval.num_draft_tokens=65"], "eval.num_draft_tokens=65: must be <= 64"),
    # a tree's own k: it was told it drafts eval.num_draft_tokens (issue 65's battery)
    (["eval.method_draft_tokens=[ngram_tree:2]"], "eval.method_draft_tokens: 'ngram_tree:2': 'ngram_tree' is a tree "
                                                  "method: eval.tree (depth, branch, nodes) shapes what it drafts"),
    (["eval.method_draft_tokens=[ngram:100]"], "eval.method_draft_tokens: 'ngram:100': k=100 is above 64"),
    # against the tiny Llama's context: an answer and the widest verify (the tree's 8 nodes + 1)
    (["eval.max_new_tokens=2039"], "eval.max_new_tokens=2039: the target has max_position_embeddings=2048, and an "
                                   "answer and one verify of 9 tokens must leave a position for the prompt: give at "
                                   "most 2038"),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_trees_are_refused_at_the_door(capsys, tmp_path, overrides, message):
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={tmp_path}", *TREES, *overrides)
    assert_user_error(code, err, message)
    assert len(err.strip().splitlines()) == 1, err
    assert written(tmp_path) == set()


def test_a_tree_and_an_answer_over_a_small_context_are_refused():
    """A target of few positions: the tree's verify, then an answer beside the widest verify."""
    from types import SimpleNamespace

    from specforge_lite.drafters.methods import length_problems, tree_problems
    from tests.conftest import compose

    small = SimpleNamespace(max_position_embeddings=32)
    ecfg = compose(["stage=evaluate", "+recipe=smoke", *TREES, "eval.tree.nodes=40", "eval.max_new_tokens=8"]).eval
    assert tree_problems(ecfg, small) == ["eval.tree.nodes=40: the target has max_position_embeddings=32, so a "
                                          "verify of nodes + 1 tokens must stay below 32"]
    ecfg = compose(["stage=evaluate", "+recipe=smoke", *TREES, "eval.max_new_tokens=24"]).eval
    assert length_problems(ecfg, small) == ["eval.max_new_tokens=24: the target has max_position_embeddings=32, and "
                                            "an answer and one verify of 9 tokens must leave a position for the "
                                            "prompt: give at most 22"]
    assert length_problems(compose(["stage=evaluate", "+recipe=smoke", *TREES, "eval.max_new_tokens=22"]).eval,
                           small) == []


def test_the_catalogue_names_each_tree_beside_its_chain():
    trees = tree_methods()
    assert {"ngram_tree", "eagle3_tree", "eagle3_mixed_tree"} <= set(trees) <= set(known())
    assert {f"{name}{kind}" for name in ("peagle", "dflash", "medusa") for kind in ("_tree", "_mixed_tree")} <= set(trees)
    assert "distilled_tree" not in trees and "ngram_mixed_tree" not in trees
    assert tree_base("eagle3_mixed_tree") == ("eagle3", True) and tree_base("ngram_tree") == ("ngram", False)
    assert tree_base("eagle3") is None
    assert chain_methods(["plain", "eagle3_mixed_tree", "ngram", "eagle3"]) == ["plain", "eagle3", "ngram"]
