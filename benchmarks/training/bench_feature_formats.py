"""Compact offline features: bytes per token, reconstruction error, read speed and held-out tau.

Held-out tau of EAGLE-3 drafters trained on each stored format (`train.feature_format`).

    python -m benchmarks.training.bench_feature_formats train bf16 int4_topk   # train + evaluate each, same rows and seed
    python -m benchmarks.training.bench_feature_formats measure                # formulas, disk, error, read speed
    python -m benchmarks.training.bench_feature_formats record                 # JSON + the docs section

`train` runs the CLI's train and evaluate stages on SmolLM2-135M-Instruct (offline mode; the
same sampled + source rows, seed and steps for every format; evaluated on first turns of the
ShareGPT held-out split, methods plain and eagle3). `measure` builds a real cache of the first
MEASURE_ROWS training rows in every format and reads it back. Runs live under runs/feature_formats/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from benchmarks.common import (ROOT, asks_help, choose, compose_config, fail, needed, paired_tau_difference, run,
                               run_cli, run_file, timed, update_doc_section, with_ci, write_results)
from specforge_lite.drafters.registry import drafter_module
from specforge_lite.training.feature_formats import (FORMATS, GROUP_SIZE, TOP_K, bytes_per_token, dequantize,
                                            quantize, sparse_teacher_logits)

OUT = Path("runs/feature_formats")
MEASURE_ROWS = 48
GROUPS = (32, 64, 128, None)  # None: one scale per token (the whole row)
COMMON = ["+recipe=eagle_smollm2", "samples_dir=runs/feature_formats/samples", "data.max_samples=8",
          "data.max_length=256", "sample.max_new_tokens=64", "sample.turns=last", "train.mode=offline",
          "train.source_conversations=300", "train.tracker=none", "train.checkpoint_every=0",
          "eval.dataset=heldout", "eval.methods=[plain,eagle3]", "eval.max_new_tokens=64", "eval.max_prompts=20",
          "eval.plots=false"]
CONFIGS = {"SmolLM2-135M": None, "Llama-3.1-8B": "llama-3.1-8b-instruct.json",
           "Llama-3.1-70B": "llama-3.1-70b-instruct.json"}


def run_dir(fmt: str) -> Path:
    """Where a format's run lives; quantized formats name their group size (a run per grouping)."""
    return OUT / (fmt if fmt == "bf16" else f"{fmt}_g{GROUP_SIZE}")


def overrides(fmt: str) -> list[str]:
    return [*COMMON, f"run_dir={run_dir(fmt)}", f"train.feature_format={fmt}"]


def train(formats: list[str]) -> None:
    for fmt in formats:
        for stage in ("train", "evaluate"):
            wall = run_cli([stage, *overrides(fmt)], f"{stage} ({fmt})", quiet=False)
            (run_dir(fmt) / f"{stage}_wall.json").write_text(json.dumps({"seconds": wall}))
            print(f"{fmt} {stage}: {wall:.0f} s", flush=True)


# --------------------------------------------------------------------------- measure

def hidden_size(name: str) -> int:
    if CONFIGS[name] is None:
        from specforge_lite.targets.loading import sizing_config

        return sizing_config("builtin:smollm2-135m-instruct").hidden_size
    return json.loads((ROOT / "specforge_lite" / "assets" / "configs" / CONFIGS[name]).read_text())["hidden_size"]


def formulas() -> dict:
    """Bytes per token of every layout, 3 aux layers, by target."""
    out = {}
    for name in CONFIGS:
        h = hidden_size(name)
        peer = (3 + 1) * h * 2  # SpecForge and speculators: aux 3H + last H, bf16
        ours = {fmt: bytes_per_token(fmt, h, 3) for fmt in FORMATS}
        out[name] = {"hidden_size": h, "specforge": peer, "speculators": peer, "ours": ours,
                     "ratio_to_specforge": {fmt: b / peer for fmt, b in ours.items()}}
    return out


def quant_error(x: torch.Tensor, fmt: str, group) -> dict:
    """Relative Frobenius error and per-token cosine of x [N, W] after a round trip."""
    width = x.shape[1]
    y = dequantize(quantize(x, fmt, group or width), fmt, width)
    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
    return {"rel_error": float((y - x).norm() / x.norm()), "cos_mean": float(cos.mean()), "cos_min": float(cos.min())}


def teacher_error(last: torch.Tensor, approx: torch.Tensor, draft_head: torch.Tensor) -> dict:
    """Draft-vocab teacher from `approx` last states against fp32's: top-1 agreement and mean KL."""
    p = torch.log_softmax(last @ draft_head.T, -1)
    q = torch.log_softmax(approx @ draft_head.T, -1)
    return {"top1_agree": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
            "kl": float((p.exp() * (p - q)).sum(-1).mean())}


