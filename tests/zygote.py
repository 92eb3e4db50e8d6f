"""Python processes for the tests, forked from a server that imported their heavy packages once.

A stage starts vLLM as `PYTHON vllm_runner.py` (specforge_lite/serving/vllm/engine.py), and a
distributed test starts torchrun as `PYTHON -m torch.distributed.run` and its ranks as
`PYTHON -m specforge_lite ...` (torchrun's `--no-python`);
each such interpreter spends much of a small run importing vLLM, or torch and transformers. For
the tests, PYTHON is a shim (`install`) that asks a server of this test process, one that
imported those packages once in the right interpreter and ran nothing else, to fork the command:

- the forked process runs the real script or module (`runpy`, as the interpreter would) with the
  caller's standard streams, environment, working directory and arguments, in a session of its own;
- the shim passes SIGTERM, SIGINT and SIGHUP on to it and exits with its status (killed by a
  signal: the same signal), so the caller sees one process, as with a fresh interpreter;
- when the process ends, what it left in its session (vLLM's engine core and workers) is killed,
  as a stage does with a fresh runner's session; when the shim dies first (SIGKILL), so does the
  forked process's session;
- any other command (`PYTHON -c ...`, a probe) runs in the real interpreter.

Processes the forked one starts (vLLM's tensor-parallel workers) start as it starts them. For
vLLM the shim goes behind `$SPECFORGE_LITE_VLLM_PYTHON` (tests/conftest.py); tests that look for
the runner in /proc by its command line and environment use the real interpreter (`real_env`).
`SPECFORGE_LITE_TEST_FRESH_PROCESS=1` turns the servers off.

Standard library only: the shim runs in the tests' interpreter without site-packages (`-S`),
the server in the served interpreter.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys
import time

ENV = "SPECFORGE_LITE_VLLM_PYTHON"
REAL_ENV = "SPECFORGE_LITE_TEST_REAL_VLLM_PYTHON"  # vLLM's interpreter behind the shim
RUNNER_NAME = "vllm_runner.py"
# vLLM and what its runner and its workers import next: the CPU worker (with the GPU worker it
# extends), the rejection sampler, the EAGLE proposer, the online-quantization check of every
# model load. Not the n-gram proposer: numba's objects break vLLM's scan of every module's names
# when it binds its kernels (AttributeError on llvmlite's `_lib_fn_wrapper`)
VLLM_PRELOAD = ["vllm", "vllm.v1.worker.cpu_worker", "vllm.v1.sample.rejection_sampler", "vllm.v1.spec_decode.eagle",
                "vllm.model_executor.layers.quantization.online.base"]
# what a rank of `python -m specforge_lite` imports before it runs anything of ours
RANK_PRELOAD = ["numpy", "torch", "transformers", "transformers.models.llama.modeling_llama", "safetensors.torch",
                "hydra", "omegaconf", "accelerate", "deepspeed", "datasets", "matplotlib.pyplot"]


LAUNCHER_PID = "SPECFORGE_LITE_LAUNCHER_PID"  # specforge_lite/scale/rank_side.py: a rank's launcher
SPAWN = "from multiprocessing.spawn import spawn_main; spawn_main("  # multiprocessing.spawn.get_command_line
MAX_FDS = 64  # descriptors a command may inherit (the standard streams and multiprocessing's pipes)


FORKED_MODULES = (["-m", "specforge_lite"], ["-m", "torch.distributed.run"])  # a stage; torchrun, a test's launcher


def forked(argv: list[str]) -> bool:
    """The commands the server forks: vLLM's runner, `-m specforge_lite`, torchrun (whose ranks are
    `-m specforge_lite` through the shim again) and the children that multiprocessing's `spawn`
    starts from a forked process (vLLM's engine core and workers)."""
    return (len(argv) == 1 and os.path.basename(argv[0]) == RUNNER_NAME) or argv[:2] in FORKED_MODULES \
        or spawned(argv)


def spawned(argv: list[str]) -> bool:
    """A child of multiprocessing's `spawn`: [the parent's interpreter flags, -c, SPAWN..., --multiprocessing-fork]."""
    return len(argv) >= 3 and argv[-3] == "-c" and argv[-2].startswith(SPAWN) and argv[-1] == "--multiprocessing-fork"


def _inherited(skip: int) -> list[int]:
    """This process's open descriptors (what a command exec'd here would inherit), but `skip`."""
    found = []
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ("0", "1", "2"):
        fd = int(name)
        try:
            os.fstat(fd)  # the listing's own descriptor is closed by now
        except OSError:
            continue
        if fd != skip:
            found.append(fd)
    return sorted(found)[:MAX_FDS]


# --------------------------------------------------------------------------- messages

def _send(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    payload = struct.pack("!I", len(data)) + data
    if fds:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(payload)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def _recv(sock: socket.socket, with_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the descriptors sent with it; (None, []) at end of stream."""
    fds: list[int] = []
    if with_fds:  # the descriptors come with the message's first bytes
        head, ancillary, _flags, _addr = sock.recvmsg(4, socket.CMSG_SPACE(with_fds * 4))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", data[:len(data) - len(data) % 4]).tolist()
        head += _exactly(sock, 4 - len(head)) if head else b""
    else:
        head = _exactly(sock, 4)
    if len(head) < 4:
        return None, fds
    body = _exactly(sock, struct.unpack("!I", head)[0])
    return (json.loads(body) if body else None), fds


def _status(wait_status: int) -> int:
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


# --------------------------------------------------------------------------- the shim (the tests' side)

def shim(address: str, real_python: str, argv: list[str]) -> None:
    """`PYTHON ARGS` as the stage ran it: the runner forked by the server, anything else exec'd."""
    if not forked(argv):
        os.execv(real_python, [real_python, *argv])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError:  # no server (it failed to start): the real interpreter
        os.execv(real_python, [real_python, *argv])
    if os.environ.get(LAUNCHER_PID) == str(os.getppid()):  # a rank: it ends with its launcher (follow_launcher)
        _die_with_parent()
    fds = _inherited(sock.fileno())
    _send(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "fds": fds, "parent": os.getppid()},
          fds=fds)
    for fd in fds:  # the command holds the caller's pipes now; their ends close with it alone
        if fd != 2:
            os.close(fd)
    started, _ = _recv(sock)
    if started is None:
        sys.exit(1)
    pid = started["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    ended, _ = _recv(sock)
    code = 1 if ended is None else ended["status"]
    if code < 0:  # killed by a signal: so is the shim
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _die_with_parent() -> None:
    """SIGKILL this shim when its parent dies (Linux), as a rank's own PR_SET_PDEATHSIG would end it;
    the server then kills the forked rank's session."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


# --------------------------------------------------------------------------- the server (vLLM's side)

def _take_descriptors(numbers: list[int], fds: list[int]) -> None:
    """Put each received descriptor `fds[i]` at the caller's number `numbers[i]`, the rest closed."""
    import fcntl

    top = max([*numbers, *fds, 2]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, top) for fd in fds]  # out of the way of every target number
    for fd in fds:
        os.close(fd)
    for number, fd in zip(numbers, moved):
        os.dup2(fd, number)
        os.close(fd)


def adopt(env: dict, cwd: str) -> None:
    """In a forked process: the caller's environment and working folder, as a fresh interpreter
    starts in them (tempfile finds its folder again from this environment's TMPDIR)."""
    import tempfile

    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None
    os.chdir(cwd)


def _run_runner(request: dict, fds: list[int], shim_path: str) -> None:
    """In the forked command: the caller's descriptors, environment and folder, then the script,
    module or multiprocessing child; what it starts in turn starts through the shim too."""
    import multiprocessing

    os.setsid()
    _take_descriptors(request["fds"][:len(fds)], fds)
    adopt(request["env"], request["cwd"])
    if os.environ.get(LAUNCHER_PID) == str(request["parent"]):
        # a rank: its launcher's process here is this process's parent, the server's handler, which
        # lives as long as the shim, which lives as long as the launcher (_die_with_parent)
        os.environ[LAUNCHER_PID] = str(os.getppid())
    sys.executable = shim_path  # a launcher's ranks and multiprocessing's spawned children: through the shim
    multiprocessing.set_executable(shim_path)
    argv = request["argv"]
    # as the interpreter would set them: sys.argv, then sys.path's first entry (the script's folder,
    # the working folder for -m, '' for -c) and $PYTHONPATH
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if spawned(argv):  # the flags before -c are the parent's, this server's own
        sys.argv, sys.path[:1] = ["-c", argv[-1]], ["", *extra]
        run_as_main(lambda: exec(compile(argv[-2], "<string>", "exec"), {"__name__": "__main__"}))
    module = argv[1] if argv[0] == "-m" else None
    script = None if module else os.path.abspath(argv[0])
    sys.path[:1] = [os.getcwd() if module else os.path.dirname(script), *extra]
    sys.argv = ["-m", *argv[2:]] if module else list(argv)
    import runpy

    run_as_main(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True) if module
                else runpy.run_path(script, run_name="__main__"))


def run_as_main(main) -> None:
    """In a forked process: `main()` as a fresh interpreter runs its `__main__`, and the exit an
    interpreter makes: its status (2 for sys.exit(2), 1 and the traceback for an exception), the
    non-daemon threads joined, the exit handlers run, Python's and C's output buffers flushed."""
    import atexit
    import threading
    import traceback

    if "OMP_NUM_THREADS" in os.environ:  # OpenMP read the server's environment when torch loaded
        import torch

        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    code = 0
    try:
        main()
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
        if not isinstance(end.code, (int, type(None))):
            print(end.code, file=sys.stderr)  # sys.exit("message"): printed, status 1
    except BaseException:  # noqa: BLE001  as the interpreter: the traceback, status 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001  a closed stream has nothing left to write
                pass
        try:
            import ctypes

            ctypes.CDLL(None).fflush(None)  # what C libraries wrote with stdio
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)


