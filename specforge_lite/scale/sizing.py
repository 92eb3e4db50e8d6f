"""Sizing at the door: per-device memory of every stage, and the offline features' disk.

Everything is computed from the target's config (built on the meta device, nothing
downloaded) and the run's settings. `stage_table` gives one row per stage (sample,
feature building, training, evaluate, export) with the bytes one device holds, how the
stage lays the target out, and the setting that changes it; `dry_run=true` prints it
for every stage, `check_stage` refuses a stage whose row does not fit the devices it sees
before that stage loads anything. Estimates, not measurements: weights are exact, the
KV caches and activations are the largest ones the settings allow.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.run_folders import atomic_write_json
from specforge_lite.scale.dry_run import DRY_RUN_GIB, HEADROOM, GiB, estimate, per_gpu_batch
from specforge_lite.training.batching import BatchChoice, choose, parse_tokens
from specforge_lite.training.feature_formats import bytes_per_token
from specforge_lite.drafters.methods import VLLM_METHODS, engine_needed, vllm_override
from specforge_lite.drafters.registry import chosen_drafter
from specforge_lite.stage_table import COMMANDS
from specforge_lite.targets.loading import sizing_config



def target_sizes(config) -> dict:
    """Parameter counts of the target: all, its decoder layers, its input embeddings and lm_head."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    return {"params": sum(p.numel() for p in model.parameters()),
            "layer_params": sum(p.numel() for p in model.model.layers.parameters()),
            "embed_params": embed.numel(), "head_params": 0 if head is embed else head.numel()}


def weight_bytes(cfg: DictConfig) -> int:
    """Bytes per target weight: 4 for float32, else 2 (bf16 / fp16; auto is bf16 on a GPU)."""
    return 4 if str(getattr(cfg.target.dtype, "value", cfg.target.dtype)) == "float32" else 2


def kv_bytes_per_token(config, w: int) -> int:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * w


def feature_tokens(cfg: DictConfig) -> tuple[int | None, str]:
    """At most how many tokens the offline cache holds for this run's data: conversations
    (data.max_samples of the train split, or the whole train split of a readable source,
    plus train.source_conversations) times data.max_length. None when the source is not here."""
    rows = cfg.data.max_samples
    how = "data.max_samples"
    if rows is None:
        from specforge_lite.data.readers import heldout_split, read_conversations

        try:
            records, _ = read_conversations(cfg.data.source, cfg.data.format, cfg.data.strict)
        except (SpecforgeError, OSError):
            return None, f"{cfg.data.source} is not here to count"
        rows = len(heldout_split(records, cfg.data.heldout_fraction, cfg.data.split_seed)[0])
        how = f"the train split of {cfg.data.source}"
    rows = (rows if cfg.train.use_samples else 0) + cfg.train.source_conversations
    return rows * cfg.data.max_length, f"{rows} conversations ({how}) x data.max_length {cfg.data.max_length}"


