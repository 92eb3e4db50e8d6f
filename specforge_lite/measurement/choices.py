"""The report's choices for one measured method: its best k (`best_k_for`) and, for a tree
method, its tree fields and best tree shape (`tree_fields`), from the method's own measured
acceptance and costs (`metrics.best_k`, `metrics.best_tree`)."""

from __future__ import annotations

import logging

from specforge_lite.config.draft_tokens import draft_tokens
from specforge_lite.measurement.metrics import best_k, best_tree, per_position_acceptance, tree_steps

log = logging.getLogger(__name__)
_said: set[tuple] = set()


def drafted_k(eval_cfg, method: str, drafter=None) -> int:
    """The k `method` drafts: its asked k (`draft_tokens`), or the drafter's own limit where that
    is lower (`max_drafts`: DFlash's block less its anchor, P-EAGLE's trained depths), which the
    report then records as the k; the first time, a line names both."""
    asked = draft_tokens(eval_cfg, method)
    limit = getattr(drafter, "max_drafts", None)
    if limit is None or asked <= limit:
        return asked
    if (method, asked, limit) not in _said:
        _said.add((method, asked, limit))
        log.warning("%s: k=%d asked, but it drafts at most %d tokens a step (%s): measured and reported at "
                    "k=%d", method, asked, limit, getattr(drafter, "limit_reason", "its own limit"), limit)
    return limit


def best_k_for(entry: dict, drafter, costs: dict[int, float], answer_shape: tuple[float, float],
                plain: dict) -> dict:
    """Best k from this method's measured acceptance and its measured costs; rates per mean
    answer (prefill_s, tokens) so that expected speedups compare with the measured ones;
    plain decoding's own overhead per token for its rate."""
    draft_ms_step, draft_ms_token = entry["draft_ms_per_step"] or 0.0, entry.get("draft_ms_per_token") or 0.0
    if getattr(drafter, "sequential", False):
        draft_cost = lambda k: 1e-3 * draft_ms_token * k  # noqa: E731  one drafter forward per token
    else:
        draft_cost = lambda k: 1e-3 * draft_ms_step  # noqa: E731  one call whatever k
    prefill_s, answer_tokens = answer_shape
    plain_overhead = plain["overhead_ms_per_step"]
    # never a k the drafter cannot propose (DFlash: its block less the anchor; P-EAGLE: the depths
    # it was trained for): its decoder's own limit, where it has one
    limit = getattr(drafter, "max_drafts", None)
    alphas = entry["per_position_acceptance"][:limit] if limit is not None else entry["per_position_acceptance"]
    return best_k(alphas, costs, draft_cost, 1e-3 * (entry["overhead_ms_per_step"] or 0),
                  prefill_s, answer_tokens, None if plain_overhead is None else 1e-3 * plain_overhead)


def tree_fields(shape, chain: str, mixed: bool, gens: list, entry: dict, drafter, costs: dict[int, float],
                 answer_shape: tuple[float, float], plain: dict) -> dict:
    """A tree method's own report fields: its shape, the chain method it grows from, nodes
    verified and path accepted per step, the path's per-depth acceptance, and the best tree
    shape estimated from them (`metrics.best_tree`). A tree verify is priced at what this
    method's verify forwards paid over the chain forwards of the same widths (the tree mask's
    cost included); drafting a depth-d tree at d / (mean depth allowed) of the measured drafting
    for a sequential drafter (one drafter forward per level, as best k's per token), else as
    measured; depths beyond the drafter's own limit (`max_drafts`) are not candidates."""
    steps = tree_steps(gens)
    alphas = per_position_acceptance(gens, shape.depth)
    widths = [n + 1 for n in steps["nodes"]]
    chained = sum(costs[w] for w in widths if w in costs)
    target_s = sum(g.target_s for g in gens)
    verify_scale = target_s / chained if chained and target_s and all(w in costs for w in widths) else 1.0
    draft_s_step = 1e-3 * (entry["draft_ms_per_step"] or 0.0)
    mean_depth = steps["depth_per_step"] or shape.depth
    if getattr(drafter, "sequential", False):
        draft_cost = lambda d: draft_s_step * d / mean_depth  # noqa: E731  one drafter forward per level
    else:
        draft_cost = lambda d: draft_s_step  # noqa: E731
    prefill_s, answer_tokens = answer_shape
    plain_overhead = plain["overhead_ms_per_step"]
    limit = getattr(drafter, "max_drafts", None)  # no depth the drafter cannot reach (as best k)
    reachable = alphas[:limit] if limit is not None else alphas
    estimate = best_tree(reachable, steps["nodes"], shape.depth, shape.branch, shape.nodes, costs, draft_cost,
                         1e-3 * (entry["overhead_ms_per_step"] or 0), prefill_s, answer_tokens,
                         None if plain_overhead is None else 1e-3 * plain_overhead, verify_scale)
    return {"chain": chain, "mixed": mixed,
            "shape": {"depth": shape.depth, "branch": shape.branch, "nodes": shape.nodes},
            "steps": steps["steps"], "nodes_per_step": steps["nodes_per_step"],
            "path_per_step": steps["path_per_step"], "depth_per_step": steps["depth_per_step"],
            "per_depth_acceptance": alphas, "verify_scale": verify_scale, "best_tree": estimate}
