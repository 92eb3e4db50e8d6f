"""The per-rank records of what each process holds of the target (specforge_lite/targets/accounting.py)."""

from __future__ import annotations

import json
import multiprocessing


def _write_many(path, start: int, count: int) -> None:
    from specforge_lite.targets.accounting import _keep_peak

    for k in range(count):  # a growing peak: every call writes
        _keep_peak(path, {"world_size": 1, "layer_bytes_held": start + 2 * k})


def test_two_processes_of_one_rank_number_record_at_once(tmp_path):
    """Data-parallel samplers (sample.rank=0 and 1, started together) are both rank 0 to torch:
    they write one record file at the same time, each through a temporary file of its own, and
    neither fails (a shared temporary name made one stop with exit 2: its file renamed away)."""
    path = tmp_path / "accounting" / "sample.rank0.json"
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_many, args=(path, first, 300)) for first in (0, 1)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert json.loads(path.read_text())["layer_bytes_held"] in range(600)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
