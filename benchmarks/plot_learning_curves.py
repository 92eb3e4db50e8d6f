"""One figure of simulated acceptance length against training steps for several runs.

    python -m benchmarks.plot_learning_curves runs/eagle_smollm2 runs/medusa_smollm2 runs/distill_smollm2 \
        --out docs/img/learning_curves_smollm2.png

Reads each `RUN/train/metrics.json` (the train stage writes it); x is the optimizer step
(every run here uses the same micro-batches, so steps are the same training tokens).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in args.runs:
        history = json.loads((run / "train" / "metrics.json").read_text())["history"]
        steps = [h["step"] for h in history]
        left.plot(steps, [h["simulated_tau"] for h in history], marker="o", label=run.name)
        right.plot(steps, [h["acc"][0] for h in history], marker="o", label=run.name)
    left.set(xlabel="optimizer step (4 sequences each)", ylabel="simulated tau (bonus incl.)",
             title="teacher-forced acceptance length")
    right.set(xlabel="optimizer step (4 sequences each)", ylabel="accuracy", title="step / head 0 agreement with target")
    left.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
