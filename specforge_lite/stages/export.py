"""The `export` stage: turn the trained drafter into a directory a serving engine loads.

Reads `run_dir/train/drafter` and writes `run_dir/export/` in the format a serving
engine loads for that drafter: EAGLE-3 in the speculators format (plus SGLang's layout
with `export.sglang=true`), Medusa in vLLM's Medusa format (vLLM <= 0.32), a draft
model as a plain HF directory with the target's tokenizer. Each gets a README with the
serve command; the stage reloads what it wrote strictly and checks that the reloaded
drafter computes the trained drafter's logits.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.artifacts import atomic_write_json, stage_dir, write_provenance
from specforge_lite.registry import DRAFTERS, detect_drafter
from specforge_lite.targets import HUB_IDS, load_target, resolve_target_path

log = logging.getLogger(__name__)


def chosen_k(cfg: DictConfig) -> tuple[int, str]:
    if cfg.export.speculative_tokens is not None:
        return int(cfg.export.speculative_tokens), "export.speculative_tokens"
    report = Path(cfg.run_dir) / "eval" / "report.json"
    if report.exists():
        best = json.loads(report.read_text()).get("best_k")
        if isinstance(best, int) and best > 0:
            return best, f"best_k measured by evaluate ({report})"
    return int(cfg.export.fallback_tokens), "export.fallback_tokens (no evaluation report found)"


def run(cfg: DictConfig) -> None:
    trained = Path(cfg.export.drafter_dir or Path(cfg.run_dir) / "train" / "drafter")
    if not trained.exists():
        raise SpecforgeError(f"no trained drafter in {trained}; run the train stage first (or set export.drafter_dir)")
    kind, found = detect_drafter(trained)
    log.info("exporting the %s drafter in %s (%s layout)", kind, trained, found)
    out = stage_dir(cfg, "export")
    target, tokenizer = load_target(cfg.target)
    k, k_source = chosen_k(cfg)
    verifier = cfg.export.verifier_name_or_path or HUB_IDS.get(cfg.target.path) or resolve_target_path(cfg.target.path)
    # written and strictly checked in a temporary folder, then swapped in: a failed check
    # leaves an earlier export (and its export.json) as it was
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        info = DRAFTERS[kind].export(cfg, trained, tmp, target, tokenizer, k, k_source, verifier)
        info.update({key: str(out / info[key]) for key in ("path", "sglang") if info.get(key)})  # final places
        write_provenance(tmp, cfg)
        atomic_write_json(tmp / "export.json", {**info, "drafter": kind, "speculative_tokens_source": k_source,
                                                "verifier": verifier, "strict_reload": "passed"})
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("export written to %s (k=%d from %s)", info["path"], info["speculative_tokens"], k_source)


def replace_dir(new: Path, old: Path) -> None:
    """Put folder `new` where `old` is: `old` is renamed aside first and removed after, so
    either the old or the new folder is in place at every moment."""
    aside = old.parent / f".{old.name}.old"
    shutil.rmtree(aside, ignore_errors=True)
    if old.exists():
        os.replace(old, aside)
    os.replace(new, old)
    shutil.rmtree(aside, ignore_errors=True)
