"""Suffix decoding (decoding/suffix.py) and the hybrid drafter (decoding/hybrid.py): hand-counted
drafts, the cut of a draft on hand-set timings, greedy identity on the tiny target for every hybrid
(chain and tree) with both sources' drafts kept (each trained kind's decoder fitted to the target's
answers: its forward runs, its drafts are the target's own), a drafter's cache after skipped steps,
the sampled law, and the samples corpus refused for other weights. The choice rule itself:
test_hybrid_policy.py."""

from __future__ import annotations

import math
import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from specforge_lite import SpecforgeError
from specforge_lite.contract import DraftContext, DraftProposal
from specforge_lite.decoding.engine import generate_plain, generate_speculative, generate_tree
from specforge_lite.decoding.hybrid import DRAFTER, LOOKUP, PLAIN_STEP, HybridDrafter
from specforge_lite.decoding.request_index import RequestIndex
from specforge_lite.decoding.suffix import CorpusIndex, SuffixDrafter, most_frequent_continuation, most_frequent_tree
from specforge_lite.decoding.tree import DraftTree, TreeShape
from specforge_lite.decoding.verify import SamplingParams
from tests.conftest import assert_same_law, tokens_2_3_law


def corpus_draft(corpus: CorpusIndex, context: list[int], k: int, draft_per_match: float, min_prob: float):
    """The corpus's draft for a context without repeats of its own (the request's draft is empty)."""
    lookup = SuffixDrafter(corpus, corpus.max_depth, draft_per_match, min_prob)
    return lookup.best(DraftContext(token_ids=context, num_prompt_tokens=len(context)), k)


def test_follow_takes_the_most_frequent_continuation_and_scores_it():
    # 1 2 3 continues with 4 twice and 5 once; after 1 2 3 4 always 6
    corpus = CorpusIndex([[1, 2, 3, 4, 6], [1, 2, 3, 5], [1, 2, 3, 4, 6]], max_depth=8)
    assert corpus.occurrences([1, 2, 3]).size == 3 and corpus.occurrences([2, 3, 4]).size == 2
    assert corpus.occurrences([7]).size == 0
    draft = corpus_draft(corpus, [9, 1, 2, 3], k=4, draft_per_match=1.0, min_prob=0.1)
    assert draft.tokens == [4, 6] and draft.match_len == 3 and draft.source == "corpus"
    assert draft.score == pytest.approx(2 / 3 + 2 / 3)  # running products 2/3, then 2/3 * 1
    # the draft stops below min_prob, and at factor x the match's length
    assert corpus_draft(corpus, [1, 2, 3], 4, 1.0, min_prob=0.7).tokens == []
    assert corpus_draft(corpus, [3], 4, draft_per_match=1.0, min_prob=0.1).tokens == [4]
    assert corpus_draft(corpus, [3], 4, draft_per_match=2.0, min_prob=0.1).tokens == [4, 6]
    # never across a sequence's end
    assert corpus_draft(corpus, [5], 4, 1.0, 0.1).tokens == []
    tokens, score = most_frequent_continuation(np.array([1, 2, -1, 1, 2]), np.array([1, 4]), 3, 0.0)
    assert tokens == [2] and score == 1.0


