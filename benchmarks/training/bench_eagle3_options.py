"""EAGLE-3 training options compared on cached SmolLM2 features, by held-out acceptance.

    python -m benchmarks.training.bench_eagle3_options features          # target features, once (~4 min)
    python -m benchmarks.training.bench_eagle3_options run NAME [key=value ...]   # one variant (~5 min)
    python -m benchmarks.training.bench_eagle3_options record [--study NAME]   # table + JSON from every variant run

The eagle_smollm2 data (its sampled conversations plus 400 source ones), the target's aux
and final hidden states computed once and kept (bf16) under runs/bench_eagle3_options/;
every variant trains the same one-epoch plan on the same rows and is scored every eighth
of the run on 40 held-out conversations (16 sampled, 24 source): teacher-forced per-step
accuracy and simulated tau (1 + mean run of correct steps, k = ttt steps, bonus included).
Only the variant's options change; the training step is the train stage's own
(`eagle3.loss_and_metrics`, AdamW, warm-up + cosine, clipping).

Variant keys: lr, bs (sequences per step), ttt (steps), init (`random`: the fully random
layer the drafter used before; default: the drafter's own init), tt (teacher temperature
applied to the training soft labels only), allpos=1 (loss at every token, prompts too),
cfg (comma-separated extra config overrides, e.g. cfg=drafter.norm_before_residual=true),
mp=bf16 (the step under CPU bf16 autocast, as train.mixed_precision=bf16), opt=muon (the train
stage's train.optimizer=muon: Muon for the 2-D weights of the layers, its step matched to
AdamW's RMS so the same lr applies; AdamW for the rest).
Every variant reports its training seconds beside its steps, so equal-time readings come
from the curves.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import (asks_help, choose, compose_config, fail, needed, run, timed, update_doc_section,
                               write_results)
from specforge_lite.drafters.registry import drafter_module

OUT = Path("runs/bench_eagle3_options")
HELD_SAMPLED, HELD_SOURCE = 16, 24


def compose(overrides: list[str]):
    return compose_config(["+recipe=eagle_smollm2", "stage=train", "train.source_conversations=400", *overrides])


def features(out: Path = OUT, cfg=None, compute: torch.dtype | None = None) -> None:
    """Every training row's target features (computed in `compute` where given, as the train
    stage's target_autocast does), kept in `out`/features.pt with the rows and the held-out split."""
    from specforge_lite.training.features import collate, target_hidden
    from specforge_lite.stages.train import ensure_samples, training_rows
    from specforge_lite.targets.loading import load_target

    cfg = cfg if cfg is not None else compose([])
    ensure_samples(cfg)
    target, tokenizer = load_target(cfg.target)
    rows = training_rows(cfg, tokenizer)  # sampled rows first, then source rows
    held = list(range(HELD_SAMPLED)) + list(range(len(rows) - HELD_SOURCE, len(rows)))
    aux_ids = [2, target.config.num_hidden_layers // 2, target.config.num_hidden_layers - 3]
    feats, started = [], time.perf_counter()
    for i, row in enumerate(rows):
        batch = collate([row], tokenizer.pad_token_id, "cpu")
        aux, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], aux_ids, compute)
        feats.append((aux[0].bfloat16(), last[0].bfloat16()))
        if i % 50 == 0:
            print(f"features {i}/{len(rows)} {time.perf_counter() - started:.0f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"rows": rows, "feats": feats, "held": held,
                "train": [i for i in range(len(rows)) if i not in set(held)]}, out / "features.pt")


def reinit_random(drafter, seed: int) -> None:
    """The drafter's earlier initialisation: every Linear N(0, 0.02) (lm_head then the target's rows)."""
    lm_head = drafter.lm_head.weight.detach().clone()
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=drafter.init_std)
        drafter.lm_head.weight.copy_(lm_head)


def tally(drafter, batches, cfg) -> dict:
    """Teacher-forced per-step accuracy and simulated tau (1 + mean run of correct steps, bonus
    included) of `drafter` over prepared batches."""
    eagle3 = drafter_module("eagle3")
    totals = {"correct": None, "total": None, "chain": None}
    with torch.no_grad():
        for batch in batches:
            _, _, metrics = eagle3.loss_and_metrics(drafter, batch, cfg)
            for key in totals:
                totals[key] = metrics[key] if totals[key] is None else [a + b for a, b in zip(totals[key], metrics[key])]
    return {"acc": [c / t for c, t in zip(totals["correct"], totals["total"])],
            "tau": 1 + sum(c / totals["total"][0] for c in totals["chain"])}


