"""What a target's weights are, by content: the digests every reuse decision keys on.

Samples, offline features, a trained drafter and the converted GGUF all belong to the
target's weights, not to its path or its files' sizes: a model rewritten in place with
the same sizes (another fine-tune, a file overwritten) must be redone. A weight file's
digest is a blake2b of its size and of

- every byte, for a file up to WHOLE_BYTES;
- past that, its safetensors header (every name, dtype, shape and offset) and, per tensor,
  CHUNK bytes at its start, middle and end (a tensor up to 3 * CHUNK whole), plus
  FILE_CHUNKS chunks at fixed, evenly spread offsets of the file (the first at 0, the last at
  the end; a .bin or .pt file gets these only): a few hundred MB of reads for a 70B target
  whatever its size, where a full hash would read all of it.

A digest is computed once per file version and kept, by (path, size, mtime_ns, ctime_ns,
inode), in this process and in `<model cache>/digests/` (a later run reads it back instead
of hashing again); ctime and inode change on any rewrite, even one that restores the mtime.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import file_stamp

log = logging.getLogger(__name__)

SCHEME = "blake2b-sampled-1"  # bump when what is hashed changes: every kept digest is recomputed
WHOLE_BYTES = 64 << 20
CHUNK = 64 << 10
FILE_CHUNKS = 64
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")

_memo: dict[tuple, str] = {}


def _stamp(path: Path) -> tuple:
    return (*file_stamp(path), SCHEME)


def _spans(path: Path, size: int, fh) -> tuple[bytes, list[tuple[int, int]]]:
    """(the safetensors header's bytes or b"", the (start, end) byte ranges sampled past it)."""
    spans, header = [], b""
    if path.suffix == ".safetensors" and size >= 8:
        length = int.from_bytes(fh.read(8), "little")
        if 8 + length <= size:
            header = fh.read(length)
            try:
                entries = json.loads(header.decode("utf-8"))
                offsets = [tuple(info["data_offsets"]) for name, info in entries.items() if name != "__metadata__"]
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
                offsets = []  # not a readable header: the fixed chunks and the size still key it
            base = 8 + length
            for begin, end in offsets:
                begin, end = base + int(begin), base + int(end)
                if end - begin <= 3 * CHUNK:
                    spans.append((begin, end))
                else:
                    middle = begin + (end - begin) // 2 - CHUNK // 2
                    spans += [(begin, begin + CHUNK), (middle, middle + CHUNK), (end - CHUNK, end)]
    last = max(size - CHUNK, 0)
    spans += [(i * last // (FILE_CHUNKS - 1), i * last // (FILE_CHUNKS - 1) + CHUNK) for i in range(FILE_CHUNKS)]
    return header, [(max(0, a), min(size, b)) for a, b in sorted(set(spans))]


def _compute(path: Path, size: int, whole_bytes: int) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{SCHEME}:{size}".encode())
    with path.open("rb") as fh:
        if size <= whole_bytes:
            while block := fh.read(8 << 20):
                digest.update(block)
            return digest.hexdigest()
        header, spans = _spans(path, size, fh)
        digest.update(header)
        for begin, end in spans:
            fh.seek(begin)
            digest.update(fh.read(end - begin))
    return digest.hexdigest()


def _kept_file(path: Path) -> Path | None:
    """Where the digest of `path` is kept between runs, or None without a usable model cache."""
    from specforge_lite.targets.loading import cache_root

    try:
        root = cache_root()
    except SpecforgeError:
        return None
    return root / "digests" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"


def file_digest(path: Path | str, whole_bytes: int = WHOLE_BYTES) -> str:
    """The content digest of one weight file (see the module docstring), computed once per version."""
    path = Path(path).resolve()  # a hub cache's files are links to blobs: the blob is what is read
    stamp = _stamp(path)
    key = (*stamp, whole_bytes)
    if key in _memo:
        return _memo[key]
    kept = _kept_file(path) if whole_bytes == WHOLE_BYTES else None
    if kept is not None and kept.is_file():
        try:
            record = json.loads(kept.read_text())
            if record.get("stamp") == list(stamp):
                _memo[key] = record["digest"]
                return record["digest"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged record: computed again and rewritten
    value = _compute(path, stamp[1], whole_bytes)
    if _stamp(path) != stamp:  # rewritten while it was read: that digest describes neither version
        raise SpecforgeError(f"{path} changed while its digest was computed; run the command again once "
                             "nothing writes the target's files")
    _memo[key] = value
    if kept is not None:
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"stamp": list(stamp), "digest": value}))
            os.replace(tmp, kept)
        except OSError as err:  # a read-only cache: the digest is computed again next run
            log.debug("cannot keep the digest of %s (%s)", path, err)
    return value


def weight_files(folder: Path) -> list[Path]:
    """A model folder's weight files and weight indexes, by name."""
    return [f for f in sorted(Path(folder).iterdir())
            if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name.endswith(".index.json"))]


def folder_digests(folder: Path) -> dict[str, str]:
    """`{file name: content digest}` of a model folder's weight files and indexes."""
    return {f.name: file_digest(f) for f in weight_files(folder)}


# what loading a hub target reads: its config, tokenizer and weight files
# (pytorch .bin weights only where a repo has no safetensors, as transformers reads them)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of hub id `repo_id` with its weight files: the one in the hub
    cache, else downloaded now (what loading it would download moments later) unless the hub is
    offline; None when neither can be had. A snapshot holding only config.json (the door reads
    it alone) is completed first, so that a content key is the same on the run that downloads
    the target and on every later one."""
    from huggingface_hub import snapshot_download

    from specforge_lite.targets.loading import hub_offline

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
        if weight_files(folder):
            return folder
    except Exception:  # noqa: BLE001  not in the cache (huggingface_hub's own errors vary by version)
        pass
    if hub_offline():
        return None
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
        if not weight_files(folder):
            folder = Path(snapshot_download(repo_id, allow_patterns=["*.bin"]))
    except Exception as err:  # noqa: BLE001  the loader reports the hub's failure in its own words
        log.warning("could not download %s to key it by content (%s); keyed by its id", repo_id, err)
        return None
    return folder if weight_files(folder) else None


def target_files(path: str) -> dict:
    """The target by content: its resolved folder, a hash of its config.json and the content
    digest of each weight file (`file_digest`); a hub id is looked up in the local hub cache."""
    from specforge_lite.targets.loading import resolve_target_path

    folder = Path(resolve_target_path(path))
    if not folder.is_dir():
        folder = hub_snapshot(str(path))
        if folder is None:  # offline and not downloaded: the loader fails on it just after
            return {"path": str(path)}
    config = folder / "config.json"
    return {"path": str(folder.resolve()), "weights": folder_digests(folder),
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None}


def recorded_files(path: str) -> dict:
    """`target_files(path)` as a JSON file records it (and reads it back): what a stage writes
    beside its output to say which weights it was made from."""
    return json.loads(json.dumps(target_files(path), default=str))


def same_weights(recorded: dict, now: dict) -> bool:
    """Whether two `recorded_files` name the same weights and config (wherever the folder is)."""
    return (recorded.get("weights"), recorded.get("config_sha256")) == (now.get("weights"), now.get("config_sha256"))
