"""Record DFlash's two position weightings (exponential decay, D-PACE) trained alike and decoded in one evaluate.

    python -m benchmarks.records.record_dflash_weighting EVAL_RUN --command "..." --train-command "..."

EVAL_RUN/eval/report.json is one evaluate whose `eval.extra_drafters` are the two DFlash drafters
(labels `dflash_exp_decay` and `dflash_dpace`), trained with the same recipe, data and steps and
only `drafter.position_weight` changed (`--train-command` shows one of the two, WEIGHT standing for
the weighting). Recorded: tau and per-position acceptance with intervals, the paired tau
difference (D-PACE less exponential decay, 95% bootstrap over prompts), and each training's
final loss and simulated tau from its `train/metrics.json`.
Writes benchmarks/results/dflash_weighting.json and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import fail, paired_tau_difference, run, run_file, update_doc_section, write_results
from benchmarks.records.record_compare import training_summary
from specforge_lite.measurement.report import methods_table

NAME = "dflash_weighting"
LABELS = {"dflash_exp_decay": "exp_decay", "dflash_dpace": "dpace"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--command", required=True, help="the evaluate that made RUN")
    parser.add_argument("--train-command", required=True, help="the train command, WEIGHT for the weighting")
    args = parser.parse_args()
    report = run_file(args.run_dir, "eval/report.json")
    methods = report["methods"]
    missing = [label for label in LABELS if label not in methods]
    if missing:
        fail(f"{args.run_dir} has no method {', '.join(missing)} (eval.extra_drafters labels)")
    folders = dict(item.split(":", 1) for item in report["settings"].get("extra_drafters") or [])
    trained = {label: training_summary(Path(folders[label])) for label in LABELS if label in folders}
    difference = paired_tau_difference(report["answers"], report["answers"], "dflash_dpace", "dflash_exp_decay")
    write_results(NAME, {"command": args.command, "train_command": args.train_command, "trained": trained,
                         "tau_difference_dpace_less_exp_decay": difference, "report": report})
    rows = "\n".join(f"- `{label}` (`drafter.position_weight={weight}`): {t['steps']} steps, {t['tokens']} tokens, "
                     f"final loss {t['final_loss']:.2f}, simulated tau {t['final_simulated_tau']:.2f}"
                     for label, weight in LABELS.items() if (t := trained.get(label)))
    update_doc_section(NAME, f"""## DFlash position weighting: exponential decay against D-PACE

Training: `{args.train_command}` with WEIGHT = exp_decay and dpace (everything else alike):
{rows}

Decoding: `{args.command}`: {report['num_prompts']} prompts, greedy, k = {report['settings']['num_draft_tokens']}.

{methods_table(report)}

Paired tau difference, D-PACE less exponential decay: {difference['difference']:+.3f}
(95% bootstrap over prompts [{difference['ci'][0]:+.3f}, {difference['ci'][1]:+.3f}], {difference['num_prompts']} prompts).
""")
    print(json.dumps(difference))


if __name__ == "__main__":
    run(main)
