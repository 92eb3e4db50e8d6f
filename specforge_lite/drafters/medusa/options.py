"""Medusa options: the typed schema of `conf/drafter/medusa.yaml` (`drafter=medusa`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specforge_lite.config.fields import Divergence, checked


@dataclass
class MedusaOptions:
    name: str = "medusa"
    # each head's lm_head predicts over the draft vocab (the most frequent loss-masked target
    # ids); a value >= the target vocab keeps the full vocabulary
    draft_vocab_size: int = checked(8192, ge=1)
    num_heads: int = checked(4, ge=1)  # head i predicts the token i + 2 ahead
    num_layers: int = checked(1, ge=1)  # residual blocks per head
    # the per-step loss against the target's draft-vocab distribution (docs/BENCHMARKS.md
    # "EAGLE-3 learning curve"); forward_kl trains through its soft cross-entropy (same gradient)
    loss: Divergence = Divergence.forward_kl
    # start from trained heads: our train folder or a vLLM Medusa folder (its heads, blocks and
    # draft vocab replace the options above)
    init_from: Optional[str] = None