def stage_table(cfg: DictConfig, config=None, world: int | None = None, disk: bool = True) -> dict:
    """Per-device bytes of every stage on `world` ranks (default `trainer.dry_run_gpus`), and
    the offline features' disk. Each row: `bytes`, `layout`, `setting` (what to change when
    it does not fit) and, for vLLM rows, `budget_share` (the device share vLLM may take)."""
    config = config or sizing_config(cfg.target.path)
    world = world or cfg.trainer.dry_run_gpus
    sizes = target_sizes(config)
    w = weight_bytes(cfg)
    layers, whole = sizes["layer_params"] * w, sizes["params"] * w
    outside = whole - layers  # embeddings, final norm, lm_head: whole on every rank
    one_layer = layers / config.num_hidden_layers
    kv_token, h, vocab = kv_bytes_per_token(config, w), config.hidden_size, config.vocab_size
    train_cfg = OmegaConf.merge(cfg, {"trainer": {"dry_run_gpus": world}})
    drafter = chosen_drafter(cfg).dry_size(train_cfg, config, per_gpu_batch(train_cfg), cfg.data.max_length)
    drafter_weights = drafter.trainable_params * 4 + drafter.frozen_bytes
    rows = {}

    s = cfg.sample
    if str(getattr(s.backend, "value", s.backend)) == "vllm":
        tp = s.vllm.tensor_parallel_size
        rows["sample"] = {"bytes": whole / tp, "layout": f"vLLM, target split over tensor_parallel_size={tp}",
                          "setting": "raise sample.vllm.tensor_parallel_size", "budget_share": s.vllm.gpu_memory_utilization}
    else:
        kv = s.batch_size * (s.max_prompt_length + s.max_new_tokens) * kv_token
        rows["sample"] = {"bytes": whole + kv + s.batch_size * vocab * 4,
                          "layout": f"whole target on every rank, KV cache of {s.batch_size} sequences",
                          "setting": "set sample.backend=vllm with sample.vllm.tensor_parallel_size"}

    batch, seq = per_gpu_batch(train_cfg), cfg.data.max_length
    forward = batch * seq * (3 * config.intermediate_size + (drafter.aux_layers + 1) * h) * w
    offline = str(getattr(cfg.train.mode, "value", cfg.train.mode)) == "offline"
    if offline:
        if cfg.trainer.shard_target:
            rows["features"] = {"bytes": layers / world + outside + 2 * one_layer + forward,
                                "layout": f"decoder layers split over {world} ranks, each its share of the rows",
                                "setting": "raise trainer.num_processes (more ranks)"}
        else:
            rows["features"] = {"bytes": whole + forward, "layout": "whole target on every rank",
                                "setting": "set trainer.shard_target=true"}
    memory = estimate(train_cfg, config, drafter, sizes["params"], sizes["layer_params"])
    strategy = getattr(cfg.trainer.strategy, "value", cfg.trainer.strategy)
    rows["train"] = {"bytes": memory["total_gib"] * GiB, "layout": f"trainer={strategy} on {world} ranks"
                     + (", target layers sharded" if cfg.trainer.shard_target and not offline else "")
                     + (", features from disk" if offline else ""),
                     "setting": "lower train.batch_size or pick a sharding trainer.strategy" if offline
                     else "set trainer.shard_target=true or train.mode=offline"}

    e = cfg.eval
    # our engine (`plain` and every method not vllm_*) holds the whole target; an evaluate of
    # vllm_* methods only holds none in our process (serving/vllm_only.py), so it has no row
    if engine_needed(e):
        context = cfg.data.max_length + e.max_new_tokens
        rows["evaluate"] = {"bytes": whole + context * kv_token + drafter_weights,
                            "layout": "our engine: whole target on one device, one sequence's KV cache",
                            "setting": "measure it in vLLM: the vllm_* methods with eval.vllm.tensor_parallel_size"}
    if any(m in VLLM_METHODS for m in e.methods):
        tp = e.vllm.tensor_parallel_size
        rows["evaluate_vllm"] = {"bytes": whole / tp, "layout": f"vLLM, tensor_parallel_size={tp}",
                                 "setting": "raise eval.vllm.tensor_parallel_size",
                                 "budget_share": e.vllm.gpu_memory_utilization}
    embed = sizes["embed_params"] * w
    rows["export"] = {"bytes": embed + sizes["head_params"] * w + h * w + 2 * drafter_weights,
                      "layout": "embeddings, final norm and lm_head read by name; the drafter twice "
                                "(trained and reloaded)", "setting": "export on a device that holds the drafter"}

    fmt = str(cfg.train.feature_format)
    per_token = bytes_per_token(fmt, h, drafter.aux_layers)  # in train.feature_format's bytes
    tokens, how = feature_tokens(cfg) if disk else (None, "not counted")
    return {"target": cfg.target.path, "recipe": cfg.recipe_name, "world": world, "weight_bytes": w,
            "target_bytes": whole, "layer_bytes": layers, "stages": rows,
            "offline_features": {"bytes_per_token": per_token, "format": fmt, "tokens_at_most": tokens,
                                 "tokens_from": how,
                                 "bytes_at_most": None if tokens is None else int(tokens * per_token),
                                 "used": offline}}


