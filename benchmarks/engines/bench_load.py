"""Speedup at load: the demo's EAGLE-3 export and n-gram through vLLM at several loads and temperatures.

Beside our engine at batch 1 (issue 66).

    python -m benchmarks.engines.bench_load --from-run runs/eagle_smollm2 --overrides "+recipe=eagle_smollm2"

One `evaluate` with methods plain, eagle3, ngram (ours, batch 1), vllm_plain, vllm_eagle3 and
vllm_ngram, `eval.concurrency` (each vLLM method at k = 1..K with that many requests in flight,
the best k per load, its schedule run through vLLM) and `eval.temperature` a list (each measured
whole), in --run-dir, reading the drafter and its export from --from-run (whose own report stays as
it is). Needs vLLM (`make vllm`) and that run's `export/speculators`. Writes
benchmarks/results/vllm_load.json and the docs/BENCHMARKS.md section `vllm_load`.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from benchmarks.common import needed, run, run_cli, run_file, update_doc_section, write_results


def markdown(report: dict, command: str) -> str:
    from specforge_lite.serving.vllm.load_report import markdown as load_table
    from specforge_lite.stages.evaluate_entries import temperature_markdown

    s = report["settings"]
    engine = report["settings"].get("engine") or {}
    temps = list(report.get("by_temperature") or [str(s["temperature"])])
    lines = [f"## At load: vLLM {report['vllm']['vllm_version']} at {', '.join(map(str, s['concurrency']))} "
             f"concurrent requests (SmolLM2, CPU)", "",
             f"{report['num_answers']} prompts of {report['dataset']}, {s['max_new_tokens']} new tokens, k = 1.."
             f"{s['load_draft_tokens'] or s['num_draft_tokens']} for each vLLM method at each load, temperatures "
             f"{', '.join(temps)} (the tables below are at the first; \"By temperature\" gives every one). Our engine "
             f"at batch 1 and vLLM both in {report.get('dtype')} (target.dtype=auto, chosen at the first temperature: "
             f"{engine.get('dtype', {}).get('reason', '-')}); vLLM's threads: {report['vllm']['threads']}.", "",
             f"    {command}", ""]
    lines.append(load_table(report["vllm"]["load"]).strip("\n"))
    lines += ["", "What evaluate recommends at load:", ""]
    lines += [f"- {line}" for line in report["recommendation"].get("at_load") or []]
    lines.append(temperature_markdown(report).rstrip("\n").replace("## By temperature", "### By temperature"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-run", default="runs/eagle_smollm2", help="the run whose drafter and export are measured")
    parser.add_argument("--run-dir", default="runs/load_bench")
    parser.add_argument("--overrides", default="+recipe=eagle_smollm2", help="the overrides that trained the drafter")
    parser.add_argument("--dataset", default="builtin:sharegpt_tasks")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--temperatures", default="0,0.7")
    args = parser.parse_args()
    source = Path(args.from_run)
    needed(source / "export" / "speculators", f"python -m specforge_lite export {args.overrides} run_dir={source}")
    overrides = shlex.split(args.overrides) + [
        f"run_dir={args.run_dir}", f"eval.vllm.export_dir={source / 'export'}",
        f"eval.drafter_dirs.eagle3={source / 'train' / 'drafter'}", f"eval.dataset={args.dataset}", f"eval.max_prompts={args.prompts}",
        "eval.max_turns=1", f"eval.max_new_tokens={args.max_new_tokens}", f"eval.num_draft_tokens={args.k}",
        "eval.method_draft_tokens=[]", "eval.methods=[plain,eagle3,ngram,vllm_plain,vllm_eagle3,vllm_ngram]",
        f"eval.concurrency=[{args.concurrency}]", f"eval.temperature=[{args.temperatures}]",
        "eval.best_k_method=eagle3", "eval.rounding_baseline=false"]
    run_cli(["evaluate", *overrides], "evaluate at load (our engine and vLLM)", quiet=False)
    report = run_file(Path(args.run_dir), "eval/report.json")
    command = shlex.join(["python", "-m", "specforge_lite", "evaluate", *overrides])
    keep = {k: report.get(k) for k in ("target", "dataset", "settings", "num_prompts", "num_answers", "prompts",
                                       "recommendation", "by_temperature")}
    keep["methods"] = {m: {k: v for k, v in e.items() if k not in ("per_category", "tree")}
                       for m, e in report["methods"].items()}
    keep["vllm"] = report["vllm"]
    path = write_results("vllm_load", {"command": command, "report": keep,
                                       "bench_command": "python -m benchmarks.engines.bench_load"})
    update_doc_section("vllm_load", markdown(report, command))
    print(f"wrote {path} and docs/BENCHMARKS.md section 'vllm_load'")


if __name__ == "__main__":
    run(main)
