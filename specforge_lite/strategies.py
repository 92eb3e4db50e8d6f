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

With `trainer.shard_target=true` (online mode) the frozen target's decoder layers are
split over the ranks (`specforge_lite.sharded_target`). Every strategy divides the gradient by the world size (mean over
ranks), which the train stage undoes with its global loss-position normalisation.

Checkpoints: `ddp` writes plain full files (resume on any number of ranks); `fsdp`
writes a torch.distributed.checkpoint folder (resharded on load: N ranks -> M ranks);
DeepSpeed writes its own ZeRO shards, which resume on the same number of ranks only.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import resource
import socket
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.checkpoints import check_written_by, read_plain, restore_rng, write_checkpoint, write_plain

log = logging.getLogger(__name__)


def mixed_precision(cfg: DictConfig) -> str:
    """`train.mixed_precision` resolved: auto is bf16 on a GPU that supports it, none on CPU
    (CPUs without native bf16 train 6-30x slower in it)."""
    mixed = cfg.train.mixed_precision
    if mixed == "auto":
        gpu = torch.cuda.is_available() and cfg.target.device != "cpu"
        mixed = "bf16" if gpu and torch.cuda.is_bf16_supported() else "no"
    if mixed not in ("no", "bf16"):
        raise SpecforgeError(f"train.mixed_precision={mixed!r}; choose auto, no or bf16")
    return mixed


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
        # training fingerprint (a checkpoint of other settings is not resumed)
        self.module = self.stamp = None

    # ---- parts
    def load_target(self, target_cfg):
        from specforge_lite.targets import load_target

        if self.cfg.trainer.shard_target and self.cfg.train.mode != "online":
            log.info("train.mode=offline: the target only builds the feature cache (on rank 0), so it is "
                     "loaded whole; trainer.shard_target applies to online training")
        elif self.cfg.trainer.shard_target:
            if not self.can_shard_target:
                raise SpecforgeError(f"trainer.shard_target=true needs every rank in every target forward: use "
                                     f"trainer=fsdp or trainer=deepspeed_zero3 (trainer={self.name} keeps the "
                                     "target whole)")
            from specforge_lite.sharded_target import load_sharded_target

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
        return {"strategy": self.name, "world_size": world_size(), "fingerprint": self.stamp}

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
        check_written_by(path, self.name, self.stamp)
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


def skip_inference_allreduce_build() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op when it starts its
    communication backend. On a CPU that op is a C++ build of about a minute and a half
    (56-94 s here, every time DeepSpeed's build flags change) on a rank's first start, and
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
        state = check_written_by(path, self.name, self.stamp)
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
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        check_written_by(path, self.name, self.stamp)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path / "dcp"))  # resharded to this run's ranks
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        return restore_rng(path)

    def full_drafter(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return plain_copy(self.skeleton, state) if self.accelerator.is_main_process else None


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


# --------------------------------------------------------------------------- helpers

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


def plain_copy(skeleton, state: dict):
    """The drafter as an ordinary module on CPU holding `state` (a full state dict)."""
    module = skeleton.to_empty(device="cpu")
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"gathered drafter state does not fit the drafter: missing {missing}, unexpected {unexpected}")
    return module