def test_the_suffix_tree_grows_best_first_by_running_product():
    # after 1 2: 3 four times (then 4 three times, 5 once), 6 twice
    corpus = CorpusIndex([[1, 2, 3, 4]] * 3 + [[1, 2, 3, 5]] + [[1, 2, 6, 7]] * 2, max_depth=8)
    starts = corpus.occurrences([1, 2]) + 2
    tree, score = most_frequent_tree(corpus.array, starts, depth=2, branch=2, nodes=3, min_prob=0.0)
    # 3 (4/6), then 3->4 (4/6 * 3/4 = 1/2), then 6 (2/6): the budget of 3 keeps the three best
    assert tree.tokens == [3, 4, 6] and tree.parents == [-1, 0, -1]
    assert score == pytest.approx(4 / 6 + 1 / 2 + 2 / 6)
    # one child per node is a chain, the same as `most_frequent_continuation`'s draft
    chain, chain_score = most_frequent_tree(corpus.array, starts, depth=4, branch=1, nodes=8, min_prob=0.0)
    assert chain.tokens == most_frequent_continuation(corpus.array, starts, 4, 0.0)[0] and chain.parents == [-1, 0]
    assert chain_score == pytest.approx(most_frequent_continuation(corpus.array, starts, 4, 0.0)[1])
    # below min_prob no node
    assert len(most_frequent_tree(corpus.array, starts, 2, 2, 8, min_prob=0.9)[0]) == 0
    # the request's tree (1 2 -> 8 1, score 2) before the corpus's (score 1.5), whose nodes follow
    drafter = SuffixDrafter(corpus, max_depth=8, draft_per_match=2.0, min_prob=0.0)
    tree = drafter.propose_tree(DraftContext(token_ids=[1, 2, 8, 1, 2], num_prompt_tokens=5), 2, 2, 6)
    assert tree.tokens == [8, 1, 3, 4, 6, 7] and tree.parents == [-1, 0, -1, 2, -1, 4]
    assert len(drafter.propose_tree(DraftContext(token_ids=[1, 2, 8, 1, 2], num_prompt_tokens=5), 2, 2, 3)) == 3


def test_the_suffix_tree_decodes_greedily_as_plain_and_accepts(tiny_target):
    model, _ = tiny_target
    corpus = CorpusIndex([generate_plain(model, p, 24).tokens for p in _prompts(model.config.vocab_size, 4, seed=1)])
    accepted = 0
    for ids in _prompts(model.config.vocab_size, 4, seed=1)[:2] + _prompts(model.config.vocab_size, 2, seed=2):
        plain = generate_plain(model, ids, 24)
        tree = generate_tree(model, SuffixDrafter(corpus), ids, 24, TreeShape(4, 2, 8))
        assert tree.tokens == plain.tokens
        accepted += sum(tree.accepted_lengths)
    assert accepted > 0


def test_the_request_index_matches_the_longest_suffix_as_tokens_arrive():
    lookup = SuffixDrafter(None, max_depth=4, draft_per_match=1.0, min_prob=0.0)
    context = [5, 6, 7, 8, 5, 6, 9, 5, 6]
    draft = lookup.best(DraftContext(token_ids=context, num_prompt_tokens=3), 3)  # 5 6 -> 7 once, 9 once: the tie goes to the smaller id
    assert draft.match_len == 2 and draft.tokens == [7, 8] and draft.source == "request"
    context = context + [9]  # an extension of the same context
    draft = lookup.best(DraftContext(token_ids=context, num_prompt_tokens=3), 3)  # 5 6 9 occurred once, then 5 6 9
    assert (draft.match_len, draft.tokens, draft.score) == (3, [5, 6, 9], 3.0)


def test_one_request_index_for_ngram_and_suffix_lookup():
    """n-gram lookup keeps the first and the latest occurrences of an n-gram; suffix decoding all of them."""
    context = [1, 2, 3] * 12 + [1, 2]
    every, capped = RequestIndex(4), RequestIndex(3, 2, keep=8)
    every.extend(context)
    capped.extend(context)
    assert every.continuations_of([1, 2]) == list(range(2, 36, 3))  # each position after "1 2"
    assert capped.continuations_of([1, 2]) == [2] + list(range(17, 36, 3))  # the first and the latest 7
    assert capped.continuations_of([2]) == [] and RequestIndex(4).continuations_of([1]) == []
    assert [n for n, _ in every.matches(context)] == [4, 3, 2, 1] and [n for n, _ in capped.matches(context)] == [3, 2]


