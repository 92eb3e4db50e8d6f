"""The target's forward in our engine (HF's, static eager, compiled) by width, and plain decoding against HF and vLLM.

Hugging Face's forward, the static-cache one eager and the same compiled; what a verification
of k + 1 tokens costs next to one token; plain decoding against HF `generate` and vLLM at the
same thread count.

    python -m benchmarks.decoding.bench_engine [--widths 9] [--context 128] [--rounds 5]
                                      [--plain-prompts 8] [--plain-tokens 96] [--no-vllm] [--untuned]

1. Forward costs (this process, SmolLM2 fp32, `torch` default threads): after a
   `--context`-token prefill, the median time of one forward over t = 1..--widths new
   tokens for each engine, rounds interleaved across engines and widths. The
   weight-streaming floor is the time to read every weight once (a sum over each
   parameter, median of rounds): no batch-1 forward can beat it on this memory system.
   Argmax flips: MT-Bench first turns decoded plainly on the compiled engine, then fed
   again in chunks of width 2..--flip-width; positions whose greedy token differs.
2. Plain decoding (one `evaluate`, one thread for everything, MT-Bench first turns,
   greedy): our plain decoding on the compiled engine, HF `generate` and vLLM's plain
   decoding (its worker bound to one core) on the same prompts, with the report's
   intervals. Skipped with --no-vllm (then without vLLM's row).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (load_smollm2, machine, median_ms, run, run_cli, run_file, timed, update_doc_section,
                               with_ci, write_results)
from specforge_lite.records import goals as issue_goals

GOAL = "verification_cost_ratio"  # benchmarks/goals.yaml, entry `engine`: the widest verification of k <= 4 drafts


def forward_costs(args) -> dict:
    import torch

    from specforge_lite.runtime.hf_runner import TargetRunner
    from specforge_lite.runtime.compile import AUTOTUNE_ENV, env_setting, gemm_rows, inductor_gemm_rows
    from specforge_lite.runtime.fast_engine import FastEngine

    model, tokenizer = load_smollm2()
    capacity = 576  # what the demo's evaluate sizes for MT-Bench first turns and 128 new tokens
    # the packaged graph compiled into an empty cache folder, then loaded from it by a second
    # engine, as a later run would (the loaded one is timed)
    with tempfile.TemporaryDirectory(prefix="bench_engine_graphs_") as cache:
        first = FastEngine(model, capacity, max_width=args.widths, compiled=True, cache_dir=cache)
        compile_s = first.compile()
        del first
        compiled = FastEngine(model, capacity, max_width=args.widths, compiled=True, cache_dir=cache)
        load_s = compiled.compile()
        assert compiled.graph_source == "loaded", compiled.graph_source
    runners = {"hf": TargetRunner(model), "static": FastEngine(model, capacity).runner(), "compiled": compiled.runner()}
    dynamo_s = None
    if not args.skip_dynamo:  # torch.compile's graphs, one per width, built in this process
        dynamo = FastEngine(model, capacity, max_width=args.widths, compiled=True, packaged=False)
        dynamo_s = dynamo.compile()
        runners["compiled_dynamo"] = dynamo.runner()
    untuned_s = None
    if args.untuned:  # the same package with inductor's default kernels, compiled in this process
        with env_setting(AUTOTUNE_ENV, "0"):
            untuned = FastEngine(model, capacity, max_width=args.widths, compiled=True, cache_dir=None)
            untuned_s = untuned.compile()
        runners["compiled_untuned"] = untuned.runner()
    if not args.skip_inductor_rows:
        # the same graphs with inductor's own register blocks for its fp32 GEMM micro-kernel
        with inductor_gemm_rows():
            stock = FastEngine(model, capacity, max_width=args.widths, compiled=True, cache_dir=None)
            stock.compile()
        runners["compiled_inductor_rows"] = stock.runner()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
    widths = range(1, args.widths + 1)
    ids = {t: torch.randint(0, vocab, (t,), generator=gen).tolist() for t in widths}
    times = {name: {t: [] for t in widths} for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            runner.reset()
            runner.forward(context, last_only=True)
            for t in widths:
                for repeat in range(2):  # the first of each pair warms the caches of this width
                    _, elapsed = timed(lambda: runner.forward(ids[t]))
                    runner.crop(args.context)
                    if repeat:
                        times[name][t].append(elapsed)
    params = list(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    with torch.no_grad():
        floor_s = median_ms([timed(lambda: [p.sum() for p in params])[1] for _ in range(args.rounds)]) / 1e3
    ms = {name: {t: median_ms(v) for t, v in by_t.items()} for name, by_t in times.items()}
    flips = argmax_flips(args, model, tokenizer, compiled)
    return {"argmax_flips": flips, "context": args.context, "rounds": args.rounds, "compile_s": compile_s,
            "load_s": load_s, "dynamo_compile_s": dynamo_s, "untuned_compile_s": untuned_s, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "ms": ms,
            "gemm_rows": gemm_rows(),
            "ratio_to_one_token": {name: {t: v[t] / v[1] for t in widths} for name, v in ms.items()},
            "weight_bytes": weight_bytes, "weight_stream_ms": 1e3 * floor_s,
            "bandwidth_gb_s": weight_bytes / floor_s / 1e9}


def argmax_flips(args, model, tokenizer, engine) -> dict:
    """How often the compiled engine's verification (widths 2..k+1) picks another greedy
    token than its plain path (width 1) at the same position: plain-decode MT-Bench first
    turns with width-1 forwards, then feed the same tokens again in chunks of width w and
    compare each position's argmax."""
    import torch

    from specforge_lite.data.chat import prompt_ids
    from specforge_lite.data.eval_prompts import read_eval_prompts
    from specforge_lite.decoding.engine import generate_plain
    from specforge_lite.data.eval_prompts import select_prompts

    prompts = select_prompts(read_eval_prompts("builtin:mt_bench"), args.flip_prompts)
    runner = engine.runner()
    flips = {w: 0 for w in range(2, args.flip_width + 1)}
    margins = []
    positions = 0
    for prompt in prompts:
        ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt["turns"][0]}])
        plain = generate_plain(model, ids, args.plain_tokens, runner=runner).tokens
        positions += len(plain) - 1
        for width in flips:
            runner.reset()
            logits, _ = runner.forward(ids, last_only=True)
            fed = 0
            with torch.inference_mode():
                while fed < len(plain) - 1:
                    chunk = plain[fed:fed + width]
                    logits, _ = runner.forward(chunk)
                    for i in range(len(chunk)):
                        if fed + i + 1 < len(plain):
                            flips[width] += int(logits[i].argmax()) != plain[fed + i + 1]
                            if width == 2:
                                top = logits[i].topk(2).values
                                margins.append(float(top[0] - top[1]))
                    fed += len(chunk)
    return {"prompts": len(prompts), "positions": positions, "flips_by_width": flips,
            "smallest_top2_margin": min(margins) if margins else None}


