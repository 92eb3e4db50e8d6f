"""P-EAGLE options: the typed schema of `conf/drafter/peagle.yaml` (`drafter=peagle`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from specforge_lite.config.fields import Divergence, checked


@dataclass
class PEagleOptions:
    name: str = "peagle"
    # the lm_head predicts over the draft vocab (the most frequent loss-masked target ids);
    # a value >= the target vocab keeps the full vocabulary
    draft_vocab_size: int = checked(8192, ge=1)
    # null: [2, L//2, L-3], as EAGLE-3; each below the target's layer count
    aux_layer_ids: Optional[List[int]] = checked(None, length=3, ge=0, below_target="num_hidden_layers")
    num_layers: int = checked(4, ge=1)  # decoder layers (speculators' default 4): the first is EAGLE-3's 2H-wide layer
    num_depths: int = checked(4, ge=1)  # tokens drafted in parallel, depths 0..D-1; the export's speculative_tokens
    # the input token of depths >= 1 (vLLM's pard_token); null: the highest target id that never
    # occurs in the loss-masked training tokens (a reserved token on Llama 3)
    mask_token_id: Optional[int] = checked(None, ge=0, below_target="vocab_size")
    # conditional drop-token sampling: depth d >= 1 trains on about n * max(r^d, floor) anchors
    # of a sequence's n depth-0 loss positions (speculators' defaults 0.7 and 0.2)
    down_sample_ratio: float = checked(0.7, gt=0.0, le=1.0)
    down_sample_ratio_min: float = checked(0.2, ge=0.0, le=1.0)
    # loss weight of depth d is depth_weight ** d; the drop-token sampling already thins depth d
    # to about r^d of the positions, so 1.0 (speculators') still weighs deep depths less
    depth_weight: float = checked(1.0, gt=0.0)
    # the per-step loss against the target's draft-vocab distribution (docs/BENCHMARKS.md
    # "EAGLE-3 learning curve"); forward_kl trains through its soft cross-entropy (same gradient)
    loss: Divergence = Divergence.forward_kl
    train_embeddings: bool = True  # speculators trains P-EAGLE's embed_tokens and exports them
    norm_before_residual: bool = True  # as EAGLE-3 (vLLM defaults it to false for peagle: always written)
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states before fc
    # a trained EAGLE-3 drafter folder (train/drafter) to start from: fc, layer 0, norm, lm_head and
    # the draft vocab are copied; the extra layers start as identities
    init_from_eagle3: Optional[str] = None