def measure() -> None:
    from specforge_lite.drafters.vocab import count_tokens
    from specforge_lite.training.features import FeatureCache, cache_key, collate, draft_vocab_targets, target_hidden
    from specforge_lite.stages.train import training_rows
    from specforge_lite.targets.loading import load_target

    eagle3 = drafter_module("eagle3")
    torch.manual_seed(0)
    cfg = compose_config(["stage=train", *overrides("bf16")])
    target, tokenizer = load_target(cfg.target)
    rows = training_rows(cfg, tokenizer)
    counts = count_tokens(((r["input_ids"], r["loss_mask"]) for r in rows), target.config.vocab_size)
    drafter = eagle3.build(cfg, target, counts)
    aux_ids = eagle3.target_layers(drafter)
    head = target.get_output_embeddings().weight.detach()
    draft_head = head[drafter.draft_vocab]
    rows = rows[:MEASURE_ROWS]
    num_tokens = sum(len(r["input_ids"]) for r in rows)

    # fp32 features of the measured rows: the reference every format is compared with
    aux_all, last_all, teacher = [], [], []
    for row in rows:
        batch = collate([row], tokenizer.pad_token_id, "cpu")
        aux, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], aux_ids)
        aux_all.append(aux[0])
        last_all.append(last[0])
    aux_all, last_all = torch.cat(aux_all), torch.cat(last_all)
    channel_absmax = torch.cat([aux_all, last_all], -1).abs().amax(0)
    outliers = {"max_over_median_channel_absmax": float(channel_absmax.max() / channel_absmax.median()),
                "channels_over_10x_median": int((channel_absmax > 10 * channel_absmax.median()).sum())}

    error = {}
    for fmt in ("bf16", "int8", "int4"):
        for group in ((None,) if fmt == "bf16" else GROUPS):
            name = fmt if fmt == "bf16" else f"{fmt}/g{group or 'row'}"
            error[name] = {"aux": quant_error(aux_all, fmt, group), "last": quant_error(last_all, fmt, group)}
            width = last_all.shape[1]
            approx = dequantize(quantize(last_all, fmt, group or width), fmt, width)
            error[name]["teacher_from_last"] = teacher_error(last_all, approx, draft_head)

    # int4_topk's teacher: the top-k draft logits renormalised against the full draft-vocab softmax
    logits = last_all @ draft_head.T
    p = torch.log_softmax(logits, -1)
    values, ids = logits.topk(TOP_K, -1)
    q = torch.log_softmax(sparse_teacher_logits(values.half(), ids, logits.shape[-1]), -1)
    mass = p.exp().gather(-1, ids).sum(-1)
    topk = {"top_k": TOP_K, "mass_mean": float(mass.mean()), "mass_min": float(mass.min()),
            "kl": float(-(mass.log()).mean()),  # KL(p || p restricted to the top k, renormalised)
            "top1_agree": float((p.argmax(-1) == q.argmax(-1)).float().mean())}

    disk, reads = {}, {}
    for fmt in FORMATS:
        cache = FeatureCache(OUT / "measure_cache" / fmt, shard_size=16, feature_format=fmt)
        vocab = drafter.draft_vocab if fmt == "int4_topk" else None
        cache.prepare(rows, target.config.hidden_size, aux_ids,
                      cache_key(rows, cfg.target.path, target.dtype, aux_ids, fmt, vocab))
        teach = None
        if fmt == "int4_topk":
            def teach(last_hidden, loss_mask):
                return draft_vocab_targets(head, draft_head, last_hidden, drafter.t2d, loss_mask)
        cache.build(target, rows, aux_ids, tokenizer.pad_token_id, 4, teacher=teach)
        size = sum(f.stat().st_size for f in cache.dir.glob("shard-*.safetensors"))
        disk[fmt] = {"bytes": size, "tokens": num_tokens, "bytes_per_token": size / num_tokens,
                     "formula_bytes_per_token": bytes_per_token(fmt, target.config.hidden_size, len(aux_ids))}
        timings = []
        for _ in range(3):  # a fresh reader each pass (shards opened again), the page cache warm
            reader = FeatureCache(cache.dir, 16, fmt)
            timings.append(timed(lambda: [reader.batch([i], "cpu") for i in range(len(rows))])[1])
        reads[fmt] = {"tokens_per_s": num_tokens / min(timings), "seconds": min(timings), "passes": len(timings)}
    (OUT / "measure.json").write_text(json.dumps({
        "rows": len(rows), "tokens": num_tokens, "aux_layer_ids": list(aux_ids), "group_size": GROUP_SIZE,
        "draft_vocab": int(drafter.draft_vocab.numel()), "outliers": outliers, "error": error, "topk_teacher": topk,
        "disk": disk, "read": reads, "threads": torch.get_num_threads()}, indent=1))
    print(json.dumps({"disk": disk, "read": reads, "topk": topk}, indent=1))


