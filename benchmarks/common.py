"""The benchmarks' harness: timing, intervals, results JSON, docs sections and one-line errors.

Every script under benchmarks/GROUP/ times with `timed`/`median_ms`, prints intervals with
`with_ci`, writes `benchmarks/results/NAME.json` with `write_results` and its section of
docs/BENCHMARKS.md with `update_doc_section`, and ends with `run(main)`: a `SpecforgeError`
(an unknown recipe, a missing run, a failed stage) then prints one `error:` line and exits 2.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn, TypeVar

from benchmarks.doc_topics import order_benchmarks, read_results
from benchmarks.docs import num, with_ci  # noqa: F401  (one formatter of a value and its interval, for all)
from specforge_lite import SpecforgeError
from specforge_lite.artifacts import package_versions

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "BENCHMARKS.md"
RECIPES = ROOT / "specforge_lite" / "conf" / "recipe"
USER_ERROR = 2  # the exit status of the CLI's one-line errors

T = TypeVar("T")

# what writes a run's files, for the line that says a run is missing
MAKES = {"eval": "python -m specforge_lite evaluate run_dir={run}",
         "train": "python -m specforge_lite train run_dir={run}",
         "samples": "python -m specforge_lite sample run_dir={run}",
         "export": "python -m specforge_lite export run_dir={run}"}

HEADER = """# Benchmarks

