"""The decoding engine on tiny targets: stub drafters forcing always / never / partial
acceptance, greedy exactness against plain decoding (and HF generate), the target
state handed to drafters, the sampled output law, and the metrics built on it."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specforge_lite.contract import DraftContext, DraftProposal
from specforge_lite.decoding.drafters import DraftModelDrafter, NgramDrafter
from specforge_lite.targets.surgery import truncated_copy
from specforge_lite.decoding.engine import TargetRunner, generate_plain, generate_speculative
from specforge_lite.decoding.verify import SamplingParams
from specforge_lite.measurement.metrics import best_k, expected_tokens_per_step, per_position_acceptance, summarise
from tests.conftest import assert_same_law, mostly_agree, tokens_2_3_law


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target[0]


def prompts(n: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


class StubDrafter:
    """Proposes the target's own greedy continuation `reference`, right for the first
    `right` positions of every proposal and wrong (token + 1) after them."""

    name = "stub"
    sequential = False

    def __init__(self, reference: list[int], right: int, vocab: int, hidden_state_layers=()):
        self.reference, self.right, self.vocab = reference, right, vocab
        self.hidden_state_layers = tuple(hidden_state_layers)
        self.seen_hidden: list[dict] = []
        self.accepted: list[int] = []

    def reset(self):
        self.seen_hidden.clear()
        self.accepted.clear()

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        self.seen_hidden.append({layer: h.clone() for layer, h in ctx.hidden_states.items()})
        done = len(ctx.token_ids) - ctx.num_prompt_tokens
        tokens = self.reference[done:done + k]
        return DraftProposal([t if i < self.right else (t + 1) % self.vocab for i, t in enumerate(tokens)])

    def accept(self, num_accepted: int) -> None:
        self.accepted.append(num_accepted)


# --------------------------------------------------------------------------- stub drafters

@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("right", [0, 2, 99])
def test_stub_acceptance_is_exact(target, k, right):
    prompt, n = prompts(1, seed=k)[0], 30
    reference = generate_plain(target, prompt, n + 8).tokens
    stub = StubDrafter(reference, right, target.config.vocab_size)
    runner = TargetRunner(target)
    gen = generate_speculative(target, stub, prompt, n, k, runner=runner)
    assert gen.tokens == reference[:n]
    # every step keeps min(right, k) drafts (the last step may be capped by max_new_tokens)
    assert all(a == min(right, limit) for a, limit in zip(gen.accepted_lengths, gen.draft_limits))
    assert stub.accepted == gen.accepted_lengths
    assert gen.tau == pytest.approx((n - 1) / gen.num_forwards)
    expected_steps = math.ceil((n - 1) / (min(right, k) + 1))
    assert gen.num_forwards == expected_steps
    # the target cache holds every committed token but the pending one, nothing rejected
    assert runner.length == len(prompt) + n - 1


def test_never_accepting_drafter_costs_one_forward_per_token(target):
    prompt = prompts(1)[0]
    reference = generate_plain(target, prompt, 20).tokens
    gen = generate_speculative(target, StubDrafter(reference, 0, target.config.vocab_size), prompt, 20, 4)
    assert gen.tau == 1.0 and gen.num_forwards == 19 and sum(gen.accepted_lengths) == 0


def test_hidden_states_handed_to_drafter_are_the_targets(target):
    """The drafter sees, for its declared layers, the hidden states of exactly the
    committed positions; concatenated they equal one full forward's."""
    prompt = prompts(1, seed=3)[0]
    reference = generate_plain(target, prompt, 25).tokens
    layers = (0, 3, -1)
    stub = StubDrafter(reference, 2, target.config.vocab_size, hidden_state_layers=layers)
    gen = generate_speculative(target, stub, prompt, 25, 3)
    assert gen.tokens == reference
    with torch.no_grad():
        full = target(torch.tensor([prompt + gen.tokens]), output_hidden_states=True).hidden_states
    for layer in layers:
        seen = torch.cat([h[layer] for h in stub.seen_hidden], dim=1)
        # every position up to the last pending token the drafter was shown
        assert seen.shape[1] == len(prompt) + sum(a + 1 for a in gen.accepted_lengths[:-1])
        assert torch.allclose(seen, full[layer][:, :seen.shape[1]], atol=1e-4), layer


