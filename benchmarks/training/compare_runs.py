"""Compare two train runs: drafter tensors and logged loss curves (e.g. before and after a refactor).

    python -m benchmarks.training.compare_runs RUN_A RUN_B [RUN_A2 RUN_B2 ...]

Prints, per pair, the number of tensors, the largest absolute weight difference and the
largest difference of the logged losses; exits 1 when the tensor names differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from benchmarks.common import asks_help, fail, needed, run, run_file


def drafter_weights(run_dir: Path) -> dict:
    weights = {}
    folder = needed(run_dir / "train" / "drafter", f"python -m specforge_lite train run_dir={run_dir}")
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


def compare(a: Path, b: Path) -> dict:
    wa, wb = drafter_weights(a), drafter_weights(b)
    if set(wa) != set(wb):
        fail(f"{a} and {b} hold different tensors: {sorted(set(wa) ^ set(wb))[:5]}")
    ha, hb = (run_file(r, "train/metrics.json")["history"] for r in (a, b))
    return {"tensors": len(wa),
            "max_abs_weight_diff": max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa),
            "loss_points": [len(ha), len(hb)],
            "max_abs_loss_diff": max(abs(x["loss"] - y["loss"]) for x, y in zip(ha, hb))}


def main() -> None:
    if asks_help(sys.argv[1:], __doc__):
        return
    args = [Path(p) for p in sys.argv[1:]]
    if not args or len(args) % 2:
        fail(f"give runs in pairs: python -m {__spec__.name} RUN_A RUN_B [RUN_A2 RUN_B2 ...]")
    for a, b in zip(args[::2], args[1::2]):
        print(a, b, json.dumps(compare(a, b)))


if __name__ == "__main__":
    run(main)