def teacher_forced(drafter, target, tokenizer, rows: list[dict], cfg, batch_size: int = 4) -> dict:
    """`tally` over token rows (`input_ids`, `loss_mask`), their features from the target's forward
    in its weights' dtype (as decoding computes them)."""
    from specforge_lite.training.features import collate, target_hidden

    eagle3 = drafter_module("eagle3")
    drafter.eval()
    prepare, batches = eagle3.batch_preparer(drafter, target), []
    aux_ids = eagle3.target_layers(drafter)
    for i in range(0, len(rows), batch_size):
        batch = collate(rows[i:i + batch_size], tokenizer.pad_token_id, "cpu")
        with torch.no_grad():
            aux, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], aux_ids)
        prepare(batch, aux, last, True)
        batches.append(batch)
    return tally(drafter, batches, cfg)


def train_variant(name: str, opts: dict, out: Path = OUT) -> None:
    from specforge_lite.drafters.vocab import count_tokens
    from specforge_lite.training.features import collate
    from specforge_lite.training.optim import build_optimizer
    from specforge_lite.stages.train import lr_at, plan_batches
    from specforge_lite.targets.loading import load_target

    eagle3 = drafter_module("eagle3")
    lr, bs = float(opts.get("lr", 1e-3)), int(opts.get("bs", 4))
    cfg = compose([f"train.lr={lr}", f"drafter.ttt_steps={int(opts.get('ttt', 3))}",
                   *[c for c in opts.get("cfg", "").split(",") if c]])
    data = torch.load(needed(out / "features.pt", f"python -m {__spec__.name} features"), weights_only=False)
    rows, feats = data["rows"], data["feats"]
    target, tokenizer = load_target(cfg.target)
    train_ids = data["train"]
    counts = count_tokens(((rows[i]["input_ids"], rows[i]["loss_mask"]) for i in train_ids),
                          target.config.vocab_size)
    drafter = eagle3.build(cfg, target, counts)
    if opts.get("init") == "random":
        reinit_random(drafter, cfg.train.seed)
    prepare = eagle3.batch_preparer(drafter, target)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = build_optimizer(opts.get("opt", "adamw"), drafter, params, lr, 0.0,  # the train stage's own
                                low_precision=opts.get("mp") == "bf16")
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if opts.get("mp") == "bf16" \
        else contextlib.nullcontext
    epochs = float(opts.get("epochs", 1))
    batches = plan_batches([len(rows[i]["input_ids"]) for i in train_ids], bs, 0, epochs)
    per_epoch = len(batches) / epochs
    hidden = drafter.config.hidden_size
    temperature = float(opts.get("tt", 1.0))

    def make(indices, held_out=False):
        batch = collate([rows[i] for i in indices], tokenizer.pad_token_id, "cpu")
        width = batch["input_ids"].shape[1]
        aux, last = torch.zeros(len(indices), width, 3 * hidden), torch.zeros(len(indices), width, hidden)
        for k, i in enumerate(indices):
            n = feats[i][0].shape[0]
            aux[k, :n], last[k, :n] = feats[i][0].float(), feats[i][1].float()
        if opts.get("allpos") == "1" and not held_out:
            batch["loss_mask"] = batch["attention_mask"].clone()
        prepare(batch, aux, last, True)
        if not held_out:
            batch["target_logits"] = batch["target_logits"] / temperature
        return batch

    held = [make(data["held"][i:i + 4], held_out=True) for i in range(0, len(data["held"]), 4)]

    def score() -> dict:
        drafter.eval()
        result = tally(drafter, held, cfg)
        drafter.train()
        return result

    curve, train_s, tokens = [], 0.0, 0
    every = max(1, len(batches) // int(opts.get("points", 8)))

    def train_step(step: int, indices: list[int]) -> dict:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, len(batches), cfg.train)
        batch = make(indices)
        with autocast():
            loss, num, _ = eagle3.loss_and_metrics(drafter, batch, cfg)
        (loss.float() / max(num, 1)).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return batch

    for step, indices in enumerate(batches):
        batch, seconds = timed(lambda: train_step(step, indices))
        train_s += seconds
        tokens += int(batch["attention_mask"].sum())
        epoch_end = opts.get("save") == "1" and round((step + 1) % per_epoch) == 0
        if (step + 1) % every == 0 or step + 1 == len(batches) or epoch_end:
            point = {**score(), "step": step + 1, "tokens": tokens, "train_s": train_s}
            if epoch_end:  # the drafter as it stands after each whole epoch, for a decoded evaluate
                point["drafter"] = str(out / "drafters" / f"{name}-epoch{round((step + 1) / per_epoch)}")
                eagle3.save(drafter, Path(point["drafter"]), extra={"trained_steps": step + 1})
            curve.append(point)
            print(name, json.dumps(point), flush=True)
    (out / "variants").mkdir(parents=True, exist_ok=True)
    (out / "variants" / f"{name}.json").write_text(json.dumps({"name": name, "options": opts, "curve": curve}))


