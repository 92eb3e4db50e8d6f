"""The four stages. Each is one module whose `run(cfg)` builds its parts, does its
work and writes its artifact under `run_dir`; `run` chains them in order. Their names,
modules and folders are listed once, in specforge_lite/stage_table.py.

- `door`: the whole config checked before any stage works;
- `sample`, `sample_backends` (the target generating in this process), `sample_dtype`;
- `train`, `train_keys` (what a resume must find unchanged);
- `evaluate` (the measurement protocol), `evaluate_decoders` (which decoder each method runs),
  `evaluate_entries` (the report's tables, more than one temperature);
- `export`.
"""

from __future__ import annotations

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data', 'training', 'decoding', 'measurement', 'drafters', 'serving', 'scale')

import importlib
import logging
from pathlib import Path

from omegaconf import DictConfig

from specforge_lite.checked_io import read_json_object
from specforge_lite.run_folders import samples_dir
from specforge_lite.scale.launch import launch, launch_plan, run_folder_locks, samples_missing, stage_overrides
from specforge_lite.scale.sizing import check_stage
from specforge_lite.scale.sizing import report as size_every_stage
from specforge_lite.stage_table import EVALUATE, EXPORT, RUN, SAMPLE, TRAIN, Stage, chained
from specforge_lite.scale.rendezvous import rendezvous_problems
from specforge_lite.stages.door import check_at_the_door, refuse
from specforge_lite import SpecforgeError
from specforge_lite.targets.accounting import begin_stage, undo_stage

log = logging.getLogger(__name__)


def run_stage(cfg: DictConfig) -> None:
    """Every command, in one sequence:

    1. the door (`door.check_at_the_door`): the whole config, then against the target's own
       config and this machine's folders and packages;
    2. `dry_run=true`: every stage sized from the target's config alone, and nothing else;
    3. the locks of the run folders this command writes (`launch.run_folder_locks`);
    4. each stage's launch plan (its own ranks, or this process: `launch.launch_plan`), and where
       launched ranks meet (`rendezvous.rendezvous_problems`);
    5. the sizing check of every stage that runs in this process, all before the first starts
       (a launched stage's ranks check their own devices when they get here);
    6. stage by stage: its ranks launched, or what it holds recorded (`accounting.begin_stage`)
       and the stage run.
    """
    target_config = check_at_the_door(cfg)
    if cfg.dry_run:  # every stage sized from the target's config alone: nothing loaded or launched
        size_every_stage(cfg, target_config)
        return
    with run_folder_locks(cfg):  # one command at a time writes a run's folders
        stages = chained(cfg.stage)
        plans = {stage.name: launch_plan(cfg, stage.name) for stage in stages}
        if plans.get(TRAIN.name) and samples_missing(cfg) and SAMPLE.name not in plans:
            # train's ranks cannot sample on their own: the sample stage runs first, as it would run alone
            log.info("no complete samples in %s: running the sample stage first", samples_dir(cfg))
            stages, plans = (SAMPLE, *stages), {SAMPLE.name: launch_plan(cfg, SAMPLE.name), **plans}
        # where the ranks meet, before the first stage runs (a busy port, a name that does not resolve)
        refuse(rendezvous_problems(cfg.trainer, any(plans.values())))
        for stage in stages:
            if plans[stage.name] is None:
                check_stage(cfg, stage.name)
        for stage in stages:
            if len(stages) > 1:
                log.info("=== stage %s ===", stage.name)
            run_one(cfg, stage, plans[stage.name])
    if cfg.stage == RUN.name:
        print_summary(cfg)


def run_one(cfg: DictConfig, stage: Stage, plan: dict | None) -> None:
    """`stage` on the ranks of `plan` (a failed rank's exit status ends this process), or here."""
    if plan is not None:
        code = launch(plan, stage.name, stage_overrides())
        if code:
            raise SystemExit(code)
        return
    begin_stage(cfg.run_dir, stage.name)
    try:
        importlib.import_module(stage.module).run(cfg)
    except SpecforgeError:
        undo_stage()  # refused: the records of what it loaded go too
        raise


def print_summary(cfg: DictConfig) -> None:
    """What `run` made: each stage's output and every method's line of the report."""
    run_dir = Path(cfg.run_dir)
    lines = [f"run finished: {run_dir}"]
    for what, path in (("samples", samples_dir(cfg) / "meta.json"), ("drafter", run_dir / TRAIN.folder / "drafter"),
                       ("report", run_dir / EVALUATE.folder / "report.md"),
                       ("export", run_dir / EXPORT.folder / "export.json")):
        if path.exists():
            lines.append(f"  {what:<8} {path}")
    report = run_dir / EVALUATE.folder / "report.json"
    if report.exists():
        methods = read_json_object(report).get("methods", {})
        for method, entry in methods.items():
            lines.append(f"  {method:<17} tau {entry.get('tau', 0):.2f}  {entry.get('tokens_per_s', 0):6.1f} tok/s  "
                         f"speedup {entry.get('speedup', 0):.2f}x")
    print("\n".join(lines))
