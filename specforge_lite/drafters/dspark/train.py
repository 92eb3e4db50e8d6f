"""DSpark training: DFlash's (`dflash/train.py`: anchors, per-row weights, the draft loss; its loss
also adds the confidence head's binary loss where the drafter has one) with the DSpark module."""

from __future__ import annotations

from pathlib import Path

import torch

from specforge_lite.drafters.dflash import train as dflash_train
from specforge_lite.drafters.dspark.model import DSparkConfig, DSparkDrafter

KIND = (DSparkConfig, DSparkDrafter)


def build(cfg, target, token_counts: torch.Tensor) -> DSparkDrafter:
    """DFlash's build (draft vocab, the target's embedding and head rows) with both heads random."""
    return dflash_train.build(cfg, target, token_counts, kind=KIND)


def describe(drafter: DSparkDrafter) -> str:
    c = drafter.config
    confidence = ("confidence head" + (" (with the Markov embedding)" if c.confidence_with_markov else "")
                  if c.confidence_head else "no confidence head")
    readout = "the anchor row drafts too" if c.sample_from_anchor else "mask rows draft"
    return f"{dflash_train.describe(drafter)}; {c.markov_head_type} Markov head of rank {c.markov_rank}, " \
           f"{confidence}, {readout}"


def save(drafter: DSparkDrafter, directory: Path, extra: dict | None = None) -> None:
    dflash_train.save(drafter, directory, extra, name="dspark")


def load(directory: Path, target) -> DSparkDrafter:
    return dflash_train.load(directory, target, kind=KIND)


def activation_bytes(cfg: DSparkConfig, batch: int, seq: int, anchors: int, checkpointing: bool) -> int:
    """DFlash's, and the heads': the Markov bias [B, Q, V_d] fp32 beside the logits (twice, its
    gradient), the embeddings and, for the rnn head, its per-row states [B, Q, 5r]."""
    q = batch * anchors * cfg.block_size
    heads = q * (2 * cfg.draft_vocab_size + (6 if cfg.markov_head_type == "rnn" else 2) * cfg.markov_rank) * 4
    return dflash_train.activation_bytes(cfg, batch, seq, anchors, checkpointing) + heads
