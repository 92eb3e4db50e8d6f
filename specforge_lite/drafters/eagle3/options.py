"""EAGLE-3 options: the typed schema of `conf/drafter/eagle3.yaml` (`drafter=eagle3`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from specforge_lite.config.fields import Divergence, checked


@dataclass
class Eagle3Options:
    name: str = "eagle3"
    # the lm_head predicts over the draft vocab (the most frequent loss-masked target ids);
    # a value >= the target vocab keeps the full vocabulary
    draft_vocab_size: int = checked(8192, ge=1)
    # null: [2, L//2, L-3]; HF output_hidden_states ids, each below the target's layer count
    aux_layer_ids: Optional[List[int]] = checked(None, length=3, ge=0, below_target="num_hidden_layers")
    ttt_steps: int = checked(3, ge=1)  # training-time test unroll
    # the per-step loss against the target's draft-vocab distribution (docs/BENCHMARKS.md
    # "EAGLE-3 learning curve"); forward_kl trains through its soft cross-entropy (same gradient)
    loss: Divergence = Divergence.forward_kl
    # the residual stream starts from hidden_norm(fused features), as speculators trains and vLLM
    # assumes by default; measured better on SmolLM2 (docs/BENCHMARKS.md "EAGLE-3 training options").
    # SGLang's layout cannot express it: train with false to export for SGLang
    norm_before_residual: bool = True
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states before fc (speculators' option)
    # EAGLE-3.1 (speculators' training defaults, read by vLLM): fc_norm normalises each aux state
    # before fc (excludes norm_before_fc); norm_output feeds the normalised output to the next step
    fc_norm: bool = False
    norm_output: bool = False
    # start from a trained EAGLE-3 drafter: our train folder, a speculators export or an SGLang /
    # SpecForge folder (its architecture replaces the options above; the target's embedding is used)
    init_from: Optional[str] = None
