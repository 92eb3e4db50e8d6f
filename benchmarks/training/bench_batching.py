"""The demo's train stage at train.batch_size=1 against train.tokens_per_step=auto: tokens/s and padding.

    python -m benchmarks.training.bench_batching [--recipe eagle_smollm2] [--rows 96] [--steps 24] [--rounds 2]

Runs `python -m specforge_lite train +recipe=RECIPE` on the recipe's source conversations
(train.use_samples=false: no sampling first), each variant in a fresh run folder, the variants
interleaved over `--rounds` (the median run counts; the machine's load average is recorded with
each run), and reads what the stage itself records in metrics.json: every
rank's real tokens over its seconds in steps (`throughput`), the padding share of its batches and
the batch it chose (`batching`). Variants: `train.batch_size=1` (the demo recipe's measured
setting on a CPU) and `train.tokens_per_step=auto` (on a CPU: a budget of
training/batching.py's CPU_MICRO_BATCH sequences of data.max_length, rows packed by length).
On a GPU, the same command measures auto's micro-batch at what the device holds.
Run it alone: the machine's cores are the measurement.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import known_recipe, run, run_cli, run_file, update_doc_section, write_results

COMMAND = "python -m benchmarks.training.bench_batching"
VARIANTS = {"batch_size=1": ["train.tokens_per_step=null", "train.batch_size=1"],
            "tokens_per_step=auto": ["train.tokens_per_step=auto"]}


def train(recipe: str, rows: int, steps: int, overrides: list[str], device: str) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="bench_batching."))
    try:
        load = os.getloadavg()[0]
        wall = run_cli(["train", f"+recipe={recipe}", f"run_dir={run_dir}", "train.use_samples=false",
                        f"train.source_conversations={rows}", f"train.max_steps={steps}", f"train.log_every={steps}",
                        "train.tracker=none", "train.checkpoint_every=0", "train.grad_accum=1",
                        f"target.device={device}", *overrides], f"train ({' '.join(overrides)})")
        metrics = run_file(run_dir, "train/metrics.json")
        rank = metrics["throughput"]["ranks"][0]
        return {"steps": steps, "tokens_per_s": rank["tokens_per_s"], "real_tokens": rank["real_tokens"],
                "mfu": rank["mfu"], "padding_share": metrics["batching"]["padding_share"],
                "batching": metrics["batching"], "wall_s": wall, "load_before": load, "load_after": os.getloadavg()[0]}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="eagle_smollm2")
    parser.add_argument("--rows", type=int, default=96, help="source conversations to train on")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps of batch_size=1 (auto: a third)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of each variant")
    parser.add_argument("--device", default="cpu", help="target.device (cuda on a GPU)")
    args = parser.parse_args()
    recipe = known_recipe(args.recipe)
    steps = {"batch_size=1": args.steps, "tokens_per_step=auto": max(2, args.steps // 3)}  # about equal tokens
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        for name, overrides in VARIANTS.items():
            runs[name].append(train(recipe, args.rows, steps[name], overrides, args.device))
            print(f"round {round_ + 1} {name}: {runs[name][-1]['tokens_per_s']:.0f} tokens/s over {steps[name]} "
                  f"steps, padding {100 * runs[name][-1]['padding_share']:.1f}%", flush=True)
    results = {}
    for name, done in runs.items():
        median = sorted(done, key=lambda r: r["tokens_per_s"])[(len(done) - 1) // 2]
        results[name] = {"overrides": VARIANTS[name], **median, "runs_tokens_per_s": [r["tokens_per_s"] for r in done]}
    base = results["batch_size=1"]["tokens_per_s"]
    for r in results.values():
        r["vs_batch_size_1"] = r["tokens_per_s"] / base if base else None
    path = write_results("batching", {"command": f"{COMMAND} --recipe {recipe} --rows {args.rows} --steps "
                                                 f"{args.steps} --rounds {args.rounds} --device {args.device}",
                                      "recipe": recipe, "device": args.device, "results": results})
    render(path)
    print(f"wrote {path} and docs/BENCHMARKS.md section 'training_batching'")


def render(path: Path) -> None:
    import json

    data = json.loads(path.read_text())
    rows = [f"| `{name}` | {r['batching']['micro_batch_per_rank']} seq"
            + (f" ({r['batching']['token_budget_per_rank']} tokens, packed)" if r['batching'].get('token_budget_per_rank')
               else "") + " "
            f"| {r['steps']} | {r['real_tokens']} | {r['tokens_per_s']:.0f} ({', '.join(f'{t:.0f}' for t in r['runs_tokens_per_s'])}) "
            f"| {r['vs_batch_size_1']:.2f}x | {100 * r['padding_share']:.1f}% | {r['load_before']:.1f} |"
            for name, r in data["results"].items()]
    update_doc_section("training_batching", f"""## Batch per rank: train.batch_size=1 against train.tokens_per_step=auto

Command: `{data['command']}` ({data['date']}, {data['machine']}). The real train stage of
`{data['recipe']}` on its source conversations, each variant for about the same real tokens,
the variants interleaved and the median run shown (every run's figure in brackets, the load
average of the machine when the shown run started beside it: other work on the machine slows a
run, so compare the variants of one round);
tokens/s are real (unpadded) tokens over the rank's seconds in steps, and the padding share is
the padded tokens the batches computed that were padding, both from the stage's own
`metrics.json`. `auto` packs rows sorted by length into a budget of padded tokens per rank
(micro-batch column: sequences of data.max_length per rank, and the budget in padded tokens); on a
CPU the budget is a small fixed one, on a GPU the most the device holds. Rows longer than
data.max_length are cut to it, so where most are, the padding share is small either way. Raw: `benchmarks/results/batching.json`.

| variant | micro-batch per rank | steps | real tokens | tokens/s (runs) | vs batch_size=1 | padding | load |
|---|---|---:|---:|---:|---:|---:|---:|
""" + "\n".join(rows))


if __name__ == "__main__":
    run(main)
