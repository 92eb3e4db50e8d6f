"""The verifier: what the target keeps of a draft, for chains and trees, as pure functions over tensors.

A draft is a tree (`tree.DraftTree`) below the pending token; a chain of k drafts is the
one-branch tree. `accept` is the one entry point the decoding loop calls; it returns the
accepted path (node indices from the root down) and the next token.

Greedy: walk down from the root, moving to the child whose token equals the target's argmax at
the current row; stop where none does and emit the argmax there (the correction, or the bonus
token below an accepted leaf). The output is the target's own greedy output. On a chain this is
`greedy_verify`: accept drafts while they equal the argmax.

Sampling (Leviathan et al. 2023, Chen et al. 2023; SpecInfer's multi-candidate rule for trees,
EAGLE-2's tree version): at the current row with target law p, try its children in order; accept
child x with probability min(1, p(x) / q(x)); on rejection p <- normalise(max(0, p - q)). q is
the law the child was drawn from (siblings drawn independently from it), or a point mass on x
for a deterministic drafter (n-gram matches, top-b children). Where every child is rejected, or
below a leaf, the next token is drawn from p. The emitted tokens are distributed exactly as the
target's own samples, provided p and q went through the same temperature / top-p transform
(`warp_probs`). On a chain, where each row has one child, the same rule is `rejection_verify`,
which draws the chain's uniforms in one call (`sample_accept` draws one per child tried: the
two rules have the target's law, tests/unit/test_tree.py and test_verify.py, but use a generator differently, and a
chain keeps its own draws so that a seeded answer stays the same).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specforge_lite.contract import GREEDY, SamplingParams  # noqa: F401  (re-exported: the rules' input)
from specforge_lite.decoding.tree import DraftTree


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


def greedy_accept(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance over a tree.

    target_logits: [N + 1, V], row 0 after the root, row 1 + i after node i.
    Returns (path, next_token): the accepted nodes from the root down (indices into the
    tree; [] when the root's choice is no child) and the target's token after them."""
    choices = target_logits.argmax(dim=-1).tolist()
    path, node = [], -1
    while True:
        choice = choices[node + 1]
        child = tree.find_child(node, choice)
        if child is None:
            return path, choice
        path.append(child)
        node = child


def sample_accept(tree: DraftTree, target_probs: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The multi-candidate rejection rule over a tree (the module's docstring).

    target_probs: [N + 1, V] the target's warped laws (rows as `greedy_accept`); tree.probs
    the drafter's warped laws after the same transform, or None for point masses.
    Returns (path, next_token) as `greedy_accept`."""
    path, node = [], -1
    while True:
        p = target_probs[node + 1].clone()
        moved = False
        for child in tree.children(node):
            x = tree.tokens[child]
            q = tree.probs[child] if tree.probs is not None else None
            q_x = float(q[x]) if q is not None else 1.0
            u = float(torch.rand(1, generator=generator, device=p.device))
            if u * q_x < float(p[x]):  # u < p(x) / q(x) without the division
                path.append(child)
                node, moved = child, True
                break
            if q is not None:
                residual = (p - q).clamp_(min=0.0)
            else:  # a copy: p must stay whole for the case below
                residual = p.clone()
                residual[x] = 0.0
            total = residual.sum()
            if total <= 0:  # p == q (or p all on x) up to rounding: p stays the right law
                continue
            p = residual / total
        if not moved:
            return path, sample_token(p, generator)


def accept(tree: DraftTree, chain: bool, target_logits: torch.Tensor, sampling: SamplingParams,
           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """What the target keeps of `tree` (`chain`: a one-branch tree, verified causally) from its
    verify forward's logits [N + 1, V]: (the accepted path, the next token)."""
    if chain:
        if sampling.greedy:
            accepted, token = greedy_verify(tree.tokens, target_logits)
        else:
            accepted, token = rejection_verify(tree.tokens, tree.probs, warp_probs(target_logits, sampling), generator)
        return list(range(accepted)), token
    if sampling.greedy:
        return greedy_accept(tree, target_logits)
    return sample_accept(tree, warp_probs(target_logits, sampling), generator)
