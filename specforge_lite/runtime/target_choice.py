"""Which target forward a run decodes with: Hugging Face's, the static one (`fast_engine`)
eager, or its compiled graphs, chosen by name or by timing them here (`build_target_engine`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

import torch

from specforge_lite.runtime.compile import autotune, gemm_rows
from specforge_lite.runtime.fast_engine import FastEngine
from specforge_lite.runtime.hf_runner import TargetRunner
from specforge_lite.runtime.static_llama import unsupported_reason
from specforge_lite.runtime.width_timing import MARGIN_RULE, keep_or_replace, time_forwards, timing_line

log = logging.getLogger(__name__)


class TargetForward:
    """The target forward a run decodes with: `runner(layers)` gives each decoder its
    runner; `info` is what choosing it measured (the report's `settings.engine`)."""

    def __init__(self, model, engine: FastEngine | None, info: dict):
        self.model, self.engine, self.info = model, engine, info

    def runner(self, layers: Iterable[int] = ()):
        return self.engine.runner(layers) if self.engine is not None else TargetRunner(self.model, layers)


def build_target_engine(model, choice: str, capacity: int, hidden_layers: Iterable[int], max_width: int,
                        repeats: int = 5, cache_dir: Path | None | str = "default", tree_width: int = 0
                        ) -> TargetForward:
    """The target forward a run decodes with, and what choosing it measured.

    choice: hf (transformers' forward), static (`StaticLlama`, eager), compiled (its
    graphs for widths 1..max_width) or auto: every candidate this model and machine
    can run, timed on widths 1 and max_width after a 64-token context in interleaved rounds
    (`width_timing.time_forwards`; `repeats` rounds), the compiled one kept unless another is
    faster by more than the noise can make (`width_timing.keep_or_replace`). cache_dir: where compiled graphs are kept (`FastEngine`); tree_width:
    the tree methods' node budget + 1, the width of the compiled tree-verify graph (0: none).
    """
    info = {"requested": choice, "capacity": capacity, "compile_s": None, "measured_ms": {}, "fallback": None}
    reason = unsupported_reason(model.config)
    if reason:
        if choice in ("static", "compiled"):
            raise ValueError(f"eval.engine={choice}: the static forward does not support {reason}; "
                             "use eval.engine=hf or auto")
        info.update(used="hf", fallback=f"the static forward does not support {reason}")
        return TargetForward(model, None, info)
    if choice == "hf":
        info["used"] = "hf"
        return TargetForward(model, None, info)
    engines = {}
    if choice in ("static", "auto"):
        engines["static"] = FastEngine(model, capacity, hidden_layers, max_width)
    if choice in ("compiled", "auto"):
        engine = FastEngine(model, capacity, hidden_layers, max_width, compiled=True, cache_dir=cache_dir,
                            tree_width=tree_width)
        try:
            info["gemm_rows"] = gemm_rows() if engine.device.type == "cpu" else None
            info["autotune"] = autotune()
            info["compile_s"] = engine.compile()
            info["graph"] = engine.graph_source  # compiled this run, or loaded from the cache
            if tree_width:
                info["tree_width"], info["tree_graph"] = tree_width, engine.tree_graph_source
            # whether the graphs are kept between runs (not where: a report names no local paths)
            info["graph_cache"] = bool(engine.cache_dir) and engine.packaged
            engines["compiled"] = engine
        except Exception as error:  # no C++ compiler, an inductor limitation: say so, keep the others
            if choice == "compiled":
                raise RuntimeError(f"eval.engine=compiled: compiling the target failed: {error}") from error
            info["fallback"] = f"compiling failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
            log.warning("eval.engine=auto: %s; choosing among the others", info["fallback"])
    if choice != "auto":
        info["used"] = choice
        return TargetForward(model, engines[choice], info)
    vocab = model.config.vocab_size
    context_len = max(1, min(64, capacity - max_width))
    context = torch.randint(0, vocab, (context_len,), generator=torch.Generator().manual_seed(0)).tolist()
    candidates = {"hf": TargetRunner(model), **{name: e.runner() for name, e in engines.items()}}
    timing = time_forwards(candidates, context, [1, max_width], repeats)
    # compiled by default: the forward the decoders are built around, and a lead inside the noise is none
    default = "compiled" if "compiled" in engines else "static"
    used = keep_or_replace(timing, default)
    info.update(used=used, measured_ms=timing["ms"], noise=timing["noise"], rounds=timing["rounds"],
                default=default, margin_rule=MARGIN_RULE)
    log.info("eval.engine=auto: %s (default %s; ms per forward of widths %s: %s)", used, default,
             sorted({1, max_width}), timing_line(timing))
    return TargetForward(model, engines.get(used), info)
