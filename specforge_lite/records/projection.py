"""Projected EAGLE-3 speedups for real target shapes: measured forward and drafter costs, stated acceptance.

Randomly initialised targets of real shapes (Llama-3.1-8B; one tensor-parallel rank of
Llama-3.1-70B at 1/8 width: 8 of 64 query heads, 1 of 8 KV heads, 1/8 of the MLP and of the
vocabulary, all 80 layers, no all-reduce timed) and their EAGLE-3 drafter (one layer at the
target's shapes, draft vocabulary of 32k), on whatever device is present:

1. the target forward over t = 1..8 new tokens after a `context`-token cache
   (`metrics.measure_forward_costs`, the engine `engine` builds, median of interleaved rounds);
2. the drafter's step as the engine calls it (the EAGLE-3 decode drafter's `propose`: one new
   anchor, then a chain of k drafts), k = 1..7;
3. the report's cost model (`metrics.best_k`, per decoding step, loop overhead left out) fed
   with each acceptance profile: the demo's measured EAGLE-3 per-position acceptance
   (benchmarks/results/eval_eagle_smollm2.json) and a stated one (the same acceptance at every
   position, tau = 3 at k = 3, the order that published EAGLE-3 drafters of 8B chat targets
   report). Every figure is a projection, labelled with the device and the profile.

`make gpu-check` runs the real shapes (its `projection` step); the benchmark script
`python -m benchmarks.decoding.bench_projection` runs them, or a tiny shape anywhere, and records them.
"""

from __future__ import annotations

import gc
import time

from specforge_lite.drafters.registry import drafter_module
from specforge_lite.records.results import load_results
from specforge_lite.records.timing import median_ms

# name -> Llama shape (hidden, layers, query heads, KV heads, head dim, MLP width, vocabulary)
SHAPES = {
    "llama3.1-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                        vocab=128256),
    "llama3.1-70b-tp8-rank": dict(hidden=8192, layers=80, heads=8, kv_heads=1, head_dim=128, intermediate=3584,
                                  vocab=128256 // 8),
}
SMALL = {"tiny": dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=320)}
DRAFT_VOCAB = 32000
MAX_WIDTH = 8  # forward widths 1..8: k = 1..7 drafts plus the pending token
STATED_TAU_AT_3 = 3.0


def stated_profile(tau_at_3: float = STATED_TAU_AT_3, positions: int = MAX_WIDTH - 1) -> list[float]:
    """The same acceptance alpha at every position, solved so that 1 + a + a^2 + a^3 = tau_at_3
    (bisection; tau 3 at k = 3 gives a of about 0.81)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        a = (low + high) / 2
        low, high = (a, high) if 1 + a + a * a + a ** 3 < tau_at_3 else (low, a)
    return [(low + high) / 2] * positions


def demo_profile() -> list[float | None]:
    """The demo's measured EAGLE-3 per-position acceptance (its evaluate report's a_i)."""
    d = load_results("eval_eagle_smollm2", "python -m benchmarks.records.record_eval")
    return d["report"]["methods"]["eagle3"]["per_position_acceptance"]


def build_target(shape: dict, device: str, dtype):
    """A randomly initialised LlamaForCausalLM of `shape`, on `device` in `dtype`, in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         head_dim=shape["head_dim"], intermediate_size=shape["intermediate"],
                         vocab_size=shape["vocab"], max_position_embeddings=8192, tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def build_drafter(target, capacity: int):
    """The EAGLE-3 drafter of `target`'s shapes (random weights) as the decoding engine runs it."""
    from specforge_lite.drafters.eagle_family import default_aux_layers

    eagle3 = drafter_module("eagle3")
    c = target.config
    cfg = eagle3.Eagle3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                       draft_vocab_size=min(DRAFT_VOCAB, c.vocab_size),
                       aux_layer_ids=default_aux_layers(c.num_hidden_layers))
    drafter = eagle3.Eagle3Drafter(cfg).to(device=target.device, dtype=target.dtype)
    return eagle3.Eagle3DecodeDrafter(drafter, capacity)


