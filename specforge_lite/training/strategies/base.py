"""The strategy interface, the DDP strategy and the helpers every strategy shares."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.runtime.dtype_choice import native_bf16
from specforge_lite.training.checkpoints import (
    check_written_by,
    read_plain,
    restore_rng,
    write_checkpoint,
    write_plain,
)

log = logging.getLogger(__name__)


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bf16 products natively (AVX-512 BF16, AMX, Arm's BF16), as the
    target's dtype choice reads it (oneDNN's own check also says yes where AVX-512 only emulates it)."""
    return native_bf16()


def mixed_precision(cfg: DictConfig) -> str:
    """`train.mixed_precision` resolved: auto is bf16 where the hardware computes it natively (a
    GPU that supports it; a CPU with AVX-512 BF16 or AMX), none elsewhere (emulated bf16 trains
    several times slower; docs/BENCHMARKS.md train_step)."""
    mixed = cfg.train.mixed_precision
    if mixed == "auto":
        gpu = torch.cuda.is_available() and cfg.target.device != "cpu"
        mixed = "bf16" if (torch.cuda.is_bf16_supported() if gpu else native_cpu_bf16()) else "no"
    if mixed not in ("no", "bf16"):
        raise SpecforgeError(f"train.mixed_precision={mixed!r}; choose auto, no or bf16")
    return mixed


def target_compute(cfg: DictConfig) -> torch.dtype | None:
    """The dtype the frozen target's forward computes in while training, where it is lower than
    its weights': bf16 when training is in bf16 and `train.target_autocast` (features.target_hidden)."""
    return torch.bfloat16 if mixed_precision(cfg) == "bf16" and cfg.train.target_autocast else None


