"""Draft trees beside their chains on the demo's target and prompts: tau, speedup, nodes per step.

One evaluate of the demo's recipe (SmolLM2-135M-Instruct, MT-Bench first turns) with each
chain method and its tree (`eval.tree`, `decoding/tree.py`): n-gram lookup always; EAGLE-3,
its tree and the mixed tree (EAGLE-3 + n-gram's match) when `--drafter DIR` names a trained
EAGLE-3 drafter. Intervals are the report's (95% bootstrap over prompts).

    python -m benchmarks.decoding.bench_trees [--drafter DIR] [--prompts 8] [--tokens 64]
        [--depth 5] [--branch 4] [--nodes 8] [--k 3] [--engine compiled]

With `--engine compiled` (the default) chains run the compiled chain graphs and trees the
compiled tree-verify graph of width nodes + 1 (`runtime/target_package.TreeVerify`); `--engine
static` runs both on the eager static forward. Writes benchmarks/results/trees.json and its
section of docs/BENCHMARKS.md.

    python -m benchmarks.decoding.bench_trees --forwards [--nodes 8] [--branch 4] [--context 128] [--rounds 5]

times the target forwards instead (no evaluate; SmolLM2 fp32, this process): after a
`--context`-token prefill, the median of one forward (rounds interleaved) of the compiled
chain graph at widths 1..nodes + 1, the compiled tree-verify graph (width nodes + 1) over a
full tree and over a half one padded to it, and the eager static forward over the same
chain widths and trees; each as a ratio to the compiled chain's width 1, in one run. Both
packages are compiled into an empty folder first (SPECFORGE_LITE_AUTOTUNE=0 shortens it).
Writes benchmarks/results/tree_forwards.json and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (load_smollm2, machine, median_ms, run, run_cli, run_file, timed, update_doc_section,
                               with_ci, write_results)

KEYS = ("tau", "tau_ci", "speedup", "speedup_ci", "tokens_per_s", "mean_draft_length", "identical_to_plain",
        "num_prompts")


def spread_tree(nodes: int, branch: int, vocab: int, seed: int = 0):
    """A tree of `nodes` nodes: `branch` children of the root, each the head of a chain."""
    import torch

    from specforge_lite.decoding.tree import DraftTree

    tokens = torch.randint(0, vocab, (nodes,), generator=torch.Generator().manual_seed(seed)).tolist()
    return DraftTree(tokens, [-1 if i < branch else i - branch for i in range(nodes)])


def forward_costs(args) -> dict:
    """Median ms per forward of the compiled chain widths, the compiled tree-verify graph and the
    eager static forward (module docstring), rounds interleaved."""
    import torch

    from specforge_lite.decoding.tree import verify_layout
    from specforge_lite.runtime.compile import autotune
    from specforge_lite.runtime.fast_engine import FastEngine

    model, _ = load_smollm2()
    capacity, width = 576, args.nodes + 1
    with tempfile.TemporaryDirectory(prefix="bench_trees_graphs_") as cache:
        compiled = FastEngine(model, capacity, max_width=width, compiled=True, cache_dir=cache, tree_width=width)
        compile_s = compiled.compile()
    engines = {"compiled": compiled, "static": FastEngine(model, capacity)}
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
    chains = {f"chain t={t}": torch.randint(0, vocab, (t,), generator=gen).tolist() for t in range(1, width + 1)}
    trees = {f"tree {n} nodes": spread_tree(n, args.branch, vocab) for n in (args.nodes, max(2, args.nodes // 2))}
    times = {engine: {op: [] for op in [*chains, *trees]} for engine in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            runner = engine.runner()
            runner.reset()
            runner.forward(context, last_only=True)
            for op in times[name]:
                if op in chains:
                    call = lambda op=op: runner.forward(chains[op])  # noqa: E731
                else:
                    positions, mask = verify_layout(trees[op], args.context)
                    call = lambda op=op: runner.forward_tree([0] + trees[op].tokens, positions, mask)  # noqa: E731
                for repeat in range(2):  # the first of each pair warms the caches of this shape
                    _, elapsed = timed(call)
                    runner.crop(args.context)
                    if repeat:
                        times[name][op].append(elapsed)
    ms = {name: {op: median_ms(v) for op, v in by_op.items()} for name, by_op in times.items()}
    one = ms["compiled"]["chain t=1"]
    return {"context": args.context, "rounds": args.rounds, "nodes": args.nodes, "tree_width": width,
            "branch": args.branch, "autotune": autotune(), "compile_s": compile_s,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "ms": ms,
            "ratio_to_compiled_one_token": {name: {op: v / one for op, v in by_op.items()}
                                            for name, by_op in ms.items()}}


def forwards_markdown(costs: dict, command: str) -> str:
    ops = list(costs["ms"]["compiled"])
    ratio = costs["ratio_to_compiled_one_token"]
    lines = ["## Tree verify forward beside the chain widths (SmolLM2, CPU, fp32)", "",
             f"Command: `{command}` ({machine()}). `compiled`: the chain package (widths as a dynamic size) and "
             f"the tree-verify package of width {costs['tree_width']} (node budget {costs['nodes']} + the root), "
             f"products {'autotuned' if costs['autotune'] else 'with inductor default kernels'}, compiled in "
             f"{costs['compile_s']:.0f} s; a tree smaller than the budget is padded to it. `static`: the same "
             "forwards eagerly. Median of one forward after a "
             f"{costs['context']}-token context ({costs['rounds']} interleaved rounds), as a ratio to the compiled "
             "one-token forward of the same run (the machine is shared: compare ratios, not times across runs):", "",
             "| engine | " + " | ".join(ops) + " |", "|---|" + "---:|" * len(ops)]
    for name, by_op in ratio.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_op[op]:.2f}" for op in ops) + " |")
    return "\n".join(lines)


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
    parser.add_argument("--engine", default="compiled", choices=("static", "hf", "compiled", "auto"))
    parser.add_argument("--forwards", action="store_true", help="time the target forwards per width instead "
                                                                 "(compiled chain, compiled tree verify, eager)")
    parser.add_argument("--context", type=int, default=128, help="--forwards: tokens before the timed forwards")
    parser.add_argument("--rounds", type=int, default=5, help="--forwards: interleaved rounds")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.forwards:
        costs = forward_costs(args)
        command = (f"python -m benchmarks.decoding.bench_trees --forwards --nodes {args.nodes} --branch {args.branch} "
                   f"--context {args.context} --rounds {args.rounds}")
        write_results("tree_forwards", {"command": command, **costs})
        update_doc_section("tree_forwards", forwards_markdown(costs, command))
        print(json.dumps(costs["ratio_to_compiled_one_token"], indent=2))
        return
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
        f"--{k} {v}" for k, v in vars(args).items()
        if v is not None and k not in ("drafter", "forwards", "context", "rounds")) \
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
