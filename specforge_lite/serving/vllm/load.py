"""Speedup at the load users serve: vLLM's methods with N requests in flight.

`eval.concurrency` (default `[1]`: nothing of this runs) lists the loads. For each, vLLM's
offline engine decodes the stage's requests with N of them in flight, a new one admitted as
each finishes (`vllm_runner.py`'s `load` op), in one engine per method and draft length whose
`max_num_seqs` is the largest N. The offline engine rather than the OpenAI server: the same
scheduler and batches a server runs, without an HTTP client competing for this machine's
cores, so that the figures are the engine's own. A method's batch-1 engine (`methods.run_methods`,
k = eval.num_draft_tokens) measures its load too where that k is among the loads' (`batch1_k`,
`in_batch1_engines`): one engine load less per method (the target's weights read, and on a GPU its
graphs captured, once less).

Each speculative method (`vllm_<drafter>`, `vllm_ngram`, ...) runs at k = 1..K
(`eval.load_draft_tokens`, else `eval.num_draft_tokens`), `vllm_plain` is k = 0. At each N
the best k is the one of highest engine throughput where speculation pays (its per-request
speedup interval above 1), else 0; merged over the measured N these give the schedule vLLM
0.32 takes as `num_speculative_tokens_per_batch_size` (`schedule`), which is then run once as a
method of its own (`<method>_schedule`: vLLM must accept it, and it is measured like the rest).
The analysis and what the report says of it live in `load_report.py`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.drafters.methods import VLLM_METHODS

log = logging.getLogger(__name__)

PLAIN = "vllm_plain"
SCHEDULE_SUFFIX = "_schedule"


def wanted(ecfg) -> bool:
    """Whether this evaluate measures at load: a concurrency other than batch 1 alone, or a schedule to try."""
    return list(ecfg.concurrency) != [1] or bool(ecfg.load_schedule)


def speculative_methods(methods: list[str]) -> list[str]:
    """The vLLM methods of `methods` swept over k (every vllm_* method but plain)."""
    return [m for m in dict.fromkeys(methods) if m in VLLM_METHODS and m != PLAIN]


def draft_lengths(ecfg) -> list[int]:
    return list(range(1, int(ecfg.load_draft_tokens or ecfg.num_draft_tokens) + 1))


def schedule_problem(schedule, most_k: int | None = None) -> str | None:
    """Why vLLM 0.32 would refuse `schedule` as `num_speculative_tokens_per_batch_size` (ranges
    (first, last, k) of batch sizes, inclusive, positive, without overlap once sorted, the first from
    1, k >= 0), or None. `most_k`: the engine's num_speculative_tokens, which no k may exceed here
    (vLLM would silently cut it)."""
    try:
        entries = [tuple(int(v) for v in entry) for entry in schedule]
    except (TypeError, ValueError):
        return "each entry must be [first batch size, last batch size, k], whole numbers"
    if not entries:
        return "it is empty"
    if any(len(entry) != 3 for entry in entries):
        return "each entry must be [first batch size, last batch size, k]"
    entries.sort(key=lambda entry: entry[0])  # vLLM sorts them first too
    previous_end = 0
    for first, last, k in entries:
        if first <= 0 or last < first:
            return f"[{first}, {last}, {k}] is no range of batch sizes (1 <= first <= last)"
        if first <= previous_end:
            return f"[{first}, {last}, {k}] overlaps the range before it"
        if k < 0 or (most_k is not None and k > most_k):
            return f"[{first}, {last}, {k}]: k must be " + (f"0..{most_k}" if most_k is not None else ">= 0")
        previous_end = last
    if entries[0][0] != 1:
        return "the first range must start at batch size 1 (vLLM needs a k for every batch size)"
    return None


def concurrency_problems(ecfg) -> list[str]:
    """The door's rules for eval.concurrency, eval.expected_concurrency and eval.load_schedule
    (one line each; the ranges of single values are the schema's)."""
    levels = [int(n) for n in ecfg.concurrency]
    problems = []
    if not levels or min(levels) < 1:
        problems.append(f"eval.concurrency={levels}: every entry must be a number of requests >= 1")
    elif 1 not in levels:
        problems.append(f"eval.concurrency={levels} has no 1: the schedule vLLM takes starts at batch size 1, and "
                        "batch 1 is the reference every report has; add 1")
    elif len(set(levels)) != len(levels):
        problems.append(f"eval.concurrency={levels} repeats an entry")
    if not wanted(ecfg):
        return problems
    if not speculative_methods(ecfg.methods):
        problems.append(f"eval.concurrency={levels}: the load is measured through vLLM, and eval.methods has no "
                        "speculative vllm_* method (add vllm_<drafter> or vllm_ngram)")
    if ecfg.load_schedule:
        if problem := schedule_problem(ecfg.load_schedule, max(draft_lengths(ecfg))):
            problems.append(f"eval.load_schedule={list(map(list, ecfg.load_schedule))}: vLLM would refuse it: {problem}")
    return problems


def levels_of(ecfg) -> list[int]:
    return sorted({int(n) for n in ecfg.concurrency})


def batch1_k(name: str, ecfg) -> int | None:
    """The k at which `name`'s batch-1 engine (k = eval.num_draft_tokens, vllm_plain's 0) is also
    one of its engines at load, so that one engine serves both; None where no load engine is the same."""
    if not wanted(ecfg) or name not in VLLM_METHODS:
        return None
    if name == PLAIN:
        return 0
    k = int(ecfg.num_draft_tokens)
    return k if k in draft_lengths(ecfg) else None


def measure(cfg, methods: list[str], requests: list[list[int]], target, out: Path, seed_of,
            done: dict | None = None) -> dict:
    """Every load of eval.concurrency, for vllm_plain and each speculative method at each k; `done`:
    {method: {k: replies}} already measured in the batch-1 engines (`batch1_k`), not run again.

    Returns {"runs": {method: {k: {N: the runner's reply} | {"error": message}}}, "levels",
    "draft_lengths"}; the schedules (`load_report.schedules`) run afterwards in `measure_schedules`.
    """
    from specforge_lite.serving.vllm.methods import speculative_config

    ecfg, done = cfg.eval, done or {}
    levels = levels_of(ecfg)

    def at(name: str, k: int, spec: dict | None) -> dict:
        if k in done.get(name, {}):
            return done[name][k]
        return run_levels(cfg, spec, levels, requests, target, out, seed_of, label_of(name, k))

    runs = {PLAIN: {0: at(PLAIN, 0, None)}}
    for name in speculative_methods(methods):
        base = speculative_config(name, cfg, target.model, target.tokenizer, out)
        runs[name] = {k: at(name, k, {**base, "num_speculative_tokens": k}) for k in draft_lengths(ecfg)}
    return {"runs": runs, "levels": levels, "draft_lengths": draft_lengths(ecfg)}


def in_batch1_engines(cfg, methods: list[str], requests, target, seed_of, done: dict) -> dict:
    """`methods.run_methods`' `after` for the methods `batch1_k` names: {name: f(engine)}, f measuring
    the loads in the method's batch-1 engine into done[name][k] (a failure as {"error": message},
    the batch-1 answers standing)."""
    levels = levels_of(cfg.eval)

    def measure_in(name: str, k: int):
        def measure(engine) -> None:
            try:
                replies = levels_in(engine, cfg, levels, requests, target, seed_of, label_of(name, k))
            except SpecforgeError as err:
                replies = failure(label_of(name, k), err)
            done[name] = {k: replies}
        return measure

    return {name: measure_in(name, k) for name in methods if (k := batch1_k(name, cfg.eval)) is not None}


def measure_schedules(cfg, schedules: dict[str, list], requests, target, out: Path, seed_of, levels) -> dict:
    """Each method's schedule run as vLLM serves it (`<method>_schedule`): {name: {"schedule", "runs": {N: reply}}
    | {"schedule", "error"}}. A schedule without any k > 0 is not run (it serves without speculation)."""
    from specforge_lite.serving.vllm.methods import speculative_config

    done = {}
    for name, schedule in schedules.items():
        most = max(k for _, _, k in schedule)
        if most == 0:
            continue
        spec = {**speculative_config(name, cfg, target.model, target.tokenizer, out), "num_speculative_tokens": most,
                "num_speculative_tokens_per_batch_size": [list(entry) for entry in schedule]}
        done[name + SCHEDULE_SUFFIX] = {"schedule": schedule, "speculative_config": spec,
                                        **run_levels(cfg, spec, levels, requests, target, out, seed_of,
                                                     name + SCHEDULE_SUFFIX, nested=True)}
    return done


def sustained(num_prompts: int, level: int, depth: int = 4) -> list[int]:
    """The prompts sent at load `level`, by index: each in turn until at least `depth` x level requests."""
    return [i % num_prompts for i in range(max(num_prompts, depth * level))]


def seeded_at_load() -> bool:
    """Whether sampled requests at load carry their own seeds: on a GPU. vLLM's CPU sampler cannot
    seed requests batched together ("CPU Generator does not use offset"), so there they draw unseeded."""
    from specforge_lite.serving.vllm.interpreter import on_gpu

    return on_gpu()


def run_levels(cfg, spec: dict | None, levels: list[int], requests, target, out: Path, seed_of, label: str,
               nested: bool = False) -> dict:
    """One engine (`max_num_seqs` = the largest load), warmed up, then the requests at each load:
    {N: reply} (or {"runs": {N: reply}} with `nested`), or {"error": message} where vLLM refused or failed."""
    from specforge_lite.serving.vllm.engine import VllmEngine
    from specforge_lite.serving.vllm.interpreter import engine_kwargs

    kwargs = engine_kwargs(target.path, target.dtype, cfg.eval.vllm, cfg.seed, spec)
    kwargs["max_num_seqs"] = max(levels)
    try:
        with VllmEngine(kwargs, cfg.eval.vllm, out / "vllm.log") as engine:
            replies = levels_in(engine, cfg, levels, requests, target, seed_of, label)
    except SpecforgeError as err:
        return failure(label, err)
    return {"runs": replies} if nested else replies


def label_of(name: str, k: int) -> str:
    """A method at k, as the log names it (vllm_plain alone)."""
    return name if name == PLAIN else f"{name} k={k}"


def failure(label: str, err: SpecforgeError) -> dict:
    """vLLM refused or failed at load: logged, and the reply that says so."""
    log.error("%s at load failed: %s", label, err)
    return {"error": str(err).split("\n--- last lines")[0]}


def levels_in(engine, cfg, levels: list[int], requests, target, seed_of, label: str) -> dict:
    """In a started engine (`max_num_seqs` >= the largest load): warmed up at the widest batch,
    then the requests at each load; {N: reply}."""
    from specforge_lite.serving.vllm.engine import sampling_params

    ecfg = cfg.eval
    seeded = seeded_at_load()
    seeds = [seed_of(i, "load") for i in range(len(requests))] if seeded else None
    params = sampling_params(ecfg.max_new_tokens, ecfg.temperature, ecfg.top_p, target.eos_ids, seeds)
    warm = sampling_params(min(ecfg.warmup_tokens, ecfg.max_new_tokens), ecfg.temperature, ecfg.top_p,
                           target.eos_ids, [seed_of("warmup")] * max(levels) if seeded else None)
    replies = {}
    for _ in range(ecfg.warmup):  # the widest batch once, so that no load pays a first-use cost
        engine.load([requests[i % len(requests)] for i in range(max(levels))], warm, max(levels))
    for level in levels:
        sent = sustained(len(requests), level)  # N in flight for most of the run, not a draining batch
        each = {**params, "seeds": [params["seeds"][i] for i in sent]} if "seeds" in params else params
        replies[level] = reply = engine.load([requests[i] for i in sent], each, level)
        log.info("%s at %d in flight: %d tokens in %.1f s", label, level,
                 sum(len(o["token_ids"]) for o in reply["outputs"]), reply["seconds"])
    return replies