def test_suffix_drafter_takes_the_better_scoring_source():
    corpus = CorpusIndex([[1, 2, 3, 4]] * 5, max_depth=8)
    drafter = SuffixDrafter(corpus, max_depth=8, draft_per_match=2.0, min_prob=0.1)
    ctx = DraftContext(token_ids=[7, 1, 2, 3], num_prompt_tokens=4)
    assert drafter.propose(ctx, 3).tokens == [4] and drafter.last.source == "corpus"
    alone = SuffixDrafter(None, max_depth=8, draft_per_match=2.0)
    ctx = DraftContext(token_ids=[1, 2, 3, 9, 1, 2, 3], num_prompt_tokens=7)
    assert alone.propose(ctx, 3).tokens == [9, 1, 2] and alone.last.source == "request"


def _prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats, so that lookup drafts and the drafts get verified."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        p = torch.randint(3, vocab, (12,), generator=g).tolist()
        out.append(p + p[:6] + p)
    return out


def _eagle3(tiny_target):
    from specforge_lite.drafters.eagle3.decode import Eagle3DecodeDrafter
    from tests.unit.test_eagle3 import VARIANTS, tiny_drafter

    drafter = tiny_drafter(tiny_target, 64, *VARIANTS[0])
    return Eagle3DecodeDrafter(drafter, capacity=256)


class _Fitted:
    """A trained kind's decoder fitted to the target without training: its forward runs on every
    call (its cache, catch-up and rollback are exercised), and its draft is replaced by as many
    tokens of the target's own greedy answer (`answers` by prompt), every other draft's last token
    wrong, so steps keep all or part of the drafter's draft."""

    def __init__(self, decoder, answers: dict[tuple, list[int]], vocab: int):
        self.decoder, self.answers, self.vocab, self.drafts = decoder, answers, vocab, 0

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def _truth(self, ctx, n: int) -> list[int]:
        done = len(ctx.token_ids) - ctx.num_prompt_tokens
        truth = self.answers[tuple(ctx.token_ids[:ctx.num_prompt_tokens])][done:done + n]
        if truth:
            self.drafts += 1
            if self.drafts % 2:
                truth[-1] = (truth[-1] + 1) % self.vocab
        return truth

    def propose(self, ctx, k):
        drafted = len(self.decoder.propose(ctx, k).tokens)
        truth = self._truth(ctx, drafted)
        return DraftProposal(truth, confidence=[0.95, 0.9, 0.2, 0.1][:len(truth)])  # `_hand_timed` cuts the third

    def propose_tree(self, ctx, depth, branch, nodes):
        tree = self.decoder.propose_tree(ctx, depth, branch, nodes)
        truth = self._truth(ctx, max(tree.depths(), default=0))
        fitted = DraftTree.chain(truth).merged(tree, nodes)  # the answer's path first, the drafter's nodes beside
        scores = [d * math.log(0.9) if i < len(truth) else -3.0 for i, d in enumerate(fitted.depths())]
        return DraftTree(fitted.tokens, fitted.parents, None, scores)


def _fitted(model, decoder, prompts: list[list[int]], new_tokens: int) -> _Fitted:
    return _Fitted(decoder, {tuple(p): generate_plain(model, p, new_tokens).tokens for p in prompts},
                   model.config.vocab_size)


def _hand_timed(hybrid: HybridDrafter) -> HybridDrafter:
    """The hybrid's costs hand-set (a verify 10 ms plus 4 ms a token, a drafting call 1 ms), not
    measured: its choices then follow what the sources keep, not this machine's load."""
    observe_verify, observe_draft = hybrid.policy.observe_verify, hybrid.policy.observe_draft
    hybrid.policy.observe_verify = lambda width, seconds: observe_verify(width, 0.010 + 0.004 * (width - 1))
    hybrid.policy.observe_draft = lambda seconds, catch_up: observe_draft(0.001, catch_up)
    return hybrid


