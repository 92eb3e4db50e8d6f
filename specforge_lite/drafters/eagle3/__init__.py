"""EAGLE-3: one decoder layer over the target's fused low / middle / high hidden states,
trained with the training-time test, predicting over a reduced draft vocabulary.

The drafter contract (`specforge_lite.contract.DrafterModule`):
`options` (typed config), `model` (the module), `train` (build, loss, save / load),
`decode` (the engine drafter), `export` (speculators and SGLang formats).
"""

from __future__ import annotations

import torch

from specforge_lite.contract import DrySize
from specforge_lite.drafters.eagle3.decode import Eagle3DecodeDrafter
from specforge_lite.drafters.eagle3.export import export, layout, sglang_problem  # sglang_problem: the door's too
from specforge_lite.drafters.eagle3.export import load_any as load
from specforge_lite.drafters.eagle3.model import FROZEN, Eagle3Config, Eagle3Drafter, save, trained_weights
from specforge_lite.drafters.eagle3.options import Eagle3Options as Options
from specforge_lite.drafters.eagle3.train import batch_preparer, build, describe, loss_and_metrics, target_layers

NAME = "eagle3"
UNTRACKED_OPTIONS: tuple[str, ...] = ()
SERVING_NOTE = None
VLLM_SERVING = ("eagle3", "speculators")  # vLLM speculative method, export subfolder
LLAMACPP_SERVING = ("DRAFT_EAGLE3", "eagle3.gguf")  # llama.cpp speculative type, draft GGUF under export/gguf
READS_LAST_HIDDEN = False  # trains on aux layers and the teacher's logits (int4_topk features work)
DRAFTS_TREES = True  # its decoder has propose_tree (EAGLE-2's dynamic tree): eval methods eagle3_tree, eagle3_mixed_tree


def decoder(drafter: Eagle3Drafter) -> Eagle3DecodeDrafter:
    return Eagle3DecodeDrafter(drafter)


def dry_size(cfg, target_config, batch: int, seq: int) -> DrySize:
    """Built on the meta device. Activations per TTT step: four [B, T, V_d] fp32 tensors kept for
    the backward (the drafter's logits, their log-softmax, the target's shifted logits and softmax),
    attention scores [B, heads, T, T + j] fp32 x2, layer activations ~ [B, T, 18H] fp32; two more
    [B, T, V_d] the step under way holds; trainer.gradient_checkpointing keeps one step's scores at
    a time (tests/integration/test_memory_estimate.py measures the terms)."""
    draft_cfg = Eagle3Config.from_target(target_config, cfg.drafter)
    with torch.device("meta"):
        drafter = Eagle3Drafter(draft_cfg)
    params = sum(p.numel() for n, p in drafter.named_parameters() if n != FROZEN)
    steps, heads, h, vd = cfg.drafter.ttt_steps, draft_cfg.num_attention_heads, draft_cfg.hidden_size, \
        draft_cfg.draft_vocab_size
    scores = batch * heads * seq * (seq + steps) * 4 * 2
    activations = steps * (batch * seq * vd * 4 * 4 + batch * seq * 18 * h * 4) + batch * seq * vd * 4 * 2 \
        + (scores if cfg.trainer.gradient_checkpointing else steps * scores)
    return DrySize(
        trainable_params=params,
        facts={"aux_layer_ids": draft_cfg.aux_layer_ids, "draft_vocab_size": vd, "ttt_steps": steps},
        line=(f"  EAGLE-3 drafter: {params / 1e6:.1f}M trainable, draft vocab {vd}, "
              f"aux layers {draft_cfg.aux_layer_ids}, {steps} TTT steps"),
        activation_bytes=activations, target_logits_bytes=batch * seq * vd * 4, aux_layers=3)


__all__ = ["NAME", "Options", "UNTRACKED_OPTIONS", "SERVING_NOTE", "VLLM_SERVING", "LLAMACPP_SERVING",
           "READS_LAST_HIDDEN", "build", "target_layers", "batch_preparer",
           "loss_and_metrics", "trained_weights", "describe", "save", "load", "layout", "decoder", "export", "dry_size"]
