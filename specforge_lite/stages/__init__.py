"""The four stages. Each is one module whose `run(cfg)` builds its parts, does its
work and writes its artifact under `run_dir`; `run` chains them in order."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from omegaconf import DictConfig

from specforge_lite.scale.accounting import begin_stage
from specforge_lite.artifact_io import read_json_object
from specforge_lite.artifacts import samples_dir
from specforge_lite.scale.sizing import check_stage
from specforge_lite.scale.sizing import report as size_every_stage
from specforge_lite.target.loading import sizing_config
from specforge_lite.scale.launch import launch, launch_plan, stage_overrides


log = logging.getLogger(__name__)

ORDER = ("sample", "train", "evaluate", "export")
MODULES = {
    "sample": "specforge_lite.stages.sample",
    "train": "specforge_lite.stages.train",
    "evaluate": "specforge_lite.stages.evaluate",
    "export": "specforge_lite.stages.export",
}


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
        if not launched(cfg, "sample"):
            begin_stage(cfg.run_dir, "sample")
            importlib.import_module(MODULES["sample"]).run(cfg)
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
    if cfg.stage != "run":
        if not launched(cfg, cfg.stage):
            begin_stage(cfg.run_dir, cfg.stage)
            importlib.import_module(MODULES[cfg.stage]).run(cfg)
        return
    # the stages `run` keeps in this process are sized now, not after hours of training; sample and
    # train size themselves on the ranks they launch (specforge_lite/scale/launch.py)
    check_stage(cfg, "evaluate", ("evaluate", "evaluate_vllm"))
    check_stage(cfg, "export", ("export",))
    for name in ORDER:
        log.info("=== stage %s ===", name)
        if not launched(cfg, name):
            begin_stage(cfg.run_dir, name)
            importlib.import_module(MODULES[name]).run(cfg)
    run_dir = Path(cfg.run_dir)
    lines = [f"run finished: {run_dir}"]
    for what, path in (("samples", samples_dir(cfg) / "meta.json"), ("drafter", run_dir / "train" / "drafter"),
                       ("report", run_dir / "eval" / "report.md"), ("export", run_dir / "export" / "export.json")):
        if path.exists():
            lines.append(f"  {what:<8} {path}")
    report = run_dir / "eval" / "report.json"
    if report.exists():
        methods = read_json_object(report).get("methods", {})
        for method, entry in methods.items():
            lines.append(f"  {method:<17} tau {entry.get('tau', 0):.2f}  {entry.get('tokens_per_s', 0):6.1f} tok/s  "
                         f"speedup {entry.get('speedup', 0):.2f}x")
    print("\n".join(lines))
