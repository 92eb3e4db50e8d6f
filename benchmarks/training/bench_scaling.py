"""Scale-out on CPU: training tokens/s on 1 vs 2 ranks per strategy, and per-rank memory.

Per-rank memory of a sharded target against DDP's.

    OMP_NUM_THREADS=1 python -m benchmarks.training.bench_scaling [--steps 30] [--rounds 2] [--memory-layers 24]

1. Throughput: the smoke recipe's train stage (tiny random Llama target, EAGLE-3 drafter)
   for `--steps` optimizer steps under each `trainer`, launched by torchrun with 1 and
   with 2 processes (gloo, same global batch). tokens/s is the last logging window's
   (half the steps, after warm-up), counted over all ranks; the configurations run
   interleaved for `--rounds` rounds and the best round counts (the machine is shared).
2. Memory: a randomly initialised Llama of a few hundred million parameters (hidden 1024,
   `--memory-layers` layers, the tiny target's byte tokenizer) trained for 2 steps on 2
   ranks under ddp, deepspeed_zero3 and fsdp. Each rank reports the target weight bytes
   it holds, its drafter and AdamW bytes, and its peak RSS (`train/memory/rank-R.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import load_results, run, run_cli, run_file, update_doc_section, write_results

STRATEGIES = ["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"]
GiB = 1024 ** 3


def train(run_dir: Path, ranks: int, overrides: list[str]) -> float:
    """One train stage under torchrun; returns its wall time."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return run_cli(["train", "+recipe=smoke", f"run_dir={run_dir}", "train.checkpoint_every=0", "train.tracker=none",
                    *overrides], f"train on {ranks} ranks ({' '.join(overrides)})", env=env,
                   launcher=["-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                             "--master_port", str(29600 + ranks)])


def fresh(samples: Path, name: str) -> Path:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_scaling_{name}."))
    shutil.copytree(samples, run_dir / "samples")
    return run_dir


def random_llama(out: Path, layers: int) -> int:
    """A random Llama (hidden 1024) with the tiny target's tokenizer, saved as safetensors."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specforge_lite.targets.loading import resolve_target_path

    tiny = resolve_target_path("builtin:tiny-llama")
    base = json.loads((Path(tiny) / "config.json").read_text())
    config = LlamaConfig(vocab_size=base["vocab_size"], hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=2048, bos_token_id=base["bos_token_id"],
                         eos_token_id=base["eos_token_id"], pad_token_id=base["pad_token_id"],
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--memory-layers", type=int, default=24)
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES)
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite the docs section from benchmarks/results/scaling.json")
    args = parser.parse_args()
    if args.render_only:
        render(load_results("scaling", "OMP_NUM_THREADS=1 python -m benchmarks.training.bench_scaling"))
        return

    work = Path(tempfile.mkdtemp(prefix="bench_scaling."))
    run_cli(["sample", "+recipe=smoke", f"run_dir={work}"], "sample (smoke)")
    samples = work / "samples"

    target_dir = work / "random_llama"
    target_params = random_llama(target_dir, args.memory_layers)
    memory = {}
    for strategy in ("ddp", "deepspeed_zero3", "fsdp"):
        run_dir = fresh(samples, f"mem_{strategy}")
        layers = args.memory_layers
        train(run_dir, 2, [f"trainer={strategy}", f"target.path={target_dir}", "train.max_steps=2",
                           "train.log_every=1", "train.batch_size=2",
                           f"drafter.aux_layer_ids=[1,{layers // 2},{layers - 3}]"])
        memory[strategy] = [json.loads((run_dir / "train" / "memory" / f"rank-{r}.json").read_text()) for r in (0, 1)]
        shutil.rmtree(run_dir, ignore_errors=True)
        print(strategy, memory[strategy], flush=True)
    throughput = {strategy: {} for strategy in args.strategies}
    for round_ in range(args.rounds):
        for strategy in args.strategies:
            for ranks in (1, 2):
                run_dir = fresh(samples, f"{strategy}_{ranks}")
                wall = train(run_dir, ranks, [f"trainer={strategy}", f"train.max_steps={args.steps}",
                                              f"train.log_every={args.steps // 2}"])
                last = run_file(run_dir, "train/metrics.json")["history"][-1]
                shutil.rmtree(run_dir, ignore_errors=True)
                entry = throughput[strategy].setdefault(ranks, {"rounds_tokens_per_s": []})
                entry["rounds_tokens_per_s"].append(last["tokens_per_s"])
                entry.update(tokens_per_s=max(entry["rounds_tokens_per_s"]), final_loss=last["loss"], wall_s=wall)
                print(round_, strategy, ranks, entry, flush=True)
    shutil.rmtree(work, ignore_errors=True)

    command = (f"OMP_NUM_THREADS=1 python -m benchmarks.training.bench_scaling --steps {args.steps} "
               f"--rounds {args.rounds} --memory-layers {args.memory_layers}")
    path = write_results("scaling", {"command": command, "steps": args.steps, "rounds": args.rounds,
                                     "memory_layers": args.memory_layers, "throughput": throughput,
                                     "memory_target_params": target_params, "memory": memory})
    render(json.loads(path.read_text()))


def render(results: dict) -> None:
    """Write the `scaling` section of docs/BENCHMARKS.md from a results JSON."""
    steps, command = results["steps"], results["command"]
    throughput = {s: {int(k): v for k, v in t.items()} for s, t in results["throughput"].items()}
    memory, target_params = results["memory"], results["memory_target_params"]
    rows = "\n".join(
        f"| {s} | {t[1]['tokens_per_s']:.0f} | {t[2]['tokens_per_s']:.0f} | {t[2]['tokens_per_s'] / t[1]['tokens_per_s']:.2f}x "
        f"| {', '.join(f'{x:.0f}' for x in t[1]['rounds_tokens_per_s'])} | {', '.join(f'{x:.0f}' for x in t[2]['rounds_tokens_per_s'])} "
        f"| {t[1]['final_loss']:.6f} / {t[2]['final_loss']:.6f} |" for s, t in throughput.items() if {1, 2} <= set(t))
    rounds = max(len(t[1]["rounds_tokens_per_s"]) for t in throughput.values())
    spread = max(max(r) / min(r) for t in throughput.values() for e in t.values()
                 for r in [e["rounds_tokens_per_s"]])
    ddp_target = memory["ddp"][0]["target_weight_bytes"]
    mem_rows = "\n".join(
        f"| {s} | {r['rank']} | {r['target_weight_bytes'] / GiB:.3f} | {r['target_weight_bytes'] / ddp_target:.2f} "
        f"| {r['drafter_weight_bytes'] / GiB:.4f} | {r['optimizer_state_bytes'] / GiB:.4f} | {r['peak_rss_bytes'] / GiB:.2f} |"
        for s, ranks in memory.items() for r in ranks)
    update_doc_section("scaling", f"""## Scale-out on CPU: strategies on 1 and 2 ranks

Command: `{command}`, run under `nice -n 19` on {results['machine']} ({results['date']}).
The 2 cores are shared with other jobs; each configuration ran in {rounds} interleaved
rounds (all listed, the best counts), and rounds of one configuration differ by up to
{spread:.1f}x. Raw: `benchmarks/results/scaling.json`.

**Training throughput**, smoke recipe (tiny random Llama target, EAGLE-3 drafter, 4
sequences per micro-batch dealt out over the ranks, fp32), torchrun with 1 and 2 gloo
processes, tokens/s over all ranks in the last {steps // 2} of {steps} steps; the best of
{rounds} interleaved rounds counts (each round listed):

| trainer | 1 rank tokens/s | 2 ranks tokens/s | 2 / 1 | 1 rank, rounds | 2 ranks, rounds | final loss 1 / 2 ranks |
|---|---:|---:|---:|---:|---:|---:|
{rows}

On this tiny model a step is a few milliseconds of arithmetic, so a second rank on a
2-core machine gives little: DDP and ZeRO-2 exchange one gradient reduction per step,
while ZeRO-3 and FSDP also all-gather every target layer and the drafter in each forward
(and the drafter again in backward), which here costs more than the halved arithmetic
saves. Read these rows as each strategy's overhead on CPU, not as GPU scaling. The final losses agree to ~1e-7 relative
(the equivalence tests in `tests/integration/test_strategies.py` check this for every strategy).

**Memory per rank**, a randomly initialised Llama target of {target_params / 1e6:.0f}M parameters
(hidden 1024, {results.get('memory_layers', 24)} layers, fp32), 2 ranks, 2 training steps:
target weights held by the rank (exact bytes of its parameters or shards), the drafter's
weights and AdamW state held by the rank, and the process's peak resident memory:

| trainer | rank | target weights GiB | vs DDP | drafter weights GiB | AdamW state GiB | peak RSS GiB |
|---|---:|---:|---:|---:|---:|---:|
{mem_rows}

With the target sharded (deepspeed_zero3, fsdp) each rank holds half of the decoder
layers plus the replicated embeddings, final norm and lm_head: 0.50 of DDP's target
weights here (the embeddings of this byte-vocabulary target are tiny). The peak RSS falls
much less: it is the process's high-water mark and also counts the Python / torch /
DeepSpeed runtime, memory-mapped safetensors pages touched while loading, allocator caches
and activations. On a GPU the held-weights column is what lands in device memory.
""")


if __name__ == "__main__":
    run(main)
