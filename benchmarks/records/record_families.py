"""Record every drafter family side by side on the demo: chains, their trees, and held-out tau per training minute.

    python -m benchmarks.records.record_families RUN --command "..." --wall "..."
        [--also RUN2 --also-command "..." ...] [--heldout HELDOUT --heldout-command "..."] [--train-threads 1]

RUN/eval/report.json is one evaluate at the demo's settings (its prompts, k, engine) of every
trained drafter's chain and tree methods beside plain and n-gram. Recorded from it: the
method and trees tables, each method's best k (DFlash: the drafts read out of its block),
and the verdicts on the goals of the trees issue (each tree's tau against its chain's, the mixed
tree of EAGLE-3 and n-gram against n-gram, the report recommending it) and of the DFlash issue
(its drafting cost per token and its speedup against EAGLE-3's and n-gram's): the entry of
benchmarks/goals.yaml named after the results file, else `eval_families_smollm2`.
Each RUN2 (--also, repeatable) is another evaluate on the same prompts with another tree
shape or k (a tree that fits the chain's verify width, the drafters at their best k): its
tables, its trees goals and its DFlash goals are recorded too; the first at another k is the
cards' "at the best k" table.
HELDOUT/eval/report.json, when given, is a greedy evaluate of the same drafters on held-out
prompts (MT-Bench first turns the demo does not evaluate): each drafter's tau there, its
training CPU minutes (the rank's logged seconds in `train/metrics.json` times
`--train-threads`, the torch threads it trained with) and (tau - 1) per CPU minute.
--equal-cpu records drafters trained for the same CPU time instead of the same tokens: each
`--pilot NAME=SECONDS` is that drafter's seconds per optimizer step measured in a short pilot run
(one torch thread, beside one other training), its steps come from its train/metrics.json, and
the table shows the CPU minutes each was given (steps x pilot) beside the minutes it logged.
Writes benchmarks/results/NAME.json (default eval_families_smollm2) and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import fail, run, run_file, update_doc_section, write_results
from specforge_lite.measurement.report import k_text, methods_table, trees_table
from specforge_lite.records import goals as issue_goals
from specforge_lite.records.runs import drafter_folders, equal_cpu, per_minute, training_summary

NAME = "eval_families_smollm2"


def brief(report: dict) -> dict:
    """A report without its per-answer rows (the main run keeps them; the tables need none)."""
    return {k: v for k, v in report.items() if k != "answers"}


def at_best_k(report: dict, others: list[tuple[str, dict]]) -> dict:
    """The first other run at another k, as the cards' results blocks show it (`records/docs.py`:
    `report_at_best_k`, `best_k_command`)."""
    k = k_text(report["settings"])
    for command, other in others:
        if k_text(other["settings"]) != k:
            return {"report_at_best_k": other, "best_k_command": command}
    return {}


def best_k_lines(report: dict) -> str:
    lines = []
    for name, m in report["methods"].items():
        best = m.get("best_k")
        if best and best.get("best_k"):
            lines.append(f"- `{name}`: best k = {best['best_k']}, expected {best['expected_speedup']:.2f}x plain "
                         f"(estimated from its per-position acceptance and the measured forward costs)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--command", required=True, help="the evaluate that made RUN")
    parser.add_argument("--wall", default="", help="its wall time, as measured")
    parser.add_argument("--also", type=Path, action="append", default=[],
                        help="another evaluate (another tree shape or k) on the same prompts; repeatable")
    parser.add_argument("--also-command", action="append", default=[], help="its command, one per --also")
    parser.add_argument("--heldout", type=Path, help="a greedy evaluate of the same drafters on held-out prompts")
    parser.add_argument("--heldout-command", default="")
    parser.add_argument("--train-threads", type=int, default=1, help="the torch threads the drafters trained with")
    parser.add_argument("--name", default=NAME, help="the results file and BENCHMARKS section")
    parser.add_argument("--equal-cpu", action="store_true", help="the drafters trained for equal CPU time (--pilot)")
    parser.add_argument("--pilot", action="append", default=[], metavar="NAME=SECONDS",
                        help="a drafter's seconds per step in its pilot run (--equal-cpu); repeatable")
    parser.add_argument("--train-command", action="append", default=[], metavar="COMMAND",
                        help="a command that trained one of the drafters, listed with the budget; repeatable")
    parser.add_argument("--dflash", action="append", default=[], metavar="METHOD",
                        help="a DFlash method whose goals are checked (default: dflash); repeatable")
    parser.add_argument("--goals", help=f"the benchmarks/goals.yaml entry to check (default: NAME's, else {NAME})")
    parser.add_argument("--process-cpu", action="append", default=[], metavar="NAME=SECONDS",
                        help="a drafter's training process CPU seconds (user + sys, start-up included); repeatable")
    args = parser.parse_args()
    args.dflash = args.dflash or ["dflash"]
    report = run_file(args.run_dir, "eval/report.json")
    methods, rec = report["methods"], report["recommendation"]

    def label(r: dict) -> str:  # a run's k, and its tree shape where it ran tree methods
        tree = r["settings"]["tree"]
        shape = "/".join(str(tree[k]) for k in ("depth", "branch", "nodes"))
        trees = any(m.get("tree") for m in r["methods"].values())
        return k_text(r["settings"]).replace(" = ", "=") + (f", trees {shape}" if trees else "")

    if len(args.also_command) != len(args.also):
        fail("give one --also-command per --also")
    runs = [report] + [run_file(d, "eval/report.json") for d in args.also]
    entry = issue_goals.goals_of(args.goals or args.name, NAME)
    goals = {}
    for r in runs:  # the trees issue's goals once per run, the DFlash issue's once per run and DFlash method
        goals[f"trees ({label(r)})"] = issue_goals.check(entry.get("trees", {}), r)
        for name in args.dflash:
            goals[f"{name} ({label(r)})"] = issue_goals.check(entry.get("dflash", {}), r, dflash=name)
    goals = {key: group for key, group in goals.items() if group}
    heldout = per_minute(run_file(args.heldout, "eval/report.json"), args.train_threads) if args.heldout else {}
    dirs = drafter_folders(report)
    trained = {m: training_summary(Path(d)) for m, d in dirs.items() if d and m in methods}
    budget = equal_cpu(dirs, args.pilot, args.process_cpu, args.train_threads) if args.equal_cpu else {}
    write_results(args.name, {"budget": budget, "command": args.command, "wall": args.wall, "heldout_command": args.heldout_command,
                         "train_threads": args.train_threads, "train_commands": args.train_command, "goals": goals, "heldout": heldout,
                         "trained": trained, "report": report,
                         "also": [{"command": c, "report": brief(r)} for c, r in zip(args.also_command, runs[1:])],
                         **at_best_k(report, [(c, brief(r)) for c, r in zip(args.also_command, runs[1:])])})
    engine = report["settings"].get("engine") or {}
    engine = (f"{engine.get('used')} target forward (tree verify width {engine.get('tree_width')}), "
              f"drafters {', '.join(f'{n} {h}' for n, h in (engine.get('drafters_graph') or {}).items()) or 'eager'}")
    goal_lines = "\n".join(line.replace("- ", f"- {issue}: ", 1)
                           for issue, group in goals.items() for line in issue_goals.lines(group))
    also_section = ""
    for command, also in zip(args.also_command, runs[1:]):
        arec = also["recommendation"]
        also_section += (f"\n\nThe same prompts at {label(also)}, `{command}`:\n\n"
                         f"{methods_table(also)}\n\n{trees_table(also)}\n\n"
                         f"Recommendation: deploy **{arec['deploy']}**: {'; '.join(arec['reasons'])}.")
    heldout_table = ""
    if heldout:
        heldout_table = ("\n\nHeld-out prompts (`" + args.heldout_command + "`), against training cost ("
                         f"logged train seconds x {args.train_threads} thread(s)):\n\n"
                         "| drafter | held-out tau [CI] | training CPU min | training tokens | (tau - 1) per CPU min |\n"
                         "|---|---:|---:|---:|---:|\n"
                         + "\n".join(f"| {n} | {r['tau']:.2f} [{r['tau_ci'][0]:.2f}, {r['tau_ci'][1]:.2f}] | "
                                     f"{r['train_cpu_min']:.0f} | {r['train_tokens']} | {r['gain_per_cpu_min']:.4f} |"
                                     for n, r in heldout.items()))
    budget_table = ""
    if budget:
        budget_table = ("\n\nTraining budget: each drafter trained for the steps that its pilot's seconds per step "
                        "make the same CPU time (one torch thread each):\n\n"
                        "| drafter | steps | pilot s/step | CPU min given | training min logged (wall) | "
                        "process CPU min | tokens |\n"
                        "|---|---:|---:|---:|---:|---:|---:|\n"
                        + "\n".join(f"| {n} | {b['steps']} | {b['pilot_s_per_step']:.2f} | {b['cpu_min_given']:.1f} | "
                                     f"{b['train_min_logged']:.1f} | "
                                     f"{'-' if b['process_cpu_min'] is None else format(b['process_cpu_min'], '.1f')} | "
                                     f"{b['tokens']} |" for n, b in budget.items()))
        if args.train_command:
            budget_table += "\n\nTrained by:\n\n" + "\n".join(f"- `{c}`" for c in args.train_command)
    title = ("Drafters at equal training CPU minutes" if budget else "Every drafter family, chains and trees")
    update_doc_section(args.name, f"""## {title}: `{args.run_dir.name}` (SmolLM2, CPU)

Command: `{args.command}` ({args.wall}). Evaluation: {report['num_prompts']} MT-Bench first turns, greedy,
{k_text(report['settings'])}, {engine}, batch 1, methods interleaved per prompt.

{methods_table(report)}

{trees_table(report)}

Best k per method:
{best_k_lines(report)}

Recommendation (computed by the report): deploy **{rec['deploy']}**: {'; '.join(rec['reasons'])}.{also_section}{budget_table}{heldout_table}

Goals of the trees issue and of the DFlash issue (benchmarks/goals.yaml), from these runs:
{goal_lines}
""")
    print(json.dumps(goals, default=str))


if __name__ == "__main__":
    run(main)
