"""The sample stage on the demo's settings, one run per backend: which sampler is this machine's fastest.

    python -m benchmarks.sampling.bench_sample_backends [--recipe eagle_smollm2] [--prompts 32] [--backends compiled,vllm]

Runs `python -m specforge_lite sample +recipe=RECIPE data.max_samples=N sample.backend=B` for each
backend in a fresh folder (the same prompts, every turn regenerated, greedy) and reads the stage's
own record (`samples/meta.json`): generated tokens over generation seconds (the model load, vLLM's
start and a compile are outside it, and are reported as the stage's whole wall time beside it).
Rows identical to the first backend's are counted: greedy samplers should agree token for token.
`vllm` needs vLLM (`make vllm` on a CPU-only machine) and runs with `sample.vllm.cpu_threads` = the
torch threads the other backends use. Run it alone: the machine's cores are the measurement.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import known_recipe, machine, run, run_cli, run_file, update_doc_section, write_results


def sample(recipe: str, prompts: int, backend: str, threads: int) -> tuple[dict, float, list]:
    import pyarrow.parquet as pq

    run_dir = Path(tempfile.mkdtemp(prefix="bench_sample_backends."))
    extra = [f"sample.vllm.cpu_threads={threads}"] if backend == "vllm" else []
    try:
        wall = run_cli(["sample", f"+recipe={recipe}", f"run_dir={run_dir}", f"samples_dir={run_dir / 'samples'}",
                        f"data.max_samples={prompts}", f"sample.backend={backend}", *extra],
                       f"sample with backend {backend}")
        meta = run_file(run_dir, "samples/meta.json")
        rows = [ids for shard in sorted((run_dir / "samples" / "data").glob("*.parquet"))
                for ids in pq.read_table(shard, columns=["input_ids"]).column("input_ids").to_pylist()]
        return meta, wall, rows
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="eagle_smollm2")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--backends", default="compiled,vllm")
    args = parser.parse_args()
    known_recipe(args.recipe)
    threads = torch.get_num_threads()
    results, first = {}, None
    for backend in args.backends.split(","):
        meta, wall, rows = sample(args.recipe, args.prompts, backend, threads)
        first = rows if first is None else first
        results[backend] = {"generated_tokens": meta["num_generated_tokens"], "generation_s": meta["generation_s"],
                            "tokens_per_s": meta["num_generated_tokens"] / meta["generation_s"], "stage_wall_s": wall,
                            "rows": len(rows), "rows_identical_to_first": sum(a == b for a, b in zip(rows, first))}
        print(backend, results[backend], flush=True)
    base = next(iter(results.values()))["tokens_per_s"]
    for entry in results.values():
        entry["vs_first"] = entry["tokens_per_s"] / base
    fastest = max(results, key=lambda b: results[b]["tokens_per_s"])
    command = (f"python -m benchmarks.sampling.bench_sample_backends --recipe {args.recipe} --prompts {args.prompts} "
               f"--backends {args.backends}")
    write_results("sample_backends", {"command": command, "recipe": args.recipe, "prompts": args.prompts,
                                      "threads": threads, "results": results, "fastest": fastest})
    names = list(results)
    rows = "\n".join(f"| `{b}` | {e['generated_tokens']} | {e['generation_s']:.1f} | {e['tokens_per_s']:.1f} | "
                     f"{e['vs_first']:.2f}x | {e['stage_wall_s']:.0f} | {e['rows_identical_to_first']}/{e['rows']} |"
                     for b, e in results.items())
    update_doc_section("sample_backends", f"""## Sampling backends on the demo's settings

The sample stage of `{args.recipe}` on its first {args.prompts} prompts, every turn regenerated, greedy,
one run per backend ({threads} torch threads; vLLM's CPU worker on as many). Generation seconds are the
stage's own record (`samples/meta.json`); the stage's wall time adds the model load and any compile or
engine start. {machine()}.
Command: `{command}`

| backend | generated tokens | generation s | tokens/s | x `{names[0]}` | stage wall s | rows identical to `{names[0]}` |
|---|---:|---:|---:|---:|---:|---:|
{rows}

Fastest here: **{fastest}**.
""")


if __name__ == "__main__":
    run(main)
