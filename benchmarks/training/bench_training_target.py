"""Does the static forward pay for the training target forward?

    python -m benchmarks.training.bench_training_target [--lengths 256,512,1024] [--rounds 5] [--compile-length 512]

Online EAGLE-3 / P-EAGLE / Medusa training runs the frozen target over every training
sequence once (`features.target_hidden`: transformers' forward, the aux layers' hidden
states kept). That is a prefill: one forward over T tokens, a product of T rows, where
the decoding engine's costs (Python, dispatch, masks, cache objects) are a small share.
This times, interleaved over rounds, on SmolLM2 fp32 batch 1: transformers' forward as
training calls it, our `StaticLlama` eager over the same T tokens (aux layers kept, the
logits of the last position only), and with --compile-length the static forward compiled
for that one length (a graph per length: training batches vary in length, so this is
the ceiling, not an option).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import load_smollm2, median_ms, run, timed, update_doc_section, write_results
from specforge_lite.runtime.static_llama import StaticLlama
from specforge_lite.runtime.compile import compile_frozen
from specforge_lite.drafters.eagle_family import default_aux_layers
from specforge_lite.training.features import target_hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,512,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile-length", type=int, default=512, help="0: skip the compiled ceiling")
    args = parser.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    model, _ = load_smollm2()
    aux_layers = tuple(default_aux_layers(model.config.num_hidden_layers))  # EAGLE-3's low, middle, high layers
    capacity = max(lengths)
    static = StaticLlama(model, capacity, aux_layers).eval()
    gen = torch.Generator().manual_seed(0)
    ids = {t: torch.randint(0, model.config.vocab_size, (1, t), generator=gen) for t in lengths}

    def hf(t):
        return target_hidden(model, ids[t], torch.ones_like(ids[t]), list(aux_layers))

    def ours(module):
        def forward(t):
            with torch.inference_mode():
                return module(ids[t][0], torch.arange(t), last_only=True)
        return forward

    modes = {"hf": hf, "static": ours(static)}
    compile_s = None
    if args.compile_length:
        t = args.compile_length
        graph, compile_s = compile_frozen(StaticLlama(model, capacity, aux_layers).eval(), [(ids[t][0], torch.arange(t))])
        modes[f"compiled_{t}"] = ours(graph)
    # same hidden states from both forwards (first length)
    t = lengths[0]
    aux, _ = hf(t)
    _, hidden = ours(static)(t)
    max_diff = float((torch.cat(hidden, -1)[None] - aux).abs().max())
    times = {name: {t: [] for t in lengths} for name in modes}
    for _ in range(args.rounds):
        for name, forward in modes.items():
            for t in lengths:
                if name.startswith("compiled") and t != args.compile_length:
                    continue
                forward(t)  # warm this length
                times[name][t].append(timed(lambda: forward(t))[1])
    ms = {name: {t: median_ms(v) for t, v in by_t.items() if v} for name, by_t in times.items()}
    command = ("python -m benchmarks.training.bench_training_target "
               f"--lengths {args.lengths} --rounds {args.rounds} --compile-length {args.compile_length}")
    path = write_results("training_target", {"command": command, "aux_layers": list(aux_layers), "ms": ms,
                                             "compile_s": compile_s, "max_abs_diff_aux_hidden": max_diff})
    rows = [f"| {name} | " + " | ".join(f"{by_t[t]:.0f}" if t in by_t else "-" for t in lengths) + " | "
            + " | ".join(f"{ms['hf'][t] / by_t[t]:.2f}x" if t in by_t else "-" for t in lengths) + " |"
            for name, by_t in ms.items()]
    update_doc_section("training_target", f"""## Training target forward: transformers' vs the static forward (SmolLM2, CPU, fp32)

One frozen target forward over T tokens, batch 1, aux layers {list(aux_layers)} kept, median of
{args.rounds} interleaved rounds (milliseconds, and speed relative to transformers').
Command: `{command}`

| forward | """ + " | ".join(f"T={t} ms" for t in lengths) + " | " + " | ".join(f"T={t} vs hf" for t in lengths) + """ |
|---|""" + "---:|" * (2 * len(lengths)) + "\n" + "\n".join(rows) + f"""

Aux hidden states of the two eager forwards differ by at most {max_diff:.1e}.
{f"Compiling the one length took {compile_s:.0f} s. " if compile_s else ""}Raw: `{path.relative_to(path.parents[2])}`.
""")
    print(ms)


if __name__ == "__main__":
    run(main)
