"""One figure of simulated acceptance length against training steps for several runs.

    python -m benchmarks.training.plot_learning_curves runs/eagle_smollm2 runs/medusa_smollm2 runs/distill_smollm2 \
        --out docs/img/learning_curves_smollm2.png

Reads each `RUN/train/metrics.json` (the train stage writes it) and the batch size from
`RUN/train/config.yaml`; x is the optimizer step (the legend says how many sequences a step took).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.common import DOC, run, run_file, update_doc_section


def batch_size(run: Path) -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(run / "train" / "config.yaml").train.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run_dir in args.runs:
        history = run_file(run_dir, "train/metrics.json")["history"]
        steps = [h["step"] for h in history]
        label = f"{run_dir.name} ({batch_size(run_dir)} seq/step)"
        left.plot(steps, [h["simulated_tau"] for h in history], marker="o", label=label)
        right.plot(steps, [h["acc"][0] for h in history], marker="o", label=label)
    left.set(xlabel="optimizer step", ylabel="simulated tau (bonus incl.)", title="teacher-forced acceptance length")
    right.set(xlabel="optimizer step", ylabel="accuracy", title="step / head 0 agreement with target")
    left.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    image = os.path.relpath(args.out.resolve(), DOC.parent.resolve())
    command = "python -m benchmarks.training.plot_learning_curves " + " ".join(str(r) for r in args.runs) + f" --out {args.out}"
    update_doc_section(f"learning_curves_{args.out.stem}", f"""## Learning curves: {', '.join(r.name for r in args.runs)}

Command: `{command}` (from each run's `train/metrics.json`: teacher-forced simulated tau
and step / head-0 accuracy over logging windows of the training run itself).

![learning curves]({image})
""")


if __name__ == "__main__":
    run(main)
