"""The decode loop outside the target forward: per method, ms per step drafting and looping, and the drafting share.

    python -m benchmarks.decoding.bench_draft_loop [--prompts 6] [--tokens 48] [--k 3] [--engine static]

SmolLM2-135M-Instruct (fp32 on a CPU, bf16 on CUDA), ShareGPT first turns, greedy, batch 1,
methods interleaved per prompt after one warm-up answer each: plain, ngram and eagle3. The
eagle3 drafter is the demo recipe's EAGLE-3 at the start of training (the target's embeddings
and lm_head rows, its residual path: the logit lens of its highest aux layer), so its costs per
step are a trained drafter's and its acceptance is not; the demo's trained acceptance lives in
its evaluate record. Per method, from the engine's own timings (`metrics.summarise`):

- forward ms per step: target forwards while decoding / decoding forwards;
- outside-forward ms per step: decoding time minus target forward time, per decoding forward
  (drafting plus the loop's own bookkeeping), split into draft and loop ms per step;
- drafting share: drafting time / decoding time;
- plain only: decoding ms per token over the isolated width-1 forward (`measure_forward_costs`
  at the median context, same runner): what the loop adds to a forward.

Writes benchmarks/results/draft_loop_<device>.json and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics

from benchmarks.common import compose_config, machine, run, sharegpt_first_turns, update_doc_section, write_results


def untrained_eagle3(model, k: int, capacity: int):
    """The demo recipe's EAGLE-3 drafter for `model` as training starts (see the docstring)."""
    import torch

    from specforge_lite.drafters.eagle3.decode import Eagle3DecodeDrafter
    from specforge_lite.drafters.eagle3.model import Eagle3Config, Eagle3Drafter

    cfg = Eagle3Config.from_target(model.config, compose_config(["+recipe=eagle_smollm2"]).drafter)
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(model, torch.arange(cfg.draft_vocab_size))
    drafter.init_residual_path()
    return Eagle3DecodeDrafter(drafter.to(device=model.device, dtype=model.dtype), capacity)


