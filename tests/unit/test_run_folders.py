"""One command per run folder (`run_folders.take_lock`) and a stage's own files beside the
user's (`run_folders.place_files`), on real processes and real folders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from specforge_lite import SpecforgeError
from specforge_lite.run_folders import MANIFEST, folder_locks, lock_path, place_files, release_lock, take_lock
from specforge_lite.scale.launch import locked_folders
from tests.conftest import compose


def holder(path, pid, host=None, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "command": "specforge_lite train",
                                "since": "then", **extra}))


@pytest.fixture
def other_process():
    """A live process that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_lock_refuses_with_its_pid_and_a_dead_one_is_taken_over(tmp_path, other_process):
    folder = tmp_path / "run" / "train"
    holder(lock_path(folder), other_process.pid)
    with pytest.raises(SpecforgeError, match=f"in use by pid {other_process.pid} on this host") as refused:
        take_lock(folder, "specforge_lite train")
    assert "\n" not in str(refused.value)
    # the way out where that pid is some other program: the lock file to delete
    assert str(refused.value).endswith(f"if pid {other_process.pid} is not that run, delete {lock_path(folder)}")
    holder(lock_path(folder), dead_pid())
    path = take_lock(folder, "specforge_lite train")
    assert json.loads(path.read_text())["pid"] == os.getpid()
    release_lock(path)
    assert not path.exists()


def test_a_pid_handed_to_another_process_is_a_stale_lock(tmp_path, other_process):
    """The holder's pid runs again, but as a process started at another time: not the holder."""
    folder = tmp_path / "eval"
    holder(lock_path(folder), other_process.pid, process_start="1")
    assert take_lock(folder, "specforge_lite evaluate") == lock_path(folder)


def test_a_lock_of_another_host_is_kept_and_says_how_to_clear_it(tmp_path):
    folder = tmp_path / "export"
    holder(lock_path(folder), dead_pid(), host="some-other-node")
    with pytest.raises(SpecforgeError, match="on host some-other-node .*delete"):
        take_lock(folder, "specforge_lite export")


def test_locks_are_released_however_the_block_ends(tmp_path):
    folders = [tmp_path / "samples", tmp_path / "train"]
    with pytest.raises(RuntimeError):
        with folder_locks(folders, "specforge_lite train"):
            assert all(lock_path(f).exists() for f in folders)
            with folder_locks(folders, "specforge_lite train"):  # this process again: no second lock
                pass
            assert all(lock_path(f).exists() for f in folders)
            raise RuntimeError
    assert not any(lock_path(f).exists() for f in folders)


def test_locked_folders_are_what_the_command_writes(tmp_path, monkeypatch):
    run = ["+recipe=smoke", f"run_dir={tmp_path}"]
    assert locked_folders(compose(["stage=export", *run])) == [tmp_path / "export"]
    # train samples first where no complete samples are: it writes both
    assert locked_folders(compose(["stage=train", *run])) == [tmp_path / "samples", tmp_path / "train"]
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "meta.json").write_text(json.dumps({"complete": True}))
    assert locked_folders(compose(["stage=train", *run])) == [tmp_path / "train"]
    assert len(locked_folders(compose(["stage=run", *run]))) == 4


def write_files(folder, files: dict):
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)


def test_a_stage_replaces_its_own_files_and_keeps_the_users(tmp_path):
    final = tmp_path / "export"
    first = tmp_path / "first"
    write_files(first, {"export.json": "1", "eagle3/model.safetensors": "1", "gguf/draft.gguf": "1"})
    place_files(first, final, "export")
    write_files(final, {"NOTES.md": "mine", "eagle3/my_serving.sh": "mine"})
    second = tmp_path / "second"
    write_files(second, {"export.json": "2", "eagle3/model.safetensors": "2"})  # no gguf this time
    place_files(second, final, "export")
    assert (final / "export.json").read_text() == (final / "eagle3" / "model.safetensors").read_text() == "2"
    assert (final / "NOTES.md").read_text() == (final / "eagle3" / "my_serving.sh").read_text() == "mine"
    assert not (final / "gguf").exists(), "the export's own file it no longer writes is removed, and its folder"
    assert json.loads((final / MANIFEST).read_text())["files"] == ["eagle3/model.safetensors", "export.json"]


def test_a_users_file_in_the_way_refuses_before_anything_changes(tmp_path):
    final = tmp_path / "export"
    write_files(final, {"export.json": "the user's own"})
    new = tmp_path / "new"
    write_files(new, {"README.md": "ours", "export.json": "ours"})
    with pytest.raises(SpecforgeError, match="export.json is in the way"):
        place_files(new, final, "export")
    assert sorted(p.name for p in final.iterdir()) == ["export.json"]
    assert (final / "export.json").read_text() == "the user's own"
    write_files(tmp_path / "blocked", {"eagle3/config.json": "ours"})
    (final / "eagle3").write_text("a file where the export puts a folder")
    with pytest.raises(SpecforgeError, match="eagle3 is in the way"):
        place_files(tmp_path / "blocked", final, "export")


def test_a_folder_of_an_earlier_version_counts_the_files_written_again_as_its_own(tmp_path):
    final = tmp_path / "export"
    write_files(final, {"versions.json": "{}", "export.json": "old", "NOTES.md": "mine"})  # no manifest
    new = tmp_path / "new"
    write_files(new, {"versions.json": "{}", "export.json": "new"})
    place_files(new, final, "export")
    assert (final / "export.json").read_text() == "new" and (final / "NOTES.md").read_text() == "mine"


def test_outputs_are_replaced_as_one_unit_only_after_success(tmp_path):
    """Issue 52: a re-run without plots leaves no plot of the previous run behind; a run that
    fails while writing (or finds something of the user's in the way) keeps the previous
    outputs whole; files the stage did not write stay."""
    from specforge_lite.run_folders import replaced_as_one

    out = tmp_path / "eval"
    with replaced_as_one(out, "evaluate") as new:
        for name in ("report.json", "plot.png", "config.yaml"):
            (new / name).write_text("old")
    (out / "vllm.log").write_text("log")  # written beside them, not by the report
    first = {p.name: p.read_text() for p in out.iterdir() if p.name != MANIFEST}
    with pytest.raises(RuntimeError):
        with replaced_as_one(out, "evaluate") as new:
            (new / "report.json").write_text("new")
            raise RuntimeError("the stage failed after its report")
    assert {p.name: p.read_text() for p in out.iterdir() if p.name != MANIFEST} == first
    (out / "notes.md").mkdir()  # something of the user's where this run writes a file
    with pytest.raises(SpecforgeError, match="notes.md is in the way"):
        with replaced_as_one(out, "evaluate") as new:
            (new / "report.json").write_text("new")
            (new / "notes.md").write_text("new")
    assert {p.name: p.read_text() for p in out.iterdir() if p.is_file() and p.name != MANIFEST} == first
    with replaced_as_one(out, "evaluate") as new:  # no plot this time
        (new / "report.json").write_text("new")
        (new / "config.yaml").write_text("new")
    assert {p.name: p.read_text() for p in out.iterdir() if p.is_file() and p.name != MANIFEST} == \
        {"report.json": "new", "config.yaml": "new", "vllm.log": "log"}
    assert not list(tmp_path.glob(".eval-*"))  # no temp folder left
