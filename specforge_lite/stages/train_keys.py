"""What decides a trained drafter (`fingerprint`, and its parts, which checkpoints record to name
what changed) and whether run_dir/train/drafter already holds it (`already_trained`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specforge_lite.checked_io import ArtifactError, read_json_object, safetensors_header
from specforge_lite.drafters.registry import RENAMED, chosen_drafter
from specforge_lite.run_folders import samples_dir
from specforge_lite.targets.digest import target_files

log = logging.getLogger("specforge_lite.stages.train")

UNTRACKED_TRAIN_KEYS = ("log_every", "tracker", "wandb", "checkpoint_every", "keep_checkpoints", "resume", "dry_run",
                        "peak_tflops")


def fingerprint(cfg: DictConfig) -> str:
    """Hash of what decides the trained weights: the target (its settings and files), the data, the samples (when
    used), the chosen drafter's options (less its `UNTRACKED_OPTIONS`) and the training
    settings (less logging, tracking and checkpoint cadence)."""
    return fingerprint_and_parts(cfg)[0]


def fingerprint_and_parts(cfg: DictConfig) -> tuple[str, dict[str, str]]:
    """`fingerprint` and the hash of each of its parts (checkpoints record them to name what
    changed), from one reading of the settings and the target's files."""
    return fingerprint_parts_settings(cfg)[:2]


# the parts whose plain settings a checkpoint records beside their hashes, to name the keys that changed
# (the target's file digests and the samples' fingerprint stay hashes: they name no key)
RECORDED_PARTS = ("target", "data", "drafter", "train")


def fingerprint_parts_settings(cfg: DictConfig) -> tuple[str, dict[str, str], dict[str, dict]]:
    """`fingerprint_and_parts` and the plain settings of the `RECORDED_PARTS`, as `state.json` holds them."""
    keys = fingerprint_keys(cfg)
    settings = json.loads(json.dumps({name: keys[name] for name in RECORDED_PARTS}, default=str))
    return _digest(keys), {name: _digest(value) for name, value in keys.items()}, settings


def _digest(value) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint_keys(cfg: DictConfig) -> dict:
    module = chosen_drafter(cfg)
    meta = samples_dir(cfg) / "meta.json"
    train = {k: v for k, v in OmegaConf.to_container(cfg.train, resolve=True).items() if k not in UNTRACKED_TRAIN_KEYS}
    drafter = {k: v for k, v in OmegaConf.to_container(cfg.drafter, resolve=True).items()
               if k not in module.UNTRACKED_OPTIONS}
    samples = read_json_object(meta).get("fingerprint") if cfg.train.use_samples and meta.exists() else None
    return {"target": OmegaConf.to_container(cfg.target, resolve=True), "target_files": target_files(cfg.target.path),
            "data": OmegaConf.to_container(cfg.data, resolve=True),
            "samples": samples, "drafter": drafter, "train": train}


def already_trained(cfg: DictConfig, stamp: str) -> bool:
    """True (and says so) when run_dir/train/drafter was trained to the end with these
    settings (`stamp`, from `fingerprint`)."""
    from specforge_lite.drafters.common import drafter_info

    folder = Path(cfg.run_dir) / "train" / "drafter"
    try:
        info = drafter_info(folder)
        for weights in sorted(folder.glob("*.safetensors")):  # whole, every byte its header promises
            safetensors_header(weights)
    except ArtifactError as err:
        log.warning("%s; training again replaces it", err)
        return False
    if info.get("fingerprint") == stamp and RENAMED.get(info.get("drafter"), info.get("drafter")) == cfg.drafter.name:
        log.info("%s already holds a %s drafter trained with these settings (%s steps); nothing to do "
                 "(delete that folder to train again)", Path(cfg.run_dir) / "train" / "drafter",
                 cfg.drafter.name, info.get("trained_steps"))
        return True
    return False
