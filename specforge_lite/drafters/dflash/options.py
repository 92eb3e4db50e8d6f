"""DFlash options: the typed schema of `conf/drafter/dflash.yaml` (`drafter=dflash`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from specforge_lite.config.fields import Divergence, checked


@dataclass
class DFlashOptions:
    name: str = "dflash"
    # the frozen lm_head predicts over the draft vocab (the target's head rows of the most frequent
    # loss-masked target ids); a value >= the target vocab keeps the full vocabulary
    draft_vocab_size: int = checked(8192, ge=1)
    # target hidden states fused by fc, as Hugging Face `output_hidden_states` indices (the input of
    # decoder layer k; vLLM's `aux_hidden_state_layer_ids`); null: [2, L//2, L-3]; any count >= 1
    aux_layer_ids: Optional[List[int]] = checked(None, ge=0, below_target="num_hidden_layers")
    num_layers: int = checked(5, ge=1)  # drafter decoder layers (speculators' default 5)
    # a block is the anchor (the last accepted token) and block_size - 1 mask positions: one
    # drafter forward proposes up to block_size - 1 tokens; at most data.max_length
    block_size: int = checked(16, ge=2)
    # training anchors drawn per sequence (without replacement, among positions whose next token
    # carries a loss); each anchor's whole block is predicted in the same forward
    num_anchors: int = checked(64, ge=1)
    # false: the positions of a block see each other (DFlash); true: each sees the ones before it
    # (the variant attention backends without non-causal support serve)
    causal: bool = False
    # the input token of the block's mask positions; null: the highest target id that never occurs
    # in the loss-masked training tokens
    mask_token_id: Optional[int] = checked(None, ge=0, below_target="vocab_size")
    # the loss weight of block position j: exp_decay exp(-(j - 1) / decay_gamma); dpace weighs j by
    # the drafter's expected acceptance of positions >= j (D-PACE, smoothed by dpace_alpha)
    position_weight: str = checked("exp_decay", choices=("exp_decay", "dpace"))
    decay_gamma: float = checked(4.0, gt=0.0)
    dpace_alpha: float = checked(0.5, ge=0.0, le=1.0)
    # the per-position loss against the target's draft-vocab distribution; forward_kl trains
    # through its soft cross-entropy (same gradient)
    loss: Divergence = Divergence.forward_kl
