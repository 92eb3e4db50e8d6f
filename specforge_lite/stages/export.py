"""The `export` stage: turn the trained drafter into a directory a serving engine loads.

Reads `run_dir/train/drafter` and writes `run_dir/export/` in the format a serving
engine loads for that drafter: EAGLE-3 in the speculators format (plus SGLang's layout
with `export.sglang=true`), Medusa in vLLM's Medusa format (vLLM <= 0.32), a draft
model as a plain HF directory with the target's tokenizer. Each gets a README with the
serve command; the stage reloads what it wrote strictly and checks that the reloaded
drafter computes the trained drafter's logits. Everything is written into a temporary
folder beside `export/` and renamed into place only once that check has passed, so a
failed export leaves the previous one, and its `export.json`, untouched.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.artifact_io import read_json_object, write_failure
from specforge_lite.artifacts import STAGE_DIRS, atomic_write_json, atomic_write_text, write_provenance
from specforge_lite.drafters import distill, eagle3, medusa
from specforge_lite.drafters.common import drafter_kind
from specforge_lite.drafters.eagle3_export import (HUB_IDS, load_speculators_dir, sglang_problem, write_sglang_dir,
                                                   write_speculators_dir)
from specforge_lite.targets import load_target, resolve_target_path

log = logging.getLogger(__name__)


def chosen_k(cfg: DictConfig) -> tuple[int, str]:
    if cfg.export.speculative_tokens is not None:
        return int(cfg.export.speculative_tokens), "export.speculative_tokens"
    report = Path(cfg.run_dir) / "eval" / "report.json"
    if report.exists():
        best = read_json_object(report).get("best_k")
        if isinstance(best, int) and best > 0:
            return best, f"best_k measured by evaluate ({report})"
    return int(cfg.export.fallback_tokens), "export.fallback_tokens (no evaluation report found)"


@torch.no_grad()
def max_logit_difference(a, b, vocab_size: int, hidden: int) -> float:
    torch.manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 24), device=a.fc.weight.device)
    aux = torch.randn(2, 24, 3 * hidden, device=a.fc.weight.device)
    return max(float((x - y).abs().max()) for x, y in zip(a.ttt_forward(ids, aux, 3), b.ttt_forward(ids, aux, 3)))


def run(cfg: DictConfig) -> None:
    trained = Path(cfg.run_dir) / "train" / "drafter"
    kind = drafter_kind(trained)
    if kind is None:
        raise SpecforgeError(f"no trained drafter in {trained}; run the train stage first")
    if kind not in EXPORTERS:
        raise SpecforgeError(f"{trained}: no export for drafter {kind!r}; known: {sorted(EXPORTERS)}")
    final = Path(cfg.run_dir) / STAGE_DIRS["export"]
    target, tokenizer = load_target(cfg.target)
    k, k_source = chosen_k(cfg)
    verifier = cfg.export.verifier_name_or_path or HUB_IDS.get(cfg.target.path) or resolve_target_path(cfg.target.path)
    # written whole into a temporary folder, checked strictly there, then renamed into place:
    # a failure leaves the previous export (and its export.json) as it was
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        write_provenance(tmp, cfg)
        try:
            info = EXPORTERS[kind](cfg, trained, tmp, target, tokenizer, k, k_source, verifier)
        except ValueError as err:  # a strict check of what was written
            raise SpecforgeError(f"export failed its strict check, nothing replaced: {err}") from None
        except Exception as err:
            if write_failure(err):  # a full disk
                raise SpecforgeError(f"cannot write the export ({err}); nothing replaced") from err
            raise
        info = {key: value.replace(str(tmp), str(final)) if isinstance(value, str) else value
                for key, value in info.items()}
        atomic_write_json(tmp / "export.json", {**info, "drafter": kind, "speculative_tokens_source": k_source,
                                                "verifier": verifier, "strict_reload": "passed"})
        replace_folder(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("export written to %s (k=%d from %s)", info["path"], info["speculative_tokens"], k_source)


def replace_folder(new: Path, final: Path) -> None:
    """Put folder `new` at `final` by renames (the old one, if any, is removed after)."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def export_eagle3(cfg, trained: Path, out: Path, target, tokenizer, k: int, k_source: str, verifier: str) -> dict:
    """The speculators directory (plus SGLang's layout with export.sglang=true)."""
    drafter = eagle3.load(trained, target)
    if cfg.export.sglang and (problem := sglang_problem(drafter.config)):  # before anything is written
        raise SpecforgeError(f"{trained}: {problem}")
    architectures = list(target.config.architectures or ["LlamaForCausalLM"])
    speculators_dir = out / "speculators"
    config = write_speculators_dir(drafter, speculators_dir, k, verifier, architectures)
    reloaded = load_speculators_dir(speculators_dir, target)
    diff = max_logit_difference(drafter, reloaded, drafter.config.vocab_size, drafter.config.hidden_size)
    if diff != 0.0:
        raise SpecforgeError(f"{speculators_dir}: reloaded drafter differs from the trained one (max |dlogit| {diff})")
    log.info("speculators export passed its strict reload (every key and shape; logits identical)")
    if cfg.export.sglang:
        write_sglang_dir(drafter, out / "sglang")
    atomic_write_text(speculators_dir / "README.md", serve_readme(cfg, verifier, k, k_source, config))
    return {"format": "speculators", "path": str(speculators_dir), "speculative_tokens": k,
            "sglang": str(out / "sglang") if cfg.export.sglang else None}


def export_medusa(cfg, trained, out, target, tokenizer, k, k_source, verifier) -> dict:
    return medusa.export(cfg, trained, out, target, k, k_source, verifier)


EXPORTERS = {"eagle3": export_eagle3, "medusa": export_medusa, "draft_model": distill.export}


def serve_readme(cfg: DictConfig, verifier: str, k: int, k_source: str, config: dict) -> str:
    return f"""# EAGLE-3 drafter for {verifier}

Trained by specforge_lite (recipe `{cfg.recipe_name}`). Format: speculators (EAGLE-3),
draft vocabulary {config['draft_vocab_size']} of {config['transformer_layer_config']['vocab_size']} tokens,
aux hidden-state layers {config['eagle_aux_hidden_state_layer_ids']}.
Speculative tokens k = {k} ({k_source}).

Serve with vLLM (long form, works with any local target path):

```bash
vllm serve {verifier} \\
  --speculative-config '{{"method": "eagle3", "model": "<this directory>", "num_speculative_tokens": {k}}}'
```

Short form (needs `verifier.name_or_path` in config.json to be a hub id vLLM can fetch):

```bash
vllm serve <this directory>
```

Check it offline: `python -m specforge_lite export +recipe={cfg.recipe_name}` reloads this directory
strictly (every field, key and shape) and compares logits with the trained drafter.
"""
