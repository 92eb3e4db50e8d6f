"""`train.dry_run=true`: size a recipe without downloading or allocating weights.

Builds the target's config (a local directory's config.json, or for the known hub ids
the copy kept in `assets/configs/`), builds the drafter on the meta device, and prints
parameter counts and per-GPU memory estimates for training at the recipe's sequence
length under the chosen `trainer` strategy on `trainer.dry_run_gpus` GPUs: the frozen
target's bf16 weights (whole on every GPU online, its decoder layers split N ways with
`trainer.shard_target`, only its lm_head offline), the drafter's fp32 weights, gradients
and AdamW moments (split as the strategy splits them), and the largest activations of one
micro-batch. Works for every drafter kind (EAGLE-3, Medusa, a distilled draft model, whose
student config comes from its own id or directory).
"""

from __future__ import annotations

import logging
import math

import torch
from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.run_folders import atomic_write_json, stage_dir
from specforge_lite.training.feature_formats import bytes_per_token
from specforge_lite.drafters.registry import chosen_drafter
from specforge_lite.targets.loading import sizing_config as target_config

log = logging.getLogger(__name__)

GiB = 1024 ** 3
HEADROOM = 0.9  # a stage fits when it needs at most this share of a device (allocator, CUDA context)
DRY_RUN_GIB = 80  # a dry run on a machine without the GPU sizes `auto` for an 80 GiB device


def strategy_name(cfg: DictConfig) -> str:
    return getattr(cfg.trainer.strategy, "value", cfg.trainer.strategy)


def per_gpu_batch(cfg: DictConfig) -> int:
    return math.ceil(cfg.train.batch_size / cfg.trainer.dry_run_gpus)


def estimate(cfg: DictConfig, config, size, target_params: int, layer_params: int = 0) -> dict:
    """Per-GPU bytes of one training rank under `trainer` on `trainer.dry_run_gpus` GPUs.

    size: the drafter's `contract.DrySize` (parameters, frozen weights, activations).
    layer_params: the target's decoder-layer parameters (what `trainer.shard_target` splits;
    embeddings, final norm and lm_head stay whole on every GPU). Offline mode reads features
    from disk; the target that built them stays loaded (sharded with `trainer.shard_target`),
    its lm_head turning them into soft labels, but runs no forward (no target activations).
    """
    strategy, gpus = strategy_name(cfg), cfg.trainer.dry_run_gpus
    if gpus < 1:
        raise SpecforgeError(f"trainer.dry_run_gpus={gpus}; it must be at least 1")
    # train.batch_size sequences per micro-batch are dealt out over all ranks
    t, b = cfg.data.max_length, per_gpu_batch(cfg)
    h = config.hidden_size
    drafter_params = size.trainable_params
    offline = cfg.train.mode == "offline"
    # online, only the strategies whose loop runs every rank in every target forward shard it
    # (strategies.Strategy.can_shard_target); the others refuse trainer.shard_target at the start
    sharded_target = cfg.trainer.shard_target and not offline and strategy in ("deepspeed_zero3", "fsdp")
    if offline:  # the target that built the features stays loaded (its lm_head makes the soft labels)
        layers = layer_params / gpus if cfg.trainer.shard_target else layer_params
        target_weights, target_gathered = (layers + target_params - layer_params) * 2, 0
    elif sharded_target:  # 1/N of the layers, the rest whole; one layer gathered, the next prefetched
        target_weights = (layer_params / gpus + target_params - layer_params) * 2
        target_gathered = 2 * layer_params / config.num_hidden_layers * 2
    else:
        target_weights, target_gathered = target_params * 2, 0
    # fp32 weights (4), gradients (4) and two AdamW moments (8) per trainable parameter
    if strategy == "ddp":
        drafter_state, drafter_gathered = drafter_params * 16, 0
    elif strategy == "deepspeed_zero2":  # gradients and optimizer state split, weights whole
        drafter_state, drafter_gathered = drafter_params * (4 + 12 / gpus), 0
    else:  # ZeRO-3 / FSDP: everything split; the whole drafter gathered for its forward and backward
        drafter_state = drafter_params * 16 / gpus
        drafter_gathered = drafter_params * (2 if cfg.train.mixed_precision in ("bf16", "auto") else 4)
    drafter_state += size.frozen_bytes
    # target forward (no grad): the largest layer transient ~ MLP [B, T, I] x3 plus the kept
    # hidden states [B, T, (aux + 1) H], bf16
    target_act = 0 if offline else b * t * (3 * config.intermediate_size + (size.aux_layers + 1) * h) * 2
    drafter_act, target_logits = size.activation_bytes, size.target_logits_bytes
    total = target_weights + target_gathered + drafter_state + drafter_gathered + target_act + drafter_act \
        + target_logits
    return {"target_weights_gib": target_weights / GiB, "target_gathered_layers_gib": target_gathered / GiB,
            "drafter_weights_grads_adam_gib": drafter_state / GiB, "drafter_gathered_gib": drafter_gathered / GiB,
            "target_activations_gib": target_act / GiB, "drafter_activations_gib": drafter_act / GiB,
            "target_logits_gib": target_logits / GiB, "total_gib": total / GiB}