def record(command: str, study: str = "eagle3_options") -> None:
    variants = [json.loads(p.read_text()) for p in sorted((OUT / "variants").glob("*.json"))]
    if not variants:
        fail(f"no variant in {OUT / 'variants'}; `python -m {__spec__.name} run NAME [key=value ...]` makes one")
    write_results(study, {"command": command, "variants": variants})
    lines = []
    for v in sorted(variants, key=lambda v: v["curve"][-1]["tau"]):
        end = v["curve"][-1]
        options = " ".join(f"{k}={val}" for k, val in v["options"].items()) or "(defaults)"
        lines.append(f"| {v['name']} | `{options}` | {end['step']} | {end['tokens']} | "
                     + " / ".join(f"{a:.3f}" for a in end["acc"]) + f" | **{end['tau']:.3f}** | "
                     + " ".join(f"{p['tau']:.2f}" for p in v["curve"]) + f" | {end['train_s'] / 60:.1f} |")
    update_doc_section(study, f"""## {TITLES.get(study, "EAGLE-3 training: " + study)} on SmolLM2 (cached features, held-out acceptance)

Commands: `python -m benchmarks.training.bench_eagle3_options features`, then per variant
`python -m benchmarks.training.bench_eagle3_options run NAME OPTIONS` (the options column), then `{command}`. One epoch of the eagle_smollm2 training rows (sampled + 400 source
conversations, 4 sequences per step unless `bs` says otherwise, lr 1e-3 unless `lr` says
otherwise, 3 TTT steps), target features cached once; scored on 40 held-out conversations
(teacher-forced, k = 3 TTT steps, bonus token included). Same rows, order and seed for
every variant; only the named options differ.

| variant | options | steps | tokens | held-out acc step 0 / 1 / 2 | simulated tau | tau at each eighth of the run | training min |
|---|---|---:|---:|---|---:|---|---:|
{chr(10).join(lines)}

Best here: **{max(variants, key=lambda v: v["curve"][-1]["tau"])["name"]}**. {PROVENANCE.get(study, "")}These are
teacher-forced numbers on held-out text; what decoding gets is in the end-to-end sections.
""")


TITLES = {"eagle3_options": "EAGLE-3 training options",
          "eagle3_study": "EAGLE-3 training study: bf16 autocast, Muon, EAGLE 3.1 norms"}
PROVENANCE = {"eagle3_options": "The first variants ran in a prototype of this script (same rows, order, training "
                                "step and scoring); this script re-ran readout_init_bs2_norm_before_residual and "
                                "reproduced it to the last digit. "}


def main() -> None:
    if asks_help(sys.argv[1:], __doc__):
        return
    step = choose(sys.argv[1] if len(sys.argv) > 1 else None, ("features", "run", "record"), "step")
    if step == "run" and len(sys.argv) < 3:
        fail(f"usage: python -m {__spec__.name} run NAME [key=value ...]")
    if step == "features":
        features()
    elif step == "run":
        train_variant(sys.argv[2], dict(a.split("=", 1) for a in sys.argv[3:]))
    else:
        args = sys.argv[2:]
        study = args[args.index("--study") + 1] if "--study" in args else "eagle3_options"
        record(f"python -m benchmarks.training.bench_eagle3_options record --study {study}", study)


if __name__ == "__main__":
    run(main)
