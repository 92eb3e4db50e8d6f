"""Speculative decoding (batch 1) over Hugging Face causal LMs.

- `verify`: the acceptance rules (greedy, rejection sampling) as pure functions;
- `drafters`: the `Drafter` interface, n-gram lookup and draft-model drafters;
- `engine`: our plain loop and chain speculative decoding with KV caches;
- `peers`: Hugging Face's own decoders, measured in the same table;
- `metrics`: tau, per-position acceptance, forward costs and the best k.
"""

from specforge_lite.decoding.drafters import (DRAFTERS, DraftContext, DraftModelDrafter, DraftProposal, Drafter,
                                              NgramDrafter, truncated_copy)
from specforge_lite.decoding.engine import Generation, TargetRunner, generate_plain, generate_speculative
from specforge_lite.decoding.verify import GREEDY, SamplingParams, greedy_verify, rejection_verify, warp_probs

__all__ = [
    "DRAFTERS", "DraftContext", "DraftModelDrafter", "DraftProposal", "Drafter", "GREEDY", "Generation",
    "NgramDrafter", "SamplingParams", "TargetRunner", "generate_plain", "generate_speculative",
    "greedy_verify", "rejection_verify", "truncated_copy", "warp_probs",
]
