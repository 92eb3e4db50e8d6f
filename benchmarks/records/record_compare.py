"""Record a side-by-side drafter evaluation in docs/BENCHMARKS.md and benchmarks/results/.

    python -m benchmarks.records.record_compare runs/compare_smollm2 --command "make compare" --wall "..."

Copies the method table and the recommendation of `RUN/eval/report.json`, a training
summary of every trained drafter it compared (from their `metrics.json`), and the goals
of the Medusa / distillation issue computed from the report: distilled tau at least 30%
above the same student untrained, Medusa tau >= 2.0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import run, run_file, update_doc_section, write_results
from specforge_lite.decoding.report import methods_table
from specforge_lite.drafters.common import drafter_info


def training_summary(drafter_dir: Path) -> dict | None:
    metrics = drafter_dir.parent / "metrics.json"
    if not metrics.exists():
        return None
    history = json.loads(metrics.read_text())["history"]
    last = history[-1]
    return {"dir": str(drafter_dir), "steps": last["step"], "tokens": last.get("tokens_seen"),
            "final_loss": last["loss"], "final_simulated_tau": last["simulated_tau"], "acc": last["acc"],
            "tokens_per_s": last["tokens_per_s"], "target_share": last["target_share"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--command", required=True, help="the command that made the evaluation")
    parser.add_argument("--wall", default="", help="wall time of that command, as measured")
    parser.add_argument("--note", default="", help="one more sentence for the section (how the drafters were trained)")
    args = parser.parse_args()
    report = run_file(args.run_dir, "eval/report.json")
    methods = report["methods"]
    dirs = dict(report["settings"].get("drafter_dirs") or {})
    own = args.run_dir / "train" / "drafter"  # a method without a folder of its own used the run's drafter
    for method, kind in (("eagle3", "eagle3"), ("medusa", "medusa"), ("distilled", "distilled")):
        if method in methods and not dirs.get(method) and drafter_info(own).get("drafter") == kind:
            dirs[method] = str(own)
    trained = {m: training_summary(Path(d)) for m, d in dirs.items() if d and m in methods}
    goals = {}
    if "distilled" in methods and "untrained_draft" in methods:
        gain = methods["distilled"]["tau"] / methods["untrained_draft"]["tau"] - 1
        goals["distilled_tau_gain_ge_30pct"] = {"value": gain, "met": gain >= 0.30}
    if "medusa" in methods:
        goals["medusa_tau_ge_2.0"] = {"value": methods["medusa"]["tau"], "met": methods["medusa"]["tau"] >= 2.0}
    if "eagle3" in methods:
        goals["eagle3_tau_ge_2.5"] = {"value": methods["eagle3"]["tau"], "met": methods["eagle3"]["tau"] >= 2.5}
    name = args.run_dir.name
    write_results(f"eval_{name}", {"command": args.command, "wall": args.wall, "goals": goals,
                                   "trained": trained, "report": report})
    rec = report["recommendation"]
    train_lines = "\n".join(
        f"- `{m}` ({s['dir']}): {s['steps']} steps, final simulated tau {s['final_simulated_tau']:.2f}, "
        f"step/head-0 accuracy {s['acc'][0]:.2f}, {s['tokens_per_s']:.0f} training tokens/s"
        for m, s in trained.items() if s)
    goal_lines = "\n".join(f"- {k}: {v['value']:.2f} -> {'met' if v['met'] else 'NOT met'}" for k, v in goals.items())
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
    print(json.dumps(goals))


if __name__ == "__main__":
    run(main)
