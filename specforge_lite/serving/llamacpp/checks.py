"""What llama.cpp can run, checked at the door (`validate`), before any stage writes anything.

- `export.gguf=true` needs a drafter llama.cpp runs: EAGLE-3 (`draft-eagle3`) on the target
  layers its converter fixes, [2, N/2, N-3], without the EAGLE-3.1 norms, DFlash
  (`draft-dflash`: any aux layers, block size and draft vocabulary, causal or not; its graph
  reads all of them) or a distilled draft model (`draft-simple`). Medusa heads and P-EAGLE have
  no llama.cpp drafter.
- the `llamacpp_*` evaluate methods need xllamacpp (`make llamacpp`), and `llamacpp_eagle3` /
  `llamacpp_distilled` the draft GGUF an earlier export wrote (`run_dir/export/gguf`); `run`
  evaluates before it exports, so it cannot provide one. Checked for evaluate and run only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from specforge_lite.stage_table import runs
from specforge_lite.drafters.methods import gguf_drafters
from specforge_lite.drafters.registry import DRAFTERS
from specforge_lite.serving.llamacpp.runner import INSTALL_HINT, METHODS, SPEC_TYPE_FLAGS

# views of the drafters' contract (`LLAMACPP_SERVING`), the one place that says what llama.cpp runs:
# drafter kind -> (llama.cpp speculative type flag, file name under export/gguf)
GGUF_DRAFTERS = {name: (SPEC_TYPE_FLAGS[spec_type], file) for name, (spec_type, file) in gguf_drafters().items()}
# evaluate method -> the trained drafter whose GGUF it serves
DRAFT_OF = {f"llamacpp_{name}": name for name in GGUF_DRAFTERS}
# drafter kind -> why llama.cpp cannot run it
NO_GGUF = {name: module.LLAMACPP_SERVING for name, module in DRAFTERS.items()
           if isinstance(module.LLAMACPP_SERVING, str)}
EAGLE3_GRAPH = "draft-eagle3"  # llama.cpp's EAGLE-3 graph: fixed tap layers, no EAGLE-3.1 norms
DFLASH_GRAPH = "draft-dflash"  # llama.cpp's DFlash graph: taps the layers the GGUF names
EAGLE31_NORMS = ("norm_before_fc", "fc_norm", "norm_output")


def extract_layers(num_target_layers: int) -> list[int]:
    """The target layers llama.cpp's converter writes for every EAGLE-3 draft: [2, N/2, N-3]."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def gguf_refusal(kind: str, options: Any, num_target_layers: int | None = None) -> str | None:
    """Why llama.cpp cannot run drafter `kind` with these options (None: it can). `options`
    reads like the drafter config (`.get`); the aux layers are checked once the depth is known."""
    if kind in NO_GGUF:
        return NO_GGUF[kind]
    if kind not in GGUF_DRAFTERS:
        return f"no GGUF layout for a {kind} drafter; llama.cpp runs {', '.join(GGUF_DRAFTERS)}"
    if GGUF_DRAFTERS[kind][0] == EAGLE3_GRAPH:
        norms = [name for name in EAGLE31_NORMS if options.get(name)]
        if norms:
            return (f"drafter.{norms[0]}=true: the EAGLE-3.1 norms ({', '.join(norms)}) are not in llama.cpp's "
                    "eagle3 graph; train with them off for a llama.cpp export")
        aux = options.get("aux_layer_ids")
        if aux is not None and num_target_layers is not None and list(aux) != extract_layers(num_target_layers):
            return (f"drafter.aux_layer_ids={list(aux)}: llama.cpp taps layers {extract_layers(num_target_layers)} "
                    f"of this {num_target_layers}-layer target ([2, N/2, N-3]); set drafter.aux_layer_ids=null")
    return None


def gguf_export_problems(cfg, target_config: Any = None) -> list[str]:
    """`export.gguf=true` with a drafter llama.cpp cannot run, or without the `gguf` package."""
    if not cfg.export.get("gguf"):
        return []
    problems = []
    layers = getattr(target_config, "num_hidden_layers", None)
    if why := gguf_refusal(str(cfg.drafter.name), cfg.drafter, layers):
        problems.append(f"export.gguf=true: {why}")
    if importlib.util.find_spec("gguf") is None:
        problems.append("export.gguf=true needs the gguf package (pip install 'gguf>=0.10,<1')")
    return problems


def draft_gguf(run_dir: str | Path, method: str) -> Path:
    """Where `method`'s draft GGUF is read: run_dir/export/gguf/<file>."""
    return Path(run_dir) / "export" / "gguf" / GGUF_DRAFTERS[DRAFT_OF[method]][1]


def method_problems(cfg) -> list[str]:
    """The llama.cpp methods this evaluate cannot run: no xllamacpp, or no draft GGUF to read."""
    if not runs(cfg.stage, "evaluate"):
        return []
    problems = []
    wanted = [m for m in cfg.eval.methods if m in METHODS]
    if wanted and importlib.util.find_spec("xllamacpp") is None:
        problems.append(f"eval.methods {wanted}: llama.cpp (xllamacpp) is not installed; {INSTALL_HINT}")
    for method in (m for m in wanted if m in DRAFT_OF):
        path = draft_gguf(cfg.run_dir, method)
        if cfg.stage == "run":
            problems.append(f"eval.methods: {method} reads {path}, which `run` writes only after evaluating; run "
                            "the stages sample, train, export (export.gguf=true), then evaluate")
        elif not path.is_file():
            problems.append(f"eval.methods: {method} needs {path}: export a {DRAFT_OF[method]} drafter with "
                            "export.gguf=true first")
    return problems
