"""Numbers of speculative decoding: tau, per-position acceptance, costs, best k.

Conventions (stated in every report):
- tau = tokens emitted by decoding forwards / decoding forwards of the target, the
  bonus token included and the prefill forward (with the first token it yields)
  excluded; plain decoding scores exactly 1.00. Summed over answers, then divided.
- per-position acceptance alpha_i = P(draft position i accepted | positions < i
  accepted), over the steps that allowed at least i drafts; a position the drafter
  left empty (an n-gram miss, a short match) counts as rejected, so that
  tau ~= 1 + sum_i prod_{j<=i} alpha_j (up to answers cut by EOS).
- tokens/s = tokens emitted / wall time of the whole call, prefill included.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from specforge_lite.decoding.engine import Generation, TargetRunner
from specforge_lite.decoding.cost import CostModel
from specforge_lite.runtime.width_timing import time_forwards


def per_position_acceptance(generations: Iterable[Generation], max_k: int) -> list[float | None]:
    """alpha_i for i = 1..max_k (None where no step reached position i)."""
    reached = [0] * max_k
    kept = [0] * max_k
    for gen in generations:
        for limit, accepted in zip(gen.draft_limits, gen.accepted_lengths):
            for i in range(min(limit, accepted + 1, max_k)):
                reached[i] += 1
                kept[i] += i < accepted
    return [k / r if r else None for k, r in zip(kept, reached)]


def calibration(generations: Iterable[Generation], max_k: int) -> list[dict] | None:
    """Per draft position i = 1..max_k, over the chain steps that reached it (drafts < i all
    accepted) and gave a confidence for it: the mean predicted confidence, the measured
    acceptance and the step count; None where no step gave a confidence."""
    predicted, kept, reached = [0.0] * max_k, [0] * max_k, [0] * max_k
    for gen in generations:
        for confidence, accepted in zip(gen.confidences, gen.accepted_lengths):
            for i, value in enumerate(confidence[:min(max_k, accepted + 1)]):
                predicted[i] += value
                kept[i] += i < accepted
                reached[i] += 1
    if not any(reached):
        return None
    return [{"position": i + 1, "predicted": p / n if n else None, "measured": k / n if n else None, "steps": n}
            for i, (p, k, n) in enumerate(zip(predicted, kept, reached))]


def expected_tokens_per_step(alphas: Sequence[float | None], k: int) -> float:
    """1 + sum_{i<=k} prod_{j<=i} alpha_j: tokens one step with k drafts yields."""
    total, survive = 1.0, 1.0
    for alpha in list(alphas)[:k]:
        survive *= alpha or 0.0
        total += survive
    return total


def summarise(generations: Sequence[Generation], max_k: int = 0) -> dict:
    """Aggregate numbers over answers: ratios of sums, not means of ratios."""
    tokens = sum(len(g.tokens) for g in generations)
    forwards = sum(g.num_forwards for g in generations)
    total_s = sum(g.total_s for g in generations)
    decode_s = sum(g.total_s - g.prefill_s for g in generations)
    steps = sum(len(g.draft_limits) for g in generations)
    proposed = sum(sum(g.draft_lengths) for g in generations)
    accepted = sum(sum(g.accepted_lengths) for g in generations)
    timed = any(g.target_s for g in generations)  # our loops time their parts; HF's generate does not
    out = {
        "num_answers": len(generations),
        "num_tokens": tokens,
        "num_target_forwards": forwards,
        "tau": (tokens - len(generations)) / forwards if forwards else None,
        "tokens_per_s": tokens / total_s if total_s else None,
        "wall_s": total_s,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_draft_length": proposed / steps if steps else None,
        "per_position_acceptance": per_position_acceptance(generations, max_k) if max_k else [],
        "confidence_calibration": calibration(generations, max_k) if max_k else None,
        "draft_time_share": None, "verify_time_share": None,
        "target_forward_ms": None, "draft_ms_per_step": None, "draft_ms_per_token": None,
        "overhead_ms_per_step": None,
    }
    if timed and forwards and decode_s > 0:
        target_s = sum(g.target_s for g in generations)
        draft_s = sum(g.draft_s for g in generations)
        overhead_s = sum(g.overhead_s for g in generations)
        out.update({
            "draft_time_share": draft_s / decode_s,
            "verify_time_share": target_s / decode_s,
            "target_forward_ms": 1e3 * target_s / forwards,
            "draft_ms_per_step": 1e3 * draft_s / forwards,
            "overhead_ms_per_step": 1e3 * overhead_s / forwards,
            "draft_ms_per_token": 1e3 * draft_s / proposed if proposed else None,
        })
    return out


@torch.inference_mode()
def measure_forward_costs(model, context_len: int, max_tokens: int, repeats: int = 3,
                          vocab_size: int | None = None, seed: int = 0, runner=None) -> dict[int, float]:
    """Median seconds of one target forward over t = 1..max_tokens new tokens after a
    `context_len`-token cache (random ids: the cost does not depend on the content), with
    the forward the run decoded with (`runner`; Hugging Face's by default).

    The widths are timed in interleaved rounds (`width_timing.time_forwards`: one forward of each
    width per round, 5 * `repeats` rounds after a warm-up round), so a drift of the machine's speed
    while measuring moves every width alike instead of whichever width was timed then (timing each
    width's repeats back to back once put the width-1 forward 27% above what plain decoding measured
    in the same run, and with it every expected speedup). A target whose cache cannot be rolled
    back is timed at t = 1 only (`cost_curve_note`)."""
    vocab = vocab_size or model.get_output_embeddings().weight.shape[0]
    context = torch.randint(0, vocab, (context_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    runner = runner or TargetRunner(model)
    # each timed forward of such a cache pays an untimed prefill anew, and no method here verifies wider
    top = max_tokens if getattr(runner, "rolls_back", True) else 1
    timing = time_forwards({"target": runner}, context, range(1, top + 1), 5 * repeats)
    return {t: ms / 1e3 for t, ms in timing["ms"]["target"].items()}


def cost_curve_note(config) -> str | None:
    """What the report says where the cost curve stops at t = 1: the target's cache cannot be
    rolled back (`hf_runner.rollback_problem`), so no method drafts on it and each timed forward
    follows the context's prefill anew instead of a crop. None for every other target."""
    from specforge_lite.runtime.hf_runner import rollback_problem

    problem = rollback_problem(config)
    if not problem:
        return None
    return f"timed at t=1 only: {problem}; each timed forward follows a prefill of the context anew"


def costs_as_decoding_paid(forward_costs: dict[int, float], plain_forward_ms: float | None) -> tuple[dict, float]:
    """The isolated cost table scaled so that its 1-token forward is what plain decoding paid a
    forward in the same run (`plain_forward_ms`, its decoding forwards' measured mean), and the
    scale: inside the loop a forward also pays what the table's tight repeats do not (caches and
    memory traffic of a longer context, the machine's state while other work ran). None: as timed."""
    if not plain_forward_ms or forward_costs.get(1, 0) <= 0:
        return dict(forward_costs), 1.0
    paid = CostModel(forward_costs)  # the hybrids' cost model, plain's forwards its one width timed
    paid.observe(1, 1e-3 * plain_forward_ms)
    return {t: paid.seconds(t) for t in forward_costs}, paid.curve_scale()


def _tokens_per_s(tokens_per_step: float, step_s: float, prefill_s: float, answer_tokens) -> float:
    """Expected tokens/s: per mean answer (prefill included) when its length is known, else per step."""
    if answer_tokens is None:
        return tokens_per_step / step_s
    return answer_tokens / (prefill_s + (answer_tokens - 1) / tokens_per_step * step_s)


def best_k(alphas: Sequence[float | None], forward_costs: dict[int, float],
           draft_cost: Callable[[int], float], overhead_s: float = 0.0, prefill_s: float = 0.0,
           answer_tokens: float | None = None, plain_overhead_s: float | None = None) -> dict:
    """The k in 1..len(alphas) maximising expected tokens/s.

    step_s(k) = draft_cost(k) + forward_costs[k + 1] + overhead_s, and per step
    expected_tokens_per_step(alphas, k) tokens; plain decoding costs forward_costs[1] +
    overhead_s per token. With `answer_tokens` (N, the mean answer length) and `prefill_s`
    (the mean prefill of an answer) the rates are per answer, as the measured tokens/s
    are: N / (prefill_s + (N - 1) / tokens_per_step * step_s); else per decoding step.
    A position no step reached (alpha None) counts as never accepted. plain_overhead_s: plain
    decoding's own measured overhead per token where known (else the method's `overhead_s`).
    """
    def rate(tokens_per_step: float, step_s: float) -> float:
        return _tokens_per_s(tokens_per_step, step_s, prefill_s, answer_tokens)

    plain_rate = rate(1.0, forward_costs[1] + (overhead_s if plain_overhead_s is None else plain_overhead_s))
    rows = []
    for k in range(1, len(alphas) + 1):
        if k + 1 not in forward_costs:
            break
        step_s = draft_cost(k) + forward_costs[k + 1] + overhead_s
        tokens = expected_tokens_per_step(alphas, k)
        rows.append({"k": k, "expected_tokens_per_step": tokens, "step_ms": 1e3 * step_s,
                     "expected_tokens_per_s": rate(tokens, step_s),
                     "expected_speedup": rate(tokens, step_s) / plain_rate})
    if not rows:
        return {"best_k": None, "table": [], "plain_tokens_per_s": plain_rate}
    best = max(rows, key=lambda r: r["expected_tokens_per_s"])
    return {"best_k": best["k"], "expected_speedup": best["expected_speedup"],
            "expected_tokens_per_s": best["expected_tokens_per_s"], "plain_tokens_per_s": plain_rate,
            "table": rows}


def full_tree_nodes(depth: int, branch: int) -> int:
    """Nodes of the full tree with `branch` children a node, `depth` levels deep: the most a
    tree of that depth and branch can hold."""
    return sum(branch ** level for level in range(1, depth + 1))


def tree_steps(generations: Iterable[Generation]) -> dict:
    """What a tree method's steps recorded, summed over answers: per step the nodes verified
    (`draft_lengths`), the depth allowed (`draft_limits`) and the accepted path's length
    (`accepted_lengths`). Returns {"steps", "nodes" (the per-step node counts, in order),
    "nodes_per_step", "path_per_step", "depth_per_step"} (None where no step ran)."""
    nodes, depths, paths = [], [], []
    for gen in generations:
        nodes += gen.draft_lengths
        depths += gen.draft_limits
        paths += gen.accepted_lengths
    mean = (lambda values: sum(values) / len(values)) if nodes else (lambda values: None)
    return {"steps": len(nodes), "nodes": nodes, "nodes_per_step": mean(nodes), "path_per_step": mean(paths),
            "depth_per_step": mean(depths)}


def best_tree(alphas: Sequence[float | None], step_nodes: Sequence[int], depth: int, branch: int, nodes: int,
              forward_costs: dict[int, float], draft_cost: Callable[[int], float], overhead_s: float = 0.0,
              prefill_s: float = 0.0, answer_tokens: float | None = None, plain_overhead_s: float | None = None,
              verify_scale: float = 1.0) -> dict:
    """The tree shape, among those the measured steps can speak for, maximising expected tokens/s
    (an estimate, as `best_k`'s).

    A tree method ran with (depth, branch, nodes) and recorded per step the nodes it verified
    (`step_nodes`) and its accepted path; `alphas` are the path's per-depth acceptance
    (`per_position_acceptance` over those steps, d = 1..depth). The candidates are the same
    branch and node budget cut at depth d = 1..depth: (d, branch, min(nodes, full tree of d)).
    Their acceptance follows from the measured steps: a drafter that grows its tree level by
    level (EAGLE-2's dynamic tree, n-gram continuations) has the same candidates in its first d
    levels whatever the depth, so the depth-d tree holds the measured tree cut at depth d and
    its accepted path is at least min(path, d): expected_tokens_per_step(alphas, d), a lower
    bound. A step of depth d verifies min(that step's measured nodes, full tree of d) nodes
    (the same budget: never more than the measured step did), priced at `forward_costs`
    [nodes + 1] times `verify_scale` (what a tree verify paid over a chain forward of the same
    width in the run); `draft_cost(d)`: drafting a depth-d tree. Smaller node budgets or
    branches at the same depth are not candidates: which nodes the accepted path used, by
    rank, is not recorded, so their acceptance cannot be derived. Rates per answer or per
    step, and plain decoding's rate, as `best_k`.

    Returns {"best": the best row or None, "plain_tokens_per_s", "table": one row per depth
    with "depth", "branch", "nodes", "mean_nodes", "expected_tokens_per_step", "step_ms",
    "expected_tokens_per_s", "expected_speedup", "measured" (the run's own depth)}.
    """
    def rate(tokens_per_step: float, step_s: float) -> float:
        return _tokens_per_s(tokens_per_step, step_s, prefill_s, answer_tokens)

    plain_rate = rate(1.0, forward_costs[1] + (overhead_s if plain_overhead_s is None else plain_overhead_s))
    rows = []
    for d in range(1, min(depth, len(alphas)) + 1):
        cap = full_tree_nodes(d, branch)
        widths = [min(n, cap) for n in step_nodes] or [min(nodes, cap)]
        if any(w + 1 not in forward_costs for w in widths):
            break  # a width whose cost was not measured
        verify_s = verify_scale * sum(forward_costs[w + 1] for w in widths) / len(widths)
        step_s = draft_cost(d) + verify_s + overhead_s
        tokens = expected_tokens_per_step(alphas, d)
        rows.append({"depth": d, "branch": branch, "nodes": min(nodes, cap), "mean_nodes": sum(widths) / len(widths),
                     "expected_tokens_per_step": tokens, "step_ms": 1e3 * step_s,
                     "expected_tokens_per_s": rate(tokens, step_s),
                     "expected_speedup": rate(tokens, step_s) / plain_rate, "measured": d == depth})
    best = max(rows, key=lambda r: r["expected_tokens_per_s"]) if rows else None
    return {"best": best, "plain_tokens_per_s": plain_rate, "table": rows}


def our_conventions(boot) -> dict:
    """How our engine's report counts, stated in every report (`boot`: eval.bootstrap)."""
    return {
        "tau": "tokens emitted by decoding forwards / decoding target forwards, bonus token included; "
               "the prefill forward and its first token are excluded, so plain decoding = 1.00",
        "per_position_acceptance": "P(draft position i accepted | positions < i accepted) over steps that "
                                   "allowed >= i drafts; a position the drafter left empty counts as rejected",
        "confidence_calibration": "per draft position, over chain steps that reached it and where the drafter "
                                  "gave a confidence (DSpark's confidence head, else its softmax probability): "
                                  "the mean confidence against the measured acceptance",
        "tokens_per_s": "tokens emitted / wall time of the whole call (prefill included), batch 1, after warm-up",
        "speedup": "tokens/s over our plain loop's tokens/s, same prompts, same run (methods interleaved)",
        "intervals": f"{boot.level:.0%} percentile bootstrap over prompts ({boot.resamples} resamples, seed "
                     f"{boot.seed}): prompts drawn with replacement, all turns of a prompt together, the same "
                     "prompts for every method (paired); tau and speedup recomputed on each resample as above",
    }
