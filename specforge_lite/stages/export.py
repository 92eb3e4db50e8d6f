"""The `export` stage: turn the trained drafter into a directory a serving engine loads.

Reads `run_dir/train/drafter` and writes `run_dir/export/` in the format a serving
engine loads for that drafter: EAGLE-3 in the speculators format (plus SGLang's layout
with `export.sglang=true`), Medusa in vLLM's Medusa format (vLLM <= 0.32), a draft
model as a plain HF directory with the target's tokenizer. Each gets a README with the
serve command; the stage reloads what it wrote strictly and checks that the reloaded
drafter computes the trained drafter's logits. Everything is written into a temporary
folder beside `export/` and moved into place only once that check has passed, so a
failed export leaves the previous one, and its `export.json`, untouched. The files it
moves replace the ones the previous export wrote (`export/manifest.json` lists them);
any other file in `export/` is the user's and stays (`artifacts.place_files`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.artifact_io import load_safetensors, read_json_object, write_failure
from specforge_lite.artifacts import (STAGE_DIRS, atomic_write_json, modes_as_umask_says, place_files,
                                     readable_temp_dir, write_provenance)
from specforge_lite.data.chat import prompt_ids
from specforge_lite.drafters.common import require_finite
from specforge_lite.serving.llamacpp.checks import gguf_refusal
from specforge_lite.serving.llamacpp.files import write_gguf_folder
from specforge_lite.scale.sizing import check_stage
from specforge_lite.config.registry import DRAFTERS, detect_drafter, sglang_refusal
from specforge_lite.target.head import load_target_head
from specforge_lite.target.loading import HUB_IDS, resolve_target_path

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


def run(cfg: DictConfig) -> None:
    check_stage(cfg, "export", ("export",))
    trained = Path(cfg.export.drafter_dir or Path(cfg.run_dir) / "train" / "drafter")
    if not trained.exists():
        raise SpecforgeError(f"no trained drafter in {trained}; run the train stage first (or set export.drafter_dir)")
    kind, found = detect_drafter(trained)
    if cfg.export.sglang and (problem := sglang_refusal(kind)):
        raise SpecforgeError(f"export.sglang=true: {trained} holds a {kind} drafter; {problem}")
    if cfg.export.gguf and (why := gguf_refusal(kind, {})):
        raise SpecforgeError(f"export.gguf=true: {trained} holds a {kind} drafter; {why}")
    log.info("exporting the %s drafter in %s (%s layout)", kind, trained, found)
    final = Path(cfg.run_dir) / STAGE_DIRS["export"]
    if final.exists() and not final.is_dir():  # never renamed aside and left hidden
        raise SpecforgeError(f"{final} is a file, not an export folder; move or delete it (or set another run_dir)")
    # the checks use the target's embeddings, final norm and lm_head: only those are read
    target, tokenizer = load_target_head(cfg.target)
    k, k_source = chosen_k(cfg)
    verifier = cfg.export.verifier_name_or_path or HUB_IDS.get(cfg.target.path) or resolve_target_path(cfg.target.path)
    # written whole into a temporary folder, checked strictly there, then moved into place:
    # a failure leaves the previous export (and its export.json) as it was
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = readable_temp_dir(final.parent, f".{final.name}.")
    try:
        write_provenance(tmp, cfg)
        try:
            info = DRAFTERS[kind].export(cfg, trained, tmp, target, tokenizer, k, k_source, verifier)
            require_finite_files(tmp)  # before anything of it is put in place (or converted to GGUF)
            if cfg.export.gguf:  # llama.cpp's files from what was just written, loaded in llama.cpp
                hello = prompt_ids(tokenizer, [{"role": "user", "content": "Say hello."}])
                info["gguf"] = write_gguf_folder(cfg.target.path, kind, tmp / info["path"], tmp / "gguf", k, hello)
                info["gguf"]["path"] = str(final / "gguf")
        except ValueError as err:  # a strict check of what was written
            raise SpecforgeError(f"export failed its strict check, nothing replaced: {err}") from None
        except Exception as err:
            if write_failure(err):  # a full disk
                raise SpecforgeError(f"cannot write the export ({err}); nothing replaced") from err
            raise
        info.update({key: str(final / info[key]) for key in ("path", "sglang") if info.get(key)})  # final places
        atomic_write_json(tmp / "export.json", {**info, "drafter": kind, "speculative_tokens_source": k_source,
                                                "verifier": verifier, "strict_reload": "passed"})
        modes_as_umask_says(tmp)  # readable by a server running as another user, as the umask says
        place_files(tmp, final, "export")  # the previous export's files replaced, the user's kept
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("export written to %s (k=%d from %s)", info["path"], info["speculative_tokens"], k_source)
    if info.get("gguf") and not info["gguf"]["checked"]:
        log.warning("export/gguf is UNCHECKED: never loaded in llama.cpp (%s); export.json marks it "
                    "\"checked\": false", info["gguf"]["load_check"]["why"])


def require_finite_files(folder: Path) -> None:
    """Every safetensors file written under `folder` holds finite values only (`require_finite`)."""
    for path in sorted(folder.rglob("*.safetensors")):
        require_finite(load_safetensors(path), f"export {path.relative_to(folder)}")
