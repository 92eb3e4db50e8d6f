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


def folder_problem(folder: Path, setting: str) -> str | None:
    """Why `folder` (named by `setting`) cannot be created or written, or None: the folder or
    one of its parents is a file, or the nearest existing one is not writable."""
    folder = Path(folder)
    probe = folder
    while not probe.exists():
        if probe.is_symlink():
            return f"{setting}: {folder} cannot be created ({probe} is a broken link)"
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == folder else f"cannot be created: {probe} is a file"
        return f"{setting}: {folder} {where}, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{setting}: {folder} cannot be written ({probe} is not writable)"
    return None


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def umask() -> int:
    """This process's umask (read without changing it where /proc says it; else set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readable_temp_dir(parent: Path, prefix: str) -> Path:
    """`tempfile.mkdtemp` in `parent`, with the mode a plain `mkdir` gives (mkdtemp's is 700,
    which a folder renamed into place would keep: a server running as another user could
    not read an export)."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    tmp.chmod(0o777 & ~umask())
    return tmp


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temporary file in the same folder and rename it into place; the file
    gets the mode a plain `open` gives under the user's umask (mkstemp's is 600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~umask())
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