def device_memory(cfg: DictConfig) -> tuple[float | None, str]:
    """Bytes of the smallest device this process sees and what it is: `device_memory_gib`
    when set, else the visible GPUs'; None on a CPU (the host's memory is not checked)."""
    if cfg.device_memory_gib is not None:
        return cfg.device_memory_gib * GiB, f"device_memory_gib={cfg.device_memory_gib}"
    if cfg.target.device != "cpu" and torch.cuda.is_available():
        sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
        return min(sizes), f"the smallest of {len(sizes)} visible GPU(s)"
    return None, "a CPU"


# a batch sized to HEADROOM of a device leaves too little for the fragments that fixed-size segments
# strand (make gpu-check's train_batched ran out so; docs/BENCHMARKS.md section gpu_check_nvidia_h200)
ALLOCATOR_SETTING = "expandable_segments:True"


def settle_allocator() -> str | None:
    """On CUDA, let the caching allocator grow its segments in place (ALLOCATOR_SETTING) unless
    PYTORCH_CUDA_ALLOC_CONF says otherwise; returns the setting applied, None where none was."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or not torch.cuda.is_available():
        return None
    torch.cuda.memory._set_allocator_settings(ALLOCATOR_SETTING)
    return ALLOCATOR_SETTING


def shown(size: float) -> str:
    return f"{size / GiB:.1f} GiB" if size >= GiB / 10 else f"{size / 2 ** 20:.1f} MiB"


def fits(row: dict, memory: float) -> bool:
    return row["bytes"] <= memory * row.get("budget_share", HEADROOM)


def check_stage(cfg: DictConfig, stage: str, rows: tuple[str, ...] | None = None) -> None:
    """Stop `stage` before it loads anything when one of its `rows` of `stage_table` (default:
    the stage's own, stage_table.py) does not fit the devices this process sees, with one
    line naming the setting to change."""
    if COMMANDS[stage].builds_drafter and cfg.train.dry_run:
        return  # a training dry run sizes, and loads nothing
    memory, where = device_memory(cfg)
    if memory is None:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if COMMANDS[stage].builds_drafter:  # at the micro-batch each rank will train on (train.tokens_per_step)
        choice = batch_choice(cfg, world)
        cfg = at_micro_batch(cfg, choice.per_rank, choice.world)
    sized = stage_table(cfg, world=world, disk=False)
    table = sized["stages"]
    for name in COMMANDS[stage].sizing_rows if rows is None else rows:
        row = table.get(name)
        if row is None or fits(row, memory):
            continue
        setting = row["setting"]
        if name == "evaluate":  # the exact override that leaves our engine out
            setting = "evaluate in vLLM alone: " + vllm_override(cfg.eval, vllm_parallel(cfg, sized["target_bytes"],
                                                                                       memory))
        raise SpecforgeError(f"{stage}: {name} needs {shown(row['bytes'])} per device ({row['layout']}), more than "
                             f"{row.get('budget_share', HEADROOM):.0%} of {shown(memory)} ({where}) on {world} "
                             f"rank(s): {setting} (dry_run=true sizes every stage)")


def vllm_parallel(cfg: DictConfig, target_bytes: float, memory: float) -> int:
    """The tensor parallelism a vLLM evaluate needs here: at least eval.vllm's (and the vllm
    sample backend's, the recipe's node layout), doubled until the target's share fits vLLM's
    budget of one device (the evaluate_vllm row's rule)."""
    e, s = cfg.eval.vllm, cfg.sample
    tp = max(e.tensor_parallel_size, s.vllm.tensor_parallel_size if str(getattr(s.backend, "value", s.backend))
             == "vllm" else 1)
    while target_bytes / tp > memory * e.gpu_memory_utilization and tp < 1024:
        tp *= 2
    return tp


def format_table(table: dict, memory: float | None = None) -> list[str]:
    """The printout of `stage_table` (with a fits column when the device memory is known)."""
    lines = [f"per-device memory on {table['world']} device(s), target {table['target']} "
             f"({table['target_bytes'] / GiB:.1f} GiB of weights):"]
    for name, row in table["stages"].items():
        verdict = "" if memory is None else ("  fits" if fits(row, memory) else f"  DOES NOT FIT: {row['setting']}")
        lines.append(f"  {name:<14} {row['bytes'] / GiB:9.2f} GiB  {row['layout']}{verdict}")
    disk = table["offline_features"]
    total = "unknown" if disk["bytes_at_most"] is None else f"at most {disk['bytes_at_most'] / 1e9:.0f} GB"
    lines.append(f"  offline features: {disk['bytes_per_token'] / 1e3:.1f} KB per token "
                 f"({disk.get('format', 'bf16')}), {total} "
                 f"({disk['tokens_from']}){'' if disk['used'] else '; this recipe trains online'}")
    return lines


def report(cfg: DictConfig, config=None) -> dict:
    """`dry_run=true`: print every stage's per-device memory and the offline features' disk,
    and write them to run_dir/dry_run.json; nothing is loaded or launched."""
    table = stage_table(cfg, config)
    memory, where = device_memory(cfg)
    print("\n".join(format_table(table, memory))
          + ("" if memory is None else f"\n  (fits: at most {HEADROOM:.0%} of {memory / GiB:.1f} GiB, {where})"))
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(cfg.run_dir) / "dry_run.json", table)
    return table


