"""Distillation options: the typed schema of `conf/drafter/distilled.yaml` (`drafter=distilled`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from specforge_lite.config.fields import Divergence, checked


@dataclass
class DistilledOptions:
    name: str = "distilled"
    student: Optional[str] = None  # an HF dir / hub id with the target's vocab; null: truncated target
    # layers of the truncated copy (first n layers, final norm, lm_head)
    student_layers: int = checked(4, ge=1, below_target="num_hidden_layers", when={"student": None})
    loss: Divergence = Divergence.forward_kl
    temperature: float = checked(1.0, gt=0.0)  # applied to both distributions; the loss is scaled by T^2
    lora: bool = False  # train LoRA adapters (merged into the weights at save) instead of all weights
    lora_rank: int = checked(16, ge=1)
    lora_alpha: int = checked(32, ge=1)
    lora_dropout: float = checked(0.0, ge=0.0, lt=1.0)
    lora_target_modules: List[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # simulated acceptance length in training logs: chains of up to this many positions
    simulated_k: int = checked(4, ge=1)
