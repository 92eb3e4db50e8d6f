"""Record how the demo's budget split between sampling and training moves decoded acceptance.

    python -m benchmarks.records.record_sampling_budget LABEL=RUN_DIR:SAMPLING_S:TRAINING_S [...] --command "..."

Each RUN_DIR is a finished `make demo` (a fresh clone's runs/eagle_smollm2); SAMPLING_S and
TRAINING_S are the stage times its log reported. Reads the run's samples meta (how many of the
target's own answers), its train metrics and its evaluate report (EAGLE-3 and n-gram on the
same prompts in the same run), and writes one row per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.common import run, run_file, update_doc_section, with_ci, write_results
from benchmarks.records.record_eval import samples_of


def summary(run: Path, sampling_s: float, training_s: float) -> dict:
    cfg = OmegaConf.load(run / "train" / "config.yaml")
    meta = json.loads((samples_of(run) / "meta.json").read_text())
    history = run_file(run, "train/metrics.json")["history"]
    report = run_file(run, "eval/report.json")
    eagle, ngram = report["methods"]["eagle3"], report["methods"]["ngram"]
    return {"prompts": cfg.data.max_samples, "sampler": str(cfg.sample.backend), "sampled_rows": meta["num_rows"],
            "sampled_loss_tokens": meta["num_loss_tokens"], "source_conversations": cfg.train.source_conversations,
            "optimizer": cfg.train.optimizer, "lr": cfg.train.lr, "steps": history[-1]["step"],
            "training_tokens": history[-1]["tokens_seen"], "sampling_min": sampling_s / 60,
            "training_min": training_s / 60,
            "eagle3": {k: eagle[k] for k in ("tau", "tau_ci", "speedup", "speedup_ci", "per_position_acceptance")},
            "ngram": {k: ngram[k] for k in ("tau", "tau_ci", "speedup", "speedup_ci")},
            "num_prompts": report["num_prompts"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR:SAMPLING_S:TRAINING_S")
    parser.add_argument("--command", required=True, help="how the runs were made")
    args = parser.parse_args()
    runs = {}
    for item in args.runs:
        label, rest = item.split("=", 1)
        folder, sampling_s, training_s = rest.rsplit(":", 2)
        runs[label] = summary(Path(folder), float(sampling_s), float(training_s))
    write_results("sampling_budget", {"command": args.command, "runs": runs})

    rows = "\n".join(
        f"| {label} | {r['prompts']} ({r['sampler']}) | {r['sampled_rows']} / {r['sampled_loss_tokens']} | "
        f"{r['source_conversations']} | {r['sampling_min']:.1f} | {r['training_min']:.1f} | "
        f"{with_ci(r['eagle3']['tau'], r['eagle3']['tau_ci'])} | "
        + " / ".join(f"{a:.2f}" for a in r["eagle3"]["per_position_acceptance"])
        + f" | {with_ci(r['eagle3']['speedup'], r['eagle3']['speedup_ci'], suffix='x')} | "
        f"{with_ci(r['ngram']['speedup'], r['ngram']['speedup_ci'], suffix='x')} |" for label, r in runs.items())
    first, last = (runs[k]["eagle3"] for k in (next(iter(runs)), next(reversed(runs))))
    overlap = first["tau_ci"][0] <= last["tau_ci"][1] and last["tau_ci"][0] <= first["tau_ci"][1]
    verdict = (f"Decoded tau moved {last['tau'] - first['tau']:+.2f} from the first row to the last, "
               + ("within the intervals: at this scale more of the target's own answers did not measurably buy "
                  "acceptance." if overlap else "with the intervals apart."))
    update_doc_section("sampling_budget", f"""## Sampling budget: the target's own answers against source text

Each row is one `make demo` on a fresh clone of this 2-core machine (EAGLE-3, one epoch, one
sequence per step; decoded on the demo's {next(iter(runs.values()))['num_prompts']} MT-Bench first turns, k = 3; 95%
intervals over prompts). Only the split of the budget between sampling the target's answers
and training on source conversations as written changes between rows. {args.command}

| run | prompts sampled (sampler) | sampled rows / answer tokens | source conversations | sampling min | training min | decoded tau | acceptance at positions 1 / 2 / 3 | EAGLE-3 vs plain | n-gram vs plain |
|---|---|---|---:|---:|---:|---:|---|---:|---:|
{rows}

{verdict}
""")


if __name__ == "__main__":
    run(main)
