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
any other file in `export/` is the user's and stays (`run_folders.place_files`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import load_safetensors, read_json_object, write_failure
from specforge_lite.run_folders import (STAGE_DIRS, atomic_write_json, modes_as_umask_says, place_files,
                                     readable_temp_dir, write_provenance)
from specforge_lite.data.chat import prompt_ids
from specforge_lite.decoding.tree import DraftTree
from specforge_lite.drafters.common import require_finite
from specforge_lite.serving.llamacpp.checks import gguf_refusal
from specforge_lite.serving.llamacpp.files import write_gguf_folder
from specforge_lite.serving.vllm.load_report import serve_section, served_schedule
from specforge_lite.drafters.registry import (DRAFTERS, detect_drafter, say_what_the_trained_folder_decides,
                                             sglang_refusal)
from specforge_lite.targets.head import load_target_head
from specforge_lite.targets.loading import HUB_IDS, resolve_target_path

log = logging.getLogger(__name__)


def evaluated(cfg: DictConfig, trained: Path | None = None, kind: str | None = None) -> tuple[Path, dict] | None:
    """(run_dir/eval/report.json, its content, read once) where it measured the drafter exported now,
    else None. With the
    drafter's folder given, a report that recorded other weights of this drafter kind (a retrain
    whose evaluate failed or never ran), or that was written before these weights without
    recording any, is said in one line and not used: its k, tree and recommendation are another
    drafter's."""
    report = Path(cfg.run_dir) / "eval" / "report.json"
    if not report.exists():
        return None
    content = read_json_object(report)
    if trained is not None and (why := stale_report(report, content, Path(trained), kind)):
        log.warning("%s %s: the export does not use its k, tree or recommendation (evaluate this drafter again)",
                    report, why)
        return None
    return report, content


def stale_report(report: Path, content: dict, trained: Path, kind: str | None) -> str | None:
    from specforge_lite.targets.digest import folder_digests, weight_files

    recorded = (content.get("drafters") or {}).get(kind)
    if recorded is not None:
        return None if recorded.get("weights") == folder_digests(trained) else \
            f"measured other weights of the {kind} drafter than those in {trained} (trained again since?)"
    newest = max((p.stat().st_mtime for p in weight_files(trained)), default=None)
    if newest is not None and report.stat().st_mtime < newest:
        return f"was written before the {kind} drafter in {trained} was trained"
    return None


def chosen_k(cfg: DictConfig, report: tuple[Path, dict] | None | bool = True) -> tuple[int, str]:
    """The k the export serves: export.speculative_tokens, else the report's best k (`report`:
    True reads run_dir's, None means no report of this drafter), else export.fallback_tokens."""
    if cfg.export.speculative_tokens is not None:
        return int(cfg.export.speculative_tokens), "export.speculative_tokens"
    report = evaluated(cfg) if report is True else report
    if report is not None:
        best = report[1].get("best_k")
        if isinstance(best, int) and best > 0:
            return best, f"best_k measured by evaluate ({report[0]})"
    return int(cfg.export.fallback_tokens), "export.fallback_tokens (no evaluation report of this drafter found)"


