"""How the train stage spreads over ranks: `trainer=ddp | deepspeed_zero2 | deepspeed_zero3 | fsdp`.

The train stage asks its strategy for every step that depends on it: the process group
and device (an accelerate `Accelerator`, kept for reductions and barriers), the target
(whole, or sharded per decoder layer), wrapping the drafter and its optimizer, backward,
the optimizer step, checkpoints, and the finished drafter as a plain module on rank 0.

- `ddp`: accelerate's DDP; every rank holds everything, gradients are all-reduced.
- `deepspeed_zero2` / `deepspeed_zero3`: a DeepSpeed engine around the drafter with the
  train stage's own torch AdamW as client optimizer (no compiled ops needed); ZeRO-2
  shards gradients and AdamW state, ZeRO-3 the weights too.
- `fsdp`: torch FSDP2 (`fully_shard`) around the drafter.

With `trainer.shard_target=true` the frozen target's decoder layers are split over the
ranks (`specforge_lite.targets.sharded`): online, for training; offline, for building the
features (every rank its share of the rows, `features.FeatureCache.build`). Every strategy divides the gradient by the world size (mean over
ranks), which the train stage undoes with its global loss-position normalisation.

Checkpoints: `ddp` writes plain full files (resume on any number of ranks); `fsdp`
writes a torch.distributed.checkpoint folder (resharded on load: N ranks -> M ranks);
DeepSpeed writes its own ZeRO shards, which resume on the same number of ranks only.
Modules:
- `base`: the strategy interface, the DDP strategy and what every strategy shares;
- `deepspeed`: DeepSpeed ZeRO-2 / ZeRO-3;
- `fsdp`: torch FSDP2.
"""

from __future__ import annotations

from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.training.strategies.base import DDPStrategy, Strategy, gradient_checkpointing  # noqa: F401
from specforge_lite.training.strategies.deepspeed import (  # noqa: F401
    ZeRO2Strategy,
    ZeRO3Strategy,
    deepspeed_config,
)
from specforge_lite.training.strategies.fsdp import FSDPStrategy

STRATEGIES = {
    "ddp": DDPStrategy,
    "deepspeed_zero2": ZeRO2Strategy,
    "deepspeed_zero3": ZeRO3Strategy,
    "fsdp": FSDPStrategy,
}


def build_strategy(cfg: DictConfig):
    name = getattr(cfg.trainer.strategy, "value", cfg.trainer.strategy)
    if name not in STRATEGIES:
        raise SpecforgeError(f"trainer.strategy={name!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](cfg)
