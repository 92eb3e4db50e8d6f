"""Medusa-1: K heads of residual blocks over the frozen target's last hidden state,
head i predicting the token i + 2 ahead.

The drafter contract (`specforge_lite.contract.DrafterModule`):
`options`, `model`, `train`, `decode`, `export` (vLLM's Medusa format).
"""

from __future__ import annotations

import torch

from specforge_lite.contract import DrySize
from specforge_lite.drafters.medusa.decode import MedusaDecodeDrafter
from specforge_lite.drafters.medusa.export import export, layout
from specforge_lite.drafters.medusa.export import load_any as load
from specforge_lite.drafters.medusa.model import MedusaConfig, MedusaHeads, save, trained_weights
from specforge_lite.drafters.medusa.options import MedusaOptions as Options
from specforge_lite.drafters.medusa.train import batch_preparer, build, describe, loss_and_metrics, target_layers

NAME = "medusa"
UNTRACKED_OPTIONS: tuple[str, ...] = ()
SERVING_NOTE = ("vLLM serves Medusa only up to 0.32 (0.33 removed it), and 0.32 only with the full vocabulary "
                "(drafter.draft_vocab_size at least the target's)")
VLLM_SERVING = ("medusa", "medusa")  # vLLM speculative method, export subfolder
LLAMACPP_SERVING = "llama.cpp has no Medusa drafter (its speculative types: draft-simple, draft-eagle3, draft-dflash, n-gram ones)"
READS_LAST_HIDDEN = True  # its heads read the target's last hidden state
DRAFTS_TREES = True  # its decoder has propose_tree (Medusa's sparse tree over the heads): medusa_tree, medusa_mixed_tree


def decoder(heads: MedusaHeads) -> MedusaDecodeDrafter:
    return MedusaDecodeDrafter(heads)


def dry_size(cfg, target_config, batch: int, seq: int) -> DrySize:
    """Per head: block activations [B, T, H] x2 per layer and four [B, T, V_d] fp32 tensors kept
    for the backward (its logits, their log-softmax, the target's shifted logits and softmax),
    plus two the step under way holds (tests/integration/test_memory_estimate.py measures them)."""
    medusa_cfg = MedusaConfig.from_target(target_config, cfg.drafter)
    with torch.device("meta"):
        heads = MedusaHeads(medusa_cfg)
    params = sum(p.numel() for p in heads.parameters())
    vd, h = medusa_cfg.draft_vocab_size, medusa_cfg.hidden_size
    return DrySize(
        trainable_params=params,
        facts={"num_heads": medusa_cfg.num_heads, "num_layers": medusa_cfg.num_layers, "draft_vocab_size": vd},
        line=(f"  Medusa: {medusa_cfg.num_heads} heads x {medusa_cfg.num_layers} blocks, {params / 1e6:.1f}M "
              f"trainable, draft vocab {vd}"),
        activation_bytes=medusa_cfg.num_heads * batch * seq * (vd * 4 * 4 + medusa_cfg.num_layers * 2 * h * 4)
        + batch * seq * vd * 4 * 2,
        target_logits_bytes=batch * seq * vd * 4)


__all__ = ["NAME", "Options", "UNTRACKED_OPTIONS", "SERVING_NOTE", "VLLM_SERVING", "LLAMACPP_SERVING",
           "READS_LAST_HIDDEN", "build", "target_layers", "batch_preparer",
           "loss_and_metrics", "trained_weights", "describe", "save", "load", "layout", "decoder", "export", "dry_size"]
