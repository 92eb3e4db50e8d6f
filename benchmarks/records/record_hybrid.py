"""Record the hybrid-drafting comparison: lookup, suffix decoding, the trained drafter and their hybrid.

    python -m benchmarks.records.record_hybrid --run RUN --command "..." [--run RUN2 --command "..."] [--wall "..."]

Each RUN/eval/report.json is one evaluate of the same methods on one prompt set (the demo's
MT-Bench first turns, `builtin:sharegpt_tasks`' held-out task areas): plain, n-gram, suffix
decoding, the EAGLE-3 chain, its trees, `eagle3_hybrid` and `eagle3_hybrid_tree`. Recorded per run:
the methods table, the hybrid's steps and kept tokens per source, tau and speedup per task
area, the report's recommendation, and the verdicts on the goals of the hybrid issue (the
`eval_hybrid_smollm2` entry of benchmarks/goals.yaml). Writes benchmarks/results/eval_hybrid_smollm2.json
(MT-Bench; another prompt set: eval_hybrid_smollm2_<its name>) and their section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import fail, run, run_file, update_doc_section, write_results
from specforge_lite.measurement.report import categories_table, methods_table, sources_table
from specforge_lite.records import goals as issue_goals

NAME = "eval_hybrid_smollm2"


def section(runs: list[dict], wall: str) -> str:
    parts = ["## Hybrid drafting: lookup, suffix decoding, EAGLE-3 and `eagle3_hybrid` (SmolLM2, CPU)", "",
             "Each method's speedup is over plain decoding in the same run. A hybrid's steps take lookup, the "
             "drafter or no draft, whichever this run's measured costs say gives the most tokens per second; "
             "the drafter's draft is then cut to the length its confidence and the verify time per width say pays "
             "(`cut`: drafted tokens left unverified). `eagle3_hybrid_tree` makes the same choice with the "
             "drafter's tree.", ""]
    for one in runs:
        report, dataset = one["report"], one["report"]["settings"]["dataset"]
        rec, settings = report.get("recommendation") or {}, report["settings"]
        engine = settings.get("engine") if isinstance(settings.get("engine"), dict) else {}
        tree = settings.get("tree") or {}
        parts += [f"### `{dataset}`", "",
                  f"Command: `{one['command']}`" + (f" ({wall})" if wall else "") + ". "
                  f"{report.get('num_prompts', '?')} prompts, greedy, k = {settings.get('num_draft_tokens')}, "
                  f"trees {tree.get('depth')}/{tree.get('branch')}/{tree.get('nodes')} (depth/branch/nodes), "
                  f"target forward {engine.get('used', '?')} in {report.get('dtype', '?')}.",
                  "", methods_table(report), ""]
        if sources := sources_table(report):
            parts += ["Which source drafted the hybrid's steps, and the tokens the target kept per step of each:", "",
                      sources, ""]
        if len(report.get("per_category_tau", {})) > 1:
            methods = [n for n in report["methods"] if n != "plain"]
            parts += ["tau / speedup over plain per task area:", "", categories_table(report, methods), ""]
        parts += [f"Recommendation: deploy `{rec.get('deploy')}`"
                  + (f"; {'; '.join(rec['reasons'])}" if rec.get("reasons") else "") + ".",
                  "", "Goals (benchmarks/goals.yaml, `eval_hybrid_smollm2`):", "",
                  *issue_goals.lines(one["goals"]), ""]
    return "\n".join(parts)


def figure_goals(specs: dict, report: dict) -> dict:
    """The goals of one figure the report holds but no method does: how flat the target forward is
    up to t = 16, how many compiled drafters fell back to eager drafting, and whether the hybrid's
    choice follows which of its sources is faster alone (the drafter's share of steps where the
    chain beats suffix lookup, else the lookup's and no draft's share)."""
    verdicts = {}
    ms = {int(t): v for t, v in report["forward_costs"]["ms_by_num_tokens"].items()}
    verdicts |= issue_goals.check_value(specs, "forward_1_to_16_within_1.3x",
                                        max(v for t, v in ms.items() if t <= 16) / ms[1])
    engine = report["settings"].get("engine") or {}
    verdicts |= issue_goals.check_value(specs, "no_compiled_drafting_fallback",
                                        len(engine.get("drafters_fallback") or {}))
    methods = report["methods"]
    sources = (methods.get("eagle3_hybrid") or {}).get("sources")
    if sources and "eagle3" in methods and "suffix" in methods:
        steps = {name: s["steps"] for name, s in sources.items() if isinstance(s, dict)}
        share = steps.get("drafter", 0) / max(sum(steps.values()), 1)
        drafter_wins = methods["eagle3"]["speedup"] > methods["suffix"]["speedup"]
        verdicts |= issue_goals.check_value(specs, "hybrid_drafter_share_follows_the_drafter",
                                            share if drafter_wins else 1 - share)
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, action="append", required=True, help="an evaluate's run_dir; repeatable")
    parser.add_argument("--command", action="append", required=True, help="its command, one per --run")
    parser.add_argument("--wall", default="", help="the wall time of each evaluate, as measured")
    args = parser.parse_args()
    if len(args.run) != len(args.command):
        fail(f"give one --command per --run ({len(args.run)} runs, {len(args.command)} commands)")
    runs = []
    for run_dir, command in zip(args.run, args.command):
        report = {k: v for k, v in run_file(run_dir, "eval/report.json").items() if k != "answers"}
        dataset = report["settings"]["dataset"]
        name = NAME if dataset == "builtin:mt_bench" else f"{NAME}_{dataset.rsplit(':', 1)[-1].split('/')[-1]}"
        specs = issue_goals.goals_of(name, NAME)
        goals = {**issue_goals.check({k: v for k, v in specs.items() if "value" not in v}, report),
                 **figure_goals(specs, report)}
        runs.append({"command": command, "dataset": dataset, "goals": goals, "report": report})
        # one results file per prompt set, each an evaluate report the cards' results blocks can show
        write_results(name, {"command": command, "wall": args.wall, "goals": goals, "report": report})
    update_doc_section(NAME, section(runs, args.wall))
    print("\n".join(f"{r['dataset']}: " + "; ".join(issue_goals.lines(r["goals"])) for r in runs))


if __name__ == "__main__":
    run(main)