def measure(model, prompts: list[list[int]], tokens: int, k: int, engine: str) -> dict:
    from specforge_lite.decoding.drafters import NgramDrafter
    from specforge_lite.decoding.engine import generate_plain, generate_speculative
    from specforge_lite.decoding.metrics import measure_forward_costs, summarise
    from specforge_lite.runtime.target_choice import build_target_engine

    capacity = max(len(p) for p in prompts) + tokens + k + 64
    drafters = {"ngram": NgramDrafter(), "eagle3": untrained_eagle3(model, k, capacity)}
    layers = sorted({layer for d in drafters.values() for layer in d.hidden_state_layers})
    target = build_target_engine(model, engine, capacity, layers, k + 1)
    decoders = {"plain": lambda ids, n, runner=target.runner(): generate_plain(model, ids, n, runner=runner)}
    for name, drafter in drafters.items():
        decoders[name] = (lambda ids, n, d=drafter, runner=target.runner(drafter.hidden_state_layers):
                          generate_speculative(model, d, ids, n, k, runner=runner))
    for decode in decoders.values():  # warm-up
        decode(prompts[0], min(tokens, 16))
    gens = {name: [] for name in decoders}
    for ids in prompts:
        for name, decode in decoders.items():
            gens[name].append(decode(ids, tokens))
            print(f"{name}: {len(gens[name][-1].tokens)} tokens in {gens[name][-1].total_s:.2f} s", flush=True)
    context = int(statistics.median(len(p) + tokens // 2 for p in prompts))
    isolated = measure_forward_costs(model, context, 1, runner=target.runner())[1]
    out = {}
    for name, answers in gens.items():
        s = summarise(answers, k if name != "plain" else 0)
        decode_s = sum(g.total_s - g.prefill_s for g in answers)
        target_s = sum(g.target_s for g in answers)
        forwards = s["num_target_forwards"]
        out[name] = {"tau": s["tau"], "tokens_per_s": s["tokens_per_s"], "num_tokens": s["num_tokens"],
                     "num_target_forwards": forwards, "forward_ms_per_step": s["target_forward_ms"],
                     "outside_forward_ms_per_step": 1e3 * (decode_s - target_s) / forwards,
                     "draft_ms_per_step": s["draft_ms_per_step"], "loop_ms_per_step": s["overhead_ms_per_step"],
                     "draft_share": s["draft_time_share"], "verify_share": s["verify_time_share"]}
    plain = gens["plain"]
    per_token = sum(g.total_s - g.prefill_s for g in plain) / sum(g.num_forwards for g in plain)
    out["plain"]["decoding_ms_per_token_over_isolated_forward"] = per_token / isolated
    return {"engine": target.info.get("used"), "isolated_forward_ms": 1e3 * isolated, "context": context,
            "methods": out}


def markdown(d: dict) -> str:
    lines = ["## Draft loop: time per step outside the target forward", "",
             f"`{d['command']}` on {d['machine']}: {d['num_prompts']} ShareGPT first turns, {d['tokens']} tokens, k = {d['k']}, "
             f"{d['dtype']}, engine `{d['engine']}`; eagle3 = the demo's drafter at the start of training "
             "(a trained drafter's costs per step, not its acceptance). Isolated width-1 forward "
             f"{d['isolated_forward_ms']:.2f} ms; plain decoding pays "
             f"{d['methods']['plain']['decoding_ms_per_token_over_isolated_forward']:.2f}x that per token."
             + (" Load average (1 min) before / after: {} / {} on {} cores: other work shared the machine, so "
                "absolute times are inflated; the shares compare methods within one run.".format(
                    *d["load_average_1min"], os.cpu_count()) if d.get("load_average_1min") else ""), "",
             "| method | tau | tokens/s | forward ms/step | outside-forward ms/step | draft ms/step | loop ms/step "
             "| drafting share |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in d["methods"].items():
        share = "-" if m["draft_share"] is None else f"{100 * m['draft_share']:.0f}%"
        lines.append(f"| {name} | {m['tau']:.2f} | {m['tokens_per_s']:.1f} | {m['forward_ms_per_step']:.2f} | "
                     f"{m['outside_forward_ms_per_step']:.2f} | {m['draft_ms_per_step']:.2f} | "
                     f"{m['loop_ms_per_step']:.2f} | {share} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--engine", default="static", choices=("hf", "static", "compiled", "auto"))
    args = parser.parse_args(argv)
    import torch
    from omegaconf import OmegaConf

    from benchmarks.common import SMOLLM2
    from specforge_lite.target.loading import load_target

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    model, tokenizer = load_target(OmegaConf.create({**SMOLLM2, "device": device, "dtype": dtype}))
    prompts = sharegpt_first_turns(tokenizer, args.prompts, 256)
    load_before = os.getloadavg()[0]  # a shared machine: how busy it was is part of the record
    measured = measure(model, prompts, args.tokens, args.k, args.engine)
    measured["load_average_1min"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    command = (f"python -m benchmarks.decoding.bench_draft_loop --prompts {args.prompts} --tokens {args.tokens} "
               f"--k {args.k} --engine {args.engine}")
    payload = {"command": command, "num_prompts": len(prompts), "tokens": args.tokens, "k": args.k, "dtype": dtype,
               **measured}
    name = f"draft_loop_{device}"
    write_results(name, payload)
    update_doc_section(name, markdown({**payload, "machine": machine()}))
    for method, m in measured["methods"].items():
        share = "-" if m["draft_share"] is None else f"{100 * m['draft_share']:.0f}%"
        print(f"{method}: outside-forward {m['outside_forward_ms_per_step']:.2f} ms/step, drafting share {share}")


if __name__ == "__main__":
    run(main)
