"""The FSDP strategy: torch FSDP2 (`fully_shard`) around the drafter."""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from specforge_lite.training.checkpoints import check_written_by, restore_rng, write_checkpoint
from specforge_lite.training.strategies.base import (
    Strategy,
    ensure_process_group,
    gradient_checkpointing,
    plain_copy,
    world_size,
)

log = logging.getLogger(__name__)


class FSDPStrategy(Strategy):
    """torch FSDP2: `fully_shard` around the drafter (weights, gradients and AdamW state sharded)."""

    name = "fsdp"

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        ensure_process_group(self.device)

    def prepare(self, drafter, optimizer):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        gradient_checkpointing(drafter, self.cfg)
        self.skeleton = copy.deepcopy(drafter).to("meta")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.mixed == "bf16" else MixedPrecisionPolicy()
        mesh = init_device_mesh(self.device.type, (world_size(),))
        names = {id(p): n for n, p in drafter.named_parameters()}
        self.model = fully_shard(drafter, mesh=mesh, mp_policy=policy)
        # fully_shard replaced the parameters: point the (still stateless) optimizer at the sharded ones
        sharded = dict(self.model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        self.optimizer = optimizer
        return self.model, self.optimizer

    def accumulate(self, last: bool):
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, max_grad_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def save_checkpoint(self, ckpt_dir: Path, step: int, keep: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        def write(tmp: Path) -> None:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "dcp"))

        write_checkpoint(ckpt_dir, step, keep, write, self.checkpoint_state())

    def load_checkpoint(self, path: Path) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_state_dict,
            set_state_dict,
        )

        check_written_by(path, self.name, self.stamp, self.stamp_parts, self.stamp_settings)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path / "dcp"))  # resharded to this run's ranks
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        return restore_rng(path)

    def full_drafter(self):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return plain_copy(self.skeleton, state) if self.accelerator.is_main_process else None
