"""The EAGLE-3 drafter's training step on SmolLM2's shapes: fp32, bf16 autocast and compiled.

    python -m benchmarks.training.bench_train_step [--seq 512] [--steps 8] [--ttt 3]

Times the step the train stage runs per sequence once the target's features are at hand
(offline mode): the TTT unroll forward, the stepwise soft cross-entropy, backward and an
AdamW step, on random features and soft labels of SmolLM2's sizes (hidden 576, draft vocab
8192, aux layers 3). Variants: fp32 eager; bf16 autocast (the drafter's weights stay fp32)
where the CPU runs bf16 natively; each of those under `torch.compile` of the forward and
loss. Reports tokens/s (median of the timed steps after two warm-ups) and the loss after the
same steps from the same seed, so a faster variant is seen to learn the same.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from benchmarks.common import median_ms, run, timed, update_doc_section, write_results
from specforge_lite.drafters.common import shifted_targets, stepwise_loss
from specforge_lite.drafters.registry import drafter_module

eagle3 = drafter_module("eagle3")  # the drafter package, from the registry


def smollm2_config():
    return eagle3.Eagle3Config(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                        intermediate_size=1536, vocab_size=49152, draft_vocab_size=8192, aux_layer_ids=[2, 15, 27],
                        rms_norm_eps=1e-5, rope_theta=100000.0, norm_before_residual=True)


def measure(variant: str, seq: int, steps: int, ttt: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    cfg = smollm2_config()
    drafter = eagle3.Eagle3Drafter(cfg)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randint(0, cfg.vocab_size, (1, seq), generator=gen),
                torch.randn(1, seq, 3 * cfg.hidden_size, generator=gen),
                torch.randn(1, seq, cfg.draft_vocab_size, generator=gen) * 3,
                torch.ones(1, seq)) for _ in range(2)]
    bf16 = variant.startswith("bf16")

    def loss_of(ids, aux, logits, valid):
        outputs = drafter(ids, aux, ttt)
        return stepwise_loss(outputs, shifted_targets(logits, valid, ttt), 0.8)[0] / ids.numel()

    step_fn = torch.compile(loss_of) if variant.endswith("compiled") else loss_of
    def train_step(batch):
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with cast:
            loss = step_fn(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    losses, times = zip(*(timed(lambda: train_step(batches[i % 2])) for i in range(steps + 2)))
    step_ms = median_ms(list(times[2:]))
    return {"tokens_per_s": 1e3 * seq / step_ms, "step_ms": step_ms, "first_step_s": times[0],
            "loss_first": losses[0], "loss_last": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ttt", type=int, default=3)
    parser.add_argument("--variants", default="fp32,bf16,fp32_compiled,bf16_compiled")
    args = parser.parse_args()
    native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    variants = [v for v in args.variants.split(",") if native_bf16 or not v.startswith("bf16")]
    results = {}
    for variant in variants:
        results[variant] = measure(variant, args.seq, args.steps, args.ttt)
        print(variant, {k: round(v, 5) for k, v in results[variant].items()}, flush=True)
    base = results["fp32"]["tokens_per_s"]
    for r in results.values():
        r["vs_fp32"] = r["tokens_per_s"] / base
    command = ("python -m benchmarks.training.bench_train_step "
               + " ".join(f"--{k} {v}" for k, v in vars(args).items()))
    payload = {"command": command, "native_bf16": native_bf16, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "settings": {"seq": args.seq, "steps": args.steps, "ttt_steps": args.ttt, "hidden": 576,
                            "draft_vocab": 8192}, "results": results}
    write_results("train_step", payload)
    rows = "\n".join(f"| {name} | {r['tokens_per_s']:.0f} | {r['vs_fp32']:.2f}x | {r['step_ms']:.0f} | "
                     f"{r['first_step_s']:.1f} | {r['loss_first']:.5f} -> {r['loss_last']:.5f} |"
                     for name, r in results.items())
    update_doc_section("train_step", f"""## EAGLE-3 training step: fp32, bf16 autocast, compiled (SmolLM2 shapes, CPU)

`{command}` (CPU capability {payload['cpu_capability']}, native bf16: {native_bf16}). One sequence of
{args.seq} tokens per step, {args.ttt} TTT steps, AdamW; random features and soft labels of SmolLM2's
sizes; median of {args.steps} timed steps after two warm-ups (the first step includes any compile).

| variant | tokens/s | vs fp32 | step ms | first step s | loss first -> last |
|---|---|---|---|---|---|
{rows}
""")


if __name__ == "__main__":
    run(main)
