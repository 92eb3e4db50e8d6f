"""The samples dataset: parquet shards the `sample` stage writes and `train` reads.

`run_dir/samples/data/shard-NNNNN.parquet` holds conversations whose assistant turns
the target wrote, with `input_ids` and an assistant-only `loss_mask`. Shard N covers
conversations [N*shard_size, (N+1)*shard_size) of the train split, whichever rank
wrote it, so shards never overlap and a restart (with any number of ranks) only
writes the shards that are missing. Each shard is written to a temporary file and
renamed into place, so a shard file either is complete or does not exist.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from specforge_lite import SpecforgeError
from specforge_lite.artifact_io import DAMAGED, ArtifactError

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
    """Write one shard atomically: its stats first, then the parquet file (the commit point)."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    final = shard_path(data_dir, index)
    for path, write in ((stats_path(data_dir, index), lambda p: p.write_text(json.dumps(stats))),
                        (final, lambda p: pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), p))):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write(tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as err:  # a full disk: no temporary file left, the shard stays to do
            tmp.unlink(missing_ok=True)
            raise SpecforgeError(f"cannot write {path} ({err.strerror or err}); run the same command again "
                                 "once there is room: it resumes at this shard") from err
    return final


def completed_shards(data_dir: Path) -> list[int]:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return []
    return sorted(int(p.stem.split("-")[1]) for p in data_dir.glob("shard-*.parquet"))


def load_samples(samples_dir: Path):
    """The samples as one `datasets.Dataset` (shards in order)."""
    import datasets

    return datasets.Dataset.from_parquet(readable_shards(samples_dir))


def readable_shards(samples_dir: Path) -> list[str]:
    """The shard files that hold rows, each checked readable (an error names a damaged one).

    A shard whose prompts were all skipped holds no rows; it stays on disk (it marks the
    shard done for a resume) and is left out here."""
    data_dir = Path(samples_dir) / "data"
    shards = completed_shards(data_dir)
    if not shards:
        raise SpecforgeError(f"no sample shards under {data_dir}; run the sample stage first")
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
