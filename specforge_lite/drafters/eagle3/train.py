"""EAGLE-3 training: build for a target, the TTT loss, and the saved training folder."""

from __future__ import annotations


import torch
from torch import nn

from specforge_lite import SpecforgeError
from specforge_lite.drafters.common import (draft_vocab_preparer, shifted_targets, stepwise_loss)
from specforge_lite.drafters.eagle3.export import load_any
from specforge_lite.drafters.eagle3.model import Eagle3Config, Eagle3Drafter


def build(cfg, target, token_counts: torch.Tensor) -> Eagle3Drafter:
    """A drafter for `target` with the draft vocab taken from loss-masked token counts."""
    from specforge_lite.drafters.vocab import target_draft_vocab

    if cfg.drafter.get("init_from"):
        return warm_start(cfg, target)
    draft_cfg = Eagle3Config.from_target(target.config, cfg.drafter)
    if draft_cfg.norm_before_fc and draft_cfg.fc_norm:
        raise SpecforgeError("drafter.norm_before_fc and drafter.fc_norm exclude each other: set one of them")
    check_aux_layers(draft_cfg.aux_layer_ids, target.config, "drafter.aux_layer_ids")
    draft_vocab = target_draft_vocab(target, token_counts, draft_cfg.draft_vocab_size)
    torch.manual_seed(cfg.train.seed)
    drafter = Eagle3Drafter(draft_cfg)
    std = target.config.initializer_range
    for module in drafter.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
    drafter.init_residual_path()
    drafter.init_from_target(target, draft_vocab)
    return drafter.to(target.device)


def check_aux_layers(aux_layer_ids: list[int], target_config, where: str) -> None:
    """Exactly 3 aux layers (vLLM enforces it for EAGLE-3 and the drafters it loads as EAGLE-3),
    each one of the target's decoder layers; `where` names the setting in the message."""
    if len(aux_layer_ids) != 3:
        raise SpecforgeError(f"{where}: aux layers {list(aux_layer_ids)}; EAGLE-3 drafters take exactly 3 aux layers "
                             "(vLLM enforces it)")
    layers = target_config.num_hidden_layers
    for layer_id in aux_layer_ids:
        if not 0 <= layer_id < layers:
            raise SpecforgeError(f"{where}: aux layer {layer_id} is outside the target's decoder layers 0..{layers - 1}")


def warm_start(cfg, target) -> Eagle3Drafter:
    """`drafter.init_from=DIR`: continue training a drafter from a folder in any layout we read;
    its architecture (draft vocab, aux layers, norm switches) comes from the folder, its
    embedding from the target (frozen, as always)."""
    drafter = load_any(cfg.drafter.init_from, target)
    check_aux_layers(drafter.config.aux_layer_ids, target.config, f"drafter.init_from={cfg.drafter.init_from}")
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    drafter.train()
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


def target_layers(drafter: Eagle3Drafter) -> list[int]:
    return list(drafter.config.aux_layer_ids)


def describe(drafter: Eagle3Drafter) -> str:
    c = drafter.config
    return f"draft vocab {c.draft_vocab_size} of {c.vocab_size}, aux layers {c.aux_layer_ids}"


def batch_preparer(drafter: Eagle3Drafter, target):
    return draft_vocab_preparer(target, drafter.draft_vocab, drafter.t2d)


def loss_and_metrics(drafter, batch: dict, cfg):
    """Summed (not averaged) weighted loss and counts for one micro-batch.

    drafter: an `Eagle3Drafter` or its DDP wrapper (called, so gradients synchronise).
    batch: `input_ids` [B, T], `aux_hidden` [B, T, 3H], `target_logits` [B, T, V_d] and
    `valid` [B, T] (see `common.draft_vocab_preparer`). TTT step j (cfg.drafter.ttt_steps
    of them) is weighted cfg.train.step_weight ** j; see `common.stepwise_loss`.
    """
    steps = cfg.drafter.ttt_steps
    outputs = drafter(batch["input_ids"], batch["aux_hidden"], steps)
    return stepwise_loss(outputs, shifted_targets(batch["target_logits"], batch["valid"], steps),
                         cfg.train.step_weight, cfg.drafter.loss)


# ---------------------------------------------------------------------- save / load
