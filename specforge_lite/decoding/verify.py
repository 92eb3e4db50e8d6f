"""Acceptance rules of chain speculative decoding, as pure functions over tensors.

Greedy: accept draft tokens while they equal the target's argmax; the first
mismatch is replaced by the target's token; if all are accepted the target adds
a bonus token. The output is the target's own greedy output.

Sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft token x with
probability min(1, p(x) / q(x)); on rejection draw from normalise(max(0, p - q));
after k acceptances draw the bonus token from p. The emitted tokens are then
distributed exactly as the target's own samples, provided p and q went through the
same temperature / top-p transform (`warp_probs`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specforge_lite.contract import GREEDY, SamplingParams  # noqa: F401  (re-exported: the rules' input)


def warp_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature and top-p (nucleus) filtering.

    logits: [..., V] -> probs [..., V] (float32, rows sum to 1). Top-p keeps the
    smallest set of most likely tokens whose mass reaches `top_p` (at least one).
    Apply the same call to target and draft logits.
    """
    if sampling.greedy:
        raise ValueError("warp_probs needs temperature > 0; greedy decoding uses argmax")
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def pick_tokens(logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token(s) from logits [..., V] (one row [V] or a batch [B, V]): argmax when
    greedy, else one draw from `warp_probs`. Returns [...] token ids."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(warp_probs(logits, sampling), 1, generator=generator).squeeze(-1)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One draw from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_verify(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy acceptance.

    draft_tokens: k proposed ids; target_logits: [k + 1, V], row i is the target's
    prediction after the context and draft_tokens[:i].
    Returns (num_accepted, next_token): the first num_accepted drafts are kept and
    next_token (the target's correction, or the bonus token when all k match) follows.
    """
    choices = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    for draft, choice in zip(draft_tokens, choices):
        if draft != choice:
            break
        accepted += 1
    return accepted, choices[accepted]


def rejection_verify(draft_tokens: Sequence[int], draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative (rejection) sampling.

    draft_tokens: k ids drawn from the drafter; draft_probs: [k, V] the drafter's
    (warped) distributions they were drawn from, or None for a deterministic drafter
    (q is then a point mass on each draft token, as for n-gram lookup);
    target_probs: [k + 1, V] the target's warped distributions.
    Returns (num_accepted, next_token) as `greedy_verify`.
    """
    k = len(draft_tokens)
    accepted = k
    if k:
        positions = torch.arange(k)
        drafts = torch.as_tensor(draft_tokens, dtype=torch.long, device=target_probs.device)
        p_x = target_probs[positions, drafts]
        q_x = draft_probs[positions, drafts] if draft_probs is not None else torch.ones_like(p_x)
        u = torch.rand(k, generator=generator, device=target_probs.device)
        # u < p/q written without the division (q(x) > 0 since x was drawn from q)
        rejected = (u * q_x >= p_x).nonzero()
        if len(rejected):
            accepted = int(rejected[0])
    if accepted == k:
        return accepted, sample_token(target_probs[k], generator)
    if draft_probs is not None:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_(min=0.0)
    else:
        residual = target_probs[accepted].clone()
        residual[draft_tokens[accepted]] = 0.0
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: a rejection is (almost) impossible, p is the right law
        return accepted, sample_token(target_probs[accepted], generator)
    return accepted, sample_token(residual / total, generator)
