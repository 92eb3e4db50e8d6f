"""Real vLLM in the loop: the `vllm` sample backend and the `vllm_*` evaluate methods.

vLLM runs in a child process started with the interpreter that has vLLM
(`vllm_runner.py`, JSON lines over a pipe; which interpreter, its environment and its
arguments: `interpreter.py`). This module is that process's life: start, requests, stop.

A child process also gives vLLM's CPU backend the `__main__` guard it needs (it spawns
its worker) and returns all its memory when it exits.
"""

from __future__ import annotations

import atexit
import getpass
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.serving.vllm.interpreter import INSTALL_HINT, RUNNER, require_python, runner_env
from specforge_lite.targets import accounting

log = logging.getLogger(__name__)


def user_name() -> str:
    """The user name in torch's default compile-cache folder (`torchinductor_<user>`)."""
    try:
        return re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):
        return "unknown"


class VllmEngine:
    """One `vllm.LLM` in a child process; `generate` returns the runner's reply."""

    def __init__(self, kwargs: dict, vcfg, log_path: Path | None = None):
        python = require_python(vcfg.python)
        self.log_path = log_path
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        stderr = open(log_path, "a") if log_path else subprocess.DEVNULL  # noqa: SIM115
        log.info("starting vLLM (%s) for %s%s", python, kwargs["model"],
                 f" with {kwargs['speculative_config']}" if "speculative_config" in kwargs else "")
        # vLLM's IPC sockets and rendezvous files go to a temp folder of this engine's, removed with
        # it (`_end`; torch's compile cache stays where it was); its own session lets `_end` stop
        # every process vLLM started, however the stage ends
        self.ipc_dir = tempfile.mkdtemp(prefix="specforge_lite-vllm-")
        env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_{user_name()}"),
               **runner_env(vcfg), "TMPDIR": self.ipc_dir, "VLLM_RPC_BASE_PATH": self.ipc_dir}
        try:
            self.proc = subprocess.Popen([python, str(RUNNER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=stderr, env=env, text=True, bufsize=1, start_new_session=True)
        except OSError as err:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            raise SpecforgeError(f"the vLLM interpreter {python} cannot run ({err.strerror or err}): "
                                 f"{INSTALL_HINT}") from None
        finally:
            if log_path:
                stderr.close()
        atexit.register(self._stop)  # a failed or interrupted stage stops vLLM too
        stop_on_sigterm(self)  # and a stage sent SIGTERM (`kill`, a scheduler), which skips atexit
        try:
            reply = self._call({"engine": kwargs})
        except BaseException:  # a failed or interrupted start: nothing of it stays
            self._stop()
            raise
        self.load_s, self.version, self.draft = reply["load_s"], reply["vllm_version"], reply.get("draft")

    def _call(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError:  # a runner gone before it read the request (BrokenPipeError)
            line = ""
        if not line:
            self.proc.wait()
            raise SpecforgeError(f"vLLM exited with status {self.proc.returncode}{self._log_tail()}")
        try:
            reply = json.loads(line)
        except ValueError:
            raise SpecforgeError(f"vLLM's runner answered {line[:200]!r}, not a reply{self._log_tail()}") from None
        if not reply["ok"]:
            raise SpecforgeError(f"vLLM failed: {reply['error']}{self._log_tail()}")
        return reply

    def _log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-25:]
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(tail)

    def generate(self, prompts: list[list[int]], params: dict, one_at_a_time: bool = False) -> dict:
        return self._call({"op": "generate", "prompts": prompts, "params": params, "one_at_a_time": one_at_a_time})

    def load(self, prompts: list[list[int]], params: dict, concurrency: int) -> dict:
        """`prompts` with `concurrency` requests in flight (`serving/vllm/load.py`)."""
        return self._call({"op": "load", "prompts": prompts, "params": params, "concurrency": concurrency})

    def held_weights(self) -> list[dict]:
        """Per worker: `{"rank", "layer_bytes", "other_bytes"}` of the target it holds."""
        return self._call({"op": "weights"})["workers"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._end()

    def _stop(self) -> None:
        """Stop vLLM now, without waiting for its answer in flight (a failed or interrupted stage)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._end()

    def _end(self) -> None:
        """After the runner: stop what vLLM left of its session (engine core, workers) and remove
        its socket folder."""
        atexit.unregister(self._stop)
        forget_on_sigterm(self)
        if hasattr(os, "killpg"):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_LIVE: list[VllmEngine] = []  # engines whose runner a SIGTERM to this process must stop
_PREVIOUS_SIGTERM: list = []  # the handler before ours, put back once no engine is live


def stop_on_sigterm(engine: VllmEngine) -> None:
    """While an engine is live, SIGTERM stops every live engine (runner, its session, its temp
    folder) and then ends the process as SIGTERM would have (exit 143, or the previous handler)."""
    if not _LIVE and threading.current_thread() is threading.main_thread():
        _PREVIOUS_SIGTERM.append(signal.signal(signal.SIGTERM, _on_sigterm))
    _LIVE.append(engine)


def forget_on_sigterm(engine: VllmEngine) -> None:
    _LIVE[:] = [live for live in _LIVE if live is not engine]
    if not _LIVE and _PREVIOUS_SIGTERM and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _PREVIOUS_SIGTERM.pop())


def _on_sigterm(signum, frame) -> None:
    previous = _PREVIOUS_SIGTERM[-1] if _PREVIOUS_SIGTERM else signal.SIG_DFL
    for engine in list(_LIVE):
        engine._stop()  # puts the previous handler back once the last one is gone
    if callable(previous):
        previous(signum, frame)
    raise SystemExit(128 + signum)


def account_workers(engine: VllmEngine, config, dtype: str, how: str) -> None:
    """Record what each vLLM worker holds of the target (`accounting`: what a rehearsal checks);
    nothing outside a stage. A vLLM that cannot answer is reported, not fatal: the stage's work
    does not depend on it (the rehearsal's test then finds no worker records and fails)."""
    if not accounting.recording():
        return
    import torch

    try:
        workers = engine.held_weights()
    except SpecforgeError as err:
        log.warning("vLLM did not say what its workers hold (%s); this stage's accounting is incomplete",
                    str(err).split("\n")[0])
        return
    accounting.record_vllm_workers(config, workers, getattr(torch, dtype), how)


def sampling_params(max_tokens: int, temperature: float, top_p: float, stop_ids: list[int],
                    seeds: list[int] | None = None) -> dict:
    greedy = temperature <= 0
    params = {"max_tokens": max_tokens, "temperature": 0.0 if greedy else temperature,
              "top_p": 1.0 if greedy else top_p, "stop_token_ids": list(stop_ids), "detokenize": False}
    if seeds is not None and not greedy:
        params["seeds"] = seeds
    return params


def prompt_seed(base: int, ids: list[int]) -> int:
    """A per-request seed from the prompt itself: the same draws whatever the batch or restart."""
    digest = hashlib.sha256(f"{base}:{','.join(map(str, ids))}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def eos_ids_of(path: str, tokenizer) -> list[int]:
    """The ids that end an answer: the model's generation config, else the tokenizer's EOS
    (the same rule as the hf backend)."""
    config = Path(path) / "generation_config.json"
    eos = json.loads(config.read_text()).get("eos_token_id") if config.exists() else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return eos if isinstance(eos, list) else [eos]
