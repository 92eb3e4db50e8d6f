"""The dry-run table of every GPU recipe: per-device memory of each stage and the features' disk.

For every conf/recipe/*llama*.yaml: per-device memory of each stage and the disk of the
offline features for the recipe's data, computed from the target's config by specforge_lite/scale/sizing.py (what `dry_run=true` prints). Writes
benchmarks/results/dry_run_recipes.json and the `dry_run_recipes` section of docs/BENCHMARKS.md.

    python -m benchmarks.training.dry_run_recipes
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import RECIPES, compose_config, run, update_doc_section, write_results
from specforge_lite.scale.sizing import GiB, HEADROOM, stage_table

COMMAND = "python -m benchmarks.training.dry_run_recipes"
DEVICES = {"H100 80 GB": 80e9, "H200 141 GB": 141e9}  # the devices the recipe cards name


def fits(row: dict, memory: float) -> bool:
    return row["bytes"] <= memory * row.get("budget_share", HEADROOM)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    recipes = sorted(p.stem for p in RECIPES.glob("*llama*.yaml"))
    tables = {}
    for name in recipes:
        cfg = compose_config(["stage=train", f"+recipe={name}"])
        table = stage_table(cfg)
        table["strategy"] = str(getattr(cfg.trainer.strategy, "value", cfg.trainer.strategy))
        table["shard_target"] = bool(cfg.trainer.shard_target)
        table["mode"] = str(getattr(cfg.train.mode, "value", cfg.train.mode))
        tables[name] = table
    path = write_results("dry_run_recipes", {"command": COMMAND, "devices": DEVICES, "headroom": HEADROOM,
                                             "recipes": tables})
    render(json.loads(path.read_text()))
    print(f"wrote {path} and docs/BENCHMARKS.md section 'dry_run_recipes'")


def render(results: dict) -> None:
    devices = results["devices"]
    stages = ["sample", "features", "train", "evaluate", "evaluate_vllm", "export"]
    lines = []
    for name, table in results["recipes"].items():
        rows = table["stages"]
        cells = []
        for stage in stages:
            row = rows.get(stage)
            if row is None:
                cells.append("-")
                continue
            marks = "".join("" if fits(row, m) else f" (not {d.split()[0]})" for d, m in devices.items())
            cells.append(f"{row['bytes'] / GiB:.1f}{marks}")
        disk = table["offline_features"]
        total = "-" if disk["bytes_at_most"] is None else f"{disk['bytes_at_most'] / 1e12:.2f} TB"
        lines.append(f"| `{name}` | {table['world']} | {table['mode']}, {table['strategy']}"
                     f"{', target sharded' if table['shard_target'] else ''} | " + " | ".join(cells)
                     + f" | {disk['bytes_per_token'] / 1e3:.1f} KB ({disk.get('format', 'bf16')}) | {total}{'' if disk['used'] else ' (online)'} |")
    update_doc_section("dry_run_recipes", f"""## Dry run of every GPU recipe: per-device memory and offline disk

Command: `{results['command']}` ({results['date']}), the table `dry_run=true` prints for each
`conf/recipe/*llama*.yaml` (any stage: `python -m specforge_lite train +recipe=NAME dry_run=true`),
computed from the target's config by `specforge_lite/scale/sizing.py`: nothing downloaded, nothing
measured. GiB per device on the recipe's `trainer.dry_run_gpus` devices; "(not H100)" / "(not
H200)" where the stage needs more than {results['headroom']:.0%} of an 80 / 141 GB device (vLLM
rows: more than its `gpu_memory_utilization`); a stage that does not fit the devices it sees
stops before loading anything, naming the setting to change. Weights are exact; KV caches
and activations are the largest the settings allow. `evaluate` is our engine (the whole
target on one device: every evaluate decodes `plain` in it), `evaluate_vllm` the vllm_*
methods with `eval.vllm.tensor_parallel_size`. Offline disk: bytes per token (the aux layers
and the last hidden state, or the int4_topk teacher, in the recipe's `train.feature_format`:
`specforge_lite/training/feature_formats.py`) times at most the recipe's conversations x `data.max_length`
({'; '.join(sorted({t['offline_features']['tokens_from'] for t in results['recipes'].values()}))}).
Raw: `benchmarks/results/dry_run_recipes.json`.

| recipe | devices | training | sample | features | train | evaluate | evaluate_vllm | export | features per token | features disk |
|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|
""" + "\n".join(lines))


if __name__ == "__main__":
    run(main)
