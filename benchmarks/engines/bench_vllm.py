"""vLLM in the loop on this CPU: decoding with our EAGLE-3 export, and sampling throughput, next to our engine.

Decoding: vLLM plain and with our EAGLE-3 export next to our engine's plain and EAGLE-3;
sampling: vLLM against our batched hf sampler.

    python -m benchmarks.engines.bench_vllm --run-dir runs/vllm_bench --overrides "+recipe=eagle_smollm2 ..."

Needs vLLM (`make vllm`) and a run whose `export/speculators` holds an EAGLE-3 export of
SmolLM2 (the overrides are the ones that trained it). Decoding is one `evaluate` with
methods plain, eagle3, vllm_plain, vllm_eagle3: same prompts, batch 1, greedy, fp32, our
engine on `--threads` torch threads and vLLM's worker bound to as many cores. Sampling:
the same first user turns of ShareGPT through `HFBackend` (one batch) and the vllm sample
backend (one call), alternating over `--rounds`, engine load excluded.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from benchmarks.common import (SMOLLM2, load_smollm2, needed, run, run_cli, run_file, sharegpt_first_turns, timed,
                               update_doc_section, write_results)


def decoding(args) -> tuple[dict, str]:
    overrides = shlex.split(args.overrides) + [
        f"run_dir={args.run_dir}", f"eval.max_prompts={args.prompts}", f"eval.max_new_tokens={args.max_new_tokens}",
        f"eval.num_draft_tokens={args.k}", "eval.methods=[plain,eagle3,vllm_plain,vllm_eagle3]",
        f"eval.vllm.cpu_threads={args.threads}", "eval.plots=false"]
    run_cli(["evaluate", *overrides], "evaluate (our engine and vLLM)", quiet=False,
            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    report = run_file(Path(args.run_dir), "eval/report.json")
    return report, f"OMP_NUM_THREADS={args.threads} " + shlex.join(["python", "-m", "specforge_lite", "evaluate",
                                                                    *overrides])


def sampling(args) -> dict:
    import torch
    from omegaconf import OmegaConf

    from specforge_lite.serving.vllm.sampler import VllmSampleBackend
    from specforge_lite.stages.sample_backends import HFBackend
    from specforge_lite.targets.loading import resolve_target_path

    torch.set_num_threads(args.threads)
    target_cfg = OmegaConf.create(SMOLLM2)
    model, tokenizer = load_smollm2()
    prompts = sharegpt_first_turns(tokenizer, args.sample_prompts, 256)
    sample_cfg = OmegaConf.create({"temperature": 0.0, "top_p": 1.0, "max_new_tokens": args.sample_max_new_tokens,
                                   "seed": 0, "vllm": {"python": None, "tensor_parallel_size": 1,
                                                       "gpu_memory_utilization": 0.9, "max_model_len": 1024,
                                                       "enforce_eager": None, "cpu_threads": args.threads,
                                                       "cpu_kvcache_gib": 1, "export_dir": None}})
    hf = HFBackend(model, tokenizer, sample_cfg)
    served, load_s = timed(lambda: VllmSampleBackend(resolve_target_path(target_cfg.path), target_cfg, sample_cfg,
                                                     tokenizer, Path(args.run_dir) / "bench_vllm_sampling.log"))
    hf.generate(prompts[:2]), served.generate(prompts[:2])  # warm-up
    timings = {"hf": [], "vllm": []}
    outputs = {}
    for _ in range(args.rounds):
        for name, backend in (("hf", hf), ("vllm", served)):
            outputs[name], seconds = timed(lambda: backend.generate(prompts))
            timings[name].append(seconds)
    served.close()
    tokens = {name: sum(len(ids) for ids, _ in out) for name, out in outputs.items()}
    best = {name: min(t) for name, t in timings.items()}
    return {"prompts": len(prompts), "max_new_tokens": args.sample_max_new_tokens, "threads": args.threads,
            "rounds": args.rounds, "seconds": timings, "tokens": tokens, "vllm_load_s": load_s,
            "tokens_per_s": {name: tokens[name] / best[name] for name in best},
            "vllm_over_hf": (tokens["vllm"] / best["vllm"]) / (tokens["hf"] / best["hf"]),
            "identical": [a == b for a, b in zip(outputs["hf"], outputs["vllm"])]}


def markdown(report: dict, command: str, sample: dict | None, sample_command: str, note: str) -> str:
    ours, served = report["methods"], report["vllm"]["methods"]
    f = lambda v, s=".2f": "-" if v is None else format(v, s)  # noqa: E731
    rows = [("our engine, plain", ours["plain"]["tau"], None, ours["plain"]["tokens_per_s"], ours["plain"]["speedup"],
             ours["plain"]["identical_to_plain"]),
            ("our engine, EAGLE-3", ours["eagle3"]["tau"], None, ours["eagle3"]["tokens_per_s"],
             ours["eagle3"]["speedup"], ours["eagle3"]["identical_to_plain"]),
            ("vLLM, plain", served["vllm_plain"]["tau"], None, served["vllm_plain"]["tokens_per_s"],
             served["vllm_plain"]["speedup_vs_our_plain"], served["vllm_plain"]["identical_to_plain"]),
            ("vLLM, our EAGLE-3 export", served["vllm_eagle3"]["tau"], served["vllm_eagle3"]["vllm_mean_acceptance_length"],
             served["vllm_eagle3"]["tokens_per_s"], served["vllm_eagle3"]["speedup_vs_our_plain"],
             served["vllm_eagle3"]["identical_to_plain"])]
    k = report["settings"]["num_draft_tokens"]
    lines = [f"## vLLM in the loop: vLLM {report['vllm']['vllm_version']} vs our engine (SmolLM2, CPU)", "",
             note, "",
             f"{report['num_answers']} MT-Bench first turns, {report['settings']['max_new_tokens']} new tokens, "
             f"greedy, fp32, batch 1, k = {k}; our engine on {report['torch_threads']} torch thread(s), vLLM's "
             f"worker on {report['vllm']['threads']} core(s). Our methods are interleaved per prompt; the vLLM "
             "methods run after them, one engine at a time, after one warm-up call each.", "",
             f"    {command}", "",
             "| decoder | tau (ours: tokens / decoding forwards) | vLLM mean acceptance length | tokens/s | "
             "x our plain | identical to our plain |", "|---|---:|---:|---:|---:|:---:|"]
    for name, tau, mal, tps, speedup, same in rows:
        lines.append(f"| {name} | {f(tau)} | {f(mal)} | {f(tps, '.1f')} | {f(speedup)} | {'yes' if same else 'NO'} |")
    e = served["vllm_eagle3"]
    lines += ["", f"Same drafter, both engines: tau {e['tau']:.3f} (vLLM) vs {ours['eagle3']['tau']:.3f} (ours), "
              f"difference {e['tau'] - ours['eagle3']['tau']:+.3f}; per-position acceptance (P(i | < i)) "
              f"vLLM {[round(a, 3) for a in e['per_position_acceptance']]} vs ours "
              f"{[round(a, 3) for a in ours['eagle3']['per_position_acceptance']]}. vLLM with the export vs vLLM "
              f"plain: {f(e['speedup_vs_vllm_plain'])}x; speculative output identical to vLLM plain: "
              f"{'yes' if e.get('identical_to_vllm_plain') else 'NO'}. vLLM's counters: {e['counters']}."]
    if sample:
        lines += ["", f"Sampling ({sample['prompts']} ShareGPT first turns, {sample['max_new_tokens']} new tokens, "
                  f"greedy, fp32, {sample['threads']} thread(s) each, best of {sample['rounds']}, engine load "
                  f"excluded: vLLM took {sample['vllm_load_s']:.0f} s to start):", "",
                  f"    {sample_command}", "",
                  "| sampler | tokens/s |", "|---|---:|",
                  f"| our `hf` backend, one batch of {sample['prompts']} | {sample['tokens_per_s']['hf']:.1f} |",
                  f"| `vllm` backend, one call | {sample['tokens_per_s']['vllm']:.1f} |", "",
                  f"vLLM / hf: {sample['vllm_over_hf']:.2f}x; identical samples: "
                  f"{sum(sample['identical'])}/{len(sample['identical'])}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", default="runs/vllm_bench")
    parser.add_argument("--overrides", required=True, help="the overrides that trained the run's drafter")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sample-prompts", type=int, default=16)
    parser.add_argument("--sample-max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-sampling", action="store_true")
    parser.add_argument("--note", default="", help="how the drafter was trained, for the doc section")
    args = parser.parse_args()
    needed(Path(args.run_dir) / "export" / "speculators",
           f"python -m specforge_lite export {args.overrides} run_dir={args.run_dir}")

    report, command = decoding(args)
    load_after_decoding = os.getloadavg()
    sample = None if args.skip_sampling else sampling(args)
    sample_command = "python -m benchmarks.engines.bench_vllm " + shlex.join(sys.argv[1:])
    keep = {k: report[k] for k in ("target", "dataset", "dtype", "device", "torch_threads", "settings",
                                   "num_prompts", "num_answers", "prompts", "vllm")}
    keep["methods"] = {m: {k: v for k, v in e.items() if k != "per_category"} for m, e in report["methods"].items()}
    path = write_results("vllm", {"command": command, "bench_command": sample_command, "decoding": keep,
                                  "sampling": sample,
                                  "load_average_after_decoding": load_after_decoding,
                                  "load_average_after_sampling": os.getloadavg()})
    update_doc_section("vllm", markdown(report, command, sample, sample_command, args.note))
    print(f"wrote {path} and docs/BENCHMARKS.md section 'vllm'")


if __name__ == "__main__":
    run(main)
