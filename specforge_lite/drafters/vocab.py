"""The reduced draft vocabulary of EAGLE-3 and its maps to the target vocabulary."""

from __future__ import annotations

from typing import Iterable

import torch

from specforge_lite.decoding.verify import warp_probs


def count_tokens(sequences: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> torch.Tensor:
    """[V] counts of target ids at loss-masked positions over `(input_ids, loss_mask)` pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in sequences:
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        mask_t = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids_t[mask_t], minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """[size] sorted target ids: `always` (e.g. EOS) first, then the most frequent.

    Ties (and tokens never seen, when fewer than `size` were) go to the lower id, so
    the result is deterministic.
    """
    vocab_size = counts.numel()
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocab size {size} must be in (0, {vocab_size}]")
    score = counts.double() - torch.arange(vocab_size, dtype=torch.double) / (2 * vocab_size)
    forced = sorted(set(int(i) for i in always))
    score[forced] = float("inf")
    return score.topk(size).indices.sort().values


def target_draft_vocab(target, counts: torch.Tensor, size: int) -> torch.Tensor:
    """`build_draft_vocab` for an HF target, its EOS id(s) always in (a `size` equal to the
    target's vocabulary gives every id: the identity map)."""
    from specforge_lite.targets.loading import eos_token_ids

    return build_draft_vocab(counts, size, always=eos_token_ids(target))


def vocab_maps(draft_vocab: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`d2t` [V_d] int64 offsets (target id = i + d2t[i]) and `t2d` [V] bool membership."""
    draft_vocab = draft_vocab.to(torch.long).cpu()
    d2t = draft_vocab - torch.arange(draft_vocab.numel(), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_vocab] = True
    return d2t, t2d


@torch.no_grad()
def copy_target_head(drafter, target, draft_vocab: torch.Tensor, vocab_size: int) -> None:
    """Into `drafter` (embed_tokens, lm_head over the draft vocab, norm, d2t / t2d buffers): the
    target's embeddings, its lm_head rows of `draft_vocab`, its final norm where the shapes agree,
    and the vocab maps."""
    drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_vocab])
    final_norm = getattr(getattr(target, "model", None), "norm", None)
    if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(final_norm.weight)
    d2t, t2d = vocab_maps(draft_vocab, vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)


def sample_independent_rows(logits: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, sampling,
                            generator) -> tuple[list[int], torch.Tensor]:
    """One target-vocab draw per row of draft-vocab `logits` [n, draft V] from the row's warped law
    (rows drafted in one forward, so no row's law depends on the draws before it).
    Returns (tokens, laws [n, V] over the target vocabulary: each draw's q for acceptance)."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    full[:, draft_vocab] = logits
    probs = torch.stack([warp_probs(row, sampling) for row in full])
    return [int(torch.multinomial(q, 1, generator=generator)) for q in probs], probs
