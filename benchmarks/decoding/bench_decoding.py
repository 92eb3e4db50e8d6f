"""Decoding benchmark on the real SmolLM2-135M-Instruct (float32), MT-Bench first turns.

Runs the `evaluate` stage with every decoder side by side (methods interleaved per
prompt, warm-up first, batch 1, greedy): HF `generate`, our plain loop, n-gram lookup,
a truncated copy of the target as draft model (untrained), HF prompt lookup and HF
assisted generation with the same draft. Writes benchmarks/results/decoding.json and
decoding.md and prints the Markdown table.

    nice -n 10 python -m benchmarks.decoding.bench_decoding                  # 10 prompts, 128 tokens, k=4
    nice -n 10 python -m benchmarks.decoding.bench_decoding --threads 1      # on a CPU shared with other jobs
    python -m benchmarks.decoding.bench_decoding --prompts 2 --max-new-tokens 16   # a quick look

Goals checked at the end (printed, never asserted): our plain loop >= HF generate,
our n-gram >= HF prompt lookup (same k and n-gram size), every greedy run identical
to plain decoding.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, compose_config, run, timed, update_doc_section, write_results

METHODS = ["plain", "ngram", "untrained_draft", "hf_generate", "hf_prompt_lookup", "hf_assisted"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=10, help="MT-Bench questions (spread over categories)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (all methods)")
    parser.add_argument("--ngram-max", type=int, default=3, help="largest n-gram matched (ours and HF's)")
    parser.add_argument("--truncate-layers", type=int, default=4, help="layers of the truncated draft model")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--target", default="smollm2", help="target config group option")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 keeps a shared CPU from thrashing")
    args = parser.parse_args()

    import torch

    from specforge_lite.measurement.report import methods_table
    from specforge_lite.stages import evaluate

    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = Path(tempfile.mkdtemp(prefix="bench_decoding."))
    overrides = [
        f"target={args.target}", "target.dtype=float32", "eval=mt_bench", f"run_dir={run_dir}", "stage=evaluate",
        f"eval.max_prompts={args.prompts}", "eval.max_turns=1", f"eval.max_new_tokens={args.max_new_tokens}",
        f"eval.num_draft_tokens={args.k}", f"eval.ngram_max={args.ngram_max}",
        f"eval.truncate_layers={args.truncate_layers}", f"eval.warmup={args.warmup}", "eval.temperature=0",
        "eval.methods=[" + ",".join(METHODS) + "]", "eval.best_k_method=ngram", "eval.plots=false",
    ]
    cfg = compose_config(overrides)
    _, wall_s = timed(lambda: evaluate.run(cfg))
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)

    m = report["methods"]
    ratio = lambda a, b: m[a]["tokens_per_s"] / m[b]["tokens_per_s"]  # noqa: E731
    goals = {
        "plain_vs_hf_generate": ratio("plain", "hf_generate"),
        "ngram_vs_hf_prompt_lookup": ratio("ngram", "hf_prompt_lookup"),
        "untrained_draft_vs_hf_assisted": ratio("untrained_draft", "hf_assisted"),
        "all_greedy_identical_to_plain": all(e["identical_to_plain"] for e in m.values()),
    }
    costs = report["forward_costs"]["ms_by_num_tokens"]
    command = " ".join(["python -m benchmarks.decoding.bench_decoding", *sys.argv[1:]])
    write_results("decoding", {"command": command, "args": vars(args), "wall_s": wall_s,
                               "torch_threads": torch.get_num_threads(), "goals": goals, "report": report})

    md = [
        f"SmolLM2-135M-Instruct, {report['dtype']}, {report['device']} ({report['torch_threads']} threads), "
        f"{report['num_prompts']} MT-Bench first turns ({', '.join(sorted(report['per_category_tau']))}), "
        f"greedy, {args.max_new_tokens} new tokens max, k = {args.k}, n-gram sizes {args.ngram_max}..1, draft model = "
        f"the target's first {args.truncate_layers} layers (untrained), batch 1, {args.warmup} warm-up run(s), "
        "methods interleaved per prompt.", "",
        methods_table(report), "",
        f"Target forward over t tokens at context {report['forward_costs']['context_len']}: "
        + ", ".join(f"t={t}: {ms:.1f} ms" for t, ms in costs.items()) + ". "
        f"Our loop's own overhead per step: plain {m['plain']['overhead_ms_per_step']:.2f} ms, "
        f"n-gram {m['ngram']['overhead_ms_per_step']:.2f} ms (n-gram lookup {m['ngram']['draft_ms_per_step']:.2f} ms) "
        f"against a {m['plain']['target_forward_ms']:.1f} ms target forward.", "",
        f"Ratios in this run: our plain / HF generate = {goals['plain_vs_hf_generate']:.3f}; "
        f"our n-gram / HF prompt lookup = {goals['ngram_vs_hf_prompt_lookup']:.3f}; "
        f"our draft model / HF assisted = {goals['untrained_draft_vs_hf_assisted']:.3f}; "
        f"every greedy output identical to plain: {goals['all_greedy_identical_to_plain']}. "
        f"Best k (n-gram) = {report['best_k']}.", "",
        f"Command: `nice -n 10 {command}`",
    ]
    (RESULTS / "decoding.md").write_text("\n".join(md) + "\n")
    update_doc_section("decoding", "## Decoding: our engine against Hugging Face's (SmolLM2, MT-Bench)\n\n"
                       + "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    run(main)