# --------------------------------------------------------------------------- the batch a device holds

TRAIN_ROWS = ("features", "train")  # what a training rank holds (features: offline, before training)
MOST_SEQUENCES = 4096  # the search's ceiling, sequences of data.max_length per rank


def at_micro_batch(cfg: DictConfig, per_rank: int, world: int) -> DictConfig:
    """`cfg` with `per_rank` sequences per rank on `world` ranks, as the sizing reads a batch."""
    return OmegaConf.merge(cfg, {"train": {"batch_size": per_rank * world, "tokens_per_step": None},
                                 "trainer": {"dry_run_gpus": world}})


def largest_micro_batch(cfg: DictConfig, world: int, memory: float, config=None) -> int:
    """The most sequences of data.max_length per rank whose training rows (`TRAIN_ROWS` of
    `stage_table`) fit `memory`; 0 when not even one does."""
    config = config or sizing_config(cfg.target.path)

    def fit(n: int) -> bool:
        rows = stage_table(at_micro_batch(cfg, n, world), config, world=world, disk=False)["stages"]
        return all(fits(rows[name], memory) for name in TRAIN_ROWS if name in rows)

    if not fit(1):
        return 0
    low, high = 1, 2
    while high <= MOST_SEQUENCES and fit(high):
        low, high = high, high * 2
    while high - low > 1:  # fit(low), not fit(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fit(middle) else (low, middle)
    return min(low, MOST_SEQUENCES)


def batch_choice(cfg: DictConfig, world: int, config=None, memory: float | None = None,
                 where: str | None = None) -> BatchChoice:
    """`train.tokens_per_step` / `train.batch_size` made a batch per rank on `world` ranks
    (training/batching.py); `auto` and a token count are sized against `memory` (default: the
    devices this process sees, `device_memory`; a CPU: none)."""
    tokens = parse_tokens(cfg.train.tokens_per_step)
    if memory is None:
        memory, where = device_memory(cfg)
    fits_per_rank = None
    if tokens is not None and memory is not None:
        fits_per_rank = largest_micro_batch(cfg, world, memory, config)
    return choose(tokens, cfg.train.batch_size, cfg.train.grad_accum, cfg.data.max_length, world, fits_per_rank,
                  f"{shown(memory)} ({where})" if memory is not None else "")



def dry_run_choice(cfg: DictConfig, config=None) -> tuple[BatchChoice, DictConfig]:
    """The batch a `train.dry_run=true` sizes on `trainer.dry_run_gpus` ranks (`auto` and token
    counts against device_memory_gib, the GPUs here, or DRY_RUN_GIB), and `cfg` at that batch."""
    world = cfg.trainer.dry_run_gpus
    memory, where = device_memory(cfg)
    if memory is None:
        memory, where = DRY_RUN_GIB * GiB, f"the dry run's default; device_memory_gib sets another"
    choice = batch_choice(cfg, world, config, memory, where)
    return choice, at_micro_batch(cfg, choice.per_rank, world)