# --------------------------------------------------------------------------- record

def run_summary(folder: Path) -> dict:
    report = run_file(folder, "eval/report.json")
    history = run_file(folder, "train/metrics.json")["history"]
    meta = run_file(folder, "train/features/meta.json")
    disk = sum(f.stat().st_size for f in (folder / "train" / "features").glob("shard-*.safetensors"))
    eagle = report["methods"]["eagle3"]
    walls = {stage: json.loads((folder / f"{stage}_wall.json").read_text())["seconds"]
             for stage in ("train", "evaluate") if (folder / f"{stage}_wall.json").exists()}
    stored = meta["key"]["stored_dtype"]
    return {"format": meta.get("feature_format", "bf16"), "stored": "bf16" if stored == "bfloat16" else stored,
            "run_dir": str(folder), "tau": eagle["tau"], "tau_ci": eagle["tau_ci"], "per_position_acceptance": eagle["per_position_acceptance"],
            "identical_to_plain": eagle["identical_to_plain"], "num_prompts": eagle["num_prompts"],
            "steps": history[-1]["step"], "final_train_simulated_tau": history[-1]["simulated_tau"],
            "cache_tokens": meta["num_tokens"], "cache_bytes": disk, "cache_bytes_per_token": disk / meta["num_tokens"],
            "wall_s": walls, "answers": report["answers"]}


def record() -> None:
    measured = json.loads(needed(OUT / "measure.json", f"python -m {__spec__.name} measure").read_text())
    found = [run_summary(f.parent.parent) for f in sorted(OUT.glob("*/eval/report.json"))]
    if not found:
        fail(f"no evaluated run under {OUT}; `python -m {__spec__.name} train bf16 int4_topk` makes them")
    runs = {r["stored"]: r for r in sorted(found, key=lambda r: (r["stored"] != "bf16", r["stored"]))}
    for name, r in runs.items():
        if name != "bf16" and "bf16" in runs:
            r["tau_minus_bf16"] = paired_tau_difference(r["answers"], runs["bf16"]["answers"], "eagle3")
    command = ("python -m benchmarks.training.bench_feature_formats train bf16 int4_topk; ... train int4 (both with "
               "group size 64); ... train int4_topk (group size 32); ... measure; ... record")
    payload = {"command": command, "overrides": COMMON, "formulas": formulas(), "measured": measured,
               "runs": {f: {k: v for k, v in r.items() if k != "answers"} for f, r in runs.items()}}
    path = write_results("feature_formats", payload)
    update_doc_section("feature_formats", render(json.loads(path.read_text())))