# --------------------------------------------------------------------------- greedy exactness

def test_plain_loop_matches_hf_generate(target, tiny_target):
    eos = tiny_target[1].eos_token_id
    for prompt in prompts(6, seed=1):
        ours = generate_plain(target, prompt, 24, eos_ids=[eos]).tokens
        hf = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)[0, len(prompt):].tolist()
        assert ours == hf


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_speculative_is_identical_to_plain(target, k):
    """Many prompts, n-gram and truncated-draft drafters, the target as its own drafter."""
    draft = truncated_copy(target, 2)
    drafters = [NgramDrafter(3, prefer="first"), NgramDrafter(2), DraftModelDrafter(draft), DraftModelDrafter(target)]
    for prompt in prompts(12, seed=k):
        reference = generate_plain(target, prompt, 40)
        for drafter in drafters:
            gen = generate_speculative(target, drafter, prompt, 40, k)
            assert gen.tokens == reference.tokens, (drafter.name, prompt)
            assert gen.finish == reference.finish
    # the target drafting for itself is always right: every step yields k + 1 tokens
    gen = generate_speculative(target, DraftModelDrafter(target), prompts(1)[0], 33, k)
    assert gen.accepted_lengths[:-1] == [k] * (len(gen.accepted_lengths) - 1)


def test_eos_stops_plain_and_speculative_alike(target):
    prompt = prompts(1, seed=5)[0]
    reference = generate_plain(target, prompt, 30).tokens
    eos = reference[7]  # pretend a token the target emits is EOS
    cut = reference[:reference.index(eos) + 1]
    plain = generate_plain(target, prompt, 30, eos_ids=[eos])
    assert plain.tokens == cut and plain.finish == "eos"
    for drafter in (StubDrafter(reference, 99, target.config.vocab_size), NgramDrafter(3)):
        gen = generate_speculative(target, drafter, prompt, 30, 5, eos_ids=[eos])
        assert gen.tokens == cut and gen.finish == "eos"


def test_truncated_copy_shares_the_target_layers(target):
    draft = truncated_copy(target, 2)
    assert len(draft.model.layers) == 2 and draft.model.layers[1] is target.model.layers[1]
    assert draft.lm_head is target.lm_head and draft.model.norm is target.model.norm
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[2]
        expected = target.lm_head(target.model.norm(hidden))
        assert torch.allclose(draft(ids).logits, expected, atol=1e-5)
    with pytest.raises(Exception, match="truncate_layers"):
        truncated_copy(target, target.config.num_hidden_layers)


def test_ngram_drafter_proposes_the_continuation():
    drafter = NgramDrafter(max_n=3, min_n=1, prefer="first")
    ctx = DraftContext(token_ids=[1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], num_prompt_tokens=4)
    assert drafter.propose(ctx, 2).tokens == [4, 9]  # the earliest occurrence of the 3-gram (1, 2, 3)
    last = NgramDrafter(max_n=3, prefer="last")
    assert last.propose(ctx, 3).tokens == [5, 7, 1]
    ctx.token_ids += [8]
    assert drafter.propose(ctx, 2).tokens == []  # 8 never occurred before
    ctx.token_ids += [5]
    assert drafter.propose(ctx, 4).tokens == [7, 1, 2, 3]  # falls back to the 1-gram (5,)



def brute_force_lookup(ids: list[int], k: int, max_n: int, prefer: str) -> list[int]:
    for n in range(min(max_n, len(ids) - 1), 0, -1):
        starts = [s for s in range(len(ids) - n) if ids[s:s + n] == ids[-n:]]
        if starts:
            start = (starts[0] if prefer == "first" else starts[-1]) + n
            return ids[start:start + k]
    return []


