"""Training checkpoints: one write path for every trainer strategy.

A checkpoint is a folder `step-NNNNNNN` under `run_dir/train/checkpoints`. Every rank
writes its part into a temporary `.step-NNNNNNN.tmp` folder; rank 0 adds the RNG state
and `state.json` last, renames the folder into place and prunes the oldest ones, so a
folder with `state.json` is complete and a crash never leaves a half-written
checkpoint where the resume looks; a failed write (a full disk) removes the temporary
folder and is reported. What "its part" is belongs to the strategy: plain full files
(`write_plain` / `read_plain`, DDP), ZeRO shards (DeepSpeed) or a
torch.distributed.checkpoint folder (FSDP).

A resume (`resume`) takes the newest checkpoint whose files are intact: a damaged one
(a truncated weights, optimizer, RNG or state file) is reported by file and the previous
one is used, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import zipfile
from pathlib import Path
from typing import Callable

import torch

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import (DAMAGED, ArtifactError, load_safetensors, read_json, read_json_object,
                                        safetensors_header, torch_load, write_failure)
from specforge_lite.run_folders import modes_as_umask_says

log = logging.getLogger(__name__)

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
            modes_as_umask_says(tmp)  # safetensors writes its files 600
            if final.exists():  # the same step written before (a resumed run): keep the first
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, final)
            prune(ckpt_dir, keep)
    except BaseException as err:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if write_failure(err):  # a full disk, a quota, a lost mount: the user's to fix
            raise SpecforgeError(f"cannot write checkpoint {final} ({_reason(err)}); its temporary "
                                 "folder was removed and the earlier checkpoints are intact") from err
        raise
    _barrier()
    return final


def _reason(err: BaseException) -> str:
    return getattr(err, "strerror", None) or str(err).strip().splitlines()[-1]


def prune(ckpt_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints."""
    for old in sorted(Path(ckpt_dir).glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def set_aside(ckpt_dir: Path) -> Path | None:
    """A run that starts over (`train.resume=false`): the checkpoints an earlier run left in
    `ckpt_dir` move to `<ckpt_dir>.previous` (replacing an older set), so that this run's steps
    are written, and a later resume finds only them; returns where they went, or None."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir() or not any(ckpt_dir.iterdir()):
        return None
    aside = ckpt_dir.with_name(ckpt_dir.name + ".previous")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(ckpt_dir, aside)
    return aside


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint folders (those with `state.json`), oldest first."""
    return sorted(p for p in Path(ckpt_dir).glob("step-*") if (p / STATE).exists())


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    done = complete_checkpoints(ckpt_dir)
    return done[-1] if done else None


def read_state(path: Path) -> dict:
    return read_json_object(Path(path) / STATE, required=("step",))


def check_files(path: Path) -> None:
    """Every file of checkpoint `path` is intact as far as can be told without loading it:
    JSON parses, a safetensors file holds every byte its header lists, a `torch.save` archive
    (.pt) has its zip directory (the end of the file: truncation loses it)."""
    read_state(path)
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        if file.suffix == ".safetensors":
            safetensors_header(file)
        elif file.suffix == ".json":
            read_json(file)
        elif file.suffix == ".pt":
            try:
                zipfile.ZipFile(file).close()
            except (zipfile.BadZipFile, OSError) as err:
                raise ArtifactError(file, f"not a complete torch.save archive ({err}); {DAMAGED}") from None


def resume(ckpt_dir: Path, load: Callable[[Path], int]) -> tuple[int, Path | None]:
    """`(step, checkpoint)` of the newest complete checkpoint that loads with `load` (the
    strategy's), or `(0, None)` when there is none. A damaged one is reported by file and
    the one before it used, with a warning; when every one is damaged that is an error
    (a partly loaded state must not be trained on as if it were fresh)."""
    damaged = []
    for path in reversed(complete_checkpoints(ckpt_dir)):
        try:
            check_files(path)
            step = load(path)
        except ArtifactError as err:
            log.warning("checkpoint %s is damaged: %s; trying the one before it", path.name, err)
            damaged.append(str(err))
            continue
        if damaged:
            log.warning("resuming from %s, an older checkpoint: the newer one(s) were damaged (%s)",
                        path, "; ".join(damaged))
        return step, path
    if damaged:
        raise SpecforgeError(f"no usable checkpoint in {ckpt_dir}: " + "; ".join(damaged)
                             + ". Delete the damaged ones (or that folder), or set train.resume=false to start over")
    return 0, None


# what each part of the training fingerprint (stages/train_keys.py `fingerprint_and_parts`) covers
FINGERPRINT_PARTS = {"target": "the target settings (target.*)",
                     "target_files": "the target's weights (the files of target.path)",
                     "data": "the data settings (data.*)", "samples": "the samples",
                     "drafter": "the drafter options (drafter.*)", "train": "the training settings (train.*)"}


def check_written_by(path: Path, strategy: str, stamp: str | None = None, parts: dict | None = None,
                     settings: dict | None = None) -> dict:
    """`state.json` of checkpoint `path`, after checking it was written by `strategy` with the
    same training fingerprint `stamp` (a checkpoint of other settings is not resumed); `parts`,
    the fingerprint's parts, name what changed where the checkpoint recorded its own, and
    `settings`, the plain settings of some parts, the keys that changed with both values."""
    state = read_state(path)
    written_by = state.get("strategy", "ddp")  # checkpoints from before strategies are DDP's
    if written_by != strategy:
        raise SpecforgeError(f"checkpoint {path} was written with trainer={written_by}; resume it with that trainer "
                             f"(now trainer={strategy}) or set train.resume=false to start over")
    if stamp is not None and state.get("fingerprint") not in (None, stamp):
        raise SpecforgeError(other_inputs(path, state, parts or {}, settings or {}))
    return state


SHOWN_KEYS = 4  # changed keys a refusal lists before "and N more"


def other_inputs(path: Path, state: dict, parts: dict, settings: dict) -> str:
    """The refusal of checkpoint `path` (its `state`) written with other inputs than `parts` and
    `settings`: the keys that changed with their old and new values where it recorded its settings,
    else the parts that changed, else (a checkpoint that recorded neither) "other training settings"."""
    before, recorded = state.get("fingerprint_parts") or {}, state.get("fingerprint_settings") or {}
    keys, others = [], []
    for part in (k for k in parts if k in before and before[k] != parts[k]):
        differ = changed_keys(part, recorded[part], settings[part]) if part in recorded and part in settings else []
        if differ:
            keys += differ
        else:  # a part recorded as a hash only (the target's files, the samples)
            others.append(FINGERPRINT_PARTS.get(part, part))
    listed = ", ".join(keys[:SHOWN_KEYS]) + (f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")
    if keys:
        what = f"with {listed}" + (f", and {', '.join(others)} changed since" if others else "")
    else:
        what = f"for other inputs: {', '.join(others)} changed since" if others else "with other training settings"
    why = "resuming it would mix two runs"
    if len(keys) == 1 and not others and keys[0].startswith("train.max_steps="):  # the usual surprise
        why += ("; train.max_steps shapes the learning-rate schedule, so a run of more (or fewer) steps is a new "
                "run, not a longer one")
    return (f"checkpoint {path} was written {what}; {why}. Use another run_dir, delete {Path(path).parent}, "
            "or set train.resume=false to start over")


def changed_keys(part: str, then: dict, now: dict) -> list[str]:
    """`part.key=old (now new)` for each key (nested ones dotted) whose value differs, by name."""
    then, now = _flatten(then, f"{part}."), _flatten(now, f"{part}.")
    return [f"{key}={_shown(then.get(key, UNSET))} (now {_shown(now.get(key, UNSET))})"
            for key in sorted(set(then) | set(now)) if then.get(key, UNSET) != now.get(key, UNSET)]


UNSET = "<unset>"  # a key one side does not have (a setting added or dropped by an upgrade)


def _flatten(tree, prefix: str) -> dict:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def _shown(value) -> str:
    """A value as it is typed on the command line (true, null, [1, 2]), strings bare."""
    return value if isinstance(value, str) else json.dumps(value)


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
    weights = load_safetensors(Path(path) / WEIGHTS)
    if set(weights) != expected:
        raise SpecforgeError(f"checkpoint {path} does not fit this drafter (missing "
                             f"{sorted(expected - set(weights))[:5]}, unexpected {sorted(set(weights) - expected)[:5]})")
    drafter.load_state_dict(weights, strict=False)
    optimizer.load_state_dict(torch_load(Path(path) / OPTIMIZER, weights_only=False))


# --------------------------------------------------------------------------- RNG

def save_rng(directory: Path) -> None:
    """torch, Python and CUDA random states of this process, to `directory/rng.pt`."""
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, Path(directory) / RNG)


def restore_rng(path: Path) -> int:
    """Restore what `save_rng` wrote in checkpoint `path`; returns the checkpoint's step."""
    rng = torch_load(Path(path) / RNG, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return read_state(path)["step"]
