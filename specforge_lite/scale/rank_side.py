"""The rank's side of a launched stage (`scale/launch.py` starts the ranks): a rank lives and dies
with the command that started it (a parent-death signal where Linux gives one, and a thread that
watches the launcher's pid everywhere), and copies what it prints to its own log."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

LAUNCHER_PID = "SPECFORGE_LITE_LAUNCHER_PID"  # set by `launch` for its ranks: the pid they follow
RANK_LOGS = "SPECFORGE_LITE_RANK_LOGS"  # the folder of the ranks' logs
WATCH_INTERVAL_S = 0.5  # how often a rank looks for its launcher


def follow_launcher() -> None:
    """In a rank that `launch` started: end with the launcher, and copy this rank's output to
    its log. Linux sends a parent-death signal (`prctl(PR_SET_PDEATHSIG)`); a thread polls the
    launcher's pid everywhere (and covers a launcher gone before the signal was asked for).
    Nothing in a process that `launch` did not start."""
    launcher, rank = os.environ.get(LAUNCHER_PID), os.environ.get("RANK")
    if not launcher or rank is None:
        return
    launcher = int(launcher)
    parent = os.getppid()
    die_with_parent(signal.SIGTERM)
    # `launch` starts its ranks as its own children: another parent means it died before the signal was asked for
    if parent != launcher or not process_alive(launcher):
        lost_launcher(rank, launcher)
    threading.Thread(target=watch_launcher, args=(rank, launcher, parent), name="specforge-launcher-watch",
                     daemon=True).start()
    if os.environ.get(RANK_LOGS):
        copy_output(Path(os.environ[RANK_LOGS]) / f"rank-{rank}.log")


def die_with_parent(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def watch_launcher(rank: str, launcher: int, parent: int) -> None:
    """Poll until the launcher is gone (or this process was handed to another parent), then exit."""
    while os.getppid() == parent and process_alive(launcher):
        time.sleep(WATCH_INTERVAL_S)
    lost_launcher(rank, launcher)


def lost_launcher(rank: str, launcher: int) -> None:
    try:
        os.write(2, f"rank {rank}: the command that started it (pid {launcher}) is gone; stopping\n".encode())
    finally:
        os._exit(128 + signal.SIGHUP)


class _Copy:
    """A text stream that also writes to a log file: what the rank prints, less progress-bar
    redraws (a line that ends without a newline, rewritten in place)."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log
        self._redraw = ""  # the newest redraw of a progress bar: logged with the newline that ends it

    def write(self, text: str) -> int:
        if "\r" in text and "\n" not in text:
            self._redraw = text.rsplit("\r", 1)[-1]
        else:
            try:  # a write that starts with a redraw replaces the one held
                self._log.write(text.rsplit("\r", 1)[-1] if text.startswith("\r") else self._redraw + text)
            except (OSError, ValueError):
                pass
            self._redraw = ""
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()
        try:
            self._log.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def copy_output(path: Path) -> None:
    """Copy what this process writes to sys.stdout and sys.stderr (logging included, once its
    handlers are made) to `path`, appended, line-buffered."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(path, "a", buffering=1, errors="replace")  # noqa: SIM115 (open for the process's life)
    except OSError as err:
        print(f"warning: cannot write this rank's log {path} ({err.strerror}); output goes to the console only",
              file=sys.stderr)
        return
    sys.stdout, sys.stderr = _Copy(sys.stdout, log_file), _Copy(sys.stderr, log_file)