def test_suffix_and_hybrid_decode_greedily_as_plain_with_both_sources_accepted(tiny_target):
    model, _ = tiny_target
    corpus_answers = [generate_plain(model, p, 24).tokens for p in _prompts(model.config.vocab_size, 4, seed=1)]
    corpus = CorpusIndex(corpus_answers, max_depth=16)
    prompts = _prompts(model.config.vocab_size, 4, seed=1)[:2] + _prompts(model.config.vocab_size, 3, seed=2)
    hybrid = _hand_timed(HybridDrafter(_fitted(model, _eagle3(tiny_target), prompts, 24), SuffixDrafter(corpus)))
    accepted = Counter()
    for ids in prompts:
        plain = generate_plain(model, ids, 24)
        suffix = generate_speculative(model, SuffixDrafter(corpus), ids, 24, 3)
        mixed = generate_speculative(model, hybrid, ids, 24, 3)
        assert suffix.tokens == plain.tokens and mixed.tokens == plain.tokens
        accepted["suffix"] += sum(suffix.accepted_lengths)
    assert accepted["suffix"] > 0
    assert hybrid.sources[LOOKUP]["accepted"] > 0  # the corpus holds these answers: lookup is kept
    assert hybrid.sources[DRAFTER]["accepted"] > 0  # and the fitted drafter's drafts


def _hybrid_bases(tiny_target):
    """A tiny drafter of every trained kind, as the engine drafts with it."""
    from specforge_lite.drafters.distilled.decode import decoder as distilled
    from specforge_lite.drafters.distilled.model import truncated_student
    from tests.unit import test_tree_drafters

    return {"eagle3": lambda: _eagle3(tiny_target),
            "peagle": lambda: test_tree_drafters.peagle_decoder(tiny_target),
            "dflash": lambda: test_tree_drafters.dflash_decoder(tiny_target),
            "medusa": lambda: test_tree_drafters.medusa_decoder(tiny_target),
            "distilled": lambda: distilled(truncated_student(tiny_target[0], 1))}


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash", "medusa", "distilled"])
def test_every_hybrid_decodes_greedily_as_plain_with_both_sources_drafting(tiny_target, kind):
    """`<drafter>_hybrid` of each trained kind (fitted): lookup's drafts and the drafter's are both
    kept, and greedy output equals plain decoding, cut drafts and skipped steps included."""
    from specforge_lite.drafters.methods import hybrid_methods

    assert f"{kind}_hybrid" in hybrid_methods()
    model, _ = tiny_target
    corpus = CorpusIndex([generate_plain(model, p, 24).tokens for p in _prompts(model.config.vocab_size, 3, seed=1)],
                         max_depth=16)
    prompts = _prompts(model.config.vocab_size, 3, seed=1)[:2] + _prompts(model.config.vocab_size, 2, seed=2)
    hybrid = _hand_timed(HybridDrafter(_fitted(model, _hybrid_bases(tiny_target)[kind](), prompts, 24),
                                       SuffixDrafter(corpus)))
    for ids in prompts:
        assert generate_speculative(model, hybrid, ids, 24, 3).tokens == generate_plain(model, ids, 24).tokens
    assert hybrid.sources[LOOKUP]["accepted"] > 0 and hybrid.sources[DRAFTER]["accepted"] > 0


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash", "medusa"])  # the kinds that draft trees
def test_every_hybrid_tree_decodes_greedily_as_plain_with_both_sources_drafting(tiny_target, kind):
    """`<drafter>_hybrid_tree` (fitted): lookup's chain, or the drafter's tree with lookup's chain
    beside it, each kept."""
    from specforge_lite.drafters.methods import tree_base, tree_methods

    assert tree_base(f"{kind}_hybrid_tree") == (f"{kind}_hybrid", False) and f"{kind}_hybrid_tree" in tree_methods()
    model, _ = tiny_target
    corpus = CorpusIndex([generate_plain(model, p, 24).tokens for p in _prompts(model.config.vocab_size, 3, seed=1)],
                         max_depth=16)
    prompts = _prompts(model.config.vocab_size, 3, seed=1)[:2] + _prompts(model.config.vocab_size, 2, seed=2)
    hybrid = _hand_timed(HybridDrafter(_fitted(model, _hybrid_bases(tiny_target)[kind](), prompts, 24),
                                       SuffixDrafter(corpus)))
    for ids in prompts:
        tree = generate_tree(model, hybrid, ids, 24, TreeShape(3, 2, 6))
        assert tree.tokens == generate_plain(model, ids, 24).tokens
    assert hybrid.sources[LOOKUP]["accepted"] > 0 and hybrid.sources[DRAFTER]["accepted"] > 0


