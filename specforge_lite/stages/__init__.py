"""The four stages. Each is one module whose `run(cfg)` builds its parts, does its
work and writes its artifact under `run_dir`; `run` chains them in order. Their names,
modules and folders are listed once, in specforge_lite/config/stages.py."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from omegaconf import DictConfig

from specforge_lite.scale.accounting import begin_stage
from specforge_lite.artifact_io import read_json_object
from specforge_lite.artifacts import samples_dir
from specforge_lite.config.stages import COMMANDS, EVALUATE, EXPORT, RUN, SAMPLE, TRAIN, chained
from specforge_lite.scale.sizing import check_stage
from specforge_lite.scale.sizing import report as size_every_stage
from specforge_lite.target.loading import sizing_config
from specforge_lite.scale.launch import launch, launch_plan, run_folder_locks, stage_overrides


log = logging.getLogger(__name__)


def launched(cfg: DictConfig, stage: str) -> bool:
    """True when `stage` ran on ranks of its own (`trainer.num_processes` / `num_nodes`, or
    the node's GPUs; specforge_lite/scale/launch.py); a failed rank's exit status ends this process."""
    plan = launch_plan(cfg, stage)
    if plan is None:
        return False
    meta = samples_dir(cfg) / "meta.json"
    if stage == "train" and cfg.train.use_samples and not (meta.exists() and read_json_object(meta).get("complete")):
        # train's ranks cannot sample on their own: the sample stage runs first, as it would run alone
        log.info("no complete samples in %s: running the sample stage first", samples_dir(cfg))
        if not launched(cfg, SAMPLE.name):
            begin_stage(cfg.run_dir, SAMPLE.name)
            importlib.import_module(SAMPLE.module).run(cfg)
    code = launch(plan, stage, stage_overrides())
    if code:
        raise SystemExit(code)
    return True


def run_stage(cfg: DictConfig) -> None:
    """Validate the config (then again against the target's own config, for the stages that
    build a drafter) and run the stage, or all of them in order for `run`."""
    from specforge_lite.config.validate import validate_config, validate_for_target

    validate_config(cfg)
    if cfg.dry_run:  # every stage sized from the target's config alone: nothing loaded or launched
        config = sizing_config(cfg.target.path)
        validate_config(cfg, config)
        size_every_stage(cfg, config)
        return
    validate_for_target(cfg)
    with run_folder_locks(cfg):  # one command at a time writes a run's folders (scale/launch.py)
        run_stages(cfg)


def run_stages(cfg: DictConfig) -> None:
    """The stage `cfg.stage`, or all of them in order for `run`."""
    if cfg.stage != RUN.name:
        if not launched(cfg, cfg.stage):
            begin_stage(cfg.run_dir, cfg.stage)
            importlib.import_module(COMMANDS[cfg.stage].module).run(cfg)
        return
    # the stages `run` keeps in this process are sized now, not after hours of training; the
    # multi-rank ones size themselves on the ranks they launch (specforge_lite/scale/launch.py)
    for stage in chained(cfg.stage):
        if not stage.multi_rank:
            check_stage(cfg, stage.name)
    for stage in chained(cfg.stage):
        log.info("=== stage %s ===", stage.name)
        if not launched(cfg, stage.name):
            begin_stage(cfg.run_dir, stage.name)
            importlib.import_module(stage.module).run(cfg)
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
