"""Compare two train runs: drafter tensors and logged loss curves (e.g. before and after a refactor).

    python -m benchmarks.compare_runs RUN_A RUN_B [RUN_A2 RUN_B2 ...]

Prints, per pair, the number of tensors, the largest absolute weight difference and the
largest difference of the logged losses; exits 1 when the tensor names differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file


def drafter_weights(run_dir: Path) -> dict:
    weights = {}
    for path in sorted((run_dir / "train" / "drafter").glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


def compare(a: Path, b: Path) -> dict:
    wa, wb = drafter_weights(a), drafter_weights(b)
    if set(wa) != set(wb):
        raise SystemExit(f"{a} and {b} hold different tensors: {sorted(set(wa) ^ set(wb))[:5]}")
    ha = json.loads((a / "train" / "metrics.json").read_text())["history"]
    hb = json.loads((b / "train" / "metrics.json").read_text())["history"]
    return {"tensors": len(wa),
            "max_abs_weight_diff": max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa),
            "loss_points": [len(ha), len(hb)],
            "max_abs_loss_diff": max(abs(x["loss"] - y["loss"]) for x, y in zip(ha, hb))}


if __name__ == "__main__":
    args = [Path(p) for p in sys.argv[1:]]
    if not args or len(args) % 2:
        raise SystemExit(__doc__)
    for a, b in zip(args[::2], args[1::2]):
        print(a, b, json.dumps(compare(a, b)))
