"""DFlash: block-parallel drafting. The target's hidden states from several layers, fused and
injected as keys and values into every drafter layer; a block of mask positions after the
last accepted token, non-causal within the block (a causal variant as a setting), drafted in
one forward; trained on random anchors per sequence with per-position weighted loss; exported
in the speculators format vLLM serves as `dflash` (speculators `models/dflash`; vLLM
`qwen3_dflash.py`).

The drafter contract (`specforge_lite.contract.DrafterModule`):
`options` (typed config), `model` (the module, the anchor-block mask, anchor sampling),
`train` (build, loss, save / load), `decode` (the engine drafter), `export` (speculators format),
`interop` (`load` and `layout`: our train folder, speculators' and SpecForge's DFlash folders).
"""

from __future__ import annotations

import torch

from specforge_lite.contract import DrySize
from specforge_lite.drafters.dflash.decode import DFlashDecodeDrafter
from specforge_lite.drafters.dflash.export import export
from specforge_lite.drafters.dflash.interop import layout
from specforge_lite.drafters.dflash.interop import load_any as load
from specforge_lite.drafters.dflash.model import DFlashConfig, DFlashDrafter
from specforge_lite.drafters.dflash.options import DFlashOptions as Options
from specforge_lite.drafters.dflash.train import (activation_bytes, anchors_per_row, batch_preparer, build,
                                                  check_options, describe, loss_and_metrics, save, target_layers,
                                                  trained_weights)

NAME = "dflash"
UNTRACKED_OPTIONS: tuple[str, ...] = ()
SERVING_NOTE = ("vLLM serves DFlash with --speculative-config '{\"method\": \"dflash\", ...}'; a non-causal drafter "
                "needs an attention backend with non-causal support (export README)")
VLLM_SERVING = ("dflash", "speculators")  # vLLM speculative method, export subfolder
LLAMACPP_SERVING = ("DRAFT_DFLASH", "dflash.gguf")  # llama.cpp speculative type, draft GGUF under export/gguf
READS_LAST_HIDDEN = False  # trains on aux layers and the teacher's logits (int4_topk features work)
DRAFTS_TREES = True  # its decoder has propose_tree (best cumulative paths over the block): dflash_tree, dflash_mixed_tree


def decoder(drafter: DFlashDrafter) -> DFlashDecodeDrafter:
    return DFlashDecodeDrafter(drafter)


def dry_size(cfg, target_config, batch: int, seq: int) -> DrySize:
    """Built on the meta device; activations for `anchors_per_row` blocks a row (`train.activation_bytes`)."""
    return sized(cfg, target_config, batch, seq, (DFlashConfig, DFlashDrafter), activation_bytes, "DFlash")


def sized(cfg, target_config, batch: int, seq: int, kind, activation, label: str,
          heads=lambda c: ({}, "")) -> DrySize:
    """The dry size of a DFlash-family module: kind (config class, module class), activation(config,
    batch, seq, anchors, checkpointing) -> bytes; heads(config) -> (a variant's facts, its line's tail)."""
    config_class, drafter_class = kind
    opts = cfg.drafter
    data = cfg.get("data")
    check_options(opts, target_config, int(data.max_length) if data is not None else None)
    draft_cfg = config_class.from_target(target_config, opts, mask_token_id=0)
    with torch.device("meta"):
        drafter = drafter_class(draft_cfg)
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in drafter.parameters() if not p.requires_grad)
    anchors = anchors_per_row(opts, seq)
    c = draft_cfg
    facts, tail = heads(c)
    return DrySize(
        trainable_params=params, frozen_bytes=frozen,
        facts={"aux_layer_ids": c.aux_layer_ids, "draft_vocab_size": c.draft_vocab_size, "num_layers": c.num_layers,
               "block_size": c.block_size, "anchors_per_row": anchors, "causal": c.causal, **facts},
        line=(f"  {label} drafter: {params / 1e6:.1f}M trainable, {c.num_layers} layers, block {c.block_size} "
              f"({'causal' if c.causal else 'non-causal'}), {anchors} anchors a row, draft vocab "
              f"{c.draft_vocab_size}, aux layers {c.aux_layer_ids}{tail}"),
        activation_bytes=activation(c, batch, seq, anchors, bool(cfg.trainer.gradient_checkpointing)),
        target_logits_bytes=batch * seq * c.draft_vocab_size * 4, aux_layers=len(c.aux_layer_ids))


__all__ = ["NAME", "Options", "UNTRACKED_OPTIONS", "SERVING_NOTE", "VLLM_SERVING", "LLAMACPP_SERVING",
           "READS_LAST_HIDDEN", "build", "target_layers", "batch_preparer", "loss_and_metrics", "trained_weights",
           "describe", "save", "load", "layout", "decoder", "export", "dry_size"]
