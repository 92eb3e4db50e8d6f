"""Record a side-by-side drafter evaluation in docs/BENCHMARKS.md and benchmarks/results/.

    python -m benchmarks.records.record_compare runs/compare_smollm2 --command "make compare" --wall "..."

Copies the method table and the recommendation of `RUN/eval/report.json`, a training
summary of every trained drafter it compared (from their `metrics.json`), and the verdicts on
the goals of the Medusa / distillation issue (the distilled student's tau over the same student
untrained, Medusa's tau) and of the EAGLE-3 issue: the entry of benchmarks/goals.yaml named after
the results file (eval_RUN), else `eval_compare_smollm2`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import run, run_file, update_doc_section, write_results
from specforge_lite.measurement.report import methods_table
from specforge_lite.drafters.common import drafter_info
from specforge_lite.records import goals as issue_goals
from specforge_lite.records.runs import training_summary

GOALS = "eval_compare_smollm2"  # the goals.yaml entry of a results file that has none of its own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--command", required=True, help="the command that made the evaluation")
    parser.add_argument("--wall", default="", help="wall time of that command, as measured")
    parser.add_argument("--note", default="", help="one more sentence for the section (how the drafters were trained)")
    parser.add_argument("--goals", help=f"the benchmarks/goals.yaml entry to check (default: eval_RUN's, else {GOALS})")
    args = parser.parse_args()
    report = run_file(args.run_dir, "eval/report.json")
    methods = report["methods"]
    dirs = dict(report["settings"].get("drafter_dirs") or {})
    own = args.run_dir / "train" / "drafter"  # a method without a folder of its own used the run's drafter
    for method, kind in (("eagle3", "eagle3"), ("medusa", "medusa"), ("distilled", "distilled")):
        if method in methods and not dirs.get(method) and drafter_info(own).get("drafter") == kind:
            dirs[method] = str(own)
    trained = {m: training_summary(Path(d)) for m, d in dirs.items() if d and m in methods}
    name = args.run_dir.name
    goals = issue_goals.check(issue_goals.goals_of(args.goals or f"eval_{name}", GOALS), report)
    write_results(f"eval_{name}", {"command": args.command, "wall": args.wall, "goals": goals,
                                   "trained": trained, "report": report})
    rec = report["recommendation"]
    train_lines = "\n".join(
        f"- `{m}` ({s['dir']}): {s['steps']} steps, final simulated tau {s['final_simulated_tau']:.2f}, "
        f"step/head-0 accuracy {s['acc'][0]:.2f}, {s['tokens_per_s']:.0f} training tokens/s"
        for m, s in trained.items() if s)
    goal_lines = "\n".join(issue_goals.lines(goals))
    update_doc_section(f"eval_{name}", f"""## Side by side: `{name}` (every drafter kind on SmolLM2, CPU)

Command: `{args.command}` ({args.wall} wall on this machine). {args.note}
Evaluation: {report['num_prompts']} MT-Bench first turns (ids {', '.join(p['id'] for p in report['prompts'])}),
greedy, k = {report['settings']['num_draft_tokens']}, batch 1, methods interleaved per prompt.
`untrained_draft` is the untrained 4-layer copy of the target the distillation starts from; `distilled` is it after training.

{methods_table(report)}

Recommendation (computed by the report from the numbers above): deploy **{rec['deploy']}**: {'; '.join(rec['reasons'])}.
{chr(10).join('- ' + a for a in rec['alternatives'])}

Trained drafters:
{train_lines}

Goals of the Medusa / distillation issue and of the EAGLE-3 issue, from this run:
{goal_lines}
""")
    print(json.dumps(goals, default=str))


if __name__ == "__main__":
    run(main)
