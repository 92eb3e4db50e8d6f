"""EAGLE-3 training throughput on SmolLM2: online vs offline, and where the time goes.

    python -m benchmarks.training.bench_training --samples runs/eagle_smollm2/samples [--steps 12]

Runs the real train stage twice on the same sampled conversations (copied into a
temporary run dir): online (the frozen target in the loop) and offline (features cached
first, then read back), each for `--steps` optimizer steps with the eagle_smollm2
settings. Reports training tokens/s (all tokens of the batch), the share of a training
step spent in the target forward (online) or in reading features (offline), and the
one-off time and size of the feature cache.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, fail, run, run_cli, run_file, update_doc_section, write_results


def train(run_dir: Path, steps: int, mode: str) -> tuple[dict, float]:
    wall = run_cli(["train", "+recipe=eagle_smollm2", f"run_dir={run_dir}", f"train.max_steps={steps}",
                    f"train.log_every={steps}", "train.tracker=none", "train.checkpoint_every=0",
                    "train.source_conversations=0", f"train.mode={mode}"], f"train ({mode})")
    return run_file(run_dir, "train/metrics.json")["history"][-1], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=Path, default=ROOT / "runs" / "eagle_smollm2" / "samples")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    if not (args.samples / "data").is_dir():
        fail(f"no samples in {args.samples}; `python -m specforge_lite sample +recipe=eagle_smollm2` makes them")
    results = {}
    for mode in ("online", "offline"):
        run_dir = Path(tempfile.mkdtemp(prefix=f"bench_train_{mode}."))
        shutil.copytree(args.samples, run_dir / "samples")
        stats, wall = train(run_dir, args.steps, mode)
        entry = {"tokens_per_s": stats["tokens_per_s"], "target_share": stats["target_share"], "wall_s": wall}
        if mode == "offline":
            meta = run_file(run_dir, "train/features/meta.json")
            size = sum(p.stat().st_size for p in (run_dir / "train" / "features").glob("*.safetensors"))
            entry.update({"feature_tokens": meta["num_tokens"], "feature_bytes": size,
                          "estimated_bytes": meta["estimated_bytes"]})
        results[mode] = entry
        shutil.rmtree(run_dir, ignore_errors=True)
        print(mode, entry)
    command = f"python -m benchmarks.training.bench_training --samples {args.samples} --steps {args.steps}"
    write_results("training", {"command": command, "steps": args.steps, "results": results})
    on, off = results["online"], results["offline"]
    update_doc_section("training", f"""## EAGLE-3 training throughput (SmolLM2, CPU, fp32)

eagle_smollm2 settings (batch 4 sequences of up to 512 tokens, 3 TTT steps, draft vocab 8192),
{args.steps} optimizer steps each on the same sampled conversations. Command: `{command}`

| mode | training tokens/s | share of a step in target forward / feature reads | wall (incl. start-up) |
|---|---:|---:|---:|
| online | {on['tokens_per_s']:.0f} | {on['target_share']:.0%} | {on['wall_s']:.0f} s |
| offline | {off['tokens_per_s']:.0f} | {off['target_share']:.0%} | {off['wall_s']:.0f} s (includes caching) |

Offline feature cache: {off['feature_tokens']} tokens, {off['feature_bytes'] / 1e6:.0f} MB on disk
(estimate printed before writing: {off['estimated_bytes'] / 1e6:.0f} MB; 4H bf16 values per token).
Offline pays the target forward once; it wins when the drafter trains for more than one epoch.
""")


if __name__ == "__main__":
    run(main)
