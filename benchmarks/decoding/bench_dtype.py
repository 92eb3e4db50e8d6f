"""The target's forward by width in float32 and bf16 on this CPU, and what target.dtype=auto chooses.

    python -m benchmarks.decoding.bench_dtype [--shape smollm2] [--threads 2] [--widths 16] [--compiled]
                                              [--name dtype_choice]

A SmolLM2-135M-shaped Llama (`--shape smollm2`: its config, random weights; forward costs do not
depend on the weights' values, so a machine without the SmolLM2 package measures the same shape)
or the built-in SmolLM2 (`--shape builtin`). After a 128-token prefill, the median time of one
forward over t = 1..--widths new tokens, rounds interleaved across engines and widths, for
Hugging Face's forward and our static forward (eager; `--compiled`: its compiled package too),
each in float32 and in bf16, at `--threads` threads. Then `choose_cpu_dtype` as evaluate calls it
(widths 1 and 4, the demo's k = 3), which says whether this CPU has native bf16 and what it picked.
Per engine and dtype the results give the ratio of the widest forward to the one-token forward
(the figure the dtype issue's goal bounds where bf16 is chosen; this script records it, checks nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import tempfile

from benchmarks.common import load_smollm2, run, update_doc_section, write_results

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)


def target(shape: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == "builtin":
        return load_smollm2()[0]
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2)).eval()


def forward_ms(runners: dict, vocab: int, widths: range, rounds: int) -> dict:
    import torch

    from specforge_lite.runtime.width_timing import time_forwards

    context = torch.randint(0, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    timing = time_forwards(runners, context, widths, rounds)
    return {name: {t: round(v, 3) for t, v in by_width.items()} for name, by_width in timing["ms"].items()}


def measure(args) -> dict:
    import torch

    from specforge_lite.runtime.dtype_choice import choose_cpu_dtype, native_bf16
    from specforge_lite.runtime.fast_engine import FastEngine
    from specforge_lite.runtime.hf_runner import TargetRunner

    torch.set_num_threads(args.threads)
    model32 = target(args.shape)
    models = {"float32": model32, "bfloat16": copy.deepcopy(model32).to(torch.bfloat16).eval()}
    capacity = 128 + args.widths + 16
    runners, compile_s = {}, {}
    for dtype, model in models.items():
        runners[f"hf {dtype}"] = TargetRunner(model)
        runners[f"static {dtype}"] = FastEngine(model, capacity, max_width=args.widths).runner()
        if args.compiled:
            with tempfile.TemporaryDirectory(prefix="bench_dtype_") as cache:
                engine = FastEngine(model, capacity, max_width=args.widths, compiled=True, cache_dir=cache)
                compile_s[dtype] = round(engine.compile(), 1)
                runners[f"compiled {dtype}"] = engine.runner()
    widths = range(1, args.widths + 1)
    ms = forward_ms(runners, model32.config.vocab_size, widths, args.rounds)
    _, choice = choose_cpu_dtype(model32, [1, 4])
    return {"threads": args.threads, "shape": args.shape, "native_bf16": native_bf16(), "widths": list(widths),
            "ms": ms, "widest_over_one": {n: round(v[args.widths] / v[1], 3) for n, v in ms.items()},
            "compile_s": compile_s, "auto_choice": choice}


def markdown(result: dict, command: str) -> str:
    widths = result["widths"]
    shown = [w for w in widths if w in (1, 2, 3, 4, 5, 6, 8, 12, 16)]
    lines = [f"`{command}`", "",
             f"CPU: {result['cpu']} ({result['threads']} threads); machine: {result['machine']}; "
             f"commit {str(result.get('commit'))[:10]}.", "",
             "| forward | " + " | ".join(f"t={w}" for w in shown) + f" | t={widths[-1]} / t=1 |",
             "|---|" + "---:|" * (len(shown) + 1)]
    for name, by_width in result["ms"].items():
        lines.append(f"| {name} | " + " | ".join(f"{by_width[str(w)]:.1f}" for w in shown)
                     + f" | {result['widest_over_one'][name]:.2f}x |")
    choice = result["auto_choice"]
    lines += ["", f"ms per forward after a 128-token context, median of rounds. target.dtype=auto here: "
                  f"**{choice['used']}** ({choice['reason']})."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("smollm2", "builtin"), default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--widths", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compiled", action="store_true", help="also time the compiled package (minutes to build)")
    parser.add_argument("--name", default="dtype_choice", help="results file and docs section name")
    args = parser.parse_args()
    command = "python -m benchmarks.decoding.bench_dtype " + shlex.join(sys.argv[1:])
    result = {"command": command, **measure(args)}
    print(json.dumps({k: result[k] for k in ("widest_over_one", "auto_choice")}, indent=1))
    path = write_results(args.name, result)
    result = json.loads(path.read_text())
    update_doc_section(args.name, markdown(result, command))


if __name__ == "__main__":
    run(main)
