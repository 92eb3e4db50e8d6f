"""`make gpu-check`: the GPU tests, demo training, bf16/fp32 evaluation and projections in one command.

On a machine with CUDA, from the checkout's root, with the machine's own torch (at most 9
minutes on one GPU; each step has its own time limit, STEP_LIMITS_S):

1. tests: `pytest -m gpu tests/gpu`;
2. train_batch1, train_batched: the demo recipe (eagle_smollm2, online EAGLE-3, bf16 autocast)
   for TRAIN_STEPS optimizer steps at batch 1 and at the device-sized batch
   (train.tokens_per_step=auto): training tokens/s and peak GPU memory;
3. eval_bfloat16, eval_float32: plain, eagle3 (the drafter train_batched wrote, or
   $GPU_CHECK_DRAFTER) and ngram on MT-Bench first turns, 128 tokens, k = 3: tau, speedup with
   intervals, identity with the bf16 verdicts (identical / rounding / mismatch), forward ms per
   width of every engine eval.engine=auto timed, draft time share and loop overhead;
4. projection: `records/projection.py` at real shapes (Llama-3.1-8B, one rank of a 70B at
   tensor-parallel 8).
5. vllm_tree: whether the machine's vLLM serves a draft tree (`serving/vllm/trees.py`: its
   version, a `speculative_token_tree` config field, tree attention backends); no vLLM is
   recorded as such, not as a failure.

It writes benchmarks/results/gpu_check_<gpu>.json after every step: a step that fails (out of
memory on a busy or small GPU, a time limit, an error) is named in `failed_steps` with its
error and whatever it had measured, and the later steps still run; the exit status is 1 then.
Without CUDA it prints one line and exits 0, running and writing nothing.

    python -m specforge_lite gpu-check [--steps tests,train_batch1,...] [--out FILE] [--keep]

--keep runs the named steps again and keeps the results file's records of the others.

Environment: GPU_CHECK_ARGS (overrides added to every train and evaluate, e.g. data.source=
rows.jsonl where the machine has no ShareGPT package), GPU_CHECK_DRAFTER (a trained EAGLE-3
drafter folder for the evaluations), GPU_CHECK_PROMPTS (default 24).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specforge_lite import SpecforgeError
from specforge_lite.records import results
from specforge_lite.records.gpu_section import incomplete, runs_of
from specforge_lite.records.results import ROOT, machine
from specforge_lite.runtime.machine import source_state

TRAIN_STEPS = {"train_batch1": 60, "train_batched": 20}  # a device-sized step holds many times batch 1's tokens
EVAL_METHODS = "[plain,eagle3,ngram]"
FLOAT32_PROMPTS = "4"  # the lossless reference in the slow static engine: a few prompts say whether it holds
# seconds per step, start-up of each process included: the first training converts the built-in target
# once, the bf16 evaluation compiles the target's graphs (eval.engine=auto; its time: docs/BENCHMARKS.md
# section gpu_check_nvidia_h200); together 9 minutes
STEP_LIMITS_S = {"tests": 80, "train_batch1": 60, "train_batched": 90, "eval_bfloat16": 200, "eval_float32": 60,
                 "projection": 40, "vllm_tree": 10}
STEPS = tuple(STEP_LIMITS_S)
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory", re.I)


# --------------------------------------------------------------------------- the writer

@dataclass
class Step:
    """One step: `run(record, doc)` fills `record` (its measurements, kept even when it raises)
    and may read the earlier steps' records in `doc["steps"]`."""

    name: str
    run: Callable[[dict, dict], None]


