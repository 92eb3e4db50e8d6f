"""What a compiled evaluate builds before anything is timed: each drafter's graphs, at the target
engine's cache size, and which forward (the target's compiled graph or its eager module) serves
each verify width, from timing both here (`FastEngine.route_widths`)."""

from __future__ import annotations

import logging
from typing import Callable, Iterable

log = logging.getLogger(__name__)


def prepare_compiled(target, drafters: dict, drafted_k: Callable[[str, object], int], widths: Iterable[int],
                     tree: tuple[int, int] | None = None) -> None:
    """For a run whose target forward is compiled (`target.info["used"]`): compile every drafter
    that compiles (`drafter.compile(k, capacity)`, k from `drafted_k(name, drafter)`; with `tree`,
    (depth, branch) of the run's draft trees, its tree graph too where it has one), then route the
    verify `widths` to the faster forward. `target.info` (the report's settings.engine) records the
    drafters' compile seconds and graph sources, and the routing's timings under `widths`."""
    info = target.info
    if info["used"] != "compiled":
        return
    info["drafters_compile_s"], info["drafters_graph"] = {}, {}
    for name, drafter in drafters.items():
        if hasattr(drafter, "compile"):
            k = drafted_k(name, drafter)
            seconds = drafter.compile(k, target.engine.capacity)
            if tree and hasattr(drafter, "compile_tree"):
                seconds += drafter.compile_tree(*tree)
            how = getattr(drafter, "graph_source", None) or "compiled"
            info["drafters_compile_s"][name] = seconds
            info["drafters_graph"][name] = how
            log.info("%s: %s its drafting graphs for k=%d in %.0f s", name, how, k, seconds)
    info["widths"] = target.engine.route_widths(widths)