def _handle(conn: socket.socket, listener: socket.socket, shim_path: str) -> None:
    """In a forked handler: fork the command, report its pid, then its status; the shim gone
    first (its socket closed) kills the command's session."""
    import threading

    request, fds = _recv(conn, with_fds=MAX_FDS)
    if request is None:
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        listener.close()
        _run_runner(request, fds, shim_path)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    done = threading.Event()

    def watch_shim():
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        if not done.is_set():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    threading.Thread(target=watch_shim, daemon=True).start()
    _, wait_status = os.waitpid(pid, 0)
    done.set()
    try:  # what vLLM left in the runner's session, as the stage kills a fresh runner's session
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        _send(conn, {"status": _status(wait_status)})
    except OSError:
        pass
    os._exit(0)


def prewarm_inductor() -> None:
    """Fill the per-process caches every process that compiles fills first, once, so that each
    fork inherits them: torch's source hash (inductor's cache key) and the CPU's vector ISA probe
    (it builds and loads a small library per ISA). Their values are this machine's, as a fresh
    process would find them. Nothing where torch is not loaded."""
    if "torch" not in sys.modules:
        return
    from torch._inductor import codecache, cpu_vec_isa

    codecache.torch_key()
    cpu_vec_isa.pick_vec_isa()


def before_forking() -> None:
    """What a server does once it has imported its modules: fill inductor's caches
    (`prewarm_inductor`), then move every object it holds out of the garbage collector's sight
    (`gc.freeze`), so that a full collection in a fork (vLLM runs several while it loads a model)
    walks the fork's own objects, not every object the server imported."""
    import gc

    prewarm_inductor()
    gc.freeze()


