"""EAGLE-3 options: the typed schema of `conf/drafter/eagle3.yaml` (`drafter=eagle3`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class Eagle3Options:
    name: str = "eagle3"
    # the lm_head predicts over the draft vocab (the most frequent loss-masked target ids);
    # a value >= the target vocab keeps the full vocabulary
    draft_vocab_size: int = 8192
    aux_layer_ids: Optional[List[int]] = None  # null: [2, L//2, L-3]
    ttt_steps: int = 3  # training-time test unroll
    # the residual stream starts from hidden_norm(fused features), as speculators trains and vLLM
    # assumes by default; measured better on SmolLM2 (docs/BENCHMARKS.md "EAGLE-3 training options").
    # SGLang's layout cannot express it: train with false to export for SGLang
    norm_before_residual: bool = True
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states before fc (speculators' option)
