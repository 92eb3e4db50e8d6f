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

from specforge_lite.config.stages import SAMPLE, STAGES

STAGE_DIRS = {s.name: s.folder for s in STAGES}  # stage -> its folder under run_dir (config/stages.py)

_VERSIONED = ("specforge_lite", "torch", "transformers", "accelerate", "datasets", "peft",
              "deepspeed", "wandb", "hydra-core", "safetensors", "gguf", "vllm")


def stage_dir(cfg: DictConfig, stage: str) -> Path:
    """`run_dir/<stage folder>`, created if missing."""
    path = samples_dir(cfg) if stage == SAMPLE.name else Path(cfg.run_dir) / STAGE_DIRS[stage]
    path.mkdir(parents=True, exist_ok=True)
    return path


def samples_dir(cfg: DictConfig) -> Path:
    """Where the sampled conversations live: `samples_dir`, or `run_dir/samples`."""
    return Path(cfg.samples_dir) if cfg.get("samples_dir") else Path(cfg.run_dir) / SAMPLE.folder


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


# the folders a user names or sets, by the setting that names them (`folder_error`)
FOLDER_ENVS = ("SPECFORGE_LITE_CACHE", "SPECFORGE_LITE_GRAPH_CACHE")


def folder_error(cfg: DictConfig, err: OSError) -> str | None:
    """One line for an OSError on a path under a folder the user named or set (`samples_dir`,
    `run_dir`, $SPECFORGE_LITE_CACHE, $SPECFORGE_LITE_GRAPH_CACHE), naming the folder and the
    setting; None when the path is elsewhere (then it is no input of the user's)."""
    named = [(cfg.get("samples_dir"), "samples_dir"), (cfg.get("run_dir"), "run_dir"),
             *((os.environ.get(env), env) for env in FOLDER_ENVS)]
    for name in (err.filename, err.filename2):
        if not name:
            continue
        path = Path(os.path.abspath(name))
        for folder, setting in named:
            if folder and str(folder).strip():
                root = Path(os.path.abspath(str(folder)))
                if path == root or root in path.parents:
                    return f"{setting}={folder}: cannot write {name} ({err.strerror or err})"
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


def modes_as_umask_says(folder: Path) -> None:
    """Give `folder` and everything under it the modes a plain `mkdir` / `open` gives under the
    user's umask: some writers use private modes (safetensors writes its files 600)."""
    mask = umask()
    for path in [Path(folder), *Path(folder).rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        wanted = 0o777 if path.is_dir() else 0o666 | (mode & 0o111)
        path.chmod(wanted & ~mask)


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
