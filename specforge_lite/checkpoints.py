"""Training checkpoints: one write path for every trainer strategy.

A checkpoint is a folder `step-NNNNNNN` under `run_dir/train/checkpoints`. Every rank
writes its part into a temporary `.step-NNNNNNN.tmp` folder; rank 0 adds the RNG state
and `state.json` last, renames the folder into place and prunes the oldest ones, so a
folder with `state.json` is complete and a crash never leaves a half-written
checkpoint where the resume looks. What "its part" is belongs to the strategy: plain
full files (`write_plain` / `read_plain`, DDP), ZeRO shards (DeepSpeed) or a
torch.distributed.checkpoint folder (FSDP).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import torch

from specforge_lite import SpecforgeError

WEIGHTS = "drafter.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
STATE = "state.json"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def write_checkpoint(ckpt_dir: Path, step: int, keep: int, write: Callable[[Path], None], state: dict) -> Path:
    """Write checkpoint `step`: `write(tmp)` on every rank (collective), then rank 0 adds
    `rng.pt` and `state.json` (`{"step": step, **state}`), renames and keeps the newest `keep`.
    A failure on rank 0 removes the temporary folder before it propagates."""
    ckpt_dir = Path(ckpt_dir)
    rank = _rank()
    final = ckpt_dir / f"step-{step:07d}"
    tmp = ckpt_dir / f".step-{step:07d}.tmp"
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        write(tmp)
        _barrier()
        if rank == 0:
            save_rng(tmp)
            (tmp / STATE).write_text(json.dumps({"step": step, **state}))
            if final.exists():  # the same step written before (a resumed run): keep the first
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, final)
            prune(ckpt_dir, keep)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return final


def prune(ckpt_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints."""
    for old in sorted(Path(ckpt_dir).glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint folders (those with `state.json`), oldest first."""
    return sorted(p for p in Path(ckpt_dir).glob("step-*") if (p / STATE).exists())


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    done = complete_checkpoints(ckpt_dir)
    return done[-1] if done else None


def read_state(path: Path) -> dict:
    return json.loads((Path(path) / STATE).read_text())


def check_written_by(path: Path, strategy: str, stamp: str | None = None) -> dict:
    """`state.json` of checkpoint `path`, after checking it was written by `strategy` with the
    same training fingerprint `stamp` (a checkpoint of other settings is not resumed)."""
    state = read_state(path)
    written_by = state.get("strategy", "ddp")  # checkpoints from before strategies are DDP's
    if written_by != strategy:
        raise SpecforgeError(f"checkpoint {path} was written with trainer={written_by}; resume it with that trainer "
                             f"(now trainer={strategy}) or set train.resume=false to start over")
    if stamp is not None and state.get("fingerprint") not in (None, stamp):
        raise SpecforgeError(f"checkpoint {path} was written with other training settings; resuming it would "
                             "mix two runs. Use another run_dir, delete that folder, or set train.resume=false")
    return state


# --------------------------------------------------------------------------- plain (full) files

def write_plain(weights: dict[str, torch.Tensor], optimizer) -> Callable[[Path], None]:
    """The `write` of a strategy whose rank 0 holds everything: weights and optimizer state."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        if _rank() == 0:
            save_file(weights, str(tmp / WEIGHTS))
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER)

    return write


def read_plain(path: Path, drafter, optimizer, expected: set[str]) -> None:
    """Load the weights (exactly the `expected` names) and optimizer state of a plain checkpoint."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(path) / WEIGHTS))
    if set(weights) != expected:
        raise SpecforgeError(f"checkpoint {path} does not fit this drafter (missing "
                             f"{sorted(expected - set(weights))[:5]}, unexpected {sorted(set(weights) - expected)[:5]})")
    drafter.load_state_dict(weights, strict=False)
    optimizer.load_state_dict(torch.load(Path(path) / OPTIMIZER, weights_only=False))


# --------------------------------------------------------------------------- RNG

def save_rng(directory: Path) -> None:
    """torch, Python and CUDA random states of this process, to `directory/rng.pt`."""
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, Path(directory) / RNG)


def restore_rng(path: Path) -> int:
    """Restore what `save_rng` wrote in checkpoint `path`; returns the checkpoint's step."""
    rng = torch.load(Path(path) / RNG, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return read_state(path)["step"]
