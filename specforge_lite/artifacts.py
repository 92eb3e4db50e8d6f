"""Run directories and provenance: every stage folder records what made it."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

STAGE_DIRS = {"sample": "samples", "train": "train", "evaluate": "eval", "export": "export"}

_VERSIONED = ("specforge_lite", "torch", "transformers", "accelerate", "datasets", "peft",
              "deepspeed", "wandb", "hydra-core", "safetensors", "gguf", "vllm")


def stage_dir(cfg: DictConfig, stage: str) -> Path:
    """`run_dir/<stage folder>`, created if missing."""
    path = samples_dir(cfg) if stage == "sample" else Path(cfg.run_dir) / STAGE_DIRS[stage]
    path.mkdir(parents=True, exist_ok=True)
    return path


def samples_dir(cfg: DictConfig) -> Path:
    """Where the sampled conversations live: `samples_dir`, or `run_dir/samples`."""
    return Path(cfg.samples_dir) if cfg.get("samples_dir") else Path(cfg.run_dir) / STAGE_DIRS["sample"]


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temporary file in the same folder and rename it into place."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_provenance(out_dir: Path, cfg: DictConfig) -> None:
    """Save the resolved config and package versions next to a stage's artifact."""
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    atomic_write_json(out_dir / "versions.json", package_versions())
