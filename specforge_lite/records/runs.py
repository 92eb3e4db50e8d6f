"""What a record reads from run folders: a run's JSON files (a missing one names the stage that
writes it), each trained drafter's training summary and cost, and the paired tau difference of
two runs' answers."""

from __future__ import annotations

import json
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import read_json_object
from specforge_lite.measurement.stats import percentile_interval, prompt_totals, resample_indices, tau
from specforge_lite.drafters.methods import labelled_drafters
from specforge_lite.stage_table import STAGES

# run folder -> the stage that writes it, for the line that says a run's file is missing
MAKES = {stage.folder: f"python -m specforge_lite {stage.name} run_dir={{run}}" for stage in STAGES}


def needed(path: Path, command: str) -> Path:
    """`path`, or an error naming the command that makes it."""
    if not Path(path).exists():
        raise SpecforgeError(f"{path} not found; `{command}` makes it")
    return Path(path)


def run_file(run_dir: Path, relative: str, command: str | None = None) -> dict:
    """A JSON file of a run (`eval/report.json`, `train/metrics.json`, ...); a missing one says
    which stage writes it (`command`, else the stage of its first folder, with the run's overrides)."""
    stage = MAKES.get(Path(relative).parts[0], "")
    path = needed(Path(run_dir) / relative, command or stage.format(run=run_dir)
                  + (" (with the overrides that made the run)" if stage and not command else ""))
    return read_json_object(path)  # a damaged file: one line naming it


# --- trained drafters ------------------------------------------------------------------------

def training_summary(drafter_dir: Path) -> dict | None:
    """The last logged window of a drafter's training (its folder's ../metrics.json), or None."""
    metrics = Path(drafter_dir).parent / "metrics.json"
    if not metrics.exists():
        return None
    history = json.loads(metrics.read_text())["history"]
    last = history[-1]
    return {"dir": str(drafter_dir), "steps": last["step"], "tokens": last.get("tokens_seen"),
            "final_loss": last["loss"], "final_simulated_tau": last["simulated_tau"], "acc": last["acc"],
            "tokens_per_s": last["tokens_per_s"], "target_share": last["target_share"]}


def drafter_folders(report: dict) -> dict:
    """Method -> trained drafter folder of a report: eval.drafter_dirs and eval.extra_drafters labels."""
    settings = report["settings"]
    return {**(settings.get("drafter_dirs") or {}), **labelled_drafters(settings)}


def per_minute(heldout: dict, threads: int) -> dict:
    """Held-out tau, training CPU minutes and (tau - 1) per CPU minute of each drafter the
    held-out evaluate decoded (its drafter folder's train/metrics.json)."""
    dirs = drafter_folders(heldout)
    rows = {}
    for name, m in heldout["methods"].items():
        metrics = Path(dirs[name]).parent / "metrics.json" if dirs.get(name) else None
        if metrics is None or not metrics.exists():
            continue
        logged = json.loads(metrics.read_text())
        minutes = sum(r["seconds"] for r in logged["throughput"]["ranks"]) * threads / 60
        rows[name] = {"tau": m["tau"], "tau_ci": m.get("tau_ci"), "train_cpu_min": minutes,
                      "train_tokens": logged["tokens_seen"], "gain_per_cpu_min": (m["tau"] - 1) / minutes}
    return rows


def named_seconds(items: list[str], option: str) -> dict:
    """`NAME=SECONDS` items as {name: seconds}; a malformed one stops with one line."""
    out = {}
    for item in items:
        name, _, seconds = item.partition("=")
        try:
            out[name] = float(seconds)
        except ValueError:
            raise SpecforgeError(f"{option} {item!r}: give NAME=SECONDS") from None
    return out


def equal_cpu(dirs: dict, pilots: list[str], process_cpu: list[str], threads: int) -> dict:
    """Per drafter of `dirs` with a `--pilot NAME=SECONDS`: its steps, the CPU minutes they make
    at the pilot's seconds per step, the training minutes it logged and, where given, its
    process's CPU minutes."""
    rates, used = named_seconds(pilots, "--pilot"), named_seconds(process_cpu, "--process-cpu")
    rows = {}
    for name, rate in rates.items():
        if not dirs.get(name):
            raise SpecforgeError(f"--pilot {name}: the evaluate decoded no drafter of that name")
        logged = json.loads((Path(dirs[name]).parent / "metrics.json").read_text())
        steps = logged["total_steps"]
        rows[name] = {"steps": steps, "pilot_s_per_step": rate, "cpu_min_given": steps * rate * threads / 60,
                      "train_min_logged": sum(r["seconds"] for r in logged["throughput"]["ranks"]) * threads / 60,
                      "tokens": logged["tokens_seen"], "process_cpu_min": used[name] / 60 if name in used else None}
    return rows


# --- two runs' answers -----------------------------------------------------------------------

def paired_tau_difference(answers: list[dict], reference: list[dict], method: str,
                          reference_method: str | None = None) -> dict:
    """tau of `method` in `answers` minus the tau of `reference_method` (default: the same method)
    in `reference` (report.json `answers` of two runs, or one run's twice) over the prompts both
    answered, with the 95% paired percentile bootstrap (one draw of prompts for both)."""
    other = reference_method or method

    def ids(rows, name):
        return {r["prompt_id"] for r in rows if r["method"] == name}

    order = {prompt: i for i, prompt in enumerate(sorted(ids(answers, method) & ids(reference, other), key=str))}
    if not order:
        raise SpecforgeError(f"no prompt answered by both {method} and {other}")

    def totals(rows, name):  # the shared prompts, in one order for both
        rows = sorted((r for r in rows if r["method"] == name and r["prompt_id"] in order),
                      key=lambda r: order[r["prompt_id"]])
        return prompt_totals(rows)[name]

    a, b = totals(answers, method), totals(reference, other)
    draws = resample_indices(len(order))
    return {"difference": float(tau(a) - tau(b)), "ci": percentile_interval(tau(a, draws) - tau(b, draws)),
            "num_prompts": len(order)}
