"""Results files: benchmarks/results/NAME.json, written under the machine, the commit and the
package versions that measured it and read back with one line for a damaged file; and the one
formatter of a value and its interval that every table of them uses."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import ArtifactError, read_json_object
from specforge_lite.run_folders import package_versions
from specforge_lite.runtime.machine import cpu_model, machine, source_state

ROOT = Path(__file__).resolve().parents[2]  # the checkout this package runs from
RESULTS = ROOT / "benchmarks" / "results"
REQUIRED = ("commit",)  # what every record carries (write_results adds it; read_results refuses one without)


def read_results(path: Path) -> dict:
    """A results file's object; a damaged one (a bad merge, a truncated write) is one line naming
    it, so `make docs` does not stop on a decoder's traceback that names no file."""
    path = Path(path)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    try:
        record = read_json_object(path)
    except ArtifactError as err:
        problem = str(err).removeprefix(f"{err.path}: ")
        raise SpecforgeError(f"results file {shown}: {problem}: restore it (git checkout -- {shown}) "
                             "or run again the benchmark that writes it") from None
    if missing := [key for key in REQUIRED if not record.get(key)]:
        raise SpecforgeError(f"results file {shown} carries no {', '.join(missing)}: a figure is published with the "
                             "commit and machine that measured it; run again the benchmark that writes it")
    return record


def load_results(name: str, command: str) -> dict:
    """benchmarks/results/NAME.json, or an error naming the command that writes it (or the damage)."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise SpecforgeError(f"{path} not found; `{command}` makes it")
    return read_results(path)


# --- writing ------------------------------------------------------------------------------

def write_results(name: str, payload: dict) -> Path:
    """benchmarks/results/NAME.json: the payload under the date, machine (and its CPU), the commit
    and whether the tree was clean, and the package versions."""
    state = source_state()
    if not state.get("commit"):  # a copy without its git folder: the caller names the commit
        raise SpecforgeError(f"results {name}: no commit to record (not a git checkout); set SPECFORGE_LITE_COMMIT "
                             "to the commit of the measured tree")
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "cpu": cpu_model(),
               **state, "versions": package_versions(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def shaped(name: str, render, *args):
    """`render(*args)` of results file `name`, or one line naming the file when its content is not
    the shape the renderer reads (a key missing, a list where a table goes: an edit, another
    benchmark's file), instead of the renderer's traceback."""
    try:
        return render(*args)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as err:
        raise SpecforgeError(f"results file benchmarks/results/{name}.json is not the shape its block reads "
                             f"({type(err).__name__}: {err}); run again the benchmark that writes it") from None


# --- formatting ---------------------------------------------------------------------------

def num(value, digits=2, suffix="") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def with_ci(value, ci, digits=2, suffix="") -> str:
    """'1.23 [1.10, 1.35]': a value and its interval ('-' for no value, the value alone for no interval)."""
    if value is None:
        return "-"
    if not ci:
        return num(value, digits, suffix)
    return f"{num(value, digits, suffix)} [{num(ci[0], digits)}, {num(ci[1], digits)}]"


def machine_name(d: dict) -> str:
    """'2-core x86_64 CPU' (or the GPU's name) from a results file's machine line."""
    text = d.get("machine", "")
    cores = re.search(r"(\d+) CPU cores", text)
    arch = text.split(",")[0] if text else "?"
    gpu = [p.strip() for p in text.split(",") if p.strip() and "GPU" not in p and "NVIDIA" in p]
    return gpu[0] if gpu else (f"{cores.group(1)}-core {arch} CPU" if cores else "?")
