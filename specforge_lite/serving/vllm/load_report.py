"""What the report says of the load runs (`load.py`): per load and method, engine throughput,
per-request speed and time per output token, speedup over vllm_plain at the same load with a
paired bootstrap interval over requests; the best k per load, the schedule, the load above which
speculation stops paying, and what to deploy at `eval.expected_concurrency`. Also the Markdown,
the plot and the export README's section."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from specforge_lite.measurement.stats import PromptTotals, percentile_interval, resample_indices, speed_ratio
from specforge_lite.serving.vllm.load import PLAIN, SCHEDULE_SUFFIX

CONVENTIONS = {
    "how": "vLLM's offline engine, max_num_seqs = the largest load, stepped by our runner with N requests in flight "
           "(a new one admitted as each finishes); at load N the prompts are sent in turn until at least 4 x N "
           "requests have been, so that N stay in flight for most of the run; one engine per method and k, warmed "
           "up once at the widest batch (at k = eval.num_draft_tokens, the engine that measured batch 1)",
    "throughput_tokens_per_s": "output tokens of every request / wall time of the whole run at that load",
    "per_request_tokens_per_s": "output tokens / seconds from admission to finish, summed over requests: what one "
                                "user's stream sees (prefill and queueing included)",
    "tpot_ms": "median over requests of (finish - first token) / (tokens - 1)",
    "seeds": "at temperature > 0, each request carries its own seed on a GPU; on a CPU none (vLLM's CPU sampler "
             "cannot seed requests batched together), so sampled answers at load are not reproducible there",
    "speedup": "per-request tokens/s over vllm_plain's at the same load, with speedup_ci its paired bootstrap over "
               "requests; throughput_ratio: the whole run's throughput over vllm_plain's (point)",
    "best_k": "the k of highest throughput among those whose speedup_ci lies above 1 and whose throughput_ratio is "
              "above 1; 0 (no speculation) where none",
    "schedule": "vLLM 0.32's num_speculative_tokens_per_batch_size: each measured load's best k from that load to the "
                "next one less 1 (the last range to the last load; vLLM carries it on), equal neighbours merged",
}


def totals(reply: dict) -> PromptTotals:
    """Per request: tokens and seconds in flight (one request = one resampling unit)."""
    outputs = reply["outputs"]
    tokens = np.array([len(o["token_ids"]) for o in outputs], dtype=np.float64)
    seconds = np.array([max(o["end"] - o["start"], 1e-9) for o in outputs], dtype=np.float64)
    return PromptTotals(tokens, np.ones_like(tokens), np.zeros_like(tokens), seconds)


def entry(reply: dict, plain: dict | None, boot, k: int, greedy: bool) -> dict:
    """One method at one load and k; greedy answers compared with vllm_plain's at that load."""
    outputs = reply["outputs"]
    tokens = sum(len(o["token_ids"]) for o in outputs)
    tpots = [(o["end"] - o["first"]) / (len(o["token_ids"]) - 1) for o in outputs
             if o.get("first") is not None and len(o["token_ids"]) > 1]
    mine = totals(reply)
    counters = reply["counters"]
    drafts = counters["num_drafts"]
    out = {"k": k, "throughput_tokens_per_s": tokens / reply["seconds"] if reply["seconds"] else None,
           "per_request_tokens_per_s": float(mine.tokens.sum() / mine.total_s.sum()),
           "tpot_ms": 1000 * statistics.median(tpots) if tpots else None,
           "most_in_flight": reply.get("most_in_flight"), "num_tokens": tokens, "wall_s": reply["seconds"],
           "acceptance_length": 1 + counters["num_accepted_tokens"] / drafts if drafts else None,
           "speedup": None, "speedup_ci": None, "throughput_ratio": None, "identical_to_vllm_plain": None}
    if plain is not None and out["throughput_tokens_per_s"]:
        base = totals(plain)
        plain_tokens = sum(len(o["token_ids"]) for o in plain["outputs"])
        out["throughput_ratio"] = out["throughput_tokens_per_s"] / (plain_tokens / plain["seconds"])
        out["speedup"] = float(speed_ratio(mine, base))  # the statistic its interval resamples
        indices = resample_indices(len(outputs), boot.resamples, boot.seed)
        out["speedup_ci"] = percentile_interval(speed_ratio(mine, base, indices), boot.level)
        if greedy:
            out["identical_to_vllm_plain"] = all(o["token_ids"] == p["token_ids"]
                                                 for o, p in zip(outputs, plain["outputs"]))
    return out