Every number here is written by a script in `benchmarks/` from a run on the machine
named in its section; re-run the command to reproduce it. Ratios are measured inside
one run (the machines are shared and noisy); absolute tokens/s vary between runs.
"""


def machine() -> str:
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}"
            + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"))


# --- errors -----------------------------------------------------------------------------

def run(main: Callable[[], object]) -> None:
    """A script's entry point: `main()`, a `SpecforgeError` printed as one line with exit 2."""
    try:
        main()
    except SpecforgeError as err:
        if os.environ.get("SPECFORGE_LITE_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR)


def fail(message: str) -> NoReturn:
    raise SpecforgeError(message)


def choose(name: str | None, known, what: str) -> str:
    """`name` if it is one of `known`, else an error that lists them (also when no name was given)."""
    known = sorted(known)
    if name not in known:
        fail(f"{f'unknown {what} {name!r}' if name else f'no {what} given'}; known: {', '.join(known) or '(none)'}")
    return name


def asks_help(argv: list[str], doc: str) -> bool:
    """For a script of steps (no argparse): print its docstring when argv is -h or --help."""
    if argv[:1] in (["-h"], ["--help"]):
        print(doc)
        return True
    return False


def known_recipe(name: str) -> str:
    """A recipe of specforge_lite/conf/recipe/ (as `+recipe=NAME` spells it), else the list of them."""
    return choose(name, (p.stem for p in RECIPES.glob("*.yaml")), "recipe")


def needed(path: Path, command: str) -> Path:
    """`path`, or an error naming the command that makes it."""
    if not Path(path).exists():
        fail(f"{path} not found; `{command}` makes it")
    return Path(path)


def run_file(run_dir: Path, relative: str, command: str | None = None) -> dict:
    """A JSON file of a run (`eval/report.json`, `train/metrics.json`, ...); a missing one says
    which stage writes it (`command`, else the stage of its first folder, with the run's overrides)."""
    stage = MAKES.get(Path(relative).parts[0], "")
    path = needed(Path(run_dir) / relative, command or stage.format(run=run_dir)
                  + (" (with the overrides that made the run)" if stage and not command else ""))
    from specforge_lite.artifact_io import read_json_object

    return read_json_object(path)  # a damaged file: one line naming it


def load_results(name: str, command: str) -> dict:
    """benchmarks/results/NAME.json, or an error naming the command that writes it (or the damage)."""
    return read_results(needed(RESULTS / f"{name}.json", command))


# --- timing ------------------------------------------------------------------------------

def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """fn's result and its wall seconds."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def median_ms(seconds: list[float]) -> float:
    """The median of timings in seconds, in milliseconds (robust to a noisy shared CPU)."""
    return 1e3 * statistics.median(seconds)


def interleaved(modes: dict[str, Callable[[], int]], rounds: int, baseline: str) -> tuple[dict, dict]:
    """Every mode once per round, in turn (a shared CPU drifts: a round compares the modes under one
    load). A mode returns what it made (tokens). Returns ({mode: [count, seconds] over all rounds},
    {mode: [its rate / the baseline's rate, per round]})."""
    totals = {name: [0, 0.0] for name in modes}
    ratios: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(rounds):
        rates = {}
        for name, fn in modes.items():
            count, seconds = timed(fn)
            totals[name][0] += count
            totals[name][1] += seconds
            rates[name] = count / seconds
            print(f"{name}: {count} tokens in {seconds:.1f} s ({rates[name]:.1f} tokens/s)", flush=True)
        for name in modes:
            ratios[name].append(rates[name] / rates[baseline])
    return totals, ratios


def run_cli(args: list[str], what: str, launcher: list[str] | None = None, env: dict | None = None,
            quiet: bool = True) -> float:
    """`python -m specforge_lite ARGS` (under `launcher`, e.g. torchrun's module) in this checkout;
    its wall seconds. A failure is an error with the stage's last line of stderr."""
    command = [sys.executable, *(launcher or []), "-m", "specforge_lite", *args]
    done, seconds = timed(lambda: subprocess.run(command, cwd=ROOT, env=env, capture_output=quiet, text=True))
    if done.returncode:
        last = [line for line in (done.stderr or "").splitlines() if line.strip()][-1:] or ["(its output is above)"]
        fail(f"{what} failed (exit {done.returncode}): {last[0].strip()}")
    return seconds


# --- intervals ---------------------------------------------------------------------------
# A value's interval prints as `with_ci(value, ci)` ("1.23 [1.10, 1.35]"); the intervals of one
# report come from specforge_lite.decoding.stats, which the evaluate report uses too.

def paired_tau_difference(answers: list[dict], reference: list[dict], method: str,
                          reference_method: str | None = None) -> dict:
    """tau of `method` in `answers` minus the tau of `reference_method` (default: the same method)
    in `reference` (report.json `answers` of two runs, or one run's twice) over the prompts both
    answered, with the 95% paired percentile bootstrap (one draw of prompts for both)."""
    from specforge_lite.decoding.stats import percentile_interval, prompt_totals, resample_indices, tau

    other = reference_method or method

    def ids(rows, name):
        return {r["prompt_id"] for r in rows if r["method"] == name}

    order = {prompt: i for i, prompt in enumerate(sorted(ids(answers, method) & ids(reference, other), key=str))}
    if not order:
        fail(f"no prompt answered by both {method} and {other}")

    def totals(rows, name):  # the shared prompts, in one order for both
        rows = sorted((r for r in rows if r["method"] == name and r["prompt_id"] in order),
                      key=lambda r: order[r["prompt_id"]])
        return prompt_totals(rows)[name]

    a, b = totals(answers, method), totals(reference, other)
    draws = resample_indices(len(order))
    return {"difference": float(tau(a) - tau(b)), "ci": percentile_interval(tau(a, draws) - tau(b, draws)),
            "num_prompts": len(order)}


# --- results -----------------------------------------------------------------------------

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
    import subprocess

    root = Path(__file__).resolve().parent.parent
    if os.environ.get("SPECFORGE_LITE_COMMIT"):  # a copy of a working tree, measured elsewhere
        return {"commit": os.environ["SPECFORGE_LITE_COMMIT"], "tree_clean": None}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return {"commit": commit, "tree_clean": not dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": os.environ.get("SPECFORGE_LITE_COMMIT"), "tree_clean": None}


def write_results(name: str, payload: dict) -> Path:
    """benchmarks/results/NAME.json: the payload under the date, machine (and its CPU), the commit
    and whether the tree was clean, and the package versions."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "cpu": cpu_model(),
               **source_state(), "versions": package_versions(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def update_doc_section(name: str, markdown: str) -> None:
    """Replace (or append) the section between `<!-- name -->` markers in docs/BENCHMARKS.md."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"<!-- {name} -->\n{markdown.strip()}\n<!-- /{name} -->"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(order_benchmarks(text))  # a new section goes under its topic, in the contents


def compose_config(overrides: list[str]):
    """The run config the CLI would build from these overrides (conf/ of this checkout)."""
    from hydra import compose, initialize_config_dir

    from specforge_lite.config.schema import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "specforge_lite" / "conf")):
        return compose(config_name="config", overrides=overrides)


# the embedded SmolLM2-135M-Instruct target, fp32 on CPU, as a `target` config
SMOLLM2 = {"path": "builtin:smollm2-135m-instruct", "dtype": "float32", "device": "cpu", "chat_template": None,
           "trust_remote_code": False}


def load_smollm2():
    """The embedded SmolLM2-135M-Instruct target, fp32 on CPU: (model, tokenizer)."""
    from omegaconf import OmegaConf

    from specforge_lite.target.loading import load_target

    return load_target(OmegaConf.create(SMOLLM2))


def sharegpt_first_turns(tokenizer, count: int, max_tokens: int) -> list[list[int]]:
    """Prompt ids of the first user turns of ShareGPT train conversations (the held-out
    split left out), the first `count` of at most `max_tokens` tokens."""
    from specforge_lite.data.chat import prompt_ids
    from specforge_lite.data.readers import heldout_split, read_conversations

    records, _ = read_conversations("builtin:sharegpt")
    train, _ = heldout_split(records, 0.02, 0)
    prompts = []
    for record in train:
        ids = prompt_ids(tokenizer, record["messages"][:1])
        if len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts
