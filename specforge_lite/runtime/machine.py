"""What a results file says of where it was measured: the machine, its CPU (and whether it computes
bf16 natively) and the commit of the code, with whether the tree had changes beside it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout this package runs from


def machine() -> str:
    """The machine line of a results file: architecture, cores, torch, its threads and the GPU."""
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}"
            + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"))


def cpu_model() -> str:
    """The CPU's model name and whether it computes bf16 natively (the target's dtype choice)."""
    from specforge_lite.runtime.dtype_choice import native_bf16

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {'native bf16' if native_bf16() else 'no native bf16'}"


def source_state() -> dict:
    """The commit the results were measured at and whether the tree had changes beside it;
    $SPECFORGE_LITE_COMMIT where it is set (a copy of the working tree measured on another machine,
    whose git folder may be older than its files)."""
    if os.environ.get("SPECFORGE_LITE_COMMIT"):  # a copy of a working tree, measured elsewhere
        return {"commit": os.environ["SPECFORGE_LITE_COMMIT"], "tree_clean": None}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return {"commit": commit, "tree_clean": not dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": os.environ.get("SPECFORGE_LITE_COMMIT"), "tree_clean": None}