def pays(cell: dict) -> bool:
    """Each request faster (its speedup interval above 1) and the engine's whole run too."""
    return bool(cell.get("speedup_ci")) and cell["speedup_ci"][0] > 1.0 and (cell.get("throughput_ratio") or 0) > 1.0


def schedule(best: dict[int, int]) -> list[list[int]]:
    """[[first, last, k], ...] from {load: best k} (see CONVENTIONS["schedule"])."""
    levels = sorted(best)
    ranges = []
    for i, level in enumerate(levels):
        last = levels[i + 1] - 1 if i + 1 < len(levels) else level
        if ranges and ranges[-1][2] == best[level]:
            ranges[-1][1] = last
        else:
            ranges.append([level, last, best[level]])
    return ranges


def analyse(measured: dict, boot, greedy: bool) -> dict:
    """The report's `vllm.load` section without the schedule runs (`add_schedule_runs`)."""
    levels, runs = measured["levels"], measured["runs"]
    plain_runs = runs[PLAIN][0]
    failed = {}
    methods = {}
    for name, by_k in runs.items():
        per_level = {}
        for k, replies in by_k.items():
            if "error" in replies:
                failed[f"{name} k={k}"] = replies["error"]
                continue
            for level in levels:
                plain = None if "error" in plain_runs else plain_runs[level]
                per_level.setdefault(level, {})[k] = entry(replies[level], plain, boot, k, greedy)
        if name == PLAIN:
            methods[name] = {"by_load": {str(n): cells[0] for n, cells in per_level.items()}}
            continue
        best = {}
        for level, cells in per_level.items():
            paying = [cell for cell in cells.values() if pays(cell)]
            best[level] = max(paying, key=lambda c: c["throughput_tokens_per_s"])["k"] if paying else 0
        methods[name] = {"by_load": {str(n): {"best_k": best[n], "by_k": {str(k): c for k, c in per_level[n].items()}}
                                     for n in sorted(per_level)},
                         "schedule": schedule(best) if len(best) == len(levels) else None,
                         "pays_up_to": max([n for n in levels if best.get(n)], default=None),
                         "stops_paying_at": min([n for n in levels if best.get(n) == 0], default=None)}
    return {"conventions": CONVENTIONS, "loads": levels, "draft_lengths": measured["draft_lengths"],
            "methods": methods, "schedule_runs": {}, "failed": failed}


def add_schedule_runs(section: dict, schedule_runs: dict, measured: dict, boot, greedy: bool) -> None:
    """Each `<method>_schedule` run, measured against vllm_plain at every load like the rest."""
    plain_runs = measured["runs"][PLAIN][0]
    for name, run in schedule_runs.items():
        if "error" in run:
            section["failed"][name] = run["error"]
            section["schedule_runs"][name] = {"schedule": run["schedule"], "accepted": False, "error": run["error"]}
            continue
        cells = {str(n): entry(reply, None if "error" in plain_runs else plain_runs[n], boot,
                               max(k for _, _, k in run["schedule"]), greedy)
                 for n, reply in run["runs"].items()}
        section["schedule_runs"][name] = {"schedule": run["schedule"], "accepted": True,
                                          "speculative_config": run["speculative_config"], "by_load": cells}