def run(cfg: DictConfig) -> None:
    trained = Path(cfg.export.drafter_dir or Path(cfg.run_dir) / "train" / "drafter")
    if cfg.export.drafter_dir and not trained.is_dir():
        raise SpecforgeError(f"export.drafter_dir={str(cfg.export.drafter_dir)!r}: no such folder; name a trained "
                             "drafter's folder (our train/drafter, a speculators or SGLang export), or leave it "
                             "null for run_dir/train/drafter")
    if not trained.exists():
        raise SpecforgeError(f"no trained drafter in {trained}; run the train stage first (or set export.drafter_dir)")
    kind, found = detect_drafter(trained)
    if cfg.export.sglang and (problem := sglang_refusal(kind)):
        raise SpecforgeError(f"export.sglang=true: {trained} holds a {kind} drafter; {problem}")
    if cfg.export.gguf and (why := gguf_refusal(kind, {})):
        raise SpecforgeError(f"export.gguf=true: {trained} holds a {kind} drafter; {why}")
    log.info("exporting the %s drafter in %s (%s layout)", kind, trained, found)
    say_what_the_trained_folder_decides(trained, found, cfg)
    final = Path(cfg.run_dir) / STAGE_DIRS["export"]
    if final.exists() and not final.is_dir():  # never renamed aside and left hidden
        raise SpecforgeError(f"{final} is a file, not an export folder; move or delete it (or set another run_dir)")
    # the checks use the target's embeddings, final norm and lm_head: only those are read
    target, tokenizer = load_target_head(cfg.target)
    report = evaluated(cfg, trained, kind)
    k, k_source = chosen_k(cfg, report)
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
                # the k the drafter's export settled on (a non-causal DFlash block serves whole)
                gguf_k = int(info.get("speculative_tokens", k))
                info["gguf"] = write_gguf_folder(cfg.target.path, kind, tmp / info["path"], tmp / "gguf", gguf_k, hello)
                info["gguf"]["path"] = str(final / "gguf")
        except ValueError as err:  # a strict check of what was written
            raise SpecforgeError(f"export failed its strict check, nothing replaced: {err}") from None
        except Exception as err:
            if write_failure(err):  # a full disk
                raise SpecforgeError(f"cannot write the export ({err}); nothing replaced") from err
            raise
        if tree := chosen_tree(cfg, kind, report):  # the evaluated tree as vLLM's static tree, beside the chain
            tree["command"] = tree_command(verifier, DRAFTERS[kind].VLLM_SERVING, tree["node_paths"])
            readme = tmp / info["path"] / "README.md"
            readme.write_text(readme.read_text() + tree_readme(tree))
            info["speculative_token_tree"] = tree
        if report and DRAFTERS[kind].VLLM_SERVING and (at_load := load_readme(report[1], kind, verifier)):
            readme = tmp / info["path"] / "README.md"  # the schedule evaluate measured, in vLLM's serve command
            readme.write_text(readme.read_text() + at_load)
            info["load_schedule"] = served_schedule(report[1], f"vllm_{kind}")
        if advice := recommendation_readme(cfg, report):  # what this run's evaluate recommends, and who serves it
            readme = tmp / info["path"] / "README.md"
            readme.write_text(readme.read_text() + advice)
        info.update({key: str(final / info[key]) for key in ("path", "sglang") if info.get(key)})  # final places
        atomic_write_json(tmp / "export.json", {**info, "drafter": kind, "speculative_tokens_source": k_source,
                                                "verifier": verifier, "strict_reload": "passed"})
        modes_as_umask_says(tmp)  # readable by a server running as another user, as the umask says
        place_files(tmp, final, "export")  # the previous export's files replaced, the user's kept
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("export written to %s (k=%d from %s)", info["path"], info["speculative_tokens"], k_source)
    if tree:
        log.info("as a static draft tree (%s; vLLM releases with tree attention, not vLLM 0.32): %s",
                 tree["source"], tree["command"].replace("<this directory>", info["path"]))
    if info.get("gguf") and not info["gguf"]["checked"]:
        log.warning("export/gguf is UNCHECKED: never loaded in llama.cpp (%s); export.json marks it "
                    "\"checked\": false", info["gguf"]["load_check"]["why"])


def chosen_tree(cfg: DictConfig, kind: str, report: tuple[Path, dict] | None | bool = True) -> dict | None:
    """The draft tree the export of a `kind` drafter carries, or None: only for a drafter that
    drafts trees (its module's DRAFTS_TREES) and that vLLM serves on its EAGLE proposer without
    extra keys (vLLM serves P-EAGLE's parallel drafting, Medusa and DFlash as chains). Its shape is the best tree
    evaluate estimated for the fastest tree method of this drafter in run_dir/eval/report.json
    (`metrics.best_tree`; the shape it ran where the report has no estimate), else `eval.tree`'s
    shape when set (not measured). Returns {"depth", "branch", "nodes", "source", "node_paths"}."""
    module = DRAFTERS[kind]
    serving = module.VLLM_SERVING or ()
    # vLLM read `speculative_token_tree` in its EAGLE proposer only (methods eagle*, no extra keys),
    # in the releases that had tree attention; vLLM 0.32 has neither
    if not getattr(module, "DRAFTS_TREES", False) or not serving or not serving[0].startswith("eagle") \
            or serving[2:]:
        return None
    shape, source = None, None
    report = evaluated(cfg) if report is True else report
    methods = report[1].get("methods") or {} if report is not None else {}
    measured = {name: m for name, m in methods.items() if (m.get("tree") or {}).get("chain") == kind}
    if measured:
        name = max(measured, key=lambda n: measured[n].get("tokens_per_s") or 0.0)
        tree = measured[name]["tree"]
        best = (tree.get("best_tree") or {}).get("best")
        shape = best or tree["shape"]
        source = (f"the best tree estimated from {name} as measured by evaluate ({report[0]})" if best
                  else f"the shape {name} ran in evaluate ({report[0]})")
    elif (cfg.get("eval") or {}).get("tree") is not None:
        shape, source = cfg.eval.tree, "eval.tree (no evaluate measured a tree of this drafter)"
    if shape is None:
        return None
    depth, branch, nodes = int(shape["depth"]), int(shape["branch"]), int(shape["nodes"])
    return {"depth": depth, "branch": branch, "nodes": nodes, "source": source,
            "node_paths": [list(path) for path in static_tree(depth, branch, nodes)]}


