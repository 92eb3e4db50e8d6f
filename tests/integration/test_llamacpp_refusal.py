"""llama.cpp refusing a draft GGUF (marker `llamacpp`): a real target GGUF where the EAGLE-3
draft goes. llama.cpp logs its refusal and decodes plain; the method must fail in the report and
in the stage's failures with llama.cpp's own line, never be listed at tau 1.00."""

from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from specforge_lite.serving.llamacpp.checks import draft_gguf
from specforge_lite.serving.llamacpp.methods import run_methods
from specforge_lite.serving.llamacpp.report import LlamaCpp
from specforge_lite.serving.llamacpp.runner import INSTALL_HINT, available

pytestmark = [pytest.mark.llamacpp]

PROMPT = [257, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


def test_refused_draft_fails_the_method_with_llamacpps_reason(tmp_path):
    if not available():
        pytest.skip(f"xllamacpp is not installed ({INSTALL_HINT})")
    cfg = OmegaConf.create({
        "target": {"path": "builtin:tiny-llama"}, "run_dir": str(tmp_path),
        "eval": {"num_draft_tokens": 3, "warmup": 0, "warmup_tokens": 4, "max_new_tokens": 8, "temperature": 0.0,
                 "bootstrap": {"resamples": 20, "seed": 0, "level": 0.9}}})
    # the target's own GGUF where the EAGLE-3 draft goes: llama.cpp will not draft with it
    from specforge_lite.serving.llamacpp.files import target_gguf

    target, _ = target_gguf(cfg.target.path)
    wrong = draft_gguf(tmp_path, "llamacpp_eagle3")
    wrong.parent.mkdir(parents=True)
    shutil.copyfile(target, wrong)

    run = run_methods(cfg, ["llamacpp_plain", "llamacpp_eagle3"], [PROMPT])
    assert "completions" in run["results"]["llamacpp_plain"]
    error = run["results"]["llamacpp_eagle3"]["error"]
    assert "completions" not in run["results"]["llamacpp_eagle3"]
    assert error.startswith(f"llama.cpp refused the draft {wrong.name}") and "not eagle3" in error
    assert "\n" not in error

    report = {"answers": [{"prompt_id": "p0", "method": "plain"}], "methods": {"plain": {"tokens_per_s": 1.0}}}
    section = LlamaCpp().report_section(run, report, None, cfg)
    assert "llamacpp_eagle3" not in section["methods"] and "llamacpp_plain" in section["methods"]
    failures = LlamaCpp().failures(section, tmp_path)
    assert len(failures) == 1 and "llamacpp_eagle3: llama.cpp refused the draft" in failures[0]


CLOSE_AT_ONCE = """
from specforge_lite.serving.llamacpp.files import target_gguf
from specforge_lite.serving.llamacpp.runner import LlamaCppRunner
target, _ = target_gguf("builtin:tiny-llama")
for _ in range(200):
    LlamaCppRunner(target, "llamacpp_plain", threads=1).start().close()
print("closed 200")
"""


def test_a_runner_closed_right_after_loading_stops_its_server():
    """A refused draft closes the runner with no request made. xllamacpp's destructor could then
    stop the task loop before it ran and wait for it forever (it hung a test session, and CI);
    `close` frees the server once the loop has answered. In a child process, so that a regression
    fails here instead of hanging."""
    import os
    import subprocess
    import sys

    if not available():
        pytest.skip(f"xllamacpp is not installed ({INSTALL_HINT})")
    # the lost stop is a race that busy cores make likely: one spinning process per core meanwhile
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        proc = subprocess.run([sys.executable, "-c", CLOSE_AT_ONCE], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("closing llama.cpp runners right after loading hung")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert proc.returncode == 0 and "closed 200" in proc.stdout, proc.stderr[-2000:]
