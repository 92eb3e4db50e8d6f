"""The samples dataset: parquet shards the `sample` stage writes and `train` reads.

`run_dir/samples/data/shard-NNNNN.parquet` holds conversations whose assistant turns
the target wrote, with `input_ids` and an assistant-only `loss_mask`. Shard N covers
conversations [N*shard_size, (N+1)*shard_size) of the train split, whichever rank
wrote it, so shards never overlap and a restart (with any number of ranks) only
writes the shards that are missing. Each shard is written to a temporary file and
renamed into place, so a shard file either is complete or does not exist; its stats record
its sha256, so a shard damaged later (truncated, overwritten) is found and rewritten, never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import DAMAGED, ArtifactError, read_json_object

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_generated_tokens", pa.int32()),
    ("finish_reasons", pa.list_(pa.string())),
])


def shard_path(data_dir: Path, index: int) -> Path:
    return Path(data_dir) / f"shard-{index:05d}.parquet"


def stats_path(data_dir: Path, index: int) -> Path:
    return Path(data_dir) / f"shard-{index:05d}.stats.json"


def write_shard(data_dir: Path, index: int, rows: list[dict[str, Any]], stats: dict[str, Any]) -> Path:
    """Write one shard atomically: the parquet file under a temporary name, its stats with the
    parquet file's sha256 (`shard_problem` checks it on every reuse), then the parquet file
    renamed into place (the commit point)."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    final = shard_path(data_dir, index)
    parquet_tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        _durable(parquet_tmp, lambda p: pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), p))
        stats = {**stats, "sha256": file_sha256(parquet_tmp)}
        stats_file = stats_path(data_dir, index)
        stats_tmp = stats_file.with_name(f".{stats_file.name}.{os.getpid()}.tmp")
        try:
            _durable(stats_tmp, lambda p: p.write_text(json.dumps(stats)))
            os.replace(stats_tmp, stats_file)
        finally:
            stats_tmp.unlink(missing_ok=True)
        os.replace(parquet_tmp, final)
    except OSError as err:  # a full disk: no temporary file left, the shard stays to do
        raise SpecforgeError(f"cannot write {final} ({err.strerror or err}); run the same command again "
                             "once there is room: it resumes at this shard") from err
    finally:
        parquet_tmp.unlink(missing_ok=True)
    return final


def _durable(path: Path, write) -> None:
    write(path)
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def shard_problem(data_dir: Path, index: int) -> str | None:
    """Why shard `index` is not the shard its stats describe (unreadable stats, bytes that differ
    from the sha256 recorded when it was written: overwritten or truncated), or None when it is
    intact. A shard written before checksums were recorded must read whole."""
    path, stats_file = shard_path(data_dir, index), stats_path(data_dir, index)
    try:
        stats = read_json_object(stats_file)
    except ArtifactError as err:
        return str(err)
    recorded = stats.get("sha256")
    if recorded is None:
        try:
            pq.read_table(path, schema=SCHEMA)
        except (pa.ArrowException, OSError, ValueError) as err:
            return f"{path}: not a readable parquet file ({err}); {DAMAGED}"
        return None
    if file_sha256(path) != recorded:
        return f"{path}: its bytes differ from the sha256 recorded when it was written; {DAMAGED}"
    return None


def damaged_shards(data_dir: Path, indices=None) -> dict[int, str]:
    """`{index: problem}` of the written shards (or of `indices` among them) that `shard_problem` finds."""
    written = completed_shards(data_dir)
    wanted = written if indices is None else sorted(set(written) & set(indices))
    found = {j: shard_problem(data_dir, j) for j in wanted}
    return {j: problem for j, problem in found.items() if problem}


def remove_shard(data_dir: Path, index: int) -> None:
    """Remove shard `index` and its stats (the parquet file first: without it the shard is to do)."""
    shard_path(data_dir, index).unlink(missing_ok=True)
    stats_path(data_dir, index).unlink(missing_ok=True)


def samples_meta(samples_dir: Path) -> dict:
    """A samples folder's meta.json; {} where it is missing or damaged (the sample stage, which
    rebuilds it, says which)."""
    path = Path(samples_dir) / "meta.json"
    try:
        return read_json_object(path) if path.exists() else {}
    except ArtifactError:
        return {}


def shard_fingerprint(data_dir: Path, index: int) -> str | None:
    """The sample settings' fingerprint shard `index` records (None: unreadable stats, or a shard
    written before shards recorded it)."""
    try:
        return read_json_object(stats_path(data_dir, index)).get("fingerprint")
    except ArtifactError:
        return None


def recorded_dtype(samples_dir: Path, stamp: str) -> str | None:
    """The dtype the target drew the samples of settings `stamp` in (the sample stage decides it once per
    samples folder): meta.json's record where it is of these settings, else the first written shard's
    of these settings; None where nothing records one (new samples, or samples from before the record)."""
    meta = samples_meta(samples_dir)
    if meta.get("fingerprint") == stamp and (meta.get("target_dtype") or {}).get("used"):
        return meta["target_dtype"]["used"]
    data_dir = Path(samples_dir) / "data"
    for index in completed_shards(data_dir):
        try:
            stats = read_json_object(stats_path(data_dir, index))
        except ArtifactError:
            continue
        if stats.get("fingerprint") == stamp and stats.get("target_dtype"):
            return stats["target_dtype"]
    return None


