"""Batched sampling: our static-cache forward (eager and compiled) against HF `generate`.

    python -m benchmarks.sampling.bench_batched_sampling [--prompts 32] [--batch-size 16] [--max-new-tokens 64]

Same prompts (first user turns of ShareGPT train conversations, sorted by length and cut
into batches as the sample stage does), same batch size, greedy, same loaded
SmolLM2-135M-Instruct target, fp32 on CPU. Modes, interleaved over `--rounds`:
`hf_generate` (transformers' `generate`, left-padded batches), `hf` (the sample stage's
`hf` backend), `static` and `compiled` (`sample.backend=static|compiled`). The compiled
step is built once before the rounds and its compile time is reported apart;
`compiled_inductor_rows` is the same step built with inductor's own register blocks for its
fp32 GEMM micro-kernel (`SPECFORGE_LITE_GEMM_ROWS=0`) instead of ours. Generated
tokens are counted up to and including EOS; rows whose tokens differ from `hf_generate`'s
are counted too (greedy fp32: they should not).
"""

from __future__ import annotations

import argparse
import os

import torch
from omegaconf import OmegaConf

from benchmarks.common import (interleaved, load_smollm2, run, sharegpt_first_turns, timed, update_doc_section,
                               write_results)
from specforge_lite.records import goals as issue_goals
from specforge_lite.runtime.compile import GEMM_ROWS_ENV, gemm_rows, inductor_gemm_rows
from specforge_lite.stages.sample_backends import HFBackend, StaticBackend, left_padded
from specforge_lite.targets.loading import eos_token_ids

MODES = ("hf_generate", "hf", "static", "compiled", "compiled_inductor_rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if os.environ.get(GEMM_ROWS_ENV):
        parser.error(f"unset {GEMM_ROWS_ENV}: this bench compares our default rows with inductor's own")

    model, tokenizer = load_smollm2()
    prompts = sharegpt_first_turns(tokenizer, args.prompts, args.max_prompt_tokens)
    prompts.sort(key=len)  # what the sample stage does within a round
    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    cfg = OmegaConf.create({"temperature": 0.0, "top_p": 1.0, "max_new_tokens": args.max_new_tokens,
                            "batch_size": args.batch_size, "max_prompt_length": args.max_prompt_tokens})
    eos = set(eos_token_ids(model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @torch.inference_mode()
    def hf_generate(batch):
        ids, start = left_padded(batch, pad)
        width = ids.shape[1]
        mask = (torch.arange(width)[None, :] >= start[:, None]).long()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=sorted(eos))[:, width:].tolist()
        rows = []
        for tokens in out:
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            rows.append(tokens[:cut])
        return rows

    backends = {"hf": HFBackend(model, tokenizer, cfg), "static": StaticBackend(model, tokenizer, cfg, False)}
    backends["compiled"], compile_s = timed(lambda: StaticBackend(model, tokenizer, cfg, True))
    with inductor_gemm_rows():
        backends["compiled_inductor_rows"] = StaticBackend(model, tokenizer, cfg, True)
    generate = {"hf_generate": hf_generate,
                **{name: (lambda b: (lambda batch: [t for t, _ in b.generate(batch)]))(b) for name, b in backends.items()}}
    for name in MODES:  # warm-up
        generate[name](batches[0][:2] if name == "hf_generate" else batches[0])

    outputs: dict[str, list] = {}

    def mode(name):
        def tokens():
            outputs[name] = [r for batch in batches for r in generate[name](batch)]
            return sum(len(r) for r in outputs[name])
        return tokens

    totals, ratios = interleaved({name: mode(name) for name in MODES}, args.rounds, "hf_generate")
    rate = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    differing = {name: sum(a != b for a, b in zip(outputs[name], outputs["hf_generate"])) for name in MODES}
    worst = {name: min(r) for name, r in ratios.items()}
    goals = issue_goals.check_value(issue_goals.goals_of("batched_sampling"), "compiled_ge_2x_hf_generate",
                                    worst["compiled"])
    command = (f"python -m benchmarks.sampling.bench_batched_sampling --prompts {args.prompts} --batch-size {args.batch_size} "
               f"--max-new-tokens {args.max_new_tokens} --rounds {args.rounds}")
    path = write_results("batched_sampling", {
        "command": command, "target": "builtin:smollm2-135m-instruct", "dtype": "float32",
        "prompts": len(prompts), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds, "torch_threads": torch.get_num_threads(), "compile_s": round(compile_s, 1),
        "tokens": {k: v[0] for k, v in totals.items()}, "seconds": {k: round(v[1], 2) for k, v in totals.items()},
        "tokens_per_s": {k: round(v, 2) for k, v in rate.items()},
        "speedup_vs_hf_generate_per_round": {k: [round(x, 2) for x in v] for k, v in ratios.items()},
        "rows_differing_from_hf_generate": differing,
        "goals": goals})
    labels = {"hf_generate": "HF `generate` (left-padded batches)", "hf": "`hf` backend (our loop, HF forward)",
              "static": "`static` backend (our forward, eager)",
              "compiled": f"`compiled` backend (width-1 step compiled, {gemm_rows()}-row GEMM blocks)",
              "compiled_inductor_rows": "`compiled`, inductor's own GEMM register blocks"}
    table = "\n".join(f"| {labels[n]} | {totals[n][0]} | {totals[n][1]:.1f} | {rate[n]:.1f} | "
                      f"{', '.join(f'{x:.2f}' for x in ratios[n])} | {differing[n]} |" for n in MODES)
    update_doc_section("batched_sampling", f"""## Batched sampling: static forward vs HF `generate` (SmolLM2, CPU, fp32)

{len(prompts)} ShareGPT first-turn prompts sorted by length in batches of {args.batch_size}, greedy,
{args.max_new_tokens} new tokens at most, {args.rounds} interleaved rounds, {torch.get_num_threads()} torch threads.
Command: `{command}`

| mode | generated tokens | seconds | tokens/s | x HF generate per round | rows differing from HF generate |
|---|---:|---:|---:|---|---:|
{table}

Compiling the batch-{args.batch_size} step took {compile_s:.0f} s (once per sample run, not in the table).
The compiled backend's least favourable round, **{worst['compiled']:.2f}x** HF `generate`, is the figure
(least favourable round). Goal (benchmarks/goals.yaml): {'; '.join(line[2:] for line in issue_goals.lines(goals)) or 'none'}.
Raw: `{path.relative_to(path.parents[2])}`.
""")
    print(f"compiled {rate['compiled']:.1f} tok/s vs HF generate {rate['hf_generate']:.1f}: {worst['compiled']:.2f}x "
          f"(least favourable round); compile {compile_s:.0f} s")


if __name__ == "__main__":
    run(main)