def serve(address: str, parent: int, preload: list[str], shim_path: str) -> None:
    """Listen at `address` (connections wait while it imports), import the `preload` modules,
    then fork a handler per connection; ends with the test process `parent`. A forked command's
    `sys.executable` and multiprocessing's interpreter are `shim_path`."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    import importlib

    for name in preload:
        try:
            module = importlib.import_module(name)
        except ImportError:  # not in this interpreter: its commands import it themselves
            continue
        if name == "vllm":
            module.LLM  # what every runner imports (vLLM loads its engine lazily)
    before_forking()

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    listener.settimeout(1.0)
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _handle(conn, listener, shim_path)
        conn.close()


# --------------------------------------------------------------------------- the tests' set-up

def install(folder: str, python: str, preload: list[str]) -> tuple[str, object]:
    """Start a server of `python` in `folder`, importing `preload`; returns the shim's path and
    the server's Popen (terminate it at the end)."""
    import subprocess

    address = os.path.join(folder, "zygote.sock")
    shim_path = os.path.join(folder, "python")
    command = [python, os.path.abspath(__file__), "serve", address, str(os.getpid()), ",".join(preload), shim_path]
    server = subprocess.Popen(command,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=open(os.path.join(folder, "zygote.log"), "w"),  # noqa: SIM115
                              start_new_session=True)
    deadline = time.monotonic() + 60  # it listens before it imports: a shim started from now on waits for it
    while not os.path.exists(address) and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(shim_path, "w") as f:
        here = os.path.dirname(os.path.abspath(__file__))
        f.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {here!r})\nimport zygote\n"
                f"zygote.shim({address!r}, {python!r}, sys.argv[1:])\n")
    os.chmod(shim_path, 0o755)
    return shim_path, server


def install_vllm(folder: str, vllm_python: str):
    """A server of vLLM's interpreter behind `$SPECFORGE_LITE_VLLM_PYTHON`; returns its Popen."""
    shim_path, server = install(folder, vllm_python, VLLM_PRELOAD)
    os.environ[ENV] = shim_path
    os.environ[REAL_ENV] = vllm_python
    return server


def stop(server) -> None:
    """End a server that `install` started."""
    import subprocess

    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def real_env(env: dict) -> dict:
    """`env` with vLLM's real interpreter instead of the shim (tests that find the runner in /proc)."""
    env = dict(env)
    real = env.pop(REAL_ENV, None)
    if real:
        env[ENV] = real
    return env


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "serve":
    serve(sys.argv[2], int(sys.argv[3]), [name for name in sys.argv[4].split(",") if name], sys.argv[5])
