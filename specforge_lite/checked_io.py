"""Opening the files of artifacts (targets, drafters, checkpoints, exports) so that a
missing, truncated or damaged file is reported by name with what is wrong, not as a
library's own error.

`ArtifactError` is the user-facing error for such a file; the checkpoint code catches it
to fall back to an older checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specforge_lite import SpecforgeError

DAMAGED = "the file is damaged or truncated"


class ArtifactError(SpecforgeError):
    """A file of an artifact is missing or unreadable; `path` names it."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)


# how libraries word a write that the file system refused (a full disk, a file-size limit, a
# quota): safetensors and torch.save raise their own error types around the OS error
_WRITE_FAILURES = ("i/o error", "os error", "failed writing", "no space left", "file too large", "quota")


def write_failure(err: BaseException) -> bool:
    """True when `err`, raised while writing files, is the file system refusing the write."""
    return isinstance(err, OSError) or any(text in str(err).lower() for text in _WRITE_FAILURES)


def file_stamp(path: Path) -> tuple:
    """(path, size, mtime_ns, ctime_ns, inode): what any rewrite of the file changes, even one that
    restores its mtime; what a result read from the file is kept by."""
    stat = Path(path).stat()
    return (str(path), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


def require_file(path: Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(path, "missing" if not path.exists() else "not a file")
    return path


def read_json(path: Path) -> Any:
    """A JSON file's content; a missing, non-UTF-8 or invalid (truncated) file is an `ArtifactError`."""
    path = require_file(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ArtifactError(path, f"not UTF-8 text (byte {err.start}); {DAMAGED}") from None
    except json.JSONDecodeError as err:
        raise ArtifactError(path, f"invalid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                            f"{DAMAGED}") from None


def read_json_object(path: Path, required: tuple[str, ...] = ()) -> dict:
    """`read_json` of a file that must hold an object with the `required` keys."""
    content = read_json(path)
    if not isinstance(content, dict):
        raise ArtifactError(path, f"expected a JSON object, found {type(content).__name__}")
    missing = [k for k in required if k not in content]
    if missing:
        raise ArtifactError(path, f"lacks {', '.join(missing)}")
    return content


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`{name: (dtype, shape)}` of a safetensors file, after checking that the file holds
    every byte its header promises (a truncated copy fails here, by name)."""
    path = require_file(path)
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ArtifactError(path, f"{size} bytes, too short for a safetensors file; {DAMAGED}")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise ArtifactError(path, f"header of {length} bytes but the file has {size}; {DAMAGED}")
        try:
            header = json.loads(fh.read(length).decode("utf-8"))
            tensors = {name: (info["dtype"], tuple(info["shape"]), tuple(info["data_offsets"]))
                       for name, info in header.items() if name != "__metadata__"}
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ArtifactError(path, f"unreadable safetensors header; {DAMAGED}") from None
    end = 8 + length + max((offsets[1] for _, _, offsets in tensors.values()), default=0)
    if end > size:
        raise ArtifactError(path, f"holds {size} of the {end} bytes its header lists; {DAMAGED}")
    return {name: (dtype, shape) for name, (dtype, shape, _) in tensors.items()}


def load_safetensors(path: Path, device: str = "cpu"):
    """All tensors of a safetensors file (checked by `safetensors_header` first)."""
    from safetensors.torch import load_file

    safetensors_header(path)
    try:
        return load_file(str(path), device=device)
    except Exception as err:  # safetensors raises its own error type for a damaged file
        raise ArtifactError(path, f"cannot read it ({err}); {DAMAGED}") from None


def check_weights(path: Path, weights: dict, expected: dict[str, tuple[int, ...]],
                  optional: tuple[str, ...] = (), finite: bool = True) -> None:
    """The tensors read from `path` against `expected` shapes: missing, unexpected and
    misshapen names (and NaN / inf values) raise an `ArtifactError` naming them."""
    missing = sorted(set(expected) - set(weights) - set(optional))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ArtifactError(path, "does not fit: " + "; ".join(
            part for part in (f"missing {_few(missing)}" if missing else "",
                              f"unexpected {_few(unexpected)}" if unexpected else "") if part))
    misshapen = [f"{name} {tuple(weights[name].shape)} (expected {expected[name]})"
                 for name in sorted(weights) if tuple(weights[name].shape) != tuple(expected[name])]
    if misshapen:
        raise ArtifactError(path, f"misshapen tensors: {_few(misshapen)}")
    if finite:
        bad = [name for name in sorted(weights) if weights[name].is_floating_point()
               and not bool(weights[name].isfinite().all())]
        if bad:
            raise ArtifactError(path, f"NaN or inf values in {_few(bad)}")


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def torch_load(path: Path, **kwargs):
    """`torch.load` of a file written by `torch.save`; a damaged one is an `ArtifactError`."""
    import pickle
    import zipfile

    import torch

    path = require_file(path)
    try:
        return torch.load(path, **kwargs)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ArtifactError(path, f"cannot read it ({first}); {DAMAGED}") from None
