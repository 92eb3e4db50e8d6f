"""Draft trees beside their chains on the demo's target and prompts: tau, speedup, nodes per step.

One evaluate of the demo's recipe (SmolLM2-135M-Instruct, MT-Bench first turns) with each
chain method and its tree (`eval.tree`, `decoding/tree.py`): n-gram lookup always; EAGLE-3,
its tree and the mixed tree (EAGLE-3 + n-gram's match) when `--drafter DIR` names a trained
EAGLE-3 drafter. Intervals are the report's (95% bootstrap over prompts).

    python -m benchmarks.decoding.bench_trees [--drafter DIR] [--prompts 8] [--tokens 64]
        [--depth 5] [--branch 4] [--nodes 8] [--k 3] [--engine static]

The tree verify runs the static forward eagerly (the compiled graphs are the chain widths'),
so `--engine static` (the default) times chains and trees on the same forward. Writes
benchmarks/results/trees.json and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.common import run, run_cli, run_file, update_doc_section, with_ci, write_results

KEYS = ("tau", "tau_ci", "speedup", "speedup_ci", "tokens_per_s", "mean_draft_length", "identical_to_plain",
        "num_prompts")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decoding.bench_trees",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", help="a trained EAGLE-3 drafter folder (adds eagle3, eagle3_tree, "
                                          "eagle3_mixed_tree)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--branch", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--engine", default="static", choices=("static", "hf", "compiled", "auto"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    methods = ["plain", "ngram", "ngram_tree"]
    extra = ["eval.best_k_method=ngram"]
    if args.drafter:
        methods += ["eagle3", "eagle3_tree", "eagle3_mixed_tree"]
        extra = [f"eval.drafter_dirs.eagle3={args.drafter}", "eval.best_k_method=eagle3"]
    overrides = ["+recipe=eagle_smollm2", f"eval.methods=[{','.join(methods)}]", f"eval.max_prompts={args.prompts}",
                 f"eval.max_new_tokens={args.tokens}", f"eval.num_draft_tokens={args.k}",
                 f"eval.tree.depth={args.depth}", f"eval.tree.branch={args.branch}", f"eval.tree.nodes={args.nodes}",
                 f"eval.engine={args.engine}", "eval.plots=false", *extra]
    with tempfile.TemporaryDirectory(prefix="bench_trees_") as run_dir:
        seconds = run_cli(["evaluate", f"run_dir={run_dir}", *overrides], "evaluate")
        report = run_file(Path(run_dir), "eval/report.json")
    rows = {name: {key: entry.get(key) for key in KEYS} for name, entry in report["methods"].items()}
    command = "python -m benchmarks.decoding.bench_trees " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "drafter") \
        + (" --drafter DIR" if args.drafter else "")
    write_results("trees", {"command": command, "overrides": overrides, "evaluate_s": seconds,
                            "drafter": "trained EAGLE-3 (--drafter)" if args.drafter else None,
                            "engine": report.get("settings", {}).get("engine"), "methods": rows})
    lines = ["## Draft trees beside their chains", "",
             f"`{command}`: SmolLM2-135M-Instruct, {args.prompts} MT-Bench first turns, {args.tokens} new tokens, "
             f"greedy, chain k = {args.k}, tree depth {args.depth} / branch {args.branch} / {args.nodes} nodes, "
             f"eval.engine={args.engine}.", "",
             "| method | tau | speedup | nodes verified per step | identical to plain |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        nodes = row["mean_draft_length"]
        lines.append(f"| {name} | {with_ci(row['tau'], row['tau_ci'])} | {with_ci(row['speedup'], row['speedup_ci'])} "
                     f"| {'-' if nodes is None else f'{nodes:.2f}'} | {row['identical_to_plain']} |")
    update_doc_section("trees", "\n".join(lines))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    run(main)
