"""Which target forward a run decodes with: Hugging Face's, the static one (`fast_engine`)
eager, or its compiled graphs, chosen by name or by timing them here (`build_target_engine`)."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Iterable

import torch

from specforge_lite.runtime.compile import autotune, gemm_rows
from specforge_lite.runtime.fast_engine import FastEngine
from specforge_lite.runtime.hf_runner import TargetRunner
from specforge_lite.runtime.static_llama import unsupported_reason

log = logging.getLogger(__name__)


def _median_forward_s(runner, context: list[int], width: int, repeats: int) -> float:
    runner.reset()
    runner.forward(context, last_only=True)
    ids = context[:width]
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        runner.forward(ids)
        runner._sync()
        times.append(time.perf_counter() - start)
        runner.crop(len(context))
    return statistics.median(times[1:])


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
    can run, timed on widths 1 and max_width after a 64-token context, the one with the
    least total kept. cache_dir: where compiled graphs are kept (`FastEngine`); tree_width:
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
    for name, runner in candidates.items():
        info["measured_ms"][name] = {w: 1e3 * _median_forward_s(runner, context, w, repeats)
                                     for w in sorted({1, max_width})}
    used = min(info["measured_ms"], key=lambda n: sum(info["measured_ms"][n].values()))
    info["used"] = used
    log.info("eval.engine=auto: %s (ms per forward of width %s: %s)", used, sorted({1, max_width}),
             "; ".join(f"{n} " + "/".join(f"{v:.1f}" for v in ms.values()) for n, ms in info["measured_ms"].items()))
    return TargetForward(model, engines.get(used), info)