def static_tree(depth: int, branch: int, nodes: int) -> list[tuple[int, ...]]:
    """A static tree of that shape as vLLM's node paths (`DraftTree.node_paths`): the first
    `nodes` nodes of the full `branch`-ary tree `depth` levels deep, breadth first, lower child
    ranks first (EAGLE-2's own tree is rebuilt every step; this is the representative shape)."""
    parents, frontier = [], [-1]
    for _ in range(depth):
        below = []
        for parent in frontier:
            for _ in range(branch):
                if len(parents) < nodes:
                    parents.append(parent)
                    below.append(len(parents) - 1)
        frontier = below
    return DraftTree([0] * len(parents), parents).node_paths()


def recommendation_readme(cfg: DictConfig, report: tuple[Path, dict] | None | bool = True) -> str:
    """The README section on the method run_dir/eval/report.json recommends, with the report's
    reasons and alternatives (which say where a method is ours only and what an engine serves
    instead), or "" without a report (of this drafter) or a recommendation."""
    report = evaluated(cfg) if report is True else report
    rec = (report[1].get("recommendation") or {}) if report is not None else {}
    if not rec.get("deploy"):
        return ""
    lines = ["", "## What evaluate recommends", "",
             f"`{report[0]}` recommends **{rec['deploy']}** on the machine and prompts it measured"
             + (f": {'; '.join(rec['reasons'])}." if rec.get("reasons") else ".")]
    lines += ["", *(f"- {line}" for line in rec.get("alternatives") or [])] if rec.get("alternatives") else []
    return "\n".join(lines) + "\n"


def load_readme(report: dict, kind: str, verifier: str) -> str:
    """The README section on serving at load (`serving/vllm/load_report.serve_section`), or ""."""
    method, _, *extra = DRAFTERS[kind].VLLM_SERVING
    return serve_section(report, f"vllm_{kind}", {"method": method, "model": "<this directory>",
                                                  **(extra[0] if extra else {})}, verifier)


def tree_command(verifier: str, serving: tuple, node_paths: list) -> str:
    """`vllm serve` with the tree in --speculative-config (valid JSON): num_speculative_tokens is
    the node count and speculative_token_tree the node paths as the Python literal vLLM parses
    (its field is a string)."""
    method, _, *extra = serving
    config = {"method": method, "model": "<this directory>", "num_speculative_tokens": len(node_paths),
              **(extra[0] if extra else {}), "speculative_token_tree": str([tuple(p) for p in node_paths])}
    return f"vllm serve {verifier} \\\n  --speculative-config '{json.dumps(config)}'"


def tree_readme(tree: dict) -> str:
    """The README section of the static tree (`chosen_tree`)."""
    paths = str([tuple(p) for p in tree["node_paths"]])
    return f"""
## As a draft tree

Tree shape: depth {tree['depth']}, branch {tree['branch']}, {tree['nodes']} nodes ({tree['source']}).
EAGLE-2's tree is dynamic (rebuilt from the drafter's scores every step); a server takes a static
tree, here the first {len(tree['node_paths'])} nodes of the full {tree['branch']}-ary tree of depth {tree['depth']},
breadth first, lower child ranks first (not ranked by acceptance: evaluate does not record which
child ranks the accepted paths used). As vLLM's `speculative_token_tree` (each node as the
child ranks along its path; a node's parent is its path less the last index):

```
{paths}
```

```bash
{tree['command']}
```

Only vLLM releases that have `speculative_token_tree` and its tree attention backend (a GPU
backend) serve this. vLLM 0.32, the version this project pins and tests, has neither: its
`SpeculativeConfig` forbids unknown keys, so the command above fails there, its attention
backends include no tree backend, and its CPU platform picks `CPU_ATTN` whatever is asked.
llama.cpp drafts chains only. There, serve the chain above.
"""


def require_finite_files(folder: Path) -> None:
    """Every safetensors file written under `folder` holds finite values only (`require_finite`)."""
    for path in sorted(folder.rglob("*.safetensors")):
        require_finite(load_safetensors(path), f"export {path.relative_to(folder)}")