def test_a_drafters_tree_is_pruned_to_the_nodes_that_pay():
    """Nodes best first by path probability, priced by hand-set verify times (a cliff at width 5)."""
    from specforge_lite.decoding.drafters import NgramDrafter
    from specforge_lite.decoding.tree import DraftTree

    hybrid = HybridDrafter(NgramDrafter(), SuffixDrafter(None))
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 1, -1], scores=[math.log(p) for p in (0.9, 0.81, 0.729, 0.05)])
    assert hybrid._pruned(tree) is tree  # no times yet
    hybrid.policy.costs.timed = {1: [0.010, 1], 4: [0.010, 1], 5: [0.040, 1]}
    pruned = hybrid._pruned(tree)  # the 4th node adds too little to pay for the dearer width
    assert (pruned.tokens, pruned.parents, hybrid.sources[DRAFTER]["cut"]) == ([5, 6, 7], [-1, 0, 1], 1)
    hybrid.policy.costs.timed[5] = [0.010, 1]
    assert hybrid._pruned(tree).tokens == [5, 6, 7, 8]  # flat costs: every node pays


def test_the_drafters_draft_is_cut_where_more_tokens_do_not_pay():
    """EAGLE-2's confidence priced by the measured verify time per width (hand-set here)."""
    from specforge_lite.decoding.hybrid import cut_length

    flat = lambda width: 0.010  # noqa: E731  widths all cost the same: every token pays
    cliff = lambda width: 0.010 if width <= 3 else 0.040  # noqa: E731  widths 4 and up cost 4x
    assert cut_length([0.9, 0.1, 0.05], flat) == 3 and cut_length([0.0, 0.0], flat) == 0
    assert cut_length([0.9, 0.9, 0.9], cliff) == 2  # the third draft does not pay for the dearer width 4
    assert cut_length([], flat) == 0

    class Fixed:  # a drafter whose greedy draft and confidences are set by hand
        name, hidden_state_layers, sequential = "fixed", (), False

        def reset(self):
            pass

        def accept(self, n):
            pass

        def propose(self, ctx, k):
            return DraftProposal([5, 6, 7][:k], confidence=[0.9, 0.9, 0.9][:k])

    hybrid = HybridDrafter(Fixed(), SuffixDrafter(None), prior=1.0)
    ctx = DraftContext(token_ids=[1, 2, 3], num_prompt_tokens=3)
    assert hybrid.propose(ctx, 3).tokens == [5, 6, 7]  # no times yet: nothing is cut
    hybrid.accept(0)
    policy = hybrid.policy  # the drafter pays at the width it verified (3), priced as a plain step's
    policy.costs.timed, policy.draft["clean"] = {3: [0.010, 1], 4: [0.040, 1]}, [0.0, 1]
    policy.drafter_accepted, policy.drafter_steps, policy.drafter_widths = 6.0, 1, Counter({3: 1})
    assert hybrid.propose(ctx, 3).tokens == [5, 6] and hybrid.sources[DRAFTER]["cut"] == 1


