"""The distilled student in the decoding engine: the engine's own draft-model drafter
(autoregressive with its own KV cache) around the trained LM."""

from __future__ import annotations

from specforge_lite.decoding.drafters import DraftModelDrafter


def decoder(lm) -> DraftModelDrafter:
    drafter = DraftModelDrafter(lm)
    drafter.name = "distilled"
    return drafter
