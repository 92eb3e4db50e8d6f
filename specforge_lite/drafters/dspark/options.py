"""DSpark options: the typed schema of `conf/drafter/dspark.yaml` (`drafter=dspark`): DFlash's, and
the Markov and confidence heads'."""

from __future__ import annotations

from dataclasses import dataclass

from specforge_lite.config.fields import checked
from specforge_lite.drafters.dflash.options import DFlashOptions


@dataclass
class DSparkOptions(DFlashOptions):
    name: str = "dspark"
    # true (speculators' and DeepSeek's default): the anchor row drafts too, one forward proposes
    # block_size tokens; false: the anchor row predicts nothing, block_size - 1 tokens (DFlash's way)
    sample_from_anchor: bool = True
    # the Markov head's low-rank logit bias W2 @ W1[previous token]; vLLM 0.32 serves vanilla only
    markov_rank: int = checked(256, ge=1)
    markov_head_type: str = checked("vanilla", choices=("vanilla", "gated", "rnn"))
    # the per-position acceptance head, its input also the previous token's Markov embedding
    confidence_head: bool = True
    confidence_with_markov: bool = True
    # the confidence loss's weight beside the draft loss, and what it predicts: overlap, the
    # chance the target accepts a sampled draft (1 - total variation, speculators'), or greedy,
    # whether the drafter's argmax is the target's
    confidence_alpha: float = checked(1.0, ge=0.0)
    confidence_target: str = checked("overlap", choices=("overlap", "greedy"))