@pytest.mark.parametrize("prefer", ["first", "last"])
def test_ngram_index_matches_brute_force_and_hf(prefer):
    """The incremental index against a brute-force scan, and the "first" rule against
    Hugging Face's own prompt-lookup candidate generator, as the context grows."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        ids = torch.randint(0, 6, (60,), generator=gen).tolist()
        k, max_n = 1 + trial % 5, 1 + trial % 4
        drafter = NgramDrafter(max_n=max_n, prefer=prefer)
        hf = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=max_n, max_length=10**6)
        for length in range(2, len(ids) + 1, 1 + trial % 3):  # grow by 1-3 tokens, as accepted drafts do
            ctx = DraftContext(token_ids=ids[:length], num_prompt_tokens=2)
            ours = drafter.propose(ctx, k).tokens
            assert ours == brute_force_lookup(ids[:length], k, max_n, prefer)
            if prefer == "first":
                candidates, _ = hf.get_candidates(torch.tensor([ids[:length]]))
                assert ours == candidates[0, length:].tolist()


# --------------------------------------------------------------------------- the sampled law

def tiny_llama(seed: int, vocab: int = 8):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                         initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def test_speculative_sampling_has_the_target_law():
    """Generated tokens 2 and 3 (the first speculative step) of the real engine with a
    different random draft model: chi-square against the exact law of the target."""
    target, draft = tiny_llama(0), tiny_llama(1)
    sampling, prompt, vocab = SamplingParams(0.8, 0.95), [1, 2, 3], 8
    exact = tokens_2_3_law(target, prompt, sampling, vocab)
    gen = torch.Generator().manual_seed(0)
    drafter = DraftModelDrafter(draft)
    n = 4000
    counts = Counter(tuple(generate_speculative(target, drafter, prompt, 3, 2, sampling, (), gen).tokens[1:])
                     for _ in range(n))
    assert_same_law(counts, exact, n)
    # and the law is not trivial: the draft disagrees with the target often
    assert sum(counts.values()) == n and len(counts) > 10


def test_target_drafting_for_itself_is_accepted_when_sampling():
    target = tiny_llama(0)
    gen = generate_speculative(target, DraftModelDrafter(target), [1, 2, 3], 40, 3, SamplingParams(1.0),
                               (), torch.Generator().manual_seed(0))
    assert gen.accepted_lengths[:-1] == [3] * (len(gen.accepted_lengths) - 1)


# --------------------------------------------------------------------------- metrics

def test_tau_matches_per_position_acceptance(target):
    prompt = prompts(1, seed=9)[0]
    reference = generate_plain(target, prompt, 60).tokens
    gens = [generate_speculative(target, StubDrafter(reference, right, target.config.vocab_size), prompt, 60, 4)
            for right in (1, 3)]
    alphas = per_position_acceptance(gens, 4)
    # steps keep 1 then 3 drafts: position 1 always accepted, 2 and 3 in the right=3 steps only
    assert alphas[0] == 1.0 and alphas[3] == 0.0
    summary = summarise(gens, 4)
    assert summary["tau"] == pytest.approx(expected_tokens_per_step(alphas, 4), rel=0.05)
    assert summary["acceptance_rate"] == pytest.approx(sum(map(sum, (g.accepted_lengths for g in gens)))
                                                       / sum(map(sum, (g.draft_lengths for g in gens))))


def test_best_k_trades_acceptance_against_cost():
    costs = {1: 0.100, 2: 0.180, 3: 0.190, 4: 0.200, 5: 0.260, 6: 0.270}
    free = lambda k: 0.0  # noqa: E731
    # always accepted: more drafts pay until the forward gets expensive
    assert best_k([1.0] * 5, costs, free)["best_k"] == 5
    # rarely accepted: a single draft is the least bad, and slower than plain
    result = best_k([0.1, 0.1, 0.1, 0.1, 0.1], costs, free)
    assert result["best_k"] == 1 and result["expected_speedup"] < 1
    # a draft cost per token pushes k down
    assert best_k([0.8] * 5, costs, lambda k: 0.1 * k)["best_k"] < best_k([0.8] * 5, costs, free)["best_k"]
    assert expected_tokens_per_step([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)


def test_best_k_per_answer_counts_the_prefill():
    """With a mean answer (N tokens, prefill p) the rates are N / (p + (N - 1) / E_k * step):
    by hand, N = 11, p = 0.5 s, plain 0.1 s per token -> 11 / 1.5; k = 1 always accepted
    (E = 2) at 0.15 s per step -> 11 / (0.5 + 5 * 0.15) = 11 / 1.25. The prefill, paid by
    both, pulls the speedup towards 1 (1.2x, against 1.33x per step)."""
    costs = {1: 0.1, 2: 0.15}
    free = lambda k: 0.0  # noqa: E731
    per_step = best_k([1.0], costs, free)
    per_answer = best_k([1.0], costs, free, prefill_s=0.5, answer_tokens=11)
    assert per_step["expected_speedup"] == pytest.approx(2 / 0.15 / 10)
    assert per_answer["plain_tokens_per_s"] == pytest.approx(11 / 1.5)
    assert per_answer["expected_tokens_per_s"] == pytest.approx(11 / 1.25)
    assert per_answer["expected_speedup"] == pytest.approx(1.5 / 1.25)


def test_best_k_prices_forwards_as_decoding_paid_them():
    """The isolated table (1-token forward 10 ms) is scaled to what plain decoding paid a forward
    in the same run (12.5 ms): every width by the same 1.25, so ratios between widths stay; and
    plain's rate uses plain's own overhead, not the drafter's."""
    from specforge_lite.measurement.metrics import costs_as_decoding_paid

    costs = {1: 0.010, 2: 0.011, 4: 0.014}
    paid, scale = costs_as_decoding_paid(costs, 12.5)
    assert scale == pytest.approx(1.25)
    assert paid == pytest.approx({1: 0.0125, 2: 0.01375, 4: 0.0175})
    assert costs_as_decoding_paid(costs, None) == (costs, 1.0)  # nothing measured: the table as timed
    free = lambda k: 0.0  # noqa: E731
    own = best_k([1.0], paid, free, overhead_s=0.002, plain_overhead_s=0.0)
    assert own["plain_tokens_per_s"] == pytest.approx(1 / 0.0125)
    assert own["expected_tokens_per_s"] == pytest.approx(2 / (0.01375 + 0.002))