def write(path: Path, doc: dict) -> None:
    """The results file, rewritten whole (through a temporary file: a reader never sees half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_steps(steps: list[Step], path: Path, header: dict, kept: dict | None = None) -> dict:
    """Run `steps` in order, writing `path` before the first and after each: per step its status
    ("ok" or "failed"), date, seconds, measurements, and for a failure the error's last line and
    whether it ran out of memory. A failed step is listed in `failed_steps`; the next still runs.
    kept: records of steps not run now (an earlier run's, `--keep`), written beside the new ones.
    Each step records the run it ran in (`run`: its date, commit and whether the tree was clean).
    `complete`: every step of STEPS is recorded and ok, all in runs of one commit on a clean tree
    (`runs` lists which steps ran in which run); a step that could not run here (no vLLM) is
    `skipped`, not ok."""
    run = {"date": header.get("date"), **source_state()}
    doc = {"benchmark": "gpu_check", **header, "steps_planned": [s.name for s in steps],
           "steps": dict(kept or {}), "failed_steps": [], "skipped_steps": [], "complete": False}
    doc["failed_steps"] = [name for name, r in doc["steps"].items() if r.get("status") not in ("ok", "skipped")]
    write(path, doc)
    for step in steps:
        doc["steps"].pop(step.name, None)
        record: dict = {"status": "running", "date": time.strftime("%Y-%m-%d %H:%M"), "run": run}
        doc["steps"][step.name] = record
        write(path, doc)
        start = time.perf_counter()
        try:
            step.run(record, doc)
            record["status"] = "ok"
        except StepSkipped as why:
            record.update(status="skipped", note=str(why))
        except BaseException as err:  # noqa: BLE001  a step's failure is recorded, then the next step runs
            if isinstance(err, KeyboardInterrupt):
                raise
            text = f"{type(err).__name__}: {err}".strip().splitlines()
            record.update(status="failed", error=text[-1][:500] if text else type(err).__name__,
                          out_of_memory=bool(OOM.search(f"{type(err).__name__} {err}")))
            if not isinstance(err, StepFailed):
                record["traceback_tail"] = traceback.format_exc().splitlines()[-3:]
            doc["failed_steps"].append(step.name)
        record["seconds"] = round(time.perf_counter() - start, 1)
        write(path, doc)
    order = [*STEPS, *(name for name in doc["steps"] if name not in STEPS)]
    doc["steps"] = {name: doc["steps"][name] for name in order if name in doc["steps"]}
    doc["skipped_steps"] = [name for name, r in doc["steps"].items() if r.get("status") == "skipped"]
    doc["runs"] = runs_of(doc["steps"])
    doc["complete"] = set(doc["steps"]) == set(STEPS) and not incomplete(doc)  # the rule the docs render
    write(path, doc)
    return doc


class StepFailed(RuntimeError):
    """A step's child process failed; the message is its last line of output."""


class StepSkipped(RuntimeError):
    """A step that cannot run on this machine (what it needs is not installed); the message says why."""


# --------------------------------------------------------------------------- the steps

def _child(args: list[str], limit: float, record: dict, env: dict | None = None) -> str:
    """Run a child process under `limit` seconds; its output's tail goes to record["log_tail"]."""
    try:
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=limit,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        record["log_tail"] = out.splitlines()[-5:]
        raise StepFailed(f"time limit of {limit:.0f} s reached") from None
    out = (done.stdout or "") + (done.stderr or "")
    lines = [line for line in out.replace("\r", "\n").splitlines() if line.strip()]
    record["log_tail"] = lines[-5:]
    if done.returncode:
        raise StepFailed(failure_line(done.returncode, done.stderr or "", lines))
    return out


def failure_line(code: int, stderr: str, lines: list[str]) -> str:
    """The line that says why a child failed: an out-of-memory line, else the CLI's `error:` line,
    else a traceback's last line, else the first line of its stderr (Hydra's own report)."""
    errs = [line.strip() for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    oom = next((line for line in reversed(lines) if OOM.search(line)), None)
    said = next((line for line in reversed(errs) if line.startswith("error:")), None)
    if oom or said:
        return oom or said
    if any(line.startswith("Traceback") for line in errs):
        return f"exit {code}: {errs[-1]}"
    return f"exit {code}: {(errs or lines or ['(no output)'])[0]}"


# the CLI in a child that also reports the GPU's peak memory (a file named by GPU_CHECK_PEAK)
PEAK_CHILD = ("import json, os, sys, torch\nfrom specforge_lite.__main__ import main\ntry:\n    main(sys.argv[1:])\n"
              "finally:\n    open(os.environ['GPU_CHECK_PEAK'], 'w').write(json.dumps("
              "torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None))\n")


def _stage(args: list[str], limit: float, record: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "peak.json"
        try:
            _child([sys.executable, "-c", PEAK_CHILD, *args, *os.environ.get("GPU_CHECK_ARGS", "").split()],
                   limit, record, {"GPU_CHECK_PEAK": str(peak), "WANDB_MODE": "disabled",
                                   # inductor's default kernels: autotuning every product takes minutes
                                   "SPECFORGE_LITE_AUTOTUNE": os.environ.get("SPECFORGE_LITE_AUTOTUNE", "0")})
        finally:
            if peak.exists() and json.loads(peak.read_text()) is not None:
                record["peak_memory_gib"] = round(json.loads(peak.read_text()) / 2 ** 30, 2)


def train_overrides(run_dir: Path, batch: list[str], device: str = "cuda", steps: int = 60) -> list[str]:
    """The demo recipe's training for `steps` steps on its source conversations (no sample stage);
    five logged windows (the first, the warm-up, is left out of tokens/s)."""
    return ["+recipe=eagle_smollm2", f"run_dir={run_dir}", f"target.device={device}", "train.mixed_precision=bf16",
            f"train.max_steps={steps}", f"train.log_every={max(1, steps // 5)}", "train.checkpoint_every=0",
            "train.tracker=none",
            "train.use_samples=false", "train.source_conversations=1000", *batch]


def eval_overrides(run_dir: Path, dtype: str, prompts: str, engine: str, drafter: str,
                   device: str = "cuda") -> list[str]:
    """The demo's evaluation (MT-Bench first turns, 128 tokens, k = 3) of plain, eagle3 and ngram."""
    return ["+recipe=eagle_smollm2", f"run_dir={run_dir}", f"target.device={device}", f"target.dtype={dtype}",
            f"eval.methods={EVAL_METHODS}", f"eval.max_prompts={prompts}", "eval.max_new_tokens=128",
            "eval.num_draft_tokens=3", f"eval.engine={engine}", "eval.plots=false",
            f"eval.drafter_dirs.eagle3={drafter}"]


def step_tests(record: dict, doc: dict) -> None:
    out = _child([sys.executable, "-m", "pytest", "-q", "-ra", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"],
                 STEP_LIMITS_S["tests"], record)
    for count, what in re.findall(r"(\d+) (passed|failed|skipped|error)", out):
        record[what] = int(count)


def train_step(name: str, batch: list[str], work: Path) -> Step:
    def step(record: dict, doc: dict) -> None:
        run_dir = work / name
        record["run_dir"] = run_dir.name
        record["overrides"] = batch
        _stage(["train", *train_overrides(run_dir, batch, steps=TRAIN_STEPS[name])], STEP_LIMITS_S[name], record)
        metrics = json.loads((run_dir / "train" / "metrics.json").read_text())
        history = metrics["history"][1:] or metrics["history"]  # the first window holds the warm-up
        record["steps"] = metrics.get("total_steps")
        record["tokens_per_s"] = sum(h["tokens_per_s"] for h in history) / len(history)
        record["last_loss"] = history[-1].get("loss")
        record["batch"] = {k: v for k, v in metrics.items() if k not in ("history",) and not isinstance(v, (dict, list))}
    return Step(name, step)


def eval_step(dtype: str, work: Path) -> Step:
    def step(record: dict, doc: dict) -> None:
        drafter = os.environ.get("GPU_CHECK_DRAFTER") or str(work / "train_batched" / "train" / "drafter")
        if not Path(drafter, "config.json").exists():
            raise StepFailed("no EAGLE-3 drafter (train_batched did not write one; set GPU_CHECK_DRAFTER)")
        run_dir = work / f"eval_{dtype}"
        prompts = os.environ.get("GPU_CHECK_PROMPTS", "24") if dtype == "bfloat16" else FLOAT32_PROMPTS
        engine = "auto" if dtype == "bfloat16" else "static"  # auto times every engine once, in bf16
        record.update(dtype=dtype, prompts=int(prompts), engine_requested=engine)
        _stage(["evaluate", *eval_overrides(run_dir, dtype, prompts, engine, drafter)],
               STEP_LIMITS_S[f"eval_{dtype}"], record)
        report = json.loads((run_dir / "eval" / "report.json").read_text())
        record.update(summarise_report(report))
    return Step(f"eval_{dtype}", step)


def summarise_report(report: dict) -> dict:
    """What the results file keeps of an evaluate report: per method tau, speedup (with intervals),
    tokens/s, identity verdicts, draft share and loop overhead; forward ms per width; the engine."""
    keep = ("tau", "tau_ci", "speedup", "speedup_ci", "tokens_per_s", "identical_answers", "lossless",
            "draft_time_share", "overhead_ms_per_step", "target_forward_ms", "per_position_acceptance")
    methods = {}
    for name, m in report["methods"].items():
        methods[name] = {k: m.get(k) for k in keep}
        identity = m.get("identity") or {}
        methods[name]["identity"] = {k: identity.get(k) for k in ("identical", "rounding", "mismatch", "answers", "text")}
    return {"methods": methods, "dtype": report.get("dtype"), "engine": report["settings"].get("engine"),
            "forward_ms_by_width": report.get("forward_costs", {}).get("ms_by_num_tokens")}


def step_projection(record: dict, doc: dict) -> None:
    from specforge_lite.records.projection import SHAPES, project  # builds drafters: loaded when the step runs

    for shape_name, shape in SHAPES.items():  # shape by shape: an out-of-memory keeps the shapes before it
        payload = project({shape_name: shape}, "cuda", "bfloat16")
        record.setdefault("shapes", {}).update(payload.pop("shapes"))
        record.update({k: v for k, v in payload.items() if k != "shapes"})


def step_vllm_tree(record: dict, doc: dict) -> None:
    from specforge_lite import SpecforgeError
    from specforge_lite.serving.vllm.interpreter import find_python
    from specforge_lite.serving.vllm.trees import tree_support

    python = find_python()
    if python is None:
        record.update(vllm=None, serves_trees=None)
        raise StepSkipped("no vLLM on this machine (make vllm, or pip install '.[vllm]')")
    try:
        record.update(tree_support(python, timeout=STEP_LIMITS_S["vllm_tree"]))
    except SpecforgeError as err:
        raise StepFailed(str(err)) from None


def default_steps(work: Path) -> list[Step]:
    return [Step("tests", step_tests),
            train_step("train_batch1", ["train.batch_size=1"], work),
            train_step("train_batched", ["train.tokens_per_step=auto"], work),
            eval_step("bfloat16", work), eval_step("float32", work),
            Step("projection", step_projection), Step("vllm_tree", step_vllm_tree)]


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3' (the results file's suffix)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specforge_lite gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", default=",".join(STEPS), help=f"a comma list of {', '.join(STEPS)}")
    parser.add_argument("--out", help="the results file (default benchmarks/results/gpu_check_<gpu>.json)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the results file's records of the steps not run now (each step says its date)")
    args = parser.parse_args(argv)
    chosen = [s for s in args.steps.split(",") if s]
    if unknown := [s for s in chosen if s not in STEPS]:
        raise SpecforgeError(f"unknown gpu-check step(s) {', '.join(unknown)}; known: {', '.join(STEPS)}")
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing to run (run `make gpu-check` on a GPU machine)")
        return 0
    gpu = torch.cuda.get_device_name()
    path = Path(args.out) if args.out else results.RESULTS / f"gpu_check_{gpu_slug(gpu)}.json"
    header = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), **source_state(), "gpu": gpu,
              "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1),
              "torch": torch.__version__, "cuda": torch.version.cuda, "command": "make gpu-check",
              "limits_s": STEP_LIMITS_S, "train_steps": TRAIN_STEPS, "float32_prompts": int(FLOAT32_PROMPTS)}
    kept = {}
    if args.keep and path.exists():
        earlier = json.loads(path.read_text())
        if earlier.get("gpu") != gpu:
            raise SpecforgeError(f"--keep: {path} holds a {earlier.get('gpu')} run, this is a {gpu}")
        kept = {name: {"date": earlier.get("date"), **r} for name, r in earlier.get("steps", {}).items()
                if name not in chosen}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        steps = [s for s in default_steps(Path(work)) if s.name in chosen]
        doc = run_steps(steps, path, header, kept)
    print(f"gpu-check: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}; "
          + ("all steps ok" if doc["complete"]
             else "not complete: " + "; ".join(incomplete(doc) or ["a step did not run"])))
    return 1 if doc["failed_steps"] else 0
