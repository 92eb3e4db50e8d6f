"""The batch `train.tokens_per_step=auto` picks on each GPU card, and each memory term at that batch.

For the five GPU recipes (eagle_llama8b, eagle_llama70b, distill_llama70b, medusa_llama8b,
peagle_llama8b) on 8 x H100-80GB and 8 x H200-141GB: the micro-batch per rank, the tokens per
optimizer step and the per-GPU memory terms of a training rank, computed from the target's
config by specforge_lite/scale/sizing.py and dry_run.py (what `train.dry_run=true
device_memory_gib=...` prints): nothing downloaded, nothing measured. Writes
benchmarks/results/dry_run_batches.json and the `dry_run_batches` section of docs/BENCHMARKS.md.

    python -m benchmarks.training.dry_run_batches
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import compose_config, run, update_doc_section, write_results
from specforge_lite.drafters.registry import chosen_drafter
from specforge_lite.scale.dry_run import estimate
from specforge_lite.scale.sizing import GiB, dry_run_choice, target_sizes
from specforge_lite.targets.loading import sizing_config

COMMAND = "python -m benchmarks.training.dry_run_batches"
CARDS = ("eagle_llama8b", "eagle_llama70b", "distill_llama70b", "medusa_llama8b", "peagle_llama8b")
DEVICES = {"8 x H100-80GB": (8, 80e9), "8 x H200-141GB": (8, 141e9)}  # GPUs, bytes each (the cards' devices)


def sized(recipe: str, gpus: int, memory: float) -> dict:
    cfg = compose_config(["stage=train", f"+recipe={recipe}", f"trainer.dry_run_gpus={gpus}",
                          f"device_memory_gib={memory / GiB}"])
    config = sizing_config(cfg.target.path)
    choice, at_batch = dry_run_choice(cfg, config)
    sizes = target_sizes(config)
    size = chosen_drafter(cfg).dry_size(at_batch, config, choice.per_rank, cfg.data.max_length)
    terms = estimate(at_batch, config, size, sizes["params"], sizes["layer_params"])
    return {"batch": choice.record(), "line": choice.line(), "memory_gib": terms,
            "mode": str(getattr(cfg.train.mode, "value", cfg.train.mode)),
            "strategy": str(getattr(cfg.trainer.strategy, "value", cfg.trainer.strategy)),
            "shard_target": bool(cfg.trainer.shard_target)}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    tables = {device: {recipe: sized(recipe, gpus, memory) for recipe in CARDS}
              for device, (gpus, memory) in DEVICES.items()}
    path = write_results("dry_run_batches", {"command": COMMAND, "devices": DEVICES, "cards": tables})
    render(json.loads(path.read_text()))
    print(f"wrote {path} and docs/BENCHMARKS.md section 'dry_run_batches'")


TERMS = [("target_weights_gib", "target"), ("target_gathered_layers_gib", "gathered layers"),
         ("drafter_weights_grads_adam_gib", "drafter + grads + AdamW"), ("drafter_gathered_gib", "gathered drafter"),
         ("target_activations_gib", "target act."), ("drafter_activations_gib", "drafter act."),
         ("target_logits_gib", "soft labels"), ("total_gib", "total")]


def render(results: dict) -> None:
    blocks = []
    for device, cards in results["cards"].items():
        lines = [f"**{device}** (each GPU {results['devices'][device][1] / 1e9:.0f} GB; a rank may use 90% of it)", "",
                 "| recipe | training | micro-batch per rank | tokens per step | " + " | ".join(t[1] for t in TERMS) + " |",
                 "|---|---|---:|---:|" + "---:|" * len(TERMS)]
        for recipe, row in cards.items():
            b = row["batch"]
            lines.append(f"| `{recipe}` | {row['mode']}, {row['strategy']}{', target sharded' if row['shard_target'] else ''}"
                         f" | {b['micro_batch_per_rank']} x {b['token_budget_per_rank'] // b['micro_batch_per_rank']}"
                         f" | {b['tokens_per_step']} | "
                         + " | ".join(f"{row['memory_gib'][k]:.1f}" for k, _ in TERMS) + " |")
        blocks.append("\n".join(lines))
    update_doc_section("dry_run_batches", f"""## Batch per rank on the GPU cards: what tokens_per_step=auto picks

Command: `{results['command']}` ({results['date']}). For each GPU card, the micro-batch per rank
(sequences x tokens) that `train.tokens_per_step=auto` picks on 8 GPUs of each kind: the most
whose training rows of the per-device sizing (`specforge_lite/scale/sizing.py`: feature building
and training) fit 90% of one GPU, and the tokens per optimizer step it makes with the recipe's
`train.grad_accum` (padded tokens at most; rows are packed by length into each rank's budget).
Then each memory term of a training rank at that batch, GiB (`train.dry_run=true` prints the
same; `device_memory_gib` sets the GPU). Computed from the targets' configs, nothing measured.
Raw: `benchmarks/results/dry_run_batches.json`.

""" + "\n\n".join(blocks))


if __name__ == "__main__":
    run(main)