def plain_decoding(args) -> tuple[dict, str]:
    run_dir = Path(args.run_dir)
    methods = "[plain,hf_generate" + ("" if args.no_vllm else ",vllm_plain") + "]"
    overrides = ["+recipe=eagle_smollm2", f"run_dir={run_dir}", f"eval.max_prompts={args.plain_prompts}",
                 f"eval.max_new_tokens={args.plain_tokens}", f"eval.methods={methods}", "eval.engine=compiled",
                 "eval.best_k_method=null", "eval.plots=false", "eval.vllm.cpu_threads=1"]
    run_cli(["evaluate", *overrides], "evaluate (plain decoding)", env={**os.environ, "OMP_NUM_THREADS": "1"},
            quiet=False)
    report = run_file(run_dir, "eval/report.json")
    return report, "OMP_NUM_THREADS=1 " + shlex.join(["python", "-m", "specforge_lite", "evaluate", *overrides])


def verification_goal(costs: dict, name: str) -> dict:
    """The goal on the compiled forward's cost ratio to one token over t = 2..5 (k = 1..4 drafts),
    judged on the largest."""
    ratios = costs["ratio_to_one_token"]["compiled"]
    widths = sorted(ratios, key=int)[1:5]
    return issue_goals.check_value(issue_goals.goals_of(name, "engine"), GOAL, max(ratios[t] for t in widths))


