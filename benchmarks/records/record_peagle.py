"""Record the P-EAGLE comparison (peagle next to eagle3 and ngram, one evaluate).

Writes docs/BENCHMARKS.md (section `peagle`) and benchmarks/results/peagle_smollm2.json.

    python -m benchmarks.records.record_peagle runs/peagle_smollm2 --eagle3 runs/eagle_smollm2 \
        --train-command "..." --eval-command "..." [--best-k-run RUN --best-k-command "..."] --note "..."

Reads the evaluate report of the P-EAGLE run (it must have evaluated peagle, eagle3 and ngram
in the same run) and both runs' `train/metrics.json`; the goals of the P-EAGLE issue (drafting
time per step against EAGLE-3's, the speedup at the best k the report estimates and the measured
one) are benchmarks/goals.yaml's `peagle_smollm2` (or --goals), checked on each evaluate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import fail, num, run, run_file, update_doc_section, with_ci, write_results
from specforge_lite.records import goals as issue_goals

METHODS = ("plain", "peagle", "eagle3", "ngram")
NAME = "peagle_smollm2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--eagle3", type=Path, required=True, help="the EAGLE-3 run trained with the same budget")
    parser.add_argument("--train-command", action="append", required=True)
    parser.add_argument("--eval-command", required=True)
    parser.add_argument("--plot", default="", help="the learning-curve image, relative to docs/")
    parser.add_argument("--eval-run", type=Path, help="where the evaluate wrote eval/ (default: run_dir)")
    parser.add_argument("--best-k-run", type=Path, help="a second evaluate, at the best k the first one estimated")
    parser.add_argument("--best-k-command", default="")
    parser.add_argument("--note", default="")
    parser.add_argument("--goals", default=NAME, help=f"the benchmarks/goals.yaml entry to check (default: {NAME})")
    args = parser.parse_args()
    report = run_file((args.eval_run or args.run_dir), "eval/report.json")
    methods = report["methods"]
    at_best = run_file(args.best_k_run, "eval/report.json") if args.best_k_run else None
    missing = [m for m in METHODS if m not in methods]
    if missing:
        fail(f"{args.run_dir}/eval/report.json lacks {missing}: evaluate them in the same run")
    histories = {name: run_file(run, "train/metrics.json")["history"]
                 for name, run in (("peagle", args.run_dir), ("eagle3", args.eagle3))}
    k = report["settings"]["num_draft_tokens"]
    pe, ea = methods["peagle"], methods["eagle3"]
    ratio = pe["draft_ms_per_step"] / ea["draft_ms_per_step"]
    entry = issue_goals.goals_of(args.goals, NAME)
    goals = issue_goals.check(entry.get("report", {}), report, k=k)
    if at_best:
        goals.update(issue_goals.check(entry.get("at_best_k", {}), at_best,
                                       k=at_best["settings"]["num_draft_tokens"]))
    write_results(NAME, {"train_commands": args.train_command, "eval_command": args.eval_command,
                         "note": args.note, "goals": goals, "draft_time_ratio_peagle_over_eagle3": ratio,
                         "train_history": histories, "report": report, "report_at_best_k": at_best,
                         "best_k_command": args.best_k_command})
    table = methods_table(report)
    best_table = ""
    if at_best:
        kb = at_best["settings"]["num_draft_tokens"]
        estimated = {m: (methods[m].get("best_k") or {}).get("best_k") for m in METHODS[1:]}
        best_table = (f"\nThe same drafters evaluated again at k = {kb} (best k estimated by the run above: "
                      + ", ".join(f"{m} {v}" for m, v in estimated.items()) + f"): `{args.best_k_command}`\n\n"
                      + methods_table(at_best))
    update_doc_section("peagle", section(args, report, table, best_table, histories, goals, ratio))


def methods_table(report: dict) -> str:
    """Per method: tau and speedup with their 95% intervals, per-position acceptance, drafting
    cost, the cost model's expected speedup at this run's k (next to the measured one) and
    its best k."""
    k = report["settings"]["num_draft_tokens"]
    methods = report["methods"]
    rows = []
    for m in METHODS:
        e = methods[m]
        acc = (e.get("per_position_acceptance") or []) + [None] * k
        best = e.get("best_k") or {}
        here = next((row for row in best.get("table", []) if row["k"] == k), {})
        share = e.get("draft_time_share")
        rows.append(f"| {m} | {with_ci(e['tau'], e.get('tau_ci'))} | " + " | ".join(num(a) for a in acc[:k])
                    + f" | {num(e.get('draft_ms_per_step'), 1)} | {'-' if share is None else f'{share:.0%}'}"
                    f" | {e['tokens_per_s']:.1f} | {with_ci(e['speedup'], e.get('speedup_ci'), suffix='x')}"
                    f" | {num(here.get('expected_speedup'), suffix='x')} | {best.get('best_k', '-')}"
                    f" | {num(best.get('expected_speedup'), suffix='x')}"
                    f" | {'yes' if e['identical_to_plain'] else 'NO'} |")
    return (f"| method | tau [95% CI] | {' | '.join(f'a{i + 1}' for i in range(k))} | draft ms/step | draft share "
            f"| tokens/s | speedup at k={k} [95% CI] | expected at k={k} | best k | expected speedup at best k "
            f"| identical to plain |\n"
            f"|---|---:|{'---:|' * k}---:|---:|---:|---:|---:|---:|---:|:---:|\n" + "\n".join(rows) + "\n")


def section(args, report, table, best_table, histories, goals, ratio) -> str:
    k = report["settings"]["num_draft_tokens"]
    engine = report["settings"].get("engine") or {}
    measured = "; ".join(f"{name} " + " / ".join(f"{v:.1f}" for v in ms.values())
                         for name, ms in (engine.get("measured_ms") or {}).items())
    engine_line = (f"(ms per forward of width 1 / k+1: {measured}; compile {engine['compile_s']:.0f} s, drafters "
                   + ", ".join(f"{n} {v:.0f} s" for n, v in (engine.get("drafters_compile_s") or {}).items()) + ")"
                   if engine.get("compile_s") else "")
    last = {name: h[-1] for name, h in histories.items()}
    train_lines = "\n".join(
        f"- {name}: {h['step']} steps, final simulated tau {h['simulated_tau']:.2f} (teacher-forced, bonus incl.), "
        f"depth / step accuracies {', '.join(f'{a:.2f}' for a in h['acc'])}, {h['tokens_per_s']:.0f} training tokens/s"
        for name, h in last.items())
    commands = "\n".join(f"- `{c}`" for c in args.train_command)
    plot = f"\n![learning curves]({args.plot})\n" if args.plot else ""
    return f"""## P-EAGLE next to EAGLE-3 and n-gram on SmolLM2 (CPU, same run)

Training (same data, budget, schedule and seed for both drafters):

{commands}

Evaluation: `{args.eval_command}`: {report['num_prompts']} MT-Bench first turns, greedy, k = {k}, batch 1,
{report['torch_threads']} torch thread(s), methods interleaved per prompt, target forward `{engine.get('used', 'hf')}`
{engine_line}. {args.note}

{table}
tau: tokens per target forward, bonus included (plain = 1.00); a_i: P(draft i accepted | drafts < i accepted);
best k and its speedup: the report's estimate from this run's measured acceptance, draft cost and target
forward costs (P-EAGLE's draft cost does not grow with k, EAGLE-3's grows linearly).
Drafting time per step, P-EAGLE / EAGLE-3 at k = {k}: {ratio:.3f}.
{best_table}
Goals of the P-EAGLE issue (benchmarks/goals.yaml):
{chr(10).join(issue_goals.lines(goals))}

Training, from each run's `train/metrics.json`:
{train_lines}
{plot}"""


if __name__ == "__main__":
    run(main)
