"""The demo's training step, before and after issue 27: tokens/s of the real train stage.

    python -m benchmarks.training.bench_demo_training [--steps 40] [--recipe eagle_smollm2]

Runs `python -m specforge_lite train +recipe=RECIPE` for `--steps` optimizer steps per variant,
each in a fresh run folder over a copy of the recipe's samples (so every variant trains the same
rows in the same order from the same seed), and reads the stage's own metrics: training tokens/s
(all tokens of the batch over the steps' time, start-up excluded) and the share of a step spent
in the frozen target's forward. Variants:

- before: the frozen fp32 target's forward in fp32 (the drafter already under bf16 autocast) and AdamW;
- bf16 target: the target's forward under bf16 autocast too (train.target_autocast, the default);
- bf16 target + Muon: and train.optimizer=muon, its Newton-Schulz iteration in bf16.

Run it alone: the machine's two cores are the measurement.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import (ROOT, compose_config, fail, known_recipe, run, run_cli, run_file, update_doc_section,
                               write_results)

VARIANTS = {
    "before": ["train.target_autocast=false", "train.optimizer=adamw"],
    "bf16 target": ["train.target_autocast=true", "train.optimizer=adamw"],
    "bf16 target + Muon": ["train.target_autocast=true", "train.optimizer=muon"],
}


def samples_of(recipe: str) -> Path:
    from specforge_lite.run_folders import samples_dir

    return ROOT / samples_dir(compose_config([f"+recipe={recipe}", "stage=train"]))


def train(recipe: str, samples: Path, steps: int, overrides: list[str]) -> tuple[dict, float]:
    run_dir = Path(tempfile.mkdtemp(prefix="bench_demo_training."))
    try:
        shutil.copytree(samples, run_dir / "samples")
        wall = run_cli(["train", f"+recipe={recipe}", f"run_dir={run_dir}", f"samples_dir={run_dir / 'samples'}",
                        f"train.max_steps={steps}", f"train.log_every={steps}", "train.tracker=none",
                        "train.checkpoint_every=0", *overrides], f"train ({' '.join(overrides)})")
        return run_file(run_dir, "train/metrics.json")["history"][-1], wall
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="eagle_smollm2")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    samples = samples_of(known_recipe(args.recipe))
    if not (samples / "data").is_dir():
        fail(f"no samples in {samples}; `python -m specforge_lite sample +recipe={args.recipe}` makes them")
    results = {}
    for name, overrides in VARIANTS.items():
        stats, wall = train(args.recipe, samples, args.steps, overrides)
        results[name] = {"overrides": overrides, "tokens_per_s": stats["tokens_per_s"],
                         "target_share": stats["target_share"], "tokens": stats["tokens_seen"], "wall_s": wall}
        print(name, results[name], flush=True)
    base = results["before"]["tokens_per_s"]
    for entry in results.values():
        entry["vs_before"] = entry["tokens_per_s"] / base
    command = f"python -m benchmarks.training.bench_demo_training --recipe {args.recipe} --steps {args.steps}"
    write_results("demo_training", {"command": command, "recipe": args.recipe, "steps": args.steps,
                                    "results": results})
    rows = "\n".join(f"| {name} | `{' '.join(e['overrides'])}` | {e['tokens_per_s']:.0f} | {e['vs_before']:.2f}x | "
                     f"{e['target_share']:.0%} |" for name, e in results.items())
    update_doc_section("demo_training", f"""## Demo training step

The real train stage of `{args.recipe}` (online: the frozen target in the loop), {args.steps} optimizer
steps per variant on the same rows, order and seed ({results['before']['tokens']} tokens); the drafter's
step is under bf16 autocast in every variant (train.mixed_precision=auto on a CPU with native bf16).
Command: `{command}`

| variant | overrides | training tokens/s | vs before | share of a step in the target's forward |
|---|---|---:|---:|---:|
{rows}

Muon's per-token gain is in "EAGLE-3 training study"; this table is its cost per step.
""")


if __name__ == "__main__":
    run(main)