def time_drafter(decoder, context: int, max_k: int, repeats: int) -> dict[int, float]:
    """Median seconds of one `propose(ctx, k)` per k = 1..max_k in steady state: each call
    commits one new position (its target hidden states) and drafts a chain of k."""
    import torch

    from specforge_lite.contract import GREEDY, DraftContext

    cfg, device = decoder.drafter.config, decoder.drafter.fc.weight.device
    dtype = decoder.drafter.fc.weight.dtype

    def hidden(n):
        return {layer: torch.randn(1, n, cfg.hidden_size, device=device, dtype=dtype)
                for layer in decoder.hidden_state_layers}

    ctx = DraftContext(token_ids=list(range(3, context + 4)), num_prompt_tokens=context, hidden_states=hidden(context),
                       sampling=GREEDY, generator=None)
    decoder.reset()
    decoder.propose(ctx, 1)  # the prompt's anchors
    times: dict[int, list[float]] = {k: [] for k in range(1, max_k + 1)}
    for round_index in range(5 * repeats + 1):  # round 0 warms up
        for k in times:
            ctx.token_ids.append(5)
            ctx.hidden_states = hidden(1)
            start = time.perf_counter()
            decoder.propose(ctx, k)  # returns token ids: the device has finished
            if round_index:
                times[k].append(time.perf_counter() - start)
    return {k: median_ms(v) / 1e3 for k, v in times.items()}


def project_shape(shape: dict, profiles: dict[str, list], device: str, dtype, context: int, repeats: int,
                  engine: str) -> dict:
    """One shape: forward and drafter costs measured on `device`, each profile's projection."""
    import torch

    from specforge_lite.measurement.metrics import best_k, measure_forward_costs
    from specforge_lite.runtime.target_choice import build_target_engine

    target = build_target(shape, device, dtype)
    decoder = build_drafter(target, capacity=context + 64 + 5 * repeats * MAX_WIDTH)
    capacity = context + 2 * MAX_WIDTH + 64
    try:
        forward = build_target_engine(target, engine, capacity, decoder.hidden_state_layers, MAX_WIDTH)
    except ValueError:  # a shape the static forward does not run: transformers' own (named in the results)
        forward = build_target_engine(target, "hf", capacity, decoder.hidden_state_layers, MAX_WIDTH)
    costs = measure_forward_costs(target, context, MAX_WIDTH, repeats, runner=forward.runner())
    drafts = time_drafter(decoder, context, MAX_WIDTH - 1, repeats)
    params = sum(p.numel() for p in target.parameters())
    out = {"shape": shape, "target_params": params, "engine": forward.info.get("used"),
           "forward_ms_by_width": {t: 1e3 * s for t, s in costs.items()},
           "drafter_ms_by_k": {k: 1e3 * s for k, s in drafts.items()}, "projections": {}}
    for name, alphas in profiles.items():
        table = best_k(alphas, costs, lambda k: drafts[k])
        out["projections"][name] = table
    del target, decoder, forward
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def project(shapes: dict[str, dict], device: str, dtype_name: str = "bfloat16", context: int = 512,
            repeats: int = 3, engine: str = "static", profiles: dict[str, list] | None = None) -> dict:
    """Every shape's measured costs and projected speedups (a results payload), labelled."""
    import torch

    dtype = getattr(torch, dtype_name)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"{device} ({torch.get_num_threads()} threads)"
    profiles = profiles or {"demo_measured": demo_profile(), f"stated_tau{STATED_TAU_AT_3:g}_at_k3": stated_profile()}
    return {"label": f"projection on {name}, {dtype_name}: measured forward and drafter costs of random weights, "
                     "expected speedups from acceptance profiles (not decoded answers)",
            "device": name, "dtype": dtype_name, "context": context, "profiles": profiles,
            "cost_model": "metrics.best_k per decoding step: step = drafter(k) + forward(k + 1); plain = forward(1); "
                          "loop overhead and tensor-parallel communication left out",
            "shapes": {shape_name: project_shape(shape, profiles, device, dtype, context, repeats, engine)
                       for shape_name, shape in shapes.items()}}


def markdown(payload: dict, command: str) -> str:
    lines = ["## Projected EAGLE-3 speedups for real target shapes", "",
             f"`{command}` on {payload['device']}, {payload['dtype']}. {payload['label']}; {payload['cost_model']}. Profiles: "
             + "; ".join(f"`{n}` a = [{', '.join('-' if a is None else f'{a:.2f}' for a in p)}]"
                         for n, p in payload["profiles"].items()) + ".", "",
             "| shape | forward ms t=1 / t=4 / t=8 | drafter ms k=3 | profile | best k | projected speedup |",
             "|---|---:|---:|---|---:|---:|"]
    for shape, s in payload["shapes"].items():
        f, d = s["forward_ms_by_width"], s["drafter_ms_by_k"]
        for profile, p in s["projections"].items():
            speed = "-" if p["best_k"] is None else f"{p['expected_speedup']:.2f}x"
            lines.append(f"| {shape} | {f[1]:.2f} / {f[4]:.2f} / {f[8]:.2f} | {d[3]:.2f} | {profile} | "
                         f"{p['best_k']} | {speed} (projection) |")
    return "\n".join(lines)
