"""`python -m specforge_lite ARGS` for the tests, without paying its imports at every call.

Each call is a real process of its own running the real command line (`runpy`, as `python -m`
does, with the caller's environment, working directory and arguments), forked from a server
process that has imported torch, transformers and hydra once and run nothing else (the
standard library's forkserver, one per test process), so no call imports them again; the
project's own modules are imported afresh by every call, so
nothing a call does reaches the next. The process ends as a fresh interpreter's would: its
non-daemon threads are joined, its exit handlers run, Python's and C's output buffers are
flushed, and its status is the command's (2 for a refused input, 1 for a traceback).

`SPECFORGE_LITE_TEST_FRESH_PROCESS=1` starts a fresh interpreter per call instead. Tests about
processes themselves (signals, ranks, locks) start theirs with subprocess directly.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile

from tests.zygote import adopt, run_as_main

# imported once by the server; nothing of ours (each call imports the project afresh); datasets,
# DeepSpeed and pyplot are what a train or evaluate call imported next (docs/TESTING.md)
PRELOAD = ["numpy", "torch", "transformers", "transformers.models.llama.modeling_llama", "safetensors.torch",
           "hydra", "omegaconf", "datasets", "deepspeed", "matplotlib.pyplot", "tests.warm_inductor"]
FRESH_ENV = "SPECFORGE_LITE_TEST_FRESH_PROCESS"
_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _command(args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """The forked process: `python -m specforge_lite ARGS` with stdin empty and stdout/stderr to files."""
    adopt(env, cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    multiprocessing.current_process().name = "MainProcess"  # as in a fresh interpreter
    sys.argv = ["-m", *args]
    run_as_main(lambda: runpy.run_module("specforge_lite", run_name="__main__", alter_sys=True))


def run_cli(args: list[str], cwd: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m specforge_lite ARGS` in `cwd` with `env` (default this process's environment): its
    status, stdout and stderr (subprocess.run's result; subprocess.TimeoutExpired after `timeout`
    seconds, the process killed)."""
    env = dict(os.environ if env is None else env)
    if env.get(FRESH_ENV) == "1":
        return subprocess.run([sys.executable, "-m", "specforge_lite", *args], cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, env=env)
    with tempfile.TemporaryDirectory(prefix="specforge_lite_cli_") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        process = _server().Process(target=_command, args=(list(args), str(cwd), env, out, err))
        process.start()
        try:
            process.join(timeout)
        except BaseException:  # a test's own timeout (pytest-timeout) or Ctrl-C: the command goes too
            process.kill()
            raise
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([sys.executable, "-m", "specforge_lite", *args], timeout)

        def read(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        return subprocess.CompletedProcess([sys.executable, "-m", "specforge_lite", *args], process.exitcode,
                                           read(out), read(err))