def advice(section: dict, expected: int) -> list[str]:
    """What to deploy at the expected load, and what changes above it (the recommendation's lines)."""
    levels = section["loads"]
    at = max([n for n in levels if n <= expected], default=min(levels))
    lines = []
    ranked = []
    for name, method in section["methods"].items():
        if name == PLAIN or not method.get("schedule"):
            continue
        cell = method["by_load"][str(at)]
        best = cell["by_k"].get(str(cell["best_k"]))
        if best is not None:
            ranked.append((best["throughput_tokens_per_s"], name, cell["best_k"], best))
    if not ranked:
        return [f"at {expected} concurrent request(s) (measured at {at}): serve without speculation; no speculative "
                "vLLM method beat vllm_plain there with its interval above 1"]
    _, name, k, best = max(ranked)
    ci = best["speedup_ci"]
    lines.append(f"at {expected} concurrent request(s) (measured at {at}): {name} with k={k}, each request "
                 f"{best['speedup']:.2f}x as fast as with vllm_plain [{ci[0]:.2f}, {ci[1]:.2f}], the engine's "
                 f"throughput {best['throughput_ratio']:.2f}x")
    method = section["methods"][name]
    idle = [n for n in levels if not method["by_load"][str(n)]["best_k"]]
    if idle:
        lines.append(f"{name} does not pay at {', '.join(map(str, idle))} concurrent requests on this machine: serve "
                     f"it with the schedule {json.dumps(method['schedule'])}, which drafts nothing there")
    else:
        lines.append(f"{name} paid at every load measured (up to {max(levels)}); its schedule "
                     f"{json.dumps(method['schedule'])}")
    return lines


