"""Medusa training: build for a target, the per-head loss, and the saved training folder."""

from __future__ import annotations


import torch

from specforge_lite import SpecforgeError
from specforge_lite.drafters.common import (draft_vocab_preparer, shifted_targets, stepwise_loss)
from specforge_lite.drafters.medusa.export import load_any
from specforge_lite.drafters.medusa.model import MedusaConfig, MedusaHeads


def build(cfg, target, token_counts: torch.Tensor) -> MedusaHeads:
    from specforge_lite.drafters.vocab import target_draft_vocab

    if cfg.drafter.get("init_from"):  # warm start: the folder's heads, trained further
        heads = load_any(cfg.drafter.init_from, target)
        if heads.config.hidden_size != target.config.hidden_size:
            raise SpecforgeError(f"drafter.init_from={cfg.drafter.init_from}: heads of hidden size "
                                 f"{heads.config.hidden_size}, the target has {target.config.hidden_size}")
        return heads.train()

    medusa_cfg = MedusaConfig.from_target(target.config, cfg.drafter)
    draft_vocab = target_draft_vocab(target, token_counts, medusa_cfg.draft_vocab_size)
    heads = MedusaHeads(medusa_cfg)
    heads.init_from_target(target, draft_vocab)
    return heads.to(target.device)


def describe(heads: MedusaHeads) -> str:
    c = heads.config
    return f"{c.num_heads} heads x {c.num_layers} residual blocks, draft vocab {c.draft_vocab_size} of {c.vocab_size}"


def target_layers(heads: MedusaHeads) -> list[int]:
    return []  # only the final hidden state


def batch_preparer(heads: MedusaHeads, target):
    return draft_vocab_preparer(target, heads.draft_vocab, heads.t2d)


def loss_and_metrics(heads, batch: dict, cfg):
    """Head i at anchor t against the target's distribution of x[t+2+i], weighted
    cfg.train.step_weight ** i, only at positions whose token is learnable (`valid`)."""
    raw = heads.module if hasattr(heads, "module") else heads
    targets = shifted_targets(batch["target_logits"], batch["valid"], raw.config.num_heads)
    outputs = heads(batch["last_hidden"], [mask.bool() for _, mask in targets])
    return stepwise_loss(outputs, targets, cfg.train.step_weight, cfg.drafter.loss)
