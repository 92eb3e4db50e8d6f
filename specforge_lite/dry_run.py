"""`train.dry_run=true`: size a recipe without downloading or allocating weights.

Builds the target's config (a local directory's config.json, or for the known hub ids
the copy kept in `assets/configs/`), builds the drafter on the meta device, and prints
parameter counts and per-GPU memory estimates for training at the recipe's sequence
length: the frozen target's bf16 weights (whole on every GPU), the drafter's fp32 weights, gradients and AdamW moments, and the
largest activations of one micro-batch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.artifacts import atomic_write_json, stage_dir

log = logging.getLogger(__name__)

ASSET_CONFIGS = Path(__file__).resolve().parent / "assets" / "configs"
KNOWN_CONFIGS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b-instruct.json",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b-instruct.json",
}
GiB = 1024 ** 3


def target_config(path: str):
    from transformers import AutoConfig, LlamaConfig

    if path in KNOWN_CONFIGS:
        return LlamaConfig.from_dict(json.loads((ASSET_CONFIGS / KNOWN_CONFIGS[path]).read_text()))
    if path.startswith("builtin:"):
        from specforge_lite.targets import resolve_target_path

        path = resolve_target_path(path)
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as err:  # no hub here: say what works
        raise SpecforgeError(f"cannot read the config of target {path!r} ({err}); dry runs know "
                             f"{', '.join(KNOWN_CONFIGS)} offline, or point target.path at a local directory") from err


def estimate(cfg: DictConfig, config, drafter_params: int, target_params: int) -> dict:
    """Per-GPU bytes of one data-parallel training rank in online mode (the whole target on
    every GPU, as DDP / ZeRO-2 of the drafter keep it)."""
    t, b = cfg.data.max_length, cfg.train.batch_size
    h, vd = config.hidden_size, min(cfg.drafter.draft_vocab_size, config.vocab_size)
    steps = cfg.drafter.ttt_steps
    heads = config.num_attention_heads
    offline = cfg.train.mode == "offline"
    target_weights = 0 if offline else target_params * 2  # offline: features come from disk
    drafter_state = drafter_params * (4 + 4 + 8)  # fp32 weights, grads, two AdamW moments
    # target forward (no grad): the largest layer transient ~ MLP [B, T, I] x3 plus the kept
    # aux hidden states [B, T, 3H] and final hidden [B, T, H], bf16
    target_act = 0 if offline else b * t * (3 * config.intermediate_size + 4 * h) * 2
    # drafter TTT (grad): per step logits + softmax + grad [B, T, V_d] fp32 x3, attention
    # scores [B, heads, T, T + j] fp32 x2, layer activations ~ [B, T, 12H] fp32
    drafter_act = steps * (b * t * vd * 4 * 3 + b * heads * t * (t + steps) * 4 * 2 + b * t * 12 * h * 4)
    target_logits = b * t * vd * 4
    total = target_weights + drafter_state + target_act + drafter_act + target_logits
    return {"target_weights_gib": target_weights / GiB, "drafter_weights_grads_adam_gib": drafter_state / GiB,
            "target_activations_gib": target_act / GiB, "drafter_activations_gib": drafter_act / GiB,
            "target_logits_gib": target_logits / GiB, "total_gib": total / GiB}


def dry_run(cfg: DictConfig) -> dict:
    from transformers import AutoModelForCausalLM

    from specforge_lite.drafters.eagle3 import FROZEN, Eagle3Config, Eagle3Drafter

    config = target_config(cfg.target.path)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config)
        draft_cfg = Eagle3Config.from_target(config, cfg.drafter.draft_vocab_size,
                                             list(cfg.drafter.aux_layer_ids) if cfg.drafter.aux_layer_ids else None)
        drafter = Eagle3Drafter(draft_cfg)
    target_params = sum(p.numel() for p in target.parameters())
    drafter_params = sum(p.numel() for n, p in drafter.named_parameters() if n != FROZEN)
    memory = estimate(cfg, config, drafter_params, target_params)
    result = {"target": cfg.target.path, "target_params_b": target_params / 1e9,
              "drafter_trainable_params_m": drafter_params / 1e6, "aux_layer_ids": draft_cfg.aux_layer_ids,
              "draft_vocab_size": draft_cfg.draft_vocab_size, "seq_len": cfg.data.max_length,
              "batch_size_per_gpu": cfg.train.batch_size, "ttt_steps": cfg.drafter.ttt_steps,
              "per_gpu_memory": memory, "fits_80gb": memory["total_gib"] < 80 * 1e9 / GiB * 0.9,
              "mode": str(cfg.train.mode.value if hasattr(cfg.train.mode, "value") else cfg.train.mode),
              "offline_feature_bytes_per_token": 4 * config.hidden_size * 2}
    lines = [f"dry run: {cfg.recipe_name} (nothing downloaded, nothing trained)",
             f"  target {cfg.target.path}: {target_params / 1e9:.2f}B parameters",
             f"  EAGLE-3 drafter: {drafter_params / 1e6:.1f}M trainable, draft vocab {draft_cfg.draft_vocab_size}, "
             f"aux layers {draft_cfg.aux_layer_ids}",
             f"  per-GPU memory at seq {cfg.data.max_length}, batch {cfg.train.batch_size}, "
             f"{cfg.drafter.ttt_steps} TTT steps:"]
    lines += [f"    {k:<32} {v:8.2f}" for k, v in memory.items() if k.endswith("gib")]
    lines.append(f"  fits a 80 GB GPU with 10% headroom: {result['fits_80gb']} ({result['mode']} mode)")
    lines.append(f"  offline feature cache: {result['offline_feature_bytes_per_token'] / 1e3:.0f} KB per token "
                 f"({result['offline_feature_bytes_per_token'] * 1e6 / 1e9:.0f} GB per million tokens)")
    print("\n".join(lines))
    out = stage_dir(cfg, "train")
    atomic_write_json(out / "dry_run.json", result)
    return result