def markdown(section: dict) -> str:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    ci = lambda v: "-" if not v else f"[{v[0]:.2f}, {v[1]:.2f}]"  # noqa: E731
    lines = ["", "## At load (vLLM)", "", CONVENTIONS["how"] + ".", "",
             "| load | method | best k | throughput tok/s | throughput x | per-request speedup | interval | "
             "per-request tok/s | TPOT ms |", "|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for level in section["loads"]:
        for name, method in section["methods"].items():
            cell = method["by_load"].get(str(level))
            if cell is None:
                continue
            if name == PLAIN:
                shown, k = cell, "0"
            elif cell["best_k"]:
                shown, k = cell["by_k"][str(cell["best_k"])], str(cell["best_k"])
            else:  # none paid: its fastest k, for what it cost
                shown = max(cell["by_k"].values(), key=lambda c: c["throughput_tokens_per_s"] or 0)
                k = f"0 (fastest: k={shown['k']})"
            lines.append(f"| {level} | {name} | {k} | {f(shown['throughput_tokens_per_s'], '.1f')} | "
                         f"{f(shown.get('throughput_ratio'))} | {f(shown['speedup'])} | {ci(shown['speedup_ci'])} | "
                         f"{f(shown['per_request_tokens_per_s'], '.1f')} | {f(shown['tpot_ms'], '.1f')} |")
    lines += ["", "Every k at every load (per-request speedup over vllm_plain's, interval; throughput x):", "",
              "| method | k | " + " | ".join(f"load {n}" for n in section["loads"]) + " |",
              "|---|---:|" + "---|" * len(section["loads"])]
    for name, method in section["methods"].items():
        if name == PLAIN:
            continue
        for k in section["draft_lengths"]:
            cells = [method["by_load"].get(str(n), {}).get("by_k", {}).get(str(k)) for n in section["loads"]]
            lines.append(f"| {name} | {k} | " + " | ".join(
                "-" if c is None else f"{f(c['speedup'])} {ci(c['speedup_ci'])}; {f(c.get('throughput_ratio'))}x"
                for c in cells) + " |")
    lines.append("")
    for name, method in section["methods"].items():
        if name != PLAIN:
            paid = ("paid at no load measured" if method["pays_up_to"] is None
                    else f"stops paying at {method['stops_paying_at']} concurrent requests"
                    if method["stops_paying_at"] is not None else "paid at every load measured")
            lines.append(f"- {name}: schedule `{json.dumps(method['schedule'])}`; {paid}")
    for name, run in section["schedule_runs"].items():
        if run["accepted"]:
            cells = ", ".join(f"{n}: {f(c['speedup'])}x" for n, c in run["by_load"].items())
            lines.append(f"- {name}: vLLM ran the schedule; speedup by load {cells}")
        else:
            lines.append(f"- {name}: vLLM refused the schedule: {run['error']}")
    for what, error in section["failed"].items():
        lines.append(f"- FAILED {what}: {error}")
    return "\n".join(lines) + "\n"


def write_plot(section: dict, out_dir: Path) -> str:
    """load_speedup.png: each method's speedup at its best k against the load, with intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, method in section["methods"].items():
        if name == PLAIN:
            continue
        xs, ys, lows, highs = [], [], [], []
        for level in section["loads"]:
            cell = method["by_load"].get(str(level))
            best = max(cell["by_k"].values(), key=lambda c: c["throughput_tokens_per_s"] or 0) if cell else None
            if best and best["speedup"] is not None:
                xs.append(level)
                ys.append(best["speedup"])
                low, high = best["speedup_ci"] or (best["speedup"], best["speedup"])
                lows.append(max(best["speedup"] - low, 0))
                highs.append(max(high - best["speedup"], 0))
        if xs:
            ax.errorbar(xs, ys, yerr=[lows, highs], marker="o", capsize=3, label=name)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrent requests", ylabel="throughput / vllm_plain's (best k)", title="Speedup at load (vLLM)")
    ax.legend() if ax.lines else None
    fig.tight_layout()
    fig.savefig(out_dir / "load_speedup.png", dpi=100)
    plt.close(fig)
    return "load_speedup.png"


def load_of(report: dict, method: str) -> tuple[dict, dict, dict]:
    """The report's load section, what it measured of `method` and its schedule's own run ({} where none)."""
    load = (report.get("vllm") or {}).get("load") or {}
    measured = (load.get("methods") or {}).get(method) or {}
    ran = (load.get("schedule_runs") or {}).get(method + SCHEDULE_SUFFIX) or {}
    return load, measured, ran


def served_schedule(report: dict, method: str) -> list | None:
    """The schedule an export serves `method` with: the one evaluate ran and vLLM accepted, else the
    measured one; None where the report measured no load for it."""
    _, measured, ran = load_of(report, method)
    return ran["schedule"] if ran.get("accepted") else measured.get("schedule")


def serve_section(report: dict, method: str, base_config: dict, verifier: str) -> str:
    """The export README's section on serving at load: the measured best k per batch size and
    vLLM's serve command with the schedule evaluate ran (the measured one, or eval.load_schedule
    where the user gave one); "" where the report measured no load for `method`."""
    load, measured, ran = load_of(report, method)
    if not measured.get("schedule"):
        return ""
    rows = "\n".join(f"| {first}-{last} | {k} |" for first, last, k in measured["schedule"])
    head = f"""
## At load

Evaluate measured {method} through vLLM at {', '.join(map(str, load['loads']))} concurrent requests (the
report's "At load" table). The draft length that paid at each batch size (0: none did):

| batch size | k |
|---|---:|
{rows}
"""
    served = served_schedule(report, method)
    most = max(k for _, _, k in served)
    if most == 0:
        return head + "\nSpeculation paid at no measured load on that machine: serve without it.\n"
    config = {**base_config, "num_speculative_tokens": most, "num_speculative_tokens_per_batch_size": served}
    source = "the measured schedule" if load.get("schedule_source") == "measured" else "eval.load_schedule"
    checked = (f"{source}, which vLLM ran in that evaluate" if ran.get("accepted")
               else f"{source}; vLLM did not run it in that evaluate")
    return head + f"""
vLLM 0.32 takes a schedule as `num_speculative_tokens_per_batch_size` ({checked}):

```bash
vllm serve {verifier} \\
  --speculative-config '{json.dumps(config)}'
```
"""
