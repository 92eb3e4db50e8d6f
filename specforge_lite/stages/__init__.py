"""The four stages. Each is one module whose `run(cfg)` builds its parts, does its
work and writes its artifact under `run_dir`; `run` chains them in order."""

from __future__ import annotations

import importlib
import logging

from omegaconf import DictConfig

from specforge_lite import SpecforgeError

log = logging.getLogger(__name__)

ORDER = ("sample", "train", "evaluate", "export")
MODULES = {
    "sample": "specforge_lite.stages.sample",
    "train": "specforge_lite.stages.train",
    "evaluate": "specforge_lite.stages.evaluate",
    "export": "specforge_lite.stages.export",
}


class StageNotBuilt(SpecforgeError):
    """Raised by a stage whose implementation has not landed yet."""


def run_stage(cfg: DictConfig) -> None:
    if cfg.stage != "run":
        importlib.import_module(MODULES[cfg.stage]).run(cfg)
        return
    for name in ORDER:
        log.info("=== stage %s ===", name)
        try:
            importlib.import_module(MODULES[name]).run(cfg)
        except StageNotBuilt as err:
            log.warning("skipping %s: %s", name, err)
