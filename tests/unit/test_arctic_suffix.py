"""`arctic_suffix`: Arctic Inference's own suffix decoding as a peer method (decoding/arctic.py), built
by `make arctic`. Skipped where it is not built; an error instead with SPECFORGE_LITE_REQUIRE_ARCTIC=1
(CI builds it). The door's refusal where it is missing needs no build."""

from __future__ import annotations

import os

import pytest

from specforge_lite.contract import DraftContext
from specforge_lite.decoding import arctic
from specforge_lite.decoding.engine import generate_plain, generate_speculative
from specforge_lite.decoding.suffix import CorpusIndex, SuffixDrafter
from tests.unit.test_suffix_hybrid import _prompts


@pytest.fixture
def built():
    if arctic.missing_problem():
        if os.environ.get("SPECFORGE_LITE_REQUIRE_ARCTIC") == "1":
            pytest.fail(f"SPECFORGE_LITE_REQUIRE_ARCTIC=1 but {arctic.missing_problem()}")
        pytest.skip(arctic.missing_problem())


def test_it_drafts_what_our_suffix_drafts_on_a_plain_corpus(built):
    # one continuation everywhere: both implementations must follow it, from the corpus and the request
    answers = [[1, 2, 3, 4, 5, 6]] * 3
    ours, theirs = SuffixDrafter(CorpusIndex(answers), draft_per_match=2.0), arctic.ArcticSuffixDrafter(answers, draft_per_match=2.0)
    for ids, prompt in (([9, 1, 2, 3], 4), ([7, 8, 9, 7, 8], 5)):
        ctx = DraftContext(token_ids=ids, num_prompt_tokens=prompt)
        assert theirs.propose(ctx, 3).tokens == ours.propose(ctx, 3).tokens != []
        theirs.reset()
        ours.reset()
    # an answer evaluated is evicted from the global tree when its request ends: the same answer with
    # its request only stopped stays there and drafts its continuation for a later request; evicted, nothing
    query = DraftContext(token_ids=[50, 41, 42], num_prompt_tokens=3)
    for evict in (False, True):
        drafter = arctic.ArcticSuffixDrafter([], draft_per_match=2.0)
        drafter.propose(DraftContext(token_ids=[40, 41, 42, 43, 44], num_prompt_tokens=2), 2)  # answer 42 43 44
        if evict:
            drafter.reset()
        else:
            drafter.cache.stop_request(drafter.request)
            drafter.request = None
        assert drafter.propose(query, 2).tokens == ([] if evict else [43, 44]), evict


def test_it_decodes_greedily_as_plain_with_acceptances(built, tiny_target):
    model, _ = tiny_target
    answers = [generate_plain(model, p, 24).tokens for p in _prompts(model.config.vocab_size, 4, seed=1)]
    drafter, accepted = arctic.ArcticSuffixDrafter(answers), 0
    for ids in _prompts(model.config.vocab_size, 4, seed=1)[:2] + _prompts(model.config.vocab_size, 2, seed=2):
        out = generate_speculative(model, drafter, ids, 24, 3)
        assert out.tokens == generate_plain(model, ids, 24).tokens
        accepted += sum(out.accepted_lengths)
    assert accepted > 0


def test_the_door_names_the_build_when_it_is_missing(monkeypatch):
    monkeypatch.setattr(arctic.importlib.util, "find_spec", lambda name: None)
    assert "make arctic" in arctic.missing_problem()
    from specforge_lite.drafters.methods import method_problems
    from tests.conftest import compose

    problems = method_problems(compose(["eval.methods=[plain,arctic_suffix]"]).eval)
    assert any("arctic_suffix needs Arctic Inference's suffix decoding" in p for p in problems)


def test_a_broken_build_is_named_at_the_door_through_the_cli(capsys, tmp_path, monkeypatch):
    """Installed but not importable (a build against another torch, a file missing): it passed
    the door and raised in evaluate (issue 65); now one line at the door names the build."""
    import sys

    from tests.integration.test_bad_inputs import assert_user_error, cli, written

    package = tmp_path / "site" / "arctic_inference"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "suffix_decoding.py").write_text("raise ImportError('undefined symbol: _ZN5torch3jit')\n")
    for name in [m for m in sys.modules if m == "arctic_inference" or m.startswith("arctic_inference.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    run_dir = tmp_path / "run"
    try:
        code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={run_dir}",
                        "eval.methods=[plain,arctic_suffix]", "eval.best_k_method=null")
    finally:  # the fake package leaves this process with the test (monkeypatch restores the real one)
        for name in [m for m in sys.modules if m.split(".")[0] == "arctic_inference"
                     and str(tmp_path) in str(getattr(sys.modules[m], "__file__", ""))]:
            del sys.modules[name]
    assert_user_error(code, err, "arctic_suffix: Arctic Inference's arctic_inference.suffix_decoding is installed but "
                                 "does not import (ImportError: undefined symbol")
    assert len(err.strip().splitlines()) == 1 and written(run_dir) == set()
