"""The `train` stage: fit a drafter to the target on the sampled conversations.

Reads `run_dir/samples`, builds the drafter from the target, then loops: target
features for a micro-batch (online: the frozen target runs here; offline: read from
the feature cache built first), the drafter's loss summed over its positions, one
optimizer step per `grad_accum` micro-batches with the gradient divided by the
number of loss positions of the whole step (across micro-batches and ranks).
Checkpoints land atomically in `run_dir/train/checkpoints/step-N`; a restarted run
continues from the newest one and ends with the weights an uninterrupted run has.
How the work spreads over ranks (DDP, DeepSpeed ZeRO-2/3, FSDP) is `trainer.strategy`,
handled in `specforge_lite.training.strategies`.
The trained drafter is written to `run_dir/train/drafter/` only when it is worth keeping: a
step whose loss or gradient norm is not finite stops the run (the checkpoints before it stay),
as does a run without a single loss position (training.health); tokens seen count the real
sequences only, per rank in metrics.json.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import ArtifactError, read_json_object, write_failure
from specforge_lite.run_folders import (atomic_write_json, modes_as_umask_says, place_files, readable_temp_dir,
                                     samples_dir, stage_dir, write_provenance)
from specforge_lite.data.samples import damaged_shards, load_samples, readable_shards
from specforge_lite.drafters.common import nonfinite_tensors
from specforge_lite.drafters.vocab import count_tokens
from specforge_lite.scale.dry_run import dry_run
from specforge_lite.training.feature_formats import stores_last
from specforge_lite.training.features import (FeatureCache, cache_key, collate, computed_dtype, draft_vocab_targets,
                                              target_hidden)
from specforge_lite.targets.digest import recorded_files
from specforge_lite.training.batching import padding_share, plan, plan_batches  # noqa: F401 (plan_batches: its old home)
from specforge_lite.training.checkpoints import check_written_by, latest_checkpoint, resume, set_aside
# fingerprint: read from here by the tests and older callers
from specforge_lite.stages.train_keys import (already_trained, fingerprint, fingerprint_and_parts,  # noqa: F401
                                               fingerprint_parts_settings)
from specforge_lite.training.health import (RankCounts, diverged_message, no_loss_position, nonfinite_flags,
                                            require_finite_drafter, require_loss_positions)
from specforge_lite.training.optim import build_optimizer
from specforge_lite.runtime.drift import DriftWatch
from specforge_lite.training.throughput import per_device
from specforge_lite.drafters.registry import chosen_drafter
from specforge_lite.scale.sizing import (batch_choice, dry_run_choice,
                                        report as size_every_stage, settle_allocator)
from specforge_lite.training.strategies import build_strategy
from specforge_lite.training.strategies.base import target_compute
from specforge_lite.training.tracking import Tracker, empty_window, global_window, plot_learning_curve, summarise_window
from specforge_lite.targets.loading import sizing_config

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- data order

def lr_at(step: int, total: int, cfg) -> float:
    """Linear warm-up to `lr`, then cosine down to `lr * min_lr_ratio`."""
    warmup = max(1, int(total * cfg.warmup_ratio))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def training_rows(cfg: DictConfig, tokenizer) -> list[dict]:
    """The sampled conversations (unless train.use_samples=false), plus
    `train.source_conversations` source ones as written (never the sampled ids)."""
    rows, sampled = [], set()
    if cfg.train.use_samples:
        dataset = load_samples(samples_dir(cfg))
        rows = [{"id": i, "input_ids": ids, "loss_mask": mask}
                for i, ids, mask in zip(dataset["id"], dataset["input_ids"], dataset["loss_mask"])]
        sampled = set(dataset["id"])
    extra, added = cfg.train.source_conversations, 0
    if extra:
        from specforge_lite.data.chat import tokenize_conversation
        from specforge_lite.data.readers import heldout_split, read_conversations

        records, _ = read_conversations(cfg.data.source, cfg.data.format, cfg.data.strict)
        train, _ = heldout_split(records, cfg.data.heldout_fraction, cfg.data.split_seed)
        for record in train:
            if added == extra:
                break
            if record["id"] in sampled:
                continue
            ids, mask = tokenize_conversation(tokenizer, record["messages"], cfg.data.max_length)
            if sum(mask):
                rows.append({"id": record["id"], "input_ids": ids, "loss_mask": mask})
                added += 1
    log.info("training on %d sampled + %d source conversations", len(rows) - added, added)
    if not rows:
        raise SpecforgeError("no training conversations: train.use_samples=false needs train.source_conversations > 0")
    return rows


def ensure_samples(cfg: DictConfig) -> None:
    """Train needs the sampled conversations (unless train.use_samples=false): when they are
    missing or incomplete, a single-process run samples them first (the sample stage resumes
    what exists). Complete samples made with other data / sample settings are refused, as the
    sample stage refuses to resume them: training on them would silently learn from stale data."""
    if not cfg.train.use_samples:
        return
    from specforge_lite.stages import sample

    meta_path = samples_dir(cfg) / "meta.json"
    try:
        meta = read_json_object(meta_path) if meta_path.exists() else {}
    except ArtifactError as err:
        log.warning("%s; the sample stage rebuilds it, keeping the shards that record these settings", err)
        meta = {}
    if meta.get("complete"):
        problem = sample.stale_samples(cfg, meta, samples_dir(cfg))
        if problem:
            raise SpecforgeError(f"train: {problem}")
    # shards checked against the sha256 recorded when they were written: a damaged one is rewritten
    damaged = damaged_shards(samples_dir(cfg) / "data")
    if meta.get("complete") and not damaged:
        pass
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SpecforgeError(f"no complete and intact samples in {samples_dir(cfg)}; run the sample stage before "
                             "a multi-process train (python -m specforge_lite sample ... on the same ranks)")
    else:
        log.info("%s in %s: running the sample stage first", "damaged sample shards" if meta.get("complete")
                 else "no complete samples", samples_dir(cfg))
        sample.run(cfg)
    if cfg.train.use_samples:
        readable_shards(samples_dir(cfg))  # some hold rows, none is damaged: before anything is written


# --------------------------------------------------------------------------- the stage

def run(cfg: DictConfig) -> None:
    module = chosen_drafter(cfg)
    if cfg.train.dry_run:
        config = sizing_config(cfg.target.path)  # checked against at the door (`door.validate_for_target`)
        batch, sized = dry_run_choice(cfg, config)  # train.tokens_per_step / batch_size per rank
        dry_run(sized, config, batch)
        size_every_stage(sized, config)
        return
    # the batch per rank (train.tokens_per_step: auto sized to the devices this rank sees; train.batch_size
    # raised to the world size), then those devices checked to hold the feature building and the training
    choice = batch_choice(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.target.device != "cpu" and (setting := settle_allocator()):
        log.info("CUDA allocator: %s (PYTORCH_CUDA_ALLOC_CONF sets another)", setting)
    ensure_samples(cfg)
    stamp, parts, settings = fingerprint_parts_settings(cfg)  # after sampling: it covers the samples' own fingerprint
    if already_trained(cfg, stamp):
        return
    tcfg = cfg.train
    out = stage_dir(cfg, "train")
    strategy = build_strategy(cfg)  # trainer.strategy: the process group, wrapping, checkpoints
    accelerator = strategy.accelerator
    # the provenance (config.yaml, versions.json) is written with the drafter it describes, at
    # the end: a run stopped before (a bad drafter.init_from) leaves the earlier drafter's as it was

    target, tokenizer = strategy.load_target(cfg.target)
    samples = training_rows(cfg, tokenizer)
    if problem := no_loss_position(samples, cfg.data.max_length):
        raise SpecforgeError(f"train: {problem}")
    counts = count_tokens(((r["input_ids"], r["loss_mask"]) for r in samples), target.config.vocab_size)
    drafter = module.build(cfg, target, counts)  # a bad drafter.init_from / student is named first
    ckpt_dir = out / "checkpoints"
    if not tcfg.resume and accelerator.is_main_process and (aside := set_aside(ckpt_dir)) is not None:
        log.warning("train.resume=false: the earlier run's checkpoints moved to %s; this run starts at step 0", aside)
    if tcfg.resume and (newest := latest_checkpoint(ckpt_dir)) is not None:  # before features are built
        try:
            check_written_by(newest, strategy.name, stamp, parts, settings)
        except ArtifactError:  # damaged: `resume` reports it and takes the one before
            pass
    aux_ids = module.target_layers(drafter)
    prepare = module.batch_preparer(drafter, target)
    params = [p for p in drafter.parameters() if p.requires_grad]
    log.info("drafter %s: %.2fM trainable parameters; %s", cfg.drafter.name,
             sum(p.numel() for p in params) / 1e6, module.describe(drafter))

    lengths = [len(r["input_ids"]) for r in samples]
    batches = plan(lengths, choice, tcfg.seed, tcfg.epochs)  # per micro-batch, the rows of each rank
    total_steps = tcfg.max_steps or max(1, len(batches) // tcfg.grad_accum)
    needed = total_steps * tcfg.grad_accum
    while len(batches) < needed:  # max_steps past the planned epochs: keep cycling the plan
        batches += plan(lengths, choice, tcfg.seed + len(batches), 1.0)

    # the frozen target's forward in the training's precision too (bf16 autocast of an fp32 target
    # on a CPU with native bf16): it is most of an online step (docs/BENCHMARKS.md "Demo training step")
    compute = target_compute(cfg)
    cache = None
    if tcfg.mode == "offline":  # every rank builds the features of its share of the rows
        cache = FeatureCache(out / "features", tcfg.offline_shard_size, tcfg.feature_format)
        teacher, draft_vocab = None, None
        if not stores_last(tcfg.feature_format):  # the cache keeps the draft-vocab teacher, not `last`
            head, draft_vocab = target.get_output_embeddings().weight, drafter.draft_vocab
            teacher = partial(draft_vocab_targets, head, head[draft_vocab], t2d=drafter.t2d)
        if accelerator.is_main_process:
            cache.prepare(samples, target.config.hidden_size, aux_ids,
                          cache_key(samples, cfg.target.path, computed_dtype(target, compute), aux_ids,
                                    tcfg.feature_format, draft_vocab))
        accelerator.wait_for_everyone()
        cache.build(target, samples, aux_ids, tokenizer.pad_token_id, tcfg.batch_size, accelerator.process_index,
                    accelerator.num_processes, accelerator.wait_for_everyone, lockstep=bool(cfg.trainer.shard_target),
                    teacher=teacher, compute=compute)
        accelerator.wait_for_everyone()

    optimizer = build_optimizer(tcfg.optimizer, drafter, params, tcfg.lr, tcfg.weight_decay,
                                low_precision=strategy.mixed == "bf16")
    # what checkpoints save and check
    strategy.module, strategy.stamp, strategy.stamp_parts, strategy.stamp_settings = module, stamp, parts, settings
    drafter, optimizer = strategy.prepare(drafter, optimizer)

    start = 0
    if tcfg.resume:  # the newest intact checkpoint (a damaged one is reported and skipped)
        start, latest = resume(ckpt_dir, strategy.load_checkpoint)
        if latest is not None:
            log.info("resuming from %s (step %d of %d)", latest, start, total_steps)

    tracker = Tracker(cfg, out, accelerator.is_main_process)
    rank, world = accelerator.process_index, accelerator.num_processes
    log.info("trainer %s on %d rank(s)", strategy.name, world)
    padding = padding_share(lengths, batches[start * tcfg.grad_accum:total_steps * tcfg.grad_accum])
    if accelerator.is_main_process:
        log.info("%s; padding %.1f%% of the padded tokens", choice.line(), 100 * padding)
    busy = 0.0  # this rank's seconds in its steps (tokens/s and MFU per device)
    bar = tqdm(total=total_steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
               disable=not accelerator.is_local_main_process)
    window = empty_window()
    history, tokens_seen, positions = [], 0, 0
    slowdown = DriftWatch("training's time per token")  # a busy machine is named in the log and metrics.json
    counts_of_rank = RankCounts()  # real tokens only: a dummy sequence of an idle rank counts zero
    data_hint = (f"the offline features in {out / 'features'} may be damaged (delete that folder to rebuild them)"
                 if cache is not None else f"the samples in {samples_dir(cfg)} may hold bad data")
    for step in range(start, total_steps):
        t0 = time.perf_counter()
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, total_steps, tcfg)
        micro = [batches[step * tcfg.grad_accum + m] for m in range(tcfg.grad_accum)]
        # this rank's rows of every micro-batch (training/batching.py gives every rank real ones; a
        # rank left without one would run rank 0's with no loss positions, so DDP still syncs)
        shares = [b[rank] for b in micro]
        prepared, target_time, real_tokens, step_loss = [], 0.0, 0, 0.0
        for indices, own in ((share or b[0], bool(share)) for share, b in zip(shares, micro)):
            t_target = time.perf_counter()
            batch = collate([samples[i] for i in indices], tokenizer.pad_token_id, accelerator.device)
            if cache is None:
                aux, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], aux_ids, compute)
            else:
                aux, last = cache.batch(indices, accelerator.device)
            prepare(batch, aux, last, own)  # soft labels, loss positions (none if not `own`)
            target_time += time.perf_counter() - t_target
            prepared.append(batch)
            real_tokens += int(batch["attention_mask"].sum()) if own else 0
        window["tokens"] += real_tokens
        counts_of_rank.add_step(real_tokens)
        # the gradient is divided by the loss positions of the whole optimizer step, on all ranks
        counts = torch.stack([b["num_positions"] for b in prepared])
        global_positions = accelerator.reduce(counts.sum(), reduction="sum").clamp(min=1.0)
        for m, batch in enumerate(prepared):
            with strategy.accumulate(last=m == len(prepared) - 1), strategy.autocast():
                in_drafter_dtype(batch, params[0].dtype)
                loss, num, metrics = module.loss_and_metrics(drafter, batch, cfg)
                # every strategy averages gradients over ranks; multiplying by world makes it a global sum
                strategy.backward(loss * world / global_positions)
            step_loss += float(loss.detach())
            window["positions"] += num
            positions += int(num)
            if window["correct"] is None:
                window["correct"] = {k: [0] * len(v) for k, v in metrics.items()}
            for k, v in metrics.items():
                window["correct"][k] = [a + b for a, b in zip(window["correct"][k], v)]
        grad_norm = strategy.step(tcfg.max_grad_norm)  # clip, step, zero the gradients
        window["loss"] += step_loss
        if any(bad := nonfinite_flags(accelerator, step_loss, float(grad_norm))):  # before this step's checkpoint
            bar.close()
            tracker.close()
            raise SpecforgeError(diverged_message(step + 1, total_steps, step_loss, float(grad_norm), bad,
                                                  tcfg.lr, step == start, data_hint,
                                                  latest_checkpoint(ckpt_dir)))
        window["time"] += time.perf_counter() - t0
        busy += time.perf_counter() - t0
        window["target_time"] += target_time
        bar.update(1)

        done = step + 1
        if done % tcfg.log_every == 0 or done == total_steps:
            if world > 1:  # logged numbers cover every rank's positions
                window = global_window(window, accelerator)
            stats = summarise_window(window, optimizer.param_groups[0]["lr"], float(grad_norm))
            if (slow := slowdown.add(window["time"] / max(window["tokens"], 1))) and accelerator.is_main_process:
                log.warning("step %d: %s", done, slow)
            stats["step"] = done
            tokens_seen += window["tokens"]
            stats["tokens_seen"] = tokens_seen  # this run's, from `start`
            history.append(stats)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", acc0=f"{stats['acc'][0]:.2f}",
                            tau_sim=f"{stats['simulated_tau']:.2f}", tok_s=f"{stats['tokens_per_s']:.0f}")
            tracker.log({"loss": stats["loss"], "lr": stats["lr"], "tokens_per_s": stats["tokens_per_s"],
                         "simulated_tau": stats["simulated_tau"], "target_share": stats["target_share"],
                         "grad_norm": stats["grad_norm"],
                         **{f"acc/step{j}": a for j, a in enumerate(stats["acc"])}}, step=done)
            window = empty_window()
        if tcfg.checkpoint_every and done % tcfg.checkpoint_every == 0 and done < total_steps:
            strategy.save_checkpoint(ckpt_dir, done, tcfg.keep_checkpoints)  # every rank: its part
    bar.close()
    tracker.close()

    if start == 0:  # a resumed run's earlier steps had theirs
        require_loss_positions(accelerator, positions, total_steps, cfg.data.max_length)
    rank_counts = counts_of_rank.gathered(accelerator, tcfg.batch_size)  # every rank's real tokens
    throughput = per_device(cfg, accelerator, rank_counts, busy, params, target)
    (out / "memory").mkdir(exist_ok=True)
    atomic_write_json(out / "memory" / f"rank-{rank}.json", strategy.memory_report(target))
    raw = strategy.full_drafter()  # every rank takes part in gathering; rank 0 gets the module
    require_finite_drafter(accelerator, nonfinite_tensors(dict(raw.state_dict())) if accelerator.is_main_process
                           else [], tcfg.lr)
    if accelerator.is_main_process:
        final = out / "drafter"

        def write(tmp: Path) -> None:
            module.save(raw, tmp, extra={"trained_steps": total_steps, "history": history, "fingerprint": stamp,
                                         "target_files": recorded_files(cfg.target.path)})
            write_provenance(tmp, cfg)  # inside the drafter folder: renamed into place with it

        save_atomically(final, write)
        write_provenance(out, cfg)  # and beside it, as in every stage folder
        if history:
            atomic_write_json(out / "metrics.json", {"history": history, "total_steps": total_steps,
                                                     "tokens_seen": sum(rank_counts["tokens_per_rank"]), **rank_counts,
                                                     "batching": {**choice.record(), "padding_share": padding},
                                                     "throughput": throughput,
                                                     "slowest_vs_start": round(slowdown.worst, 2)})
            plot_learning_curve(history, out / "learning_curve.png")
        log.info("drafter written to %s", final)
    accelerator.wait_for_everyone()


def save_atomically(final: Path, write) -> None:
    """`write(folder)` into a temporary folder beside `final`, then move its files into place,
    replacing those the train stage wrote there before and keeping the user's (`place_files`);
    a failure (a full disk) removes the temporary folder and leaves `final` as it was."""
    tmp = readable_temp_dir(final.parent, f".{final.name}.")
    try:
        write(tmp)
        modes_as_umask_says(tmp)  # readable by a server running as another user, as the umask says
        place_files(tmp, final, "train")
    except Exception as err:
        if write_failure(err):
            raise SpecforgeError(f"cannot write {final} ({err}); nothing was replaced") from err
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def in_drafter_dtype(batch: dict, dtype: torch.dtype) -> None:
    """Without autocast (training in float32 on a CPU without native bf16) the drafter's products
    need its own dtype: a bf16 target's features (`aux_hidden`, `last_hidden`) are cast to it.
    Under autocast they stay as they are, and the products cast them (no float32 copy in memory)."""
    for key in ("aux_hidden", "last_hidden"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype \
                and not torch.is_autocast_enabled(value.device.type):
            batch[key] = value.to(dtype)