def dry_run(cfg: DictConfig, config=None, batch=None) -> dict:
    """Print and record the sizes; `batch`: the `training.batching.BatchChoice` that `cfg`'s
    train.batch_size already holds per rank (scale/sizing.py `dry_run_choice`)."""
    from transformers import AutoModelForCausalLM

    if config is None:  # the caller checked cfg against it (`validate.validate_config`)
        config = target_config(cfg.target.path)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config)
    target_params = sum(p.numel() for p in target.parameters())
    layer_params = sum(p.numel() for p in target.model.layers.parameters())
    size = chosen_drafter(cfg).dry_size(cfg, config, per_gpu_batch(cfg), cfg.data.max_length)
    memory = estimate(cfg, config, size, target_params, layer_params)
    mode = str(getattr(cfg.train.mode, "value", cfg.train.mode))
    strategy, gpus = strategy_name(cfg), cfg.trainer.dry_run_gpus
    aux, fmt = size.aux_layers, str(cfg.train.feature_format)
    result = {"target": cfg.target.path, "drafter": cfg.drafter.name, "target_params_b": target_params / 1e9,
              "drafter_trainable_params_m": size.trainable_params / 1e6, **size.facts, "seq_len": cfg.data.max_length,
              "batch_size_per_gpu": per_gpu_batch(cfg),
              "strategy": strategy, "num_gpus": gpus, "shard_target": bool(cfg.trainer.shard_target),
              "per_gpu_memory": memory, "fits_80gb": memory["total_gib"] <= HEADROOM * DRY_RUN_GIB,
              "mode": mode, "offline_feature_bytes_per_token": bytes_per_token(fmt, config.hidden_size, aux),
              "offline_feature_format": fmt, "batch": None if batch is None else batch.record()}
    lines = [f"dry run: {cfg.recipe_name} (nothing downloaded, nothing trained)",
             f"  target {cfg.target.path}: {target_params / 1e9:.2f}B parameters", size.line,
             *([f"  {batch.line()}"] if batch is not None else []),
             f"  per-GPU memory (GiB) with trainer={strategy} on {gpus} GPUs"
             f"{' (target layers sharded)' if cfg.trainer.shard_target else ''}, seq {cfg.data.max_length}, "
             f"batch {per_gpu_batch(cfg)} per GPU:"]
    lines += [f"    {k:<32} {v:8.2f}" for k, v in memory.items() if k.endswith("gib")]
    lines.append(f"  fits an {DRY_RUN_GIB} GiB GPU with {1 - HEADROOM:.0%} headroom: {result['fits_80gb']} ({mode} mode)")
    lines.append(f"  offline feature cache: {result['offline_feature_bytes_per_token'] / 1e3:.1f} KB per token ({fmt}) "
                 f"({result['offline_feature_bytes_per_token'] * 1e6 / 1e9:.0f} GB per million tokens)")
    print("\n".join(lines))
    out = stage_dir(cfg, "train")
    atomic_write_json(out / "dry_run.json", result)
    return result
