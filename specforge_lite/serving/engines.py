"""The serving engines the evaluate stage measures, behind one interface.

Each engine (`Engine`) is a real serving engine decoding the stage's own requests (the token
ids of every prompt and turn): vLLM in a child process (`serving/vllm/`), llama.cpp in
process (`serving/llamacpp/`). It says which evaluation methods are its own, runs them on
the target the stage resolved once (`ServedTarget`), turns the results into its report
section (`report[engine.name]`), renders that in Markdown and lists its failures (the stage
fails on them once the report is written). `ENGINES` lists them; the stage loops over it
and names none.

Without our engine (every method an engine's: `drafters.methods.engine_needed`), the report's
`methods` table is that engine's own, measured against its plain decoding (`alone_entries`,
`alone_markdown`): first turns only, as a later turn follows our plain answer to the one before.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from specforge_lite import SpecforgeError
from specforge_lite.measurement.stats import method_intervals, prompt_totals, speed_ratio, tau, tokens_per_s
from specforge_lite.serving.llamacpp.report import LlamaCpp
from specforge_lite.serving.vllm.engine import eos_ids_of
from specforge_lite.serving.vllm.report import Vllm


@dataclass
class ServedTarget:
    """The target as the evaluate stage resolved it, once, for every engine."""

    path: str  # target.path resolved (`resolve_target_path`): a local folder or a hub id
    config: Any  # its Hugging Face config
    dtype: str  # the dtype our engine loads it in (auto: float32 on a CPU, bfloat16 on a GPU)
    eos_ids: list[int]  # the ids that end an answer, the same for every engine
    model: Any = None  # our engine's copy, when it runs (vllm_untrained_draft builds its draft from it)
    tokenizer: Any = None


@runtime_checkable
class Engine(Protocol):
    """What the evaluate stage asks of a serving engine.

    - `name`: its report section (`report[name]`); `label`: its name in prose;
    - `plain`: its own plain decoding, the baseline it measures against without our engine;
    - `conventions`: how its section's numbers are defined (`tau`, `tokens_per_s`, ...);
    - `methods(method_list)`: the methods of `method_list` it runs, in their order;
    - `run(cfg, methods, requests, target, out)`: runs them on every request, returns its results;
    - `rows(results, prompts, requests, greedy)`: one row per answer in the report's `answers`
      schema, outputs compared with its `plain` (where it measures without our engine);
    - `alone(cfg)`: the report's `engine` sentence where it measures without our engine;
    - `report_section(results, report, plain_tokens, cfg)`: its section of `report`, beside our
      engine's methods (`plain_tokens`: our plain answers) or alone (`plain_tokens` None);
    - `markdown(section, cfg)`: the section in Markdown;
    - `failures(section, out)`: one line per failure that fails the stage (none: empty);
    - `config_problems(cfg, target_config)` and `environment_problems(cfg)`: what the door
      (`stages/door.py`) asks of it before any stage works: its settings, checked against the
      target's config where known, and what it needs installed; one line per problem.
    """

    name: str
    label: str
    plain: str
    conventions: dict

    def methods(self, method_list: list[str]) -> list[str]: ...

    def run(self, cfg, methods: list[str], requests: list[list[int]], target: ServedTarget, out: Path) -> Any: ...

    def rows(self, results, prompts: list[dict], requests: list[list[int]], greedy: bool) -> list[dict]: ...

    def alone(self, cfg) -> str: ...

    def report_section(self, results, report: dict, plain_tokens: list[list[int]] | None, cfg) -> dict: ...

    def markdown(self, section: dict, cfg) -> str: ...

    def failures(self, section: dict, out: Path) -> list[str]: ...

    def config_problems(self, cfg, target_config) -> list[str]: ...

    def environment_problems(self, cfg) -> list[str]: ...


ENGINES: tuple[Engine, ...] = (Vllm(), LlamaCpp())  # run in this order, after our interleaved methods


def stop_ids(path: str, tokenizer) -> list[int]:
    """The ids that end an answer without our engine's model: the target's generation config,
    else the tokenizer's EOS, plus the tokenizer's EOS (`targets.loading.eos_token_ids`' rule)."""
    ids = eos_ids_of(path, tokenizer)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def alone_measured(cfg, engine: Engine, results, prompts: list[dict], requests: list[list[int]],
                   out: Path) -> tuple[list[dict], dict, dict, dict]:
    """Where `engine` measured without our engine: the report's answer rows, its `methods`, its
    conventions and the fields it adds (`baseline`, `engine`). Its plain decoding failing fails
    the stage: there is nothing to measure against."""
    section = engine.report_section(results, {"methods": {}}, None, cfg)
    if engine.plain in section["failed"]:
        raise SpecforgeError(f"{engine.plain}, the baseline of an evaluate without our engine, failed: "
                             f"{section['failed'][engine.plain]['error']} (logs in {out})")
    rows = engine.rows(results, prompts, requests, cfg.eval.temperature == 0)
    return (rows, alone_entries(cfg, engine, rows, section), alone_conventions(engine, cfg.eval.bootstrap),
            {"baseline": engine.plain, "engine": engine.alone(cfg)})


def alone_conventions(engine: Engine, boot) -> dict:
    """The report's `conventions` where `engine` measures without our engine."""
    return {
        "baseline": f"{engine.plain}: speedup and identical_to_plain are against {engine.label}'s plain decoding of "
                    "the same target (our engine does not run in this evaluate)",
        "tau": engine.conventions["tau"],
        "tokens_per_s": engine.conventions["tokens_per_s"],
        "speedup": f"tokens/s over {engine.plain}'s tokens/s, same prompts, same run",
        "intervals": f"{boot.level:.0%} percentile bootstrap over prompts ({boot.resamples} resamples, seed "
                     f"{boot.seed}), paired: the same prompts for every method",
    }


def alone_entries(cfg, engine: Engine, rows: list[dict], section: dict) -> dict:
    """The report's `methods` where `engine` measures without our engine: tau, tokens/s and
    speedup over `engine.plain` from the answer rows, their paired bootstrap intervals
    (measurement/stats.py), greedy outputs against `engine.plain`'s, per category; per-position
    acceptance from its section."""
    boot = cfg.eval.bootstrap
    greedy = cfg.eval.temperature == 0
    baseline = engine.plain
    totals = prompt_totals(rows)
    intervals = method_intervals(totals, baseline, boot.resamples, boot.seed, boot.level)
    by_cat = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_cat[row["method"]][row["category"]].append(row)
    entries = {}
    for name in totals:
        same = [row["identical_to_plain"] for row in rows if row["method"] == name]
        entry = {"tau": float(tau(totals[name])), "tokens_per_s": float(tokens_per_s(totals[name])),
                 "speedup": float(speed_ratio(totals[name], totals[baseline])), **intervals[name],
                 "identical_to_plain": all(same) if greedy else None,
                 "identical_answers": f"{sum(same)}/{len(same)}" if greedy else None,
                 "per_position_acceptance": section["methods"][name]["per_position_acceptance"],
                 "per_category": {}}
        for cat, cat_rows in by_cat[name].items():
            mine, base = prompt_totals(cat_rows)[name], prompt_totals(by_cat[baseline][cat])[baseline]
            entry["per_category"][cat] = {"tau": float(tau(mine)), "tokens_per_s": float(tokens_per_s(mine)),
                                          "speedup": float(speed_ratio(mine, base))}
        entries[name] = entry
    return entries


def alone_markdown(report: dict, engine: Engine) -> str:
    """The head of report.md where `engine` measured without our engine (its section follows)."""
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    ci = lambda v: "-" if not v else f"[{v[0]:.2f}, {v[1]:.2f}]"  # noqa: E731
    level = f"{report['settings']['bootstrap']['level']:.0%}"
    base = report["baseline"]
    lines = [f"# Evaluate: {report['target']} on {report['dataset']}, in {engine.label} alone", "",
             f"Baseline: **{base}** (our engine does not run: {report['engine']}). "
             f"{report['num_prompts']} prompts, {report['turns']}.", "",
             f"| method | tau | tau {level} CI | tokens/s | speedup vs {base} | speedup {level} CI "
             f"| identical to {base} |", "|---|---:|---|---:|---:|---|:---:|"]
    for name, m in report["methods"].items():
        same = {True: "yes", False: f"NO ({m['identical_answers']})", None: "n/a"}[m["identical_to_plain"]]
        lines.append(f"| {name} | {f(m['tau'])} | {ci(m['tau_ci'])} | {f(m['tokens_per_s'], '.1f')} | "
                     f"{f(m['speedup'])}x | {ci(m['speedup_ci'])} | {same} |")
    rec = report["recommendation"]
    lines += ["", "## Recommendation", "", f"Baseline {rec['baseline']}. Deploy **{rec['deploy']}**: "
              + "; ".join(rec["reasons"]) + ".", *(f"- {line}" for line in rec["alternatives"]),
              *(f"- At load (vLLM): {line}" for line in rec.get("at_load") or [])]
    if report["skipped"]:
        lines += ["", f"Skipped {report['skipped']['prompt_too_long']} prompt(s) longer than the target's context."]
    return "\n".join(lines) + "\n"
