"""SIGTERM to the stage process itself (`kill PID`, a scheduler's stop) while vLLM runs: the
runner, its session and its temp folder go with the stage, as they do on Ctrl-C (marker `vllm`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specforge_lite.serving.vllm.interpreter import find_python
from tests.conftest import REPO
from tests.integration.test_sample_fallback import left_behind, runners
from tests.zygote import real_env


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads processes from /proc")
def test_sigterm_to_a_vllm_stage_stops_its_runner_and_removes_its_folder(tmp_path):
    if find_python() is None:
        pytest.skip("vLLM is not installed (make vllm)")
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = tmp_path / "stage.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "specforge_lite", "sample", "+recipe=eagle_smollm2",
                                 f"run_dir={tmp_path / 'run'}", f"samples_dir={tmp_path / 'run'}",
                                 "sample.backend=vllm", "data.max_samples=8", "sample.max_new_tokens=64"],
                                cwd=REPO, env=real_env(dict(os.environ, TMPDIR=str(temp))), stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not runners(temp) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None and runners(temp), out.read_text()[-3000:]
        time.sleep(5)  # vLLM well under way
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out.read_text()[-3000:]
    assert not runners(temp), "vLLM outlived the stage sent SIGTERM"
    assert not left_behind(temp), left_behind(temp)