def ensure_process_group(device: torch.device) -> None:
    """A process group even for one process started without a launcher (ZeRO and FSDP need one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:  # a free port for this single-process group
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def local_bytes(tensors) -> int:
    """Bytes this rank holds of the given tensors (a DTensor's local shard, a ZeRO-3 partition)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        elif hasattr(t, "ds_tensor"):
            t = t.ds_tensor
        total += t.numel() * t.element_size()
    return total


# --------------------------------------------------------------------------- strategies

class Strategy:
    """What every strategy shares; the subclasses differ only in the methods they override.

    Class attributes say what a strategy is: `name` (its `trainer.strategy` value, also
    written into its checkpoints), `accelerate_mixed_precision` (accelerate casts the
    forward; the others cast themselves) and `can_shard_target` (every rank runs every
    target forward, so `trainer.shard_target` works).
    """

    name = "base"
    accelerate_mixed_precision = False
    can_shard_target = True

    def __init__(self, cfg: DictConfig):
        from accelerate import Accelerator

        self.cfg = cfg
        self.mixed = mixed_precision(cfg)
        # cpu=True is what makes accelerate form a gloo process group on CPU-only machines
        self.accelerator = Accelerator(mixed_precision=self.mixed if self.accelerate_mixed_precision else "no",
                                       cpu=cfg.target.device == "cpu" or not torch.cuda.is_available())
        self.device = self.accelerator.device
        self.model = self.optimizer = self.skeleton = None
        # set by the train stage: the drafter's module (what a checkpoint holds) and the
        # training fingerprint (a checkpoint of other settings is not resumed), its parts' hashes and settings
        self.module = self.stamp = self.stamp_parts = self.stamp_settings = None

    # ---- parts
    def load_target(self, target_cfg):
        from specforge_lite.targets.loading import load_target

        if self.cfg.trainer.shard_target:
            # offline, every rank builds the features of its share of the rows with every rank in
            # every target forward (features.FeatureCache.build's lockstep), whatever the strategy;
            # online, the strategy's own loop must run every rank in every forward
            if not self.can_shard_target and self.cfg.train.mode == "online":
                raise SpecforgeError(f"trainer.shard_target=true needs every rank in every target forward: use "
                                     f"trainer=fsdp or trainer=deepspeed_zero3 (trainer={self.name} keeps the "
                                     "target whole)")
            from specforge_lite.targets.sharded import load_sharded_target

            ensure_process_group(self.device)
            return load_sharded_target(target_cfg, self.device)
        return load_target(OmegaConf.merge(target_cfg, {"device": str(self.device)}))

    def prepare(self, drafter, optimizer):
        """Wrap the drafter and its optimizer; returns what the loop calls and steps."""
        gradient_checkpointing(drafter, self.cfg)
        self.model, self.optimizer = self.accelerator.prepare(drafter, optimizer)
        return self.model, self.optimizer

    def checkpoint_state(self) -> dict:
        """What `state.json` records besides the step: who wrote it, on how many ranks, with which settings."""
        return {"strategy": self.name, "world_size": world_size(), "fingerprint": self.stamp,
                "fingerprint_parts": self.stamp_parts, "fingerprint_settings": self.stamp_settings}

    # ---- one optimizer step
    def accumulate(self, last: bool):
        """Context of one micro-batch's forward and backward; gradients sync on the last one."""
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    def autocast(self):
        return self.accelerator.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def step(self, max_grad_norm: float) -> float:
        """Clip, step, zero the gradients; returns the gradient norm before clipping."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = self.accelerator.clip_grad_norm_(params, max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ---- checkpoints and output
    def save_checkpoint(self, ckpt_dir: Path, step: int, keep: int) -> None:
        """Plain full files written by rank 0 (resume on any number of ranks)."""
        weights = self.module.trained_weights(self.accelerator.unwrap_model(self.model)) \
            if self.accelerator.is_main_process else {}
        write_checkpoint(ckpt_dir, step, keep, write_plain(weights, self.optimizer), self.checkpoint_state())

    def load_checkpoint(self, path: Path) -> int:
        check_written_by(path, self.name, self.stamp, self.stamp_parts, self.stamp_settings)
        drafter = self.accelerator.unwrap_model(self.model)
        read_plain(path, drafter, self.optimizer, set(self.module.trained_weights(drafter)))
        return restore_rng(path)

    def full_drafter(self):
        """The trained drafter as a plain module with full weights (rank 0; collective)."""
        return self.accelerator.unwrap_model(self.model)

    def memory_report(self, target) -> dict:
        """What this rank holds: target and drafter weights, optimizer state, peak RSS."""
        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        while hasattr(opt, "optimizer"):  # accelerate / DeepSpeed wrappers
            opt = opt.optimizer
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        return {"strategy": self.name, "world_size": world_size(),
                "rank": self.accelerator.process_index,
                "target_weight_bytes": local_bytes(target.parameters()),
                "drafter_weight_bytes": local_bytes(self.model.parameters()),
                "optimizer_state_bytes": local_bytes(state),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}


class DDPStrategy(Strategy):
    """accelerate's DDP: every rank holds everything; gradients are all-reduced."""

    name = "ddp"
    accelerate_mixed_precision = True
    can_shard_target = False


def gradient_checkpointing(drafter, cfg: DictConfig) -> None:
    """`trainer.gradient_checkpointing`: recompute activations in backward. A drafter with a
    `gradient_checkpointing` flag (EAGLE-3: each TTT step's [B, h, T, T] attention) sets it;
    one that is (or holds) a Hugging Face model turns on its own checkpointing."""
    if not cfg.trainer.gradient_checkpointing:
        return
    if isinstance(getattr(drafter, "gradient_checkpointing", None), bool):
        drafter.gradient_checkpointing = True
        return
    model = drafter if hasattr(drafter, "gradient_checkpointing_enable") else getattr(drafter, "model", None)
    if model is None and hasattr(drafter, "base"):  # a distilled student wraps its HF model
        model = drafter.base()
    if model is None or not hasattr(model, "gradient_checkpointing_enable"):
        raise SpecforgeError(f"trainer.gradient_checkpointing=true: drafter {cfg.drafter.name!r} does not support "
                             "it (no gradient_checkpointing flag, not a Hugging Face model)")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def plain_copy(skeleton, state: dict):
    """The drafter as an ordinary module on CPU holding `state` (a full state dict)."""
    module = skeleton.to_empty(device="cpu")
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"gathered drafter state does not fit the drafter: missing {missing}, unexpected {unexpected}")
    return module
