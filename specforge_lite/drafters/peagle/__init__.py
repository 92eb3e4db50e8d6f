"""P-EAGLE: EAGLE-3's feature fusion and N Llama-style layers that predict depths 0..D-1 in
parallel, the missing target features replaced by a learned mask hidden state and the
missing tokens by `mask_token_id`; trained with conditional drop-token sampling, decoded
with all k drafts from one drafter forward, exported in the speculators format vLLM serves
with parallel drafting (arXiv 2602.01469; speculators `models/peagle`).

The drafter contract (`specforge_lite.contract.DrafterModule`):
`options` (typed config), `model` (the module, the drop-token layout and its attention mask),
`train` (build, loss, save / load), `decode` (the engine drafter), `export` (speculators format).
"""

from __future__ import annotations

import torch

from specforge_lite.contract import DrySize
from specforge_lite.training.losses import loss_bytes
from specforge_lite.drafters.peagle.decode import PEagleDecodeDrafter
from specforge_lite.drafters.peagle.export import export, layout
from specforge_lite.drafters.peagle.export import load_any as load
from specforge_lite.drafters.peagle.model import PEagleConfig, PEagleDrafter
from specforge_lite.drafters.peagle.options import PEagleOptions as Options
from specforge_lite.drafters.peagle.train import (batch_preparer, build, describe, loss_and_metrics, save,
                                                  target_layers, trained_weights)

NAME = "peagle"
UNTRACKED_OPTIONS: tuple[str, ...] = ()
SERVING_NOTE = ("vLLM serves P-EAGLE on its EAGLE-3 proposer: pass "
                "--speculative-config '{\"method\": \"eagle3\", ..., \"parallel_drafting\": true}' (export README)")
# vLLM serves the export on its EAGLE-3 proposer with parallel drafting (evaluate's vllm_peagle;
# tests/integration/test_vllm.py serves one)
VLLM_SERVING = ("eagle3", "speculators", {"parallel_drafting": True})
LLAMACPP_SERVING = ("llama.cpp has no P-EAGLE drafter (parallel drafting with a mask token); its EAGLE-3 graph "
                    "drafts one token per forward")
READS_LAST_HIDDEN = False  # trains on aux layers and the teacher's logits (int4_topk features work)
DRAFTS_TREES = True  # its decoder has propose_tree (best cumulative paths over the depths): peagle_tree, peagle_mixed_tree


def decoder(drafter: PEagleDrafter) -> PEagleDecodeDrafter:
    return PEagleDecodeDrafter(drafter)


def dry_size(cfg, target_config, batch: int, seq: int) -> DrySize:
    """Built on the meta device. A row holds N = T * (1 + sum_d max(r^d, floor)) entries
    (every depth-0 anchor, the kept deeper ones at most), not T * D. Activations per layer
    ~ [B, N, 12H] fp32 and attention scores [B, heads, N, N] fp32 x2 (one layer's at a time
    with trainer.gradient_checkpointing); the logits [B, N, V_d] and their loss (`losses.loss_bytes`)."""
    opts = cfg.drafter
    draft_cfg = PEagleConfig.from_target(target_config, opts, mask_token_id=0)
    with torch.device("meta"):
        drafter = PEagleDrafter(draft_cfg, train_embeddings=bool(opts.train_embeddings))
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in drafter.parameters() if not p.requires_grad)
    entries_per_token = 1 + sum(max(opts.down_sample_ratio ** d, opts.down_sample_ratio_min)
                                for d in range(1, draft_cfg.num_depths))
    n = int(seq * entries_per_token)
    layers, heads, h, vd = draft_cfg.num_layers, draft_cfg.num_attention_heads, draft_cfg.hidden_size, \
        draft_cfg.draft_vocab_size
    scores = batch * heads * n * n * 4 * 2
    activations = layers * batch * n * 12 * h * 4 + loss_bytes(batch * n, batch * n, vd) \
        + (scores if cfg.trainer.gradient_checkpointing else layers * scores)
    return DrySize(
        trainable_params=params, frozen_bytes=frozen,
        facts={"aux_layer_ids": draft_cfg.aux_layer_ids, "draft_vocab_size": vd, "num_layers": layers,
               "num_depths": draft_cfg.num_depths, "entries_per_token": round(entries_per_token, 3),
               "train_embeddings": bool(opts.train_embeddings)},
        line=(f"  P-EAGLE drafter: {params / 1e6:.1f}M trainable, {layers} layers, {draft_cfg.num_depths} parallel "
              f"depths ({entries_per_token:.2f} entries per token after drop-token sampling), draft vocab {vd}, "
              f"aux layers {draft_cfg.aux_layer_ids}"),
        activation_bytes=activations, target_logits_bytes=batch * seq * vd * 4, aux_layers=3)


__all__ = ["NAME", "Options", "UNTRACKED_OPTIONS", "SERVING_NOTE", "VLLM_SERVING", "LLAMACPP_SERVING",
           "READS_LAST_HIDDEN", "build", "target_layers", "batch_preparer",
           "loss_and_metrics", "trained_weights", "describe", "save", "load", "layout", "decoder", "export", "dry_size"]