def test_steps_where_no_source_pays_draft_nothing_and_stay_lossless(tiny_target):
    model, _ = tiny_target
    corpus = CorpusIndex([generate_plain(model, p, 24).tokens for p in _prompts(model.config.vocab_size, 2, seed=1)])
    hybrid = HybridDrafter(_eagle3(tiny_target), SuffixDrafter(corpus), prior=0.0)
    policy = hybrid.policy  # a drafter that never pays: 1 s a call, nothing kept in 1000 steps
    policy.draft["clean"], policy.drafter_accepted, policy.drafter_steps = [1.0, 1], 0.0, 1000
    policy.costs.timed[1] = [0.001, 1]
    for ids in _prompts(model.config.vocab_size, 2, seed=1) + _prompts(model.config.vocab_size, 2, seed=2):
        assert generate_speculative(model, hybrid, ids, 24, 3).tokens == generate_plain(model, ids, 24).tokens
    assert hybrid.sources[PLAIN_STEP]["steps"] > 0 and hybrid.sources[LOOKUP]["accepted"] > 0
    assert hybrid.sources[DRAFTER]["steps"] == 0 and hybrid.sources[PLAIN_STEP]["accepted"] == 0


def test_a_drafter_after_skipped_steps_holds_what_a_drafter_of_every_step_holds(tiny_target):
    """The hybrid hands the skipped steps' hidden states to EAGLE-3 at its next step: its cache of
    committed anchors equals that of the same drafter drafting every step of the same answer."""
    model, _ = tiny_target
    ids = _prompts(model.config.vocab_size, 1, seed=3)[0]
    plain = generate_plain(model, ids, 30)
    corpus = CorpusIndex([plain.tokens[:12]], max_depth=16)  # lookup knows the answer's start only
    hybrid = HybridDrafter(_eagle3(tiny_target), SuffixDrafter(corpus), prior=0.0, explore=0.0)
    hybrid.policy.observe_verify = lambda width, seconds: None  # untimed: lookup where it drafts, else the drafter
    every = _eagle3(tiny_target)
    seen = {"hybrid": [], "every": []}  # context lengths at each drafter step (anchors up to length - 2)
    for name, drafter in (("hybrid", hybrid.drafter), ("every", every)):
        propose = drafter.propose
        drafter.propose = lambda ctx, k, p=propose, log=seen[name]: (log.append((len(ctx.token_ids), k)), p(ctx, k))[1]
    order = []
    accept = hybrid.accept
    hybrid.accept = lambda n: (order.append(hybrid.choice), accept(n))[1]
    a = generate_speculative(model, hybrid, ids, 30, 3)
    b = generate_speculative(model, every, ids, 30, 3)
    assert a.tokens == b.tokens == plain.tokens
    assert LOOKUP in order and DRAFTER in order[order.index(LOOKUP):]  # a drafter step after skipped ones
    written = min(max(n for n, k in seen[name] if k) for name in seen) - 1
    assert written > len(ids)
    cache_a, cache_b = hybrid.drafter.kv, every.kv
    assert torch.allclose(cache_a.k[:, :, :written], cache_b.k[:, :, :written], atol=1e-5)
    assert torch.allclose(cache_a.v[:, :, :written], cache_b.v[:, :, :written], atol=1e-5)
    assert cache_a.k[:, :, :written].abs().sum() > 0


def test_the_sampled_hybrid_keeps_the_target_law():
    """Tokens 2 and 3 (the first speculative step, drafted by lookup from a corpus that predicts
    them) of the real engine: chi-square against the target's exact law."""
    from tests.unit.test_engine import tiny_llama

    target, draft = tiny_llama(0), tiny_llama(1)
    sampling, prompt, vocab = SamplingParams(0.8, 0.95), [1, 2, 3], 8
    exact = tokens_2_3_law(target, prompt, sampling, vocab)
    from specforge_lite.decoding.drafters import DraftModelDrafter

    corpus = CorpusIndex([[1, 2, 3, 4, 5, 6]] * 4 + [[2, 3, 5, 5]], max_depth=8)
    hybrid = HybridDrafter(DraftModelDrafter(draft), SuffixDrafter(corpus, draft_per_match=4.0), prior=0.0, explore=0.0)
    observe_verify = hybrid.policy.observe_verify  # every width costs the same: lookup wherever it drafts
    hybrid.policy.observe_verify = lambda width, seconds: observe_verify(width, 0.010)
    gen, n = torch.Generator().manual_seed(0), 4000
    counts = Counter(tuple(generate_speculative(target, hybrid, prompt, 3, 2, sampling, (), gen).tokens[1:])
                     for _ in range(n))
    assert hybrid.sources[LOOKUP]["steps"] > 0
    assert_same_law(counts, exact, n)


