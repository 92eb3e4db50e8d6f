"""The decode loop outside the target forward: per method, ms per step drafting and looping, and the drafting share.

    python -m benchmarks.decoding.bench_draft_loop [--prompts 6] [--tokens 48] [--k 3] [--engine static]

SmolLM2-135M-Instruct (fp32 on a CPU, bf16 on CUDA), ShareGPT first turns, greedy, batch 1,
methods interleaved per prompt after one warm-up answer each: plain, ngram and eagle3. The
eagle3 drafter is the demo recipe's EAGLE-3 at the start of training (the target's embeddings
and lm_head rows, its residual path: the logit lens of its highest aux layer), so its costs per
step are a trained drafter's and its acceptance is not; the demo's trained acceptance lives in
its evaluate record. What it measures per method: `specforge_lite/records/draft_loop.py`.

Writes benchmarks/results/draft_loop_<device>.json and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import compose_config, machine, run, sharegpt_first_turns, update_doc_section, write_results
from specforge_lite.records.draft_loop import markdown, measure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--engine", default="static", choices=("hf", "static", "compiled", "auto"))
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="the target's dtype (default: bf16 on CUDA, float32 on a CPU)")
    parser.add_argument("--drafter-dir", default=None, help="a trained EAGLE-3 folder (default: the untrained one)")
    parser.add_argument("--name", default=None, help="the results file's name (default: draft_loop_<device>)")
    args = parser.parse_args(argv)
    import torch
    from omegaconf import OmegaConf

    from benchmarks.common import SMOLLM2
    from specforge_lite.targets.loading import load_target

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    model, tokenizer = load_target(OmegaConf.create({**SMOLLM2, "device": device, "dtype": dtype}))
    prompts = sharegpt_first_turns(tokenizer, args.prompts, 256)
    load_before = os.getloadavg()[0]  # a shared machine: how busy it was is part of the record
    measured = measure(model, prompts, args.tokens, args.k, args.engine,
                       compose_config(["+recipe=eagle_smollm2"]).drafter, args.drafter_dir)
    measured["load_average_1min"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    command = (f"python -m benchmarks.decoding.bench_draft_loop --prompts {args.prompts} --tokens {args.tokens} "
               f"--k {args.k} --engine {args.engine}" + (f" --dtype {args.dtype}" if args.dtype else "")
               + (f" --drafter-dir {args.drafter_dir}" if args.drafter_dir else "")
               + (f" --name {args.name}" if args.name else ""))
    payload = {"command": command, "num_prompts": len(prompts), "tokens": args.tokens, "k": args.k, "dtype": dtype,
               **measured}
    name = args.name or f"draft_loop_{device}"
    write_results(name, payload)
    update_doc_section(name, markdown({**payload, "machine": machine()}))
    for method, m in measured["methods"].items():
        share = "-" if m["draft_share"] is None else f"{100 * m['draft_share']:.0f}%"
        print(f"{method}: outside-forward {m['outside_forward_ms_per_step']:.2f} ms/step, drafting share {share}")


if __name__ == "__main__":
    run(main)