# --------------------------------------------------------------------------- the real target

@pytest.mark.slow
def test_smollm2_greedy_speculative_is_identical_to_plain(smollm2_target):
    """The real SmolLM2 (float32) on MT-Bench prompts: n-gram and a truncated 2-layer
    draft are token-identical to plain greedy decoding, which matches HF generate (on the first:
    plain decoding's own rule, once)."""
    from specforge_lite.data.chat import prompt_ids
    from specforge_lite.data.eval_prompts import read_eval_prompts

    model, tokenizer = smollm2_target
    assert model.dtype == torch.float32
    eos = [tokenizer.eos_token_id]
    questions = read_eval_prompts("builtin:mt_bench")
    draft = DraftModelDrafter(truncated_copy(model, 2))
    for question in (questions[0], questions[25], questions[60]):
        ids = prompt_ids(tokenizer, [{"role": "user", "content": question["turns"][0]}])
        plain = generate_plain(model, ids, 24, eos_ids=eos)
        if question is questions[0]:
            hf = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos[0])[0, len(ids):].tolist()
            assert plain.tokens == hf
        for drafter in (NgramDrafter(3), draft):
            gen = generate_speculative(model, drafter, ids, 24, 4, eos_ids=eos)
            assert gen.tokens == plain.tokens, (drafter.name, question["id"])


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bfloat16"])
def test_compiled_draft_model_drafts_like_the_eager_one(tiny_target, tmp_path, monkeypatch, dtype):
    """The draft model's compiled static forward (`DraftModelDrafter.compile`, what the distilled
    drafter and untrained_draft decode with) proposes what its eager module proposes, call for call,
    in bf16; a two-layer copy of the target, so its drafts are accepted in part (float32:
    test_fast_target.py's test of the same name, step for step)."""
    import copy

    monkeypatch.setenv("SPECFORGE_LITE_GRAPH_CACHE", str(tmp_path))
    target = copy.deepcopy(tiny_target[0]).to(dtype)
    draft = truncated_copy(target, 2)
    eager, compiled = DraftModelDrafter(draft), DraftModelDrafter(draft)
    assert compiled.compile(3, capacity=128) > 0 and compiled.runner is not None
    accepted, same = 0, []
    for ids in prompts(4, seed=2):
        a = generate_speculative(target, eager, ids, 24, 3)
        b = generate_speculative(target, compiled, ids, 24, 3)
        same.append(a.tokens == b.tokens and a.draft_lengths == b.draft_lengths
                    and a.accepted_lengths == b.accepted_lengths)
        accepted += sum(b.accepted_lengths)
    assert mostly_agree(same, dtype) and accepted > 0