def dtype_problem(samples_dir: Path, recorded: str | None, requested: str) -> str | None:
    """Why sampling into `samples_dir` with target.dtype=`requested` is refused: its written shards were
    drawn in `recorded` (`recorded_dtype`), another dtype; None where nothing would mix."""
    if not recorded or requested in ("auto", recorded) or not completed_shards(Path(samples_dir) / "data"):
        return None
    return (f"{samples_dir} holds samples the target drew in {recorded}; target.dtype={requested} would mix "
            f"{requested} and {recorded} shards: set target.dtype={recorded} (or auto, which keeps it), "
            "or use another samples_dir (or run_dir)")


def wait_for_recorded_dtype(samples_dir: Path, stamp: str, rank: int, timeout_s: float = 3600.0,
                            poll_s: float = 2.0) -> str:
    """The dtype rank 0 chose for these samples (`recorded_dtype`), waiting until it records one: ranks
    that chose apart (timings differ between processes) would mix float32 and bf16 shards."""
    deadline = time.monotonic() + timeout_s
    while (dtype := recorded_dtype(samples_dir, stamp)) is None:
        if time.monotonic() > deadline:
            raise SpecforgeError(f"sample rank {rank} waited {timeout_s:.0f} s for rank 0 to record the dtype "
                                 f"target.dtype=auto chose in {Path(samples_dir) / 'meta.json'}; start rank 0 as "
                                 "well, or name the dtype on every rank (target.dtype=float32 or bfloat16)")
        time.sleep(poll_s)
    return dtype


def completed_shards(data_dir: Path) -> list[int]:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return []
    # only names the sample stage writes (`shard_path`): a stray `shard-x.parquet` is no shard
    return sorted(int(m.group(1)) for p in data_dir.glob("shard-*.parquet")
                  if (m := re.fullmatch(r"shard-(\d{5,})\.parquet", p.name)))


def load_samples(samples_dir: Path):
    """The samples as one `datasets.Dataset` (shards in order)."""
    import datasets

    return datasets.Dataset.from_parquet(readable_shards(samples_dir))


def readable_shards(samples_dir: Path) -> list[str]:
    """The shard files that hold rows, each checked intact (`shard_problem`; an error names a damaged
    one and the command that rewrites it).

    A shard whose prompts were all skipped holds no rows; it stays on disk (it marks the
    shard done for a resume) and is left out here."""
    data_dir = Path(samples_dir) / "data"
    shards = completed_shards(data_dir)
    if not shards:
        raise SpecforgeError(f"no sample shards under {data_dir}; run the sample stage first")
    damaged = damaged_shards(data_dir)
    if damaged:
        raise SpecforgeError(f"{next(iter(damaged.values()))} ({len(damaged)} damaged shard(s)); run the sample "
                             "stage again with the same settings (python -m specforge_lite sample ...): it "
                             "rewrites them")
    files = [str(path) for path in (shard_path(data_dir, i) for i in shards) if shard_rows(path)]
    if not files:
        raise SpecforgeError(f"the samples in {samples_dir} hold no conversations: every prompt was skipped "
                             f"(see skipped in {Path(samples_dir) / 'meta.json'}); sample with other settings")
    return files


def shard_rows(path: Path) -> int:
    """Rows of a shard, read from its parquet footer (a damaged shard is an error naming it)."""
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ArtifactError(path, f"not a readable parquet file ({err}); {DAMAGED}; delete it and run the "
                            "sample stage again to rewrite that shard") from None
    if not parquet.schema_arrow.equals(SCHEMA, check_metadata=False):
        raise ArtifactError(path, "not a samples shard (its columns differ from the samples schema)")
    return parquet.metadata.num_rows


def answer_corpus(samples_dir: Path, target_path: str, max_tokens: int) -> list[list[int]] | None:
    """The target's own answers in a samples folder (each assistant turn's tokens, in shard order,
    up to `max_tokens` in all), the corpus suffix decoding drafts from beside each request; None
    where no samples were written. Samples drawn from other weights than `target_path`'s are
    refused: their continuations are another model's."""
    from specforge_lite.targets.digest import recorded_files, same_weights

    meta_path = Path(samples_dir) / "meta.json"
    if not meta_path.exists():
        return None
    made_by = (read_json_object(meta_path).get("fingerprint_keys") or {}).get("target_files")
    if not same_weights(made_by or {}, recorded_files(target_path)):  # by content, wherever the folder is
        raise SpecforgeError(f"eval.suffix.samples: the samples in {samples_dir} were drawn from other weights than "
                             f"{target_path}'s; sample this target again (python -m specforge_lite sample ...) or set "
                             "eval.suffix.samples=false")
    answers, total = [], 0
    for path in readable_shards(samples_dir):
        table = pq.read_table(path, columns=["input_ids", "loss_mask"])
        for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
            turn: list[int] = []
            for token, kept in zip(ids + [None], mask + [0]):  # a sentinel closes the last turn
                if kept:
                    turn.append(token)
                elif turn:
                    answers.append(turn)
                    total += len(turn)
                    turn = []
                    if total >= max_tokens:
                        return answers
    return answers
