"""The decode loop outside the target forward, per method: ms per step drafting and looping, and the drafting share.

What `python -m benchmarks.decoding.bench_draft_loop` measures and records. Per method, from the
engine's own timings (`metrics.summarise`):

- forward ms per step: target forwards while decoding / decoding forwards;
- outside-forward ms per step: decoding time minus target forward time, per decoding forward
  (drafting plus the loop's own bookkeeping), split into draft and loop ms per step;
- drafting share: drafting time / decoding time;
- plain only: decoding ms per token over the isolated width-1 forward (`measure_forward_costs`
  at the median context, same runner): what the loop adds to a forward.
"""

from __future__ import annotations

import os
import statistics

from specforge_lite.drafters.registry import drafter_module


def untrained_eagle3(model, drafter_cfg, capacity: int):
    """The EAGLE-3 drafter of `drafter_cfg` (a composed config's `drafter`) for `model` as training
    starts: the target's embeddings and lm_head rows, its residual path (the logit lens of its
    highest aux layer), so its costs per step are a trained drafter's and its acceptance is not."""
    import torch

    eagle3 = drafter_module("eagle3")
    cfg = eagle3.Eagle3Config.from_target(model.config, drafter_cfg)
    drafter = eagle3.Eagle3Drafter(cfg)
    drafter.init_from_target(model, torch.arange(cfg.draft_vocab_size))
    drafter.init_residual_path()
    return eagle3.Eagle3DecodeDrafter(drafter.to(device=model.device, dtype=model.dtype), capacity)


def drafter_arithmetic(module) -> dict:
    """What one drafted token reads and computes in `module` (an EAGLE-3 drafter): the bytes of its
    weights but the embedding (a lookup reads one row of it) and about 2 FLOPs per such weight
    (one multiply-add each; attention over the context is left out: a few hundred positions of one
    layer's keys)."""
    weights = [p for name, p in module.named_parameters() if not name.startswith("embed_tokens")]
    return {"bytes": int(sum(p.numel() * p.element_size() for p in weights)),
            "flops": int(2 * sum(p.numel() for p in weights)), "dtype": str(weights[0].dtype).removeprefix("torch.")}


def measure(model, prompts: list[list[int]], tokens: int, k: int, engine: str, drafter_cfg,
            drafter_dir=None) -> dict:
    """Plain, ngram and EAGLE-3 on `prompts`, interleaved per prompt after one warm-up answer each:
    per method tau, tokens/s and ms per step in and outside the target forward (drafting, loop), the
    drafting share; plain's decoding ms per token over the isolated width-1 forward at the median
    context; EAGLE-3's ms per drafted token beside its bytes and FLOPs per drafted token. EAGLE-3 is
    the trained drafter in `drafter_dir` loaded as evaluate loads it (the target's dtype), else the
    untrained one of `drafter_cfg`; on a compiled engine it drafts with its compiled graphs."""
    from specforge_lite.decoding.drafters import NgramDrafter
    from specforge_lite.decoding.engine import generate_plain, generate_speculative
    from specforge_lite.measurement.metrics import measure_forward_costs, summarise
    from specforge_lite.drafters.registry import engine_decoder
    from specforge_lite.runtime.compiled_run import prepare_compiled
    from specforge_lite.runtime.target_choice import build_target_engine

    capacity = max(len(p) for p in prompts) + tokens + k + 64
    eagle3 = (engine_decoder("eagle3", drafter_dir, model) if drafter_dir
              else untrained_eagle3(model, drafter_cfg, capacity))
    drafters = {"ngram": NgramDrafter(), "eagle3": eagle3}
    layers = sorted({layer for d in drafters.values() for layer in d.hidden_state_layers})
    target = build_target_engine(model, engine, capacity, layers, k + 1)
    prepare_compiled(target, drafters, lambda name, drafter: k, range(1, k + 2))
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
    drafted = sum(sum(g.draft_lengths) for g in gens["eagle3"])
    drafting_s = sum(g.draft_s for g in gens["eagle3"])
    out["eagle3"].update(drafter_arithmetic(eagle3.drafter), trained=bool(drafter_dir),
                         graph=(target.info.get("drafters_graph") or {}).get("eagle3", "eager"),
                         ms_per_drafted_token=1e3 * drafting_s / drafted if drafted else None)
    return {"engine": target.info.get("used"), "isolated_forward_ms": 1e3 * isolated, "context": context,
            "methods": out}


def markdown(d: dict) -> str:
    lines = ["## Draft loop: time per step outside the target forward", "",
             f"`{d['command']}` on {d['machine']}: {d['num_prompts']} ShareGPT first turns, {d['tokens']} tokens, k = {d['k']}, "
             f"{d['dtype']}, engine `{d['engine']}`; eagle3 = "
             + ("the demo's trained drafter" if d["methods"]["eagle3"].get("trained") else
                "the demo's drafter at the start of training (a trained drafter's costs per step, not its acceptance)")
             + ". Isolated width-1 forward "
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
    e = d["methods"]["eagle3"]
    if e.get("ms_per_drafted_token") is not None:
        lines += ["", f"EAGLE-3 drafting ({e.get('graph', 'eager')} graphs, {e['dtype']}): "
                      f"{e['ms_per_drafted_token']:.2f} ms per drafted token, reading {e['bytes'] / 1e6:.1f} MB of "
                      f"weights and computing {e['flops'] / 1e6:.1f} MFLOP per drafted token "
                      f"({e['bytes'] / 1e9 / (e['ms_per_drafted_token'] / 1e3):.1f} GB/s of weights read)."]
    return "\n".join(lines)
