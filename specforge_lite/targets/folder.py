"""A local target folder's files, checked before a library reads them: config.json, the tokenizer's
JSON files and the weights' headers, each error naming its file (`check_target_dir`)."""

from __future__ import annotations

import os
from pathlib import Path

from specforge_lite.checked_io import ArtifactError, read_json, read_json_object, safetensors_header

# the JSON files of a model folder besides config.json, checked by name before a library reads them
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


# folder -> the stat of every file it had when its check passed: a command resolves and loads its
# target several times, and each check would parse a tokenizer.json of megabytes again
_PASSED: dict[tuple[str, bool], tuple] = {}


def _files_state(path: Path) -> tuple:
    """(name, size, mtime_ns, inode) of every file in `path`: what a check read, and what a copy,
    a rewrite or a truncation of any of them changes."""
    state = []
    for entry in os.scandir(path):
        if entry.is_file():
            st = entry.stat()
            state.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(state))


def check_target_dir(path: Path, weights: bool = True) -> None:
    """A local target folder: its config.json (present, valid JSON, a model_type) and, with
    `weights`, every safetensors file it has or its index lists, complete. Errors name the file.
    A folder whose files are unchanged since it passed in this process is not read again."""
    key = (str(Path(path).resolve()), weights)
    try:
        state = _files_state(Path(path))
    except OSError:
        state = None
    if state is not None and _PASSED.get(key) == state:
        return
    _check_target_files(Path(path), weights)
    if state is not None:
        _PASSED[key] = state


def _check_target_files(path: Path, weights: bool) -> None:
    config = read_json_object(Path(path) / "config.json")
    if "model_type" not in config:
        raise ArtifactError(Path(path) / "config.json", "no model_type: not a Hugging Face model config")
    for name in TOKENIZER_JSON:
        if (Path(path) / name).exists():
            read_json(Path(path) / name)
    if not weights:
        return
    index = Path(path) / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index, required=("weight_map",))["weight_map"]
        files = sorted({Path(path) / name for name in weight_map.values()})
    else:
        files = sorted(Path(path).glob("*.safetensors"))
    if not files and not list(Path(path).glob("pytorch_model*.bin")):
        raise ArtifactError(Path(path), "no weights (model.safetensors or pytorch_model.bin)")
    for file in files:
        safetensors_header(file)