def test_the_samples_corpus_comes_from_this_target_only(tmp_path):
    """The sample stage's answers become the corpus; the same samples read for a target whose
    weights differ are refused with one line, and the same weights copied to another folder are not."""
    from safetensors.torch import load_file, save_file

    from specforge_lite.data.samples import answer_corpus
    from specforge_lite.targets.loading import resolve_target_path
    from tests.conftest import run_cli

    run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path / 'run'}", check=True)
    samples = tmp_path / "run" / "samples"
    answers = answer_corpus(samples, "builtin:tiny-llama", 10**6)
    assert answers and all(answers) and sum(map(len, answers)) > 10
    assert sum(map(len, answer_corpus(samples, "builtin:tiny-llama", 5))) < sum(map(len, answers))
    other = tmp_path / "other"
    shutil.copytree(resolve_target_path("builtin:tiny-llama"), other)
    assert answer_corpus(samples, str(other), 10**6) == answers  # the same bytes in another folder: the same target
    proc = run_cli("evaluate", "+recipe=smoke", f"run_dir={tmp_path / 'run'}", f"target.path={other}",
                   "eval.methods=[plain,suffix]", "eval.best_k_method=null", "eval.max_prompts=1",
                   "eval.max_new_tokens=4", "eval.warmup=0", "eval.plots=false")
    assert proc.returncode == 0, proc.stderr[-2000:]  # it was refused as "drawn from other weights" (issue 65)
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["suffix_corpus"] == {"samples_asked": True, "tokens": sum(map(len, answers))}
    # no samples in its run folder: the report says lookup drafted from each request alone (it said nothing)
    proc = run_cli("evaluate", "+recipe=smoke", f"run_dir={tmp_path / 'bare'}", "eval.methods=[plain,suffix]",
                   "eval.best_k_method=null", "eval.max_prompts=1", "eval.max_new_tokens=4", "eval.warmup=0",
                   "eval.plots=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    bare = tmp_path / "bare" / "eval"
    assert json.loads((bare / "report.json").read_text())["suffix_corpus"] == {"samples_asked": True, "tokens": 0}
    assert "**No samples of this target**" in (bare / "report.md").read_text()
    weights = next(other.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(SpecforgeError, match="drawn from other weights") as err:
        answer_corpus(samples, str(other), 10**6)
    assert len(str(err.value).splitlines()) == 1
    assert answer_corpus(tmp_path / "nothing", "builtin:tiny-llama", 10) is None


def test_the_report_gives_each_hybrids_sources():
    """The report's table of a hybrid's steps per source (hand-set counts), the cut included."""
    from specforge_lite.measurement.report import sources_table

    sources = {LOOKUP: {"steps": 6, "accepted": 9}, DRAFTER: {"steps": 3, "accepted": 3, "cut": 2},
               PLAIN_STEP: {"steps": 1, "accepted": 0}}
    table = sources_table({"methods": {"plain": {}, "eagle3_hybrid": {"sources": sources}}})
    assert table.splitlines()[2] == "| eagle3_hybrid | 60% (6) | 1.50 | 30% (3) | 1.00 | 2 | 10% (1) |"
    assert sources_table({"methods": {"plain": {}}}) == ""
