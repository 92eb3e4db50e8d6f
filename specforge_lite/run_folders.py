"""Run directories and provenance: every stage folder records what made it."""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import tempfile
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.stage_table import SAMPLE, STAGES

log = logging.getLogger(__name__)

STAGE_DIRS = {s.name: s.folder for s in STAGES}  # stage -> its folder under run_dir (stage_table.py)

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


@contextmanager
def replaced_as_one(final: Path, stage: str):
    """A stage's outputs put into `final` as one unit, once the `with` block has written them
    all into the folder it is given (a fresh one beside `final`): `place_files` then replaces
    the previous run's files (removing those this run no longer writes, such as a plot not
    drawn again) and keeps the user's; on any failure the previous outputs stay as they were."""
    import shutil

    Path(final).parent.mkdir(parents=True, exist_ok=True)
    tmp = readable_temp_dir(Path(final).parent, f".{Path(final).name}-")
    try:
        yield tmp
        place_files(tmp, final, stage)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_provenance(out_dir: Path, cfg: DictConfig) -> None:
    """Save the resolved config and package versions next to a stage's artifact."""
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    atomic_write_json(out_dir / "versions.json", package_versions())


# --------------------------------------------------------------------------- one run per folder

def lock_path(folder: Path) -> Path:
    """The lock that guards `folder`: beside it, named after it (`run_dir/.train.lock`)."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}.lock"


def process_start(pid: int) -> str | None:
    """When process `pid` started, as the kernel counts it (Linux's /proc); None where unknown.
    With the pid it names one process: a pid handed to a new process gets another start."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def lock_holder_alive(holder: dict) -> bool:
    """Whether the process a lock names still runs; one on another host counts as running."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", 0))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    started = holder.get("process_start")
    return started is None or process_start(pid) in (None, started)


def take_lock(folder: Path, command: str) -> Path | None:
    """Take the lock on `folder` for this process (PID, host, command), or raise SpecforgeError
    naming the live run that holds it. A lock whose process is gone (this host) is taken over.
    Returns the lock's path, or None when this process holds it already."""
    path = lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "process_start": process_start(os.getpid()),
            "command": command, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(20):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue  # released meanwhile
            try:
                holder = json.loads(text)
                holder = holder if isinstance(holder, dict) else {}
            except ValueError:  # being written by its taker now, or left half-written by a crash
                if time.time() - path.stat().st_mtime < 2:
                    time.sleep(0.1)
                    continue
                holder = {}
            if holder.get("pid") == mine["pid"] and holder.get("host") == mine["host"]:
                return None
            if holder and lock_holder_alive(holder):
                here = holder["host"] == mine["host"]
                where = "this host" if here else f"host {holder['host']}"
                # a pid can name another program (a lock copied between machines, a hand-made one)
                gone = (f"; if pid {holder['pid']} is not that run, delete {path}" if here
                        else f"; if that run is gone, delete {path}")
                raise SpecforgeError(f"{folder} is in use by pid {holder['pid']} on {where} "
                                     f"(`{holder.get('command', '?')}`, since {holder.get('since', '?')}): wait for "
                                     f"it to end or stop it{gone}")
            log.warning("%s: the run that held it (pid %s on %s) is gone; taking it over", path,
                        holder.get("pid", "?"), holder.get("host", "?"))
            try:
                if path.read_text() == text:  # nobody took it over meanwhile
                    path.unlink()
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(mine) + "\n")
        return path
    raise SpecforgeError(f"cannot take the lock {path}: other runs keep taking it")


def release_lock(path: Path | None) -> None:
    """Remove a lock this process took (`take_lock`), unless another process holds it now."""
    if path is None:
        return
    try:
        holder = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        Path(path).unlink(missing_ok=True)


@contextmanager
def folder_locks(folders: list[Path], command: str):
    """Hold the locks of `folders` (`take_lock`) for the `with` block; released however it ends."""
    taken: list[Path | None] = []
    try:
        for folder in folders:
            taken.append(take_lock(folder, command))
        yield
    finally:
        for path in reversed(taken):
            release_lock(path)


# --------------------------------------------------------------------------- a stage replaces only its own files

MANIFEST = "manifest.json"  # in a folder a stage writes: the files it wrote there
PROVENANCE = "versions.json"  # written by `write_provenance` into every folder a stage writes


def written_files(folder: Path, stage: str) -> set[str] | None:
    """The files (relative paths) `stage` recorded in `folder`'s manifest, None without one."""
    try:
        record = json.loads((Path(folder) / MANIFEST).read_text())
        files = record["files"] if record.get("stage") == stage else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return set(files) if isinstance(files, list) else None


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file() or p.is_symlink())


def in_the_way(final: Path, rel: str, ours: set[str]) -> Path | None:
    """What in `final` keeps this stage from writing its file `rel` there: a file not its own
    at that path, or anything but a plain folder where a folder of the path goes."""
    target = final / rel
    for parent in reversed(Path(rel).parents[:-1]):
        folder = final / parent
        if (folder.exists() or folder.is_symlink()) and (folder.is_symlink() or not folder.is_dir()):
            return folder
    if target.is_symlink() or target.exists():
        return target if target.is_dir() or rel not in ours else None
    return None


def place_files(new: Path, final: Path, stage: str) -> None:
    """Move the files of folder `new` into `final`, replacing the ones `stage` wrote there before
    (listed in its MANIFEST) and removing those of them it no longer writes; every other file
    in `final` is the user's and stays. Something of the user's in the way of a file to write
    refuses the whole move (SpecforgeError) before anything is changed. A folder without a
    manifest but with this package's PROVENANCE was written by an earlier version: the files
    written again count as its own."""
    new, final = Path(new), Path(final)
    ours = files_under(new)
    before = written_files(final, stage)
    if before is None:
        if (final / MANIFEST).exists() or (final / MANIFEST).is_symlink():
            raise SpecforgeError(f"{final / MANIFEST} is not the {stage} stage's list of its files; move it "
                                 f"out of the way, then run {stage} again")
        before = set(ours) if (final / PROVENANCE).is_file() else set()
    for rel in ours:
        if (path := in_the_way(final, rel, before)) is not None:
            raise SpecforgeError(f"{path} is in the way: the {stage} stage writes {final / rel} and did not write "
                                 f"that (it is not in {final / MANIFEST}); move it away, then run {stage} again")
    final.mkdir(parents=True, exist_ok=True)
    # while files move, old and new count as this stage's: an interrupted move leaves no file disowned
    atomic_write_json(final / MANIFEST, {"stage": stage, "files": sorted(set(ours) | before)})
    for rel in ours:
        (final / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(new / rel, final / rel)
    for rel in sorted(before - set(ours)):
        stale = final / rel
        if stale.is_symlink() or stale.is_file():
            stale.unlink()
        for parent in stale.parents:  # folders it leaves empty
            if final not in parent.parents or not parent.is_dir() or any(parent.iterdir()):
                break
            parent.rmdir()
    atomic_write_json(final / MANIFEST, {"stage": stage, "files": ours})