def markdown(costs: dict, plain: tuple[dict, str] | None, command: str, goals: dict) -> str:
    ms = costs["ms"]
    widths = sorted(ms["hf"], key=int)
    dynamo = (f"; `compiled_dynamo`: torch.compile's graphs, one per width, {costs['dynamo_compile_s']:.0f} s to build, "
              "every run" if costs.get("dynamo_compile_s") is not None else "")
    untuned = (f"; `compiled_untuned`: the same package with inductor's default kernels instead of autotuned ones "
               f"(`SPECFORGE_LITE_AUTOTUNE=0`), {costs['untuned_compile_s']:.0f} s to compile"
               if costs.get("untuned_compile_s") is not None else "")
    # a run with --untuned compares kernels, not engines: its own heading (docs headings are unique)
    what = ("autotuned against default kernels" if costs.get("untuned_compile_s") is not None
            else "static cache and compiled graphs")
    lines = [f"## Target forward: {what} (SmolLM2, CPU {costs.get('cpu_capability')}, fp32)",
             "", f"Command: `{command}` ({machine()}). `compiled`: one AOTInductor package for widths "
             f"1..{widths[-1]} (frozen, pre-packed weights, autotuned products), {costs['compile_s']:.0f} s to compile "
             f"into an empty cache, then {costs['load_s']:.1f} s to load from it, as a later run does; the loaded "
             f"one is timed{dynamo}{untuned}.", "",
             f"Median ms of one forward over t new tokens after a {costs['context']}-token context "
             f"({costs['rounds']} interleaved rounds), and the ratio to t = 1 (a verification of k drafts "
             f"has t = k + 1). The compiled forwards use inductor's fp32 GEMM micro-kernel with {costs['gemm_rows']}-row "
             "register blocks where the CPU has AVX-512 (our default; elsewhere inductor's own)"
             + (", `compiled_inductor_rows` inductor's own choice (`SPECFORGE_LITE_GEMM_ROWS=0`)"
                if "compiled_inductor_rows" in ms else "") + ":", "",
             "| engine | " + " | ".join(f"t={t}" for t in widths) + " |",
             "|---|" + "---:|" * len(widths)]
    for name, by_t in ms.items():
        lines.append(f"| {name} ms | " + " | ".join(f"{by_t[t]:.1f}" for t in widths) + " |")
    for name, by_t in costs["ratio_to_one_token"].items():
        lines.append(f"| {name} ratio | " + " | ".join(f"{by_t[t]:.2f}" for t in widths) + " |")
    lines += ["", f"Weight-streaming floor: reading the {costs['weight_bytes'] / 1e6:.0f} MB of weights once takes "
              f"{costs['weight_stream_ms']:.1f} ms ({costs['bandwidth_gb_s']:.1f} GB/s).",
              f"Compiled one-token forward vs HF's: {ms['hf'][widths[0]] / ms['compiled'][widths[0]]:.2f}x faster; "
              "verification cost ratio to t = 1 for k <= 4 drafts: "
              + ", ".join(f"t={t}: {costs['ratio_to_one_token']['compiled'][t]:.2f}" for t in widths[1:5])
              + "; goal (benchmarks/goals.yaml): "
              + ("; ".join(line[2:] for line in issue_goals.lines(goals)) or "none") + "."]
    flips = costs["argmax_flips"]
    lines += ["", f"Greedy agreement of the compiled verification with the compiled plain path: "
              f"{flips['prompts']} MT-Bench first turns decoded plainly ({flips['positions']} positions), then "
              "fed again in chunks of width w: positions whose argmax differs: "
              + ", ".join(f"w={w}: {n}" for w, n in flips["flips_by_width"].items())
              + f" (smallest top-2 logit margin met: {flips['smallest_top2_margin']:.2e})."]
    if plain:
        report, eval_command = plain
        lines += ["", f"Plain decoding, one thread each (`{eval_command}`): "
                  f"{report['settings']['max_prompts']} MT-Bench first turns, {report['settings']['max_new_tokens']} "
                  "new tokens, greedy; tokens/s with the report's 95% bootstrap interval of the speedup over "
                  "our plain decoding:", "", "| method | tokens/s | vs our plain [95% CI] | identical to plain |",
                  "|---|---:|---:|:---:|"]
        for name, entry in report["methods"].items():
            lines.append(f"| {name} | {entry['tokens_per_s']:.1f} | {with_ci(entry['speedup'], entry.get('speedup_ci'), suffix='x')} | "
                         f"{entry['identical_to_plain']} |")
        for name, entry in report.get("vllm", {}).get("methods", {}).items():
            lines.append(f"| {name} (vLLM) | {entry['tokens_per_s']:.1f} | "
                         f"{entry['tokens_per_s'] / report['methods']['plain']['tokens_per_s']:.2f}x | "
                         f"{entry.get('identical_to_plain')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, default=9)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plain-prompts", type=int, default=8)
    parser.add_argument("--plain-tokens", type=int, default=96)
    parser.add_argument("--flip-prompts", type=int, default=16)
    parser.add_argument("--flip-width", type=int, default=5)
    parser.add_argument("--run-dir", default="runs/bench_engine")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--skip-plain", action="store_true")
    parser.add_argument("--skip-dynamo", action="store_true",
                        help="do not also time torch.compile's per-width graphs")
    parser.add_argument("--untuned", action="store_true",
                        help="also time the package built with inductor's default kernels (SPECFORGE_LITE_AUTOTUNE=0)")
    parser.add_argument("--name", default="engine", help="results file and docs section name")
    parser.add_argument("--skip-inductor-rows", action="store_true",
                        help="do not also time the compiled graphs with inductor's own GEMM register blocks")
    args = parser.parse_args()
    command = "python -m benchmarks.decoding.bench_engine " + shlex.join(sys.argv[1:])
    costs = forward_costs(args)
    print(json.dumps(costs["ms"], indent=1))
    plain = None if args.skip_plain else plain_decoding(args)
    goals = verification_goal(costs, args.name)
    payload = {"command": command, "forward_costs": costs, "goals": goals}
    if plain:
        report, eval_command = plain
        payload["plain_decoding"] = {"command": eval_command, "methods": report["methods"],
                                     "vllm": report.get("vllm", {}).get("methods"), "engine": report["settings"]["engine"]}
    write_results(args.name, payload)
    update_doc_section(args.name, markdown(costs, plain, command, goals))


if __name__ == "__main__":
    run(main)
