"""`sample.backend=auto` falls back from a vLLM that cannot run, in one line, and a vLLM stage
leaves no process and no socket or rendezvous file of its own behind."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specforge_lite.serving.vllm.interpreter import find_python
from tests.conftest import REPO, run_cli, terminal_signals
from tests.zygote import real_env

SAMPLE = ["sample", "+recipe=smoke", "sample.backend=auto", "data.max_samples=4", "sample.max_new_tokens=8"]


@pytest.mark.slow
@pytest.mark.parametrize("interpreter", ["exits", "has_no_vllm"])
def test_auto_samples_without_a_vllm_that_cannot_run(tmp_path, interpreter):
    if interpreter == "exits":
        python = tmp_path / "python"
        python.write_text("#!/bin/sh\nexit 3\n")
        python.chmod(0o755)
    else:
        python = Path(sys.executable)  # this package's interpreter, without vLLM
        if subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
            pytest.skip("this interpreter has vLLM")
    proc = run_cli(*SAMPLE, f"run_dir={tmp_path / 'run'}", f"sample.vllm.python={python}", timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr  # log lines go to stdout
    said = [line for line in output.splitlines() if "sample.backend=auto: vLLM cannot sample" in line]
    assert len(said) == 1, output[-3000:]
    assert ("exited with status 3" if interpreter == "exits" else "No module named 'vllm'") in said[0]
    assert "Traceback" not in output
    meta = json.loads((tmp_path / "run" / "samples" / "meta.json").read_text())
    assert meta["complete"] and meta["num_rows"] > 0
    assert meta["sampling"]["backend"] == ("hf" if "with the hf backend" in said[0] else "compiled")


def left_behind(folder: Path) -> list[str]:
    """vLLM's sockets, rendezvous files and our engine's socket folders under `folder`."""
    return [str(p) for p in folder.rglob("*") if p.name.startswith(("vllm_dist_", "specforge_lite-vllm-"))
            or (not p.is_symlink() and stat.S_ISSOCK(p.stat().st_mode))]


def runners(temp: Path) -> list[int]:
    """The vLLM runners started under `temp` (their own temp folder is made inside it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and "vllm_runner.py" in (entry / "cmdline").read_text() \
                    and f"TMPDIR={temp}/" in (entry / "environ").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads processes from /proc")
def test_a_vllm_stage_leaves_no_process_or_socket_file(tmp_path):
    if find_python() is None:
        pytest.skip("vLLM is not installed (make vllm)")
    temp = tmp_path / "tmp"
    temp.mkdir()
    # the finished and the failed stage run vLLM forked from the test server (tests/zygote.py): a
    # runner left behind keeps its shim alive, an exec'd process whose command line names the runner
    # and whose environment is the runner's (`runners` finds it)
    forked = dict(os.environ, TMPDIR=str(temp))
    # SmolLM2, which vLLM's CPU kernels run: a stage that succeeds
    done = run_cli("sample", "+recipe=eagle_smollm2", f"run_dir={tmp_path / 'ok'}", f"samples_dir={tmp_path / 'ok'}",
                   "sample.backend=vllm", "data.max_samples=2", "sample.max_new_tokens=8", "sample.turns=last",
                   "sample.shard_size=2", env=forked, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not left_behind(temp), left_behind(temp)
    assert not runners(temp)
    # the tiny target, whose head size vLLM's CPU attention refuses: a stage whose vLLM fails
    failed = run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path / 'failed'}", "sample.backend=vllm",
                     "data.max_samples=2", "sample.max_new_tokens=8", env=forked, timeout=1200)
    assert failed.returncode == 2 and "vLLM failed" in failed.stderr, failed.stderr[-3000:]
    assert not left_behind(temp), left_behind(temp)
    assert not runners(temp)
    # interrupted: vLLM's real interpreter, in the stage's process group as a user's terminal has it
    env = real_env(forked)
    # interrupted (Ctrl-C) while vLLM loads or samples
    out = tmp_path / "interrupted.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "specforge_lite", "sample", "+recipe=eagle_smollm2",
                                 f"run_dir={tmp_path / 'int'}", f"samples_dir={tmp_path / 'int'}", "sample.backend=vllm",
                                 "data.max_samples=8", "sample.max_new_tokens=64"], cwd=REPO, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, preexec_fn=terminal_signals)
    deadline = time.monotonic() + 600
    while not runners(temp) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None and runners(temp), out.read_text()[-3000:]
    time.sleep(5)  # vLLM well under way
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    assert not runners(temp), "vLLM outlived the interrupted stage"
    assert not left_behind(temp), left_behind(temp)
