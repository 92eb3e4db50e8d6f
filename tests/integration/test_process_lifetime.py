"""Processes end with the command that started them, one command per run folder, the user's
files kept: real 2-rank CPU (gloo) train runs of the smoke recipe, killed for real."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specforge_lite.scale.rendezvous import free_port
from specforge_lite.training.checkpoints import latest_checkpoint
from tests.conftest import REPO, run_cli, terminal_signals

# long enough to be training still when it is killed
TRAIN = ["+recipe=smoke", "trainer.num_processes=2", "train.max_steps=100000", "train.checkpoint_every=0",
         "train.log_every=100000", "train.tracker=none"]
STEP = re.compile(r"train:.*\|\s*([1-9]\d*)/100000")  # the rank's progress bar, a step done
# what the stopped line says of a run with train.checkpoint_every=0: nothing to resume
NO_CHECKPOINT = ("the same command starts training over: checkpoints are off (train.checkpoint_every=0); "
                 "give train.checkpoint_every=N to keep progress")


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    run = tmp_path_factory.mktemp("samples_once")
    run_cli("sample", "+recipe=smoke", f"run_dir={run}", check=True)
    return run / "samples"


def start_training(run: Path, samples: Path, output: Path) -> subprocess.Popen:
    shutil.copytree(samples, run / "samples")
    with open(output, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "specforge_lite", "train", *TRAIN, f"run_dir={run}",
                                 f"trainer.master_port={free_port()}"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))


def ranks_of(launcher: int) -> dict[int, int]:
    """{rank: pid} of the live processes whose parent is `launcher`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and running(int(entry.name)):
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                env = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
            except (OSError, IndexError, ValueError):
                continue
            if ppid == launcher and "RANK" in env:
                found[int(env["RANK"])] = int(entry.name)
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for_training(proc: subprocess.Popen, output: Path, timeout: float = 600) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early:\n{output.read_text()[-3000:]}"
        ranks = ranks_of(proc.pid)
        if len(ranks) == 2 and STEP.search(output.read_text(errors="replace")):
            return ranks
        time.sleep(0.25)
    proc.kill()
    raise AssertionError(f"no training step within {timeout} s:\n{output.read_text()[-3000:]}")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_a_killed_command_takes_its_ranks_and_its_lock_with_it(tmp_path, samples):
    run, output = tmp_path / "run", tmp_path / "train.out"
    proc = start_training(run, samples, output)
    ranks = {}
    try:
        ranks = wait_for_training(proc, output)
        # a second command on the same folder is refused, naming the first one's pid
        second = run_cli("train", "+recipe=smoke", f"run_dir={run}", "train.max_steps=1")
        assert second.returncode == 2, second.stderr[-2000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"in use by pid {proc.pid} on this host" in errors[0], second.stderr[-2000:]
        os.kill(proc.pid, signal.SIGKILL)  # what the OOM killer or `kill -9` does to the command typed
        proc.wait()
        deadline = time.monotonic() + 5
        while any(running(pid) for pid in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks.values() if running(pid)], "ranks outlived the command that started them"
    finally:  # whatever failed above, no rank is left training
        for pid in {**ranks, **ranks_of(proc.pid)}.values():
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
    # its lock is left behind, stale: the next command takes it over and runs
    assert (run / ".train.lock").exists()
    third = run_cli("train", "+recipe=smoke", f"run_dir={run}", "train.max_steps=2", "train.checkpoint_every=0")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "taking it over" in third.stdout + third.stderr
    assert not (run / ".train.lock").exists()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_a_dead_rank_ends_the_run_with_one_line_of_ours(tmp_path, samples):
    run, output = tmp_path / "run", tmp_path / "train.out"
    proc = start_training(run, samples, output)
    try:
        ranks = wait_for_training(proc, output)
        os.kill(ranks[1], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    text = output.read_text(errors="replace")
    assert proc.returncode == 128 + signal.SIGKILL, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text[-3000:]
    line = errors[0]
    assert f"rank 1 (pid {ranks[1]}) was killed by SIGKILL" in line and "run the same command again" in line, line
    log = Path(re.search(r"its log: (\S+);", line).group(1))
    assert log.name == "rank-1.log" and log.is_file() and run in log.parents
    assert "failed (exitcode" not in text, "torchelastic's own lines are ours now"
    assert not ranks_of(proc.pid)


def test_a_users_file_in_export_survives_a_re_export(tmp_path, samples):
    run = tmp_path / "run"
    shutil.copytree(samples, run / "samples")
    args = ["+recipe=smoke", f"run_dir={run}", "train.max_steps=2", "train.checkpoint_every=0", "train.tracker=none"]
    run_cli("train", *args, check=True)
    run_cli("export", *args, check=True)
    (run / "export" / "NOTES.md").write_text("how we serve it")
    (run / "train" / "drafter" / "notes.txt").write_text("mine too")
    run_cli("train", *args, "train.max_steps=3", check=True)
    run_cli("export", *args, check=True)
    assert (run / "export" / "NOTES.md").read_text() == "how we serve it"
    assert (run / "train" / "drafter" / "notes.txt").read_text() == "mine too"
    assert (run / "export" / "export.json").exists()
    # a file of the user's where the export writes one of its own: refused, nothing replaced
    (run / "export" / "manifest.json").unlink()
    (run / "export" / "export.json").write_text("the user's")
    (run / "export" / "versions.json").unlink()
    refused = run_cli("export", *args)
    assert refused.returncode == 2 and "is in the way" in refused.stderr, refused.stderr[-2000:]
    assert (run / "export" / "export.json").read_text() == "the user's"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
@pytest.mark.parametrize("how", ["ctrl_c", "sigterm"])
def test_ctrl_c_and_sigterm_end_a_two_rank_run_with_one_line_and_the_shell_status(tmp_path, samples, how):
    """Ctrl-C in the terminal (SIGINT to the command and its ranks, one process group) exits 130;
    SIGTERM to the command typed (a scheduler's stop) exits 143. Either way: no traceback, one
    line of ours saying what stopped it and how to resume, and no rank left behind."""
    run, output = tmp_path / "run", tmp_path / "train.out"
    shutil.copytree(samples, run / "samples")
    with open(output, "w") as out:  # a session of its own: the group a terminal would signal
        proc = subprocess.Popen([sys.executable, "-m", "specforge_lite", "train", *TRAIN, f"run_dir={run}",
                                 f"trainer.master_port={free_port()}"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                                preexec_fn=terminal_signals)
    try:
        ranks = wait_for_training(proc, output)
        if how == "ctrl_c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends the foreground process group
        else:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    text = output.read_text(errors="replace")
    want = 128 + (signal.SIGINT if how == "ctrl_c" else signal.SIGTERM)
    assert proc.returncode == want, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    ours = [line for line in text.splitlines() if line.startswith("stopped:")]
    assert len(ours) == 1, text[-3000:]
    assert ("Ctrl-C" if how == "ctrl_c" else "SIGTERM") in ours[0] and "and its 2 ranks with it" in ours[0], ours
    assert NO_CHECKPOINT in ours[0] and "resumes" not in ours[0], ours  # train.checkpoint_every=0: none to resume
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in ranks.values() if running(pid)], "a rank outlived the command"


@pytest.mark.parametrize("signum,every", [(signal.SIGINT, 0), (signal.SIGTERM, 0), (signal.SIGTERM, 2)],
                         ids=["ctrl_c", "sigterm", "sigterm_checkpointed"])
def test_a_one_process_stage_stopped_by_a_signal_says_one_line(tmp_path, samples, signum, every):
    """The same on one process: exit 128 + N, no traceback, one line of ours, which promises a
    resume only where a checkpoint was written (and says which step)."""
    run, output = tmp_path / "run", tmp_path / "train.out"
    shutil.copytree(samples, run / "samples")
    one = [a.replace("trainer.num_processes=2", "trainer.num_processes=1")
           .replace("train.checkpoint_every=0", f"train.checkpoint_every={every}") for a in TRAIN]
    checkpoints = run / "train" / "checkpoints"
    with open(output, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specforge_lite", "train", *one, f"run_dir={run}"], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                start_new_session=True, preexec_fn=terminal_signals)
    try:
        deadline = time.monotonic() + 600
        while not (STEP.search(output.read_text(errors="replace"))
                   and (not every or latest_checkpoint(checkpoints) is not None)) and time.monotonic() < deadline:
            assert proc.poll() is None, output.read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signum)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    text = output.read_text(errors="replace")
    assert proc.returncode == 128 + signum and "Traceback" not in text, text[-3000:]
    ours = [line for line in text.splitlines() if line.startswith("stopped:")]
    assert len(ours) == 1 and "ranks" not in ours[0], text[-3000:]
    if every:  # the step it names is the newest complete checkpoint the stop left
        step = int(latest_checkpoint(checkpoints).name.split("-")[-1])
        assert f"the same command resumes from its newest checkpoint (step {step})" in ours[0], ours
    else:
        assert NO_CHECKPOINT in ours[0] and "resumes" not in ours[0], ours
