"""A local target folder's files, checked before a library reads them: config.json, the tokenizer's
JSON files and the weights' headers, each error naming its file (`check_target_dir`)."""

from __future__ import annotations

import functools
from pathlib import Path

from specforge_lite.checked_io import ArtifactError, file_stamp, read_json, read_json_object, safetensors_header

# the JSON files of a model folder besides config.json, checked by name before a library reads them
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def check_target_dir(path: Path, weights: bool = True) -> None:
    """A local target folder: its config.json (present, valid JSON, a model_type) and, with
    `weights`, every safetensors file it has or its index lists, complete. Errors name the file.
    A folder whose files are unchanged since it passed in this process is not read again (a command
    resolves and loads its target several times; each check parsed a tokenizer.json of megabytes)."""
    path = Path(path)
    try:
        stamps = tuple(file_stamp(f) for f in sorted(path.iterdir()) if f.is_file())
    except OSError:  # unreadable as a folder: the check itself names what is wrong
        _check_files(path, weights)
        return
    _checked(path, weights, stamps)


@functools.lru_cache(maxsize=64)
def _checked(path: Path, weights: bool, stamps: tuple) -> None:
    """`_check_files` once per folder version (`stamps`): a failed check raises, and is not kept."""
    _check_files(path, weights)


def _check_files(path: Path, weights: bool) -> None:
    config = read_json_object(path / "config.json")
    if "model_type" not in config:
        raise ArtifactError(path / "config.json", "no model_type: not a Hugging Face model config")
    for name in TOKENIZER_JSON:
        if (path / name).exists():
            read_json(path / name)
    if not weights:
        return
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index, required=("weight_map",))["weight_map"]
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files and not list(path.glob("pytorch_model*.bin")):
        raise ArtifactError(path, "no weights (model.safetensors or pytorch_model.bin)")
    for file in files:
        safetensors_header(file)
