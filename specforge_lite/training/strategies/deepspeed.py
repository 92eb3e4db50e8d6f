"""DeepSpeed ZeRO-2 / ZeRO-3 strategies: a DeepSpeed engine around the drafter with the train
stage's own AdamW as client optimizer."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
from pathlib import Path

import torch
from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.training.checkpoints import check_written_by, restore_rng, write_checkpoint
from specforge_lite.training.strategies.base import (
    Strategy,
    ensure_process_group,
    gradient_checkpointing,
    plain_copy,
    world_size,
)

log = logging.getLogger(__name__)


def skip_inference_allreduce_build() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op when it starts its
    communication backend. On a CPU that op is a C++ build on a rank's first start (again
    whenever DeepSpeed's build flags change; docs/BENCHMARKS.md "Scale-out on CPU"), and
    only DeepSpeed's tensor-parallel inference calls it; ZeRO training reduces through
    torch.distributed. DeepSpeed skips any op its compatibility table marks unavailable."""
    import deepspeed.ops

    table = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(table, dict):
        table["deepspeed_shm_comm"] = False


class DeepSpeedStrategy(Strategy):
    """A DeepSpeed ZeRO engine around the drafter, with the stage's torch AdamW as client optimizer."""

    stage = 2

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        ensure_process_group(self.device)
        # DeepSpeed builds C++ ops on first use; none is needed here, but keep any build cached
        # (the one it would build on every start is skipped: skip_inference_allreduce_build)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))

    def prepare(self, drafter, optimizer):
        import deepspeed

        skip_inference_allreduce_build()
        gradient_checkpointing(drafter, self.cfg)
        self.skeleton = copy.deepcopy(drafter).to("meta") if self.stage == 3 else None
        config = deepspeed_config(self.cfg, self.stage, world_size(), self.mixed)
        self.model, self.optimizer, _, _ = deepspeed.initialize(model=drafter, optimizer=optimizer, config=config,
                                                                dist_init_required=False)
        return self.model, self.optimizer

    def accumulate(self, last: bool):
        return contextlib.nullcontext()  # the engine counts micro-batches (gradient_accumulation_steps)

    def autocast(self):
        if self.mixed == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # the loss is already normalised by the step's global positions: no 1/grad_accum here;
        # engine.step() after every micro-batch steps the optimizer at the accumulation boundary
        self.model.backward(loss, scale_wrt_gas=False)
        self.model.step()

    def step(self, max_grad_norm: float) -> float:
        norm = self.model.get_global_grad_norm()  # clipped inside the engine (gradient_clipping)
        return float(norm) if norm is not None else float("nan")

    def save_checkpoint(self, ckpt_dir: Path, step: int, keep: int) -> None:
        def write(tmp: Path) -> None:
            self.model.save_checkpoint(str(tmp), tag="deepspeed", save_latest=False)

        write_checkpoint(ckpt_dir, step, keep, write, self.checkpoint_state())

    def load_checkpoint(self, path: Path) -> int:
        state = check_written_by(path, self.name, self.stamp, self.stamp_parts, self.stamp_settings)
        if state.get("world_size", world_size()) != world_size():
            raise SpecforgeError(
                f"checkpoint {path} was written by {state['world_size']} ranks with trainer={self.name}; DeepSpeed "
                f"resumes its ZeRO shards on the same number of ranks only: relaunch with --nproc_per_node "
                f"{state['world_size']} (or set train.resume=false to start over)")
        self.model.load_checkpoint(str(path), tag="deepspeed", load_lr_scheduler_states=False)
        return restore_rng(path)

    def full_drafter(self):
        if self.stage < 3:
            return self.model.module  # ZeRO-2 keeps full weights on every rank
        import deepspeed

        module = self.model.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} \
                if self.accelerator.is_main_process else None
        return plain_copy(self.skeleton, state) if state is not None else None


class ZeRO2Strategy(DeepSpeedStrategy):
    name = "deepspeed_zero2"
    stage = 2


class ZeRO3Strategy(DeepSpeedStrategy):
    name = "deepspeed_zero3"
    stage = 3


def deepspeed_config(cfg: DictConfig, stage: int, world: int, mixed: str) -> dict:
    """The DeepSpeed config: `trainer.deepspeed_config` (a JSON file) or a minimal one for
    `stage`, with batch sizes, clipping and precision taken from `train.*` ("auto" values
    are filled; explicit values must agree)."""
    tcfg = cfg.train
    source = cfg.trainer.deepspeed_config
    if source:
        try:
            config = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise SpecforgeError(f"trainer.deepspeed_config={source!r}: {err}") from err
    else:
        config = {"zero_optimization": {"stage": stage}}
    where = f"trainer.deepspeed_config={source!r}" if source else "the built-in DeepSpeed config"
    if config.get("zero_optimization", {}).get("stage", stage) != stage:
        raise SpecforgeError(f"{where} sets zero_optimization.stage={config['zero_optimization']['stage']} but "
                             f"trainer.strategy=deepspeed_zero{stage}")
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise SpecforgeError(f"{where} has an {section!r} section; the train stage builds AdamW and its "
                                 f"schedule from train.* (lr, weight_decay, warmup_ratio): remove it")
    micro = max(1, math.ceil(tcfg.batch_size / world))  # this rank's share of a micro-batch
    ours = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": tcfg.grad_accum,
            "train_batch_size": micro * tcfg.grad_accum * world, "gradient_clipping": tcfg.max_grad_norm,
            "zero_allow_untested_optimizer": True}
    for key, value in ours.items():
        given = config.get(key, "auto")
        if given not in ("auto", value):
            raise SpecforgeError(f"{where} sets {key}={given!r}, but train.* gives {value!r}: set it to \"auto\"")
        config[key] = value
    for half in ("bf16", "fp16"):
        enabled = config.get(half, {}).get("enabled", "auto")
        want = half == "bf16" and mixed == "bf16"
        if enabled not in ("auto", want):
            raise SpecforgeError(f"{where} sets {half}.enabled={enabled!r}, but train.mixed_precision resolves to "
                                 f"{mixed!r}: set it to \"auto\"")
        config.setdefault(half, {})["enabled"] = want
    config.setdefault("steps_per_print", 10 ** 9)
    return config
