"""The acceptance rules as pure functions: hand-computed cases, identities, and a
chi-square test that the speculative output law is the target's (and that the test
catches deliberately wrong samplers)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specforge_lite.decoding.verify import SamplingParams, greedy_verify, rejection_verify, warp_probs


# --------------------------------------------------------------------------- warping

def test_warp_temperature_one_is_softmax():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]])
    assert torch.allclose(warp_probs(logits, SamplingParams(1.0)), torch.softmax(logits, -1))


def test_warp_temperature_sharpens():
    logits = torch.tensor([1.0, 2.0, 0.5])
    assert torch.allclose(warp_probs(logits, SamplingParams(0.5)), torch.softmax(logits * 2, -1))


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    logits = probs.log()
    # 0.5 < 0.75 so 0.3 is needed too; 0.5 + 0.3 = 0.8 >= 0.75 so the 0.1s go
    out = warp_probs(logits, SamplingParams(1.0, top_p=0.75))
    assert torch.allclose(out, torch.tensor([0.0, 0.625, 0.375, 0.0]))
    # a tiny top_p keeps the argmax alone
    assert torch.allclose(warp_probs(logits, SamplingParams(1.0, top_p=1e-6)), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_greedy_params_refuse_warping_and_bad_values_fail():
    with pytest.raises(ValueError):
        warp_probs(torch.zeros(3), SamplingParams(0.0))
    with pytest.raises(ValueError):
        SamplingParams(1.0, top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(-1.0)


# --------------------------------------------------------------------------- greedy

def one_hot_logits(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_all_accepted_gives_bonus():
    assert greedy_verify([3, 4, 5], one_hot_logits([3, 4, 5, 7])) == (3, 7)


def test_greedy_first_mismatch_takes_target_token():
    assert greedy_verify([3, 9, 5], one_hot_logits([3, 4, 5, 7])) == (1, 4)
    assert greedy_verify([1, 4, 5], one_hot_logits([3, 4, 5, 7])) == (0, 3)


def test_greedy_without_drafts_is_plain_decoding():
    assert greedy_verify([], one_hot_logits([6])) == (0, 6)


# --------------------------------------------------------------------------- rejection sampling

def test_rejection_with_q_equal_p_accepts_everything():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, generator=gen), -1)
    for _ in range(200):
        drafts = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(3)]
        accepted, _ = rejection_verify(drafts, p[:3], p, gen)
        assert accepted == 3


def test_rejection_of_impossible_draft_samples_the_residual():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for _ in range(50):
        assert rejection_verify([0], q, p, gen) == (0, 1)  # p(0) = 0: reject, residual is all on 1


def test_deterministic_drafter_point_mass():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    outcomes = Counter(rejection_verify([0], None, p, gen) for _ in range(4000))
    # accept 0 with p(0) = 0.5 (then the bonus is 2); otherwise the residual excludes 0
    assert set(outcomes) == {(1, 2), (0, 1)}
    assert abs(outcomes[(1, 2)] / 4000 - 0.5) < 0.05


# --------------------------------------------------------------------------- the output law

V = 4


class ToyLM:
    """A context -> next-token law over V tokens, random but fixed per context."""

    def __init__(self, seed: int, scale: float, sampling: SamplingParams):
        self.seed, self.scale, self.sampling, self.memo = seed, scale, sampling, {}

    def probs(self, context: tuple) -> torch.Tensor:
        if context not in self.memo:
            gen = torch.Generator().manual_seed(hash((self.seed,) + context) % 2**31)
            self.memo[context] = warp_probs(torch.randn(V, generator=gen) * self.scale, self.sampling)
        return self.memo[context]


def wrong_resample_from_p(draft, q, p, gen):
    """A classic bug: on rejection, resample from p instead of max(0, p - q)."""
    accepted, _ = rejection_verify(draft, q, p, gen)
    if accepted == len(draft):
        return accepted, int(torch.multinomial(p[accepted], 1, generator=gen))
    return accepted, int(torch.multinomial(p[accepted], 1, generator=gen))


def wrong_accept_if_q_likes_it(draft, q, p, gen):
    """Another bug: accept with probability q(x) instead of min(1, p(x)/q(x))."""
    for i, x in enumerate(draft):
        if float(torch.rand(1, generator=gen)) >= float(q[i, x]):
            residual = (p[i] - q[i]).clamp(min=0)
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=gen))


def first_two_tokens(target: ToyLM, draft: ToyLM | None, k: int, verify, gen, context=(0,)) -> tuple[int, int]:
    """Speculative decoding on toy LMs until two tokens are out; draft None = n-gram-like
    deterministic drafter that always proposes token 0."""
    out: list[int] = []
    while len(out) < 2:
        ctx = context + tuple(out)
        tokens, qs = [], []
        for _ in range(k):
            if draft is None:
                tokens.append(0)
            else:
                q = draft.probs(ctx + tuple(tokens))
                qs.append(q)
                tokens.append(int(torch.multinomial(q, 1, generator=gen)))
        p = torch.stack([target.probs(ctx + tuple(tokens[:i])) for i in range(k + 1)])
        accepted, nxt = verify(tokens, torch.stack(qs) if qs else None, p, gen)
        out += tokens[:accepted] + [nxt]
    return out[0], out[1]


def chi_square(counts: Counter, expected: dict, n: int) -> tuple[float, float]:
    """Pearson statistic and its 0.1% critical value (Wilson-Hilferty approximation)."""
    for cell, count in counts.items():
        assert expected.get(cell, 0.0) > 0 or count == 0, f"sampled impossible pair {cell}"
    cells = [c for c, e in expected.items() if e > 0]
    stat = sum((counts.get(c, 0) - n * expected[c]) ** 2 / (n * expected[c]) for c in cells)
    df = len(cells) - 1
    z = 3.0902  # upper 0.1% normal quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def exact_first_two(target: ToyLM, context=(0,)) -> dict:
    p1 = target.probs(context)
    return {(a, b): float(p1[a] * target.probs(context + (a,))[b]) for a in range(V) for b in range(V)}


CASES = {
    "T=1": (SamplingParams(1.0), 2.0, 3),
    "T=0.9,top_p=0.9": (SamplingParams(0.9, 0.9), 1.0, 2),  # top-p leaves 12 of 16 pairs possible
}


@pytest.mark.parametrize("case", CASES)
def test_speculative_law_equals_target_law(case):
    sampling, scale, k = CASES[case]
    target, draft = ToyLM(1, scale, sampling), ToyLM(2, scale, sampling)
    gen = torch.Generator().manual_seed(123)
    n = 20000
    counts = Counter(first_two_tokens(target, draft, k, rejection_verify, gen) for _ in range(n))
    stat, critical = chi_square(counts, exact_first_two(target), n)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: the output law is not the target's"


def test_deterministic_drafter_law_equals_target_law():
    sampling = SamplingParams(1.0)
    target = ToyLM(3, 2.0, sampling)
    gen = torch.Generator().manual_seed(7)
    n = 20000
    counts = Counter(first_two_tokens(target, None, 2, rejection_verify, gen) for _ in range(n))
    stat, critical = chi_square(counts, exact_first_two(target), n)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


@pytest.mark.parametrize("wrong", [wrong_resample_from_p, wrong_accept_if_q_likes_it])
def test_chi_square_rejects_a_wrong_sampler(wrong):
    sampling = SamplingParams(1.0)
    target, draft = ToyLM(1, 2.0, sampling), ToyLM(2, 2.0, sampling)
    gen = torch.Generator().manual_seed(123)
    n = 20000
    counts = Counter(first_two_tokens(target, draft, 3, wrong, gen) for _ in range(n))
    stat, critical = chi_square(counts, exact_first_two(target), n)
    assert stat > critical, f"the test did not catch {wrong.__name__} (chi-square {stat:.1f} < {critical:.1f})"
