"""A wheel built from the repository and installed without `-e` carries its config: the CLI
runs the smoke recipe from a directory that holds no project files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_installed_wheel_runs_the_smoke_recipe_from_any_directory(tmp_path):
    wheels, site, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(ROOT)], check=True, capture_output=True, text=True)
    wheel = next(wheels.glob("specforge_lite-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    # the installed copy comes first on the path: no editable install, no repository files
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    where = subprocess.run([sys.executable, "-c", "import specforge_lite; print(specforge_lite.__file__)"],
                           cwd=elsewhere, env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(site), where
    proc = subprocess.run([sys.executable, "-m", "specforge_lite", "run", "+recipe=smoke", "run_dir=out",
                           "train.max_steps=2", "eval.max_prompts=1", "eval.methods=[plain,eagle3]"],
                          cwd=elsewhere, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (elsewhere / "out" / "export" / "export.json").exists()
    assert (elsewhere / "out" / "eval" / "report.json").exists()