def render(d: dict) -> str:
    m, peers = d["measured"], d["formulas"]
    size = ["| target | H | SpecForge / speculators (bf16: (3 + 1) * H * 2) | "
            + " | ".join(f"ours {f}" for f in FORMATS) + " |", "|---|---:|---:|" + "---:|" * len(FORMATS)]
    for name, row in peers.items():
        size.append(f"| {name} | {row['hidden_size']} | {row['specforge']:.0f} B | " + " | ".join(
            f"{row['ours'][f]:.0f} B ({row['ratio_to_specforge'][f]:.3f})" for f in FORMATS) + " |")
    disk = ["| format | formula B/token | measured B/token on disk | read tokens/s | read vs bf16 |",
            "|---|---:|---:|---:|---:|"]
    base = m["read"]["bf16"]["tokens_per_s"]
    for f in FORMATS:
        dd, rr = m["disk"][f], m["read"][f]
        disk.append(f"| {f} | {dd['formula_bytes_per_token']:.0f} | {dd['bytes_per_token']:.0f} | "
                    f"{rr['tokens_per_s']:.0f} | {rr['tokens_per_s'] / base:.2f}x |")
    err = ["| stored as | aux rel. error | aux cos mean / min | last rel. error | last cos mean / min | "
           "teacher top-1 agree | teacher KL |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, e in m["error"].items():
        t = e["teacher_from_last"]
        err.append(f"| {name} | {e['aux']['rel_error']:.4f} | {e['aux']['cos_mean']:.4f} / {e['aux']['cos_min']:.4f} | "
                   f"{e['last']['rel_error']:.4f} | {e['last']['cos_mean']:.4f} / {e['last']['cos_min']:.4f} | "
                   f"{t['top1_agree']:.4f} | {t['kl']:.5f} |")
    t = m["topk_teacher"]
    err.append(f"| top-{t['top_k']} teacher (int4_topk) | - | - | - | - | {t['top1_agree']:.4f} | {t['kl']:.5f} |")
    tau = ["| features | steps | held-out tau [95% CI] | tau - bf16 [95% paired CI] | acceptance a1 / a2 / a3 | "
           "identical to plain | cache B/token (this run) |", "|---|---:|---:|---:|---|---|---:|"]
    for f, r in d["runs"].items():
        delta = r.get("tau_minus_bf16")
        tau.append(f"| {f} | {r['steps']} | {with_ci(r['tau'], r['tau_ci'], 3)} | "
                   + (f"{delta['difference']:+.3f} [{delta['ci'][0]:+.3f}, {delta['ci'][1]:+.3f}]" if delta else "-")
                   + f" | {' / '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} | {r['identical_to_plain']} | "
                     f"{r['cache_bytes_per_token']:.0f} |")
    o = m["outliers"]
    chosen = d["runs"].get(f"int4_topk/g{m['group_size']}", {}).get("tau_minus_bf16")
    verdict = "-" if chosen is None else (
        f"its held-out tau minus bf16's is {chosen['difference']:+.3f}, 95% paired interval "
        f"[{chosen['ci'][0]:+.3f}, {chosen['ci'][1]:+.3f}], which "
        + ("includes 0: equal within the interval" if chosen["ci"][0] <= 0 <= chosen["ci"][1] else "excludes 0"))
    smol = peers["SmolLM2-135M"]["ratio_to_specforge"]
    last_int4 = m["error"].get(f"int4/g{m['group_size']}", {}).get("teacher_from_last", {})
    reading = (f"Reading: int4 of the last state keeps only {last_int4.get('top1_agree', 0):.0%} of the teacher's "
               f"top-1 choices, the stored top-{t['top_k']} teacher {t['top1_agree']:.1%}; `int4_topk` with "
               f"{m['group_size']} channels per scale is {smol['int4_topk']:.3f} of SpecForge's bytes per token on "
               f"SmolLM2 and {peers['Llama-3.1-70B']['ratio_to_specforge']['int4_topk']:.3f} on Llama-3.1-70B, and "
               f"{verdict}. It is the `train.feature_format` of the offline EAGLE-3 recipes (eagle_llama70b, "
               "eagle_smollm2_full); `bf16` stays the default elsewhere, and distill_llama70b keeps bf16 "
               "(its drafter reads the last state for full-vocab logits, which int4 does not keep).")
    return f"""## Compact offline features (`train.feature_format`)

Command: `{d['command']}` ({d['date']}, {d['machine']}). What the offline cache stores per
token for 3 aux layers: SpecForge and speculators keep aux (3H) and last (H) in bf16, (3 + 1) * H * 2
bytes. Ours: `bf16` the same; `int8` / `int4` the same tensors quantized with one fp16 scale per
{m['group_size']} channels (payload + 2 bytes per group); `int4_topk` the aux states in int4 and, instead of
the last state, the teacher's top {t['top_k']} draft-vocab logits (fp16 value + int16 id) and one in-draft
byte: 3H * (0.5 + 2 / {m['group_size']}) + {t['top_k']} * 4 + 1. Bytes per token (ratio to SpecForge):

{chr(10).join(size)}

A real cache of the first {m['rows']} training rows of SmolLM2-135M-Instruct ({m['tokens']} tokens, aux layers
{m['aux_layer_ids']}): bytes on disk (safetensors headers included) beside the formula, and read throughput
(`FeatureCache.batch` of one sequence at a time, dequantized to fp32, best of {m['read']['bf16']['passes']} passes,
{m['threads']} threads):

{chr(10).join(disk)}

Reconstruction against the target's fp32 states of those rows (relative Frobenius error, per-token
cosine), and the draft-vocab teacher ({m['draft_vocab']} ids) computed from the stored last state against
fp32's (top-1 agreement, mean KL). `gN`: N channels per scale; `grow`: one scale per token. The hidden
states have outlier channels (largest channel absmax / median: {o['max_over_median_channel_absmax']:.0f};
{o['channels_over_10x_median']} channels above 10x the median), which one scale per token spreads over every channel:

{chr(10).join(err)}

Held-out decoded tau of EAGLE-3 drafters trained on each format: the same {d['runs']['bf16']['cache_tokens'] if 'bf16' in d['runs'] else '?'}-token
rows (sampled + source ShareGPT conversations), seed and steps; `evaluate` on {next(iter(d['runs'].values()))['num_prompts']}
first turns of the ShareGPT held-out split, max 64 new tokens, k = 3, fp32. Overrides: `{' '.join(d['overrides'])}`.

{chr(10).join(tau)}

{reading}
"""


def main() -> None:
    if asks_help(sys.argv[1:], __doc__):
        return
    step = choose(sys.argv[1] if len(sys.argv) > 1 else None, ("train", "measure", "record"), "step")
    if step == "train":
        train([choose(fmt, FORMATS, "feature format") for fmt in sys.argv[2:]] or ["bf16", "int4_topk"])
    else:
        {"measure": measure, "record": record}[step]()


if __name__ == "__main__":
    run(main)
