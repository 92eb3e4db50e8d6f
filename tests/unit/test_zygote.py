"""tests/zygote.py, the tests' forked interpreters, with a stand-in vLLM runner script and a
server that preloads `json` instead of vLLM: the caller sees one process, as with a fresh
interpreter (its pipes, environment, folder, exit status and signals), and nothing outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import zygote

RUNNER = """import os, sys, time
line = sys.stdin.readline()
print(line.strip(), os.environ["ZYGOTE_TEST"], os.getcwd(), os.getpid(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if line.startswith("sleep"):
    with open(os.environ["ZYGOTE_PID"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
sys.exit(int(line.split()[1]))
"""


@pytest.fixture
def shim(tmp_path, monkeypatch):
    shim_path, server = zygote.install(str(tmp_path), sys.executable, ["json"])
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / zygote.RUNNER_NAME).write_text(RUNNER)
    yield shim_path, tmp_path
    zygote.stop(server)


def start(shim_path, tmp_path, **env):
    return subprocess.Popen([shim_path, str(tmp_path / "work" / zygote.RUNNER_NAME)], cwd=tmp_path / "work",
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "err", "w"),
                            env=dict(os.environ, ZYGOTE_TEST="seen", ZYGOTE_PID=str(tmp_path / "pid"), **env),
                            text=True, start_new_session=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_forked_runner_has_the_callers_streams_environment_folder_and_status(shim):
    shim_path, tmp_path = shim
    proc = start(shim_path, tmp_path)
    out, _ = proc.communicate("exit 3\n", timeout=60)
    assert proc.returncode == 3
    assert out.split()[:4] == ["exit", "3", "seen", str(tmp_path / "work")]
    assert int(out.split()[4]) != proc.pid  # forked by the server, not the shim's own interpreter
    assert (tmp_path / "err").read_text() == "to stderr\n"
    # anything but the runner runs in the real interpreter
    probe = subprocess.run([shim_path, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
    assert probe.stdout.strip() == sys.executable


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads processes from /proc")
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_signal_to_the_shim_ends_the_runner(shim, how):
    """SIGTERM is passed on (the shim ends as the runner did, by the signal); SIGKILL of the shim
    kills the runner's session."""
    shim_path, tmp_path = shim
    proc = start(shim_path, tmp_path)
    proc.stdin.write("sleep 0\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    runner = int((tmp_path / "pid").read_text())
    assert runner != proc.pid and alive(runner)
    proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    assert proc.wait(timeout=60) == (-signal.SIGTERM if how == "sigterm" else -signal.SIGKILL)
    deadline = time.monotonic() + 30
    while alive(runner) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(runner)


def test_a_module_runs_as_with_python_m(shim):
    """`-m specforge_lite ARGS` is forked too: the package's own entry point, its arguments, status 2
    for a refused input, as `python -m specforge_lite` (here: an unknown command)."""
    shim_path, tmp_path = shim
    proc = subprocess.run([shim_path, "-m", "specforge_lite", "no_such_command"], cwd=tmp_path / "work",
                          capture_output=True, text=True, timeout=120)
    fresh = subprocess.run([sys.executable, "-m", "specforge_lite", "no_such_command"], cwd=tmp_path / "work",
                           capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert proc.returncode == 2 and "no_such_command" in proc.stderr


SPAWNING_RUNNER = """import multiprocessing, os, sys


def child(queue, code):
    queue.put((os.getppid(), os.environ["SPECFORGE_LITE_LAUNCHER_PID"], "json" in sys.modules))
    sys.exit(code)


if __name__ == "__main__":
    os.environ["SPECFORGE_LITE_LAUNCHER_PID"] = str(os.getpid())  # as our launcher sets it for its ranks
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue, 7))
    process.start()
    parent, launcher, preloaded = queue.get(timeout=60)
    process.join(60)
    print(os.getpid(), process.pid, parent, launcher, preloaded, process.exitcode,
          os.fsdecode(multiprocessing.spawn.get_executable()))
"""


def test_a_forked_commands_spawned_children_are_forked_too(tmp_path):
    """multiprocessing's `spawn` in a forked command (vLLM's engine core and workers) starts its
    children through the shim: forked from the server (the preloaded `json` is there), with the
    pipes spawn passes them, the child's exit status seen by its parent; a child whose
    launcher variable names its caller (our ranks) names the process it actually runs under."""
    shim_path, server = zygote.install(str(tmp_path), sys.executable, ["json"])
    try:
        (tmp_path / "work").mkdir()
        (tmp_path / "work" / zygote.RUNNER_NAME).write_text(SPAWNING_RUNNER)
        proc = subprocess.run([shim_path, str(tmp_path / "work" / zygote.RUNNER_NAME)], cwd=tmp_path / "work",
                              capture_output=True, text=True, timeout=120)
    finally:
        zygote.stop(server)
    assert proc.returncode == 0, proc.stderr
    runner, shim_pid, parent, launcher, preloaded, exitcode, executable = proc.stdout.split()
    assert executable == shim_path and exitcode == "7"
    assert parent not in (runner, shim_pid)  # not exec'd by the shim: forked by the server's handler
    assert launcher == parent and preloaded == "True"
