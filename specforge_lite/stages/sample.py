"""The `sample` stage: the target answers the training prompts in its own words.

A drafter learns to predict the target, so it trains best on text the target itself
wrote. This stage reads a conversation source, keeps the train side of the held-out
split, regenerates the assistant turns with the target (the last one, or every one
conditioned on the target's own earlier answers) and writes parquet shards of
`input_ids` and assistant-only `loss_mask` under `run_dir/samples/`.

Resume: shards are the unit of work and are committed by rename; a restarted run
skips the shards that exist, so a killed run loses at most the shard in flight.
Data parallel: rank r of w writes shards r, r+w, r+2w, ...
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import ArtifactError, read_json_object
from specforge_lite.run_folders import atomic_write_json, package_versions, samples_dir, stage_dir, write_provenance
from specforge_lite.data.chat import prompt_ids, require_chat_template, tokenize_conversation
from specforge_lite.data.readers import heldout_split, read_conversations
from specforge_lite.data.samples import (completed_shards, damaged_shards, remove_shard, samples_meta, shard_fingerprint,
                                         shard_path, stats_path, write_shard)
from specforge_lite.targets.digest import target_files
from specforge_lite.runtime.static_llama import unsupported_reason
from specforge_lite.serving.vllm.engine import sampling_params
from specforge_lite.serving.vllm.interpreter import find_python, on_gpu
from specforge_lite.serving.vllm.sampler import VllmSampleBackend
from specforge_lite.targets.loading import load_target, load_target_config, load_tokenizer, resolve_target_path
from specforge_lite.stages.sample_backends import HFBackend, StaticBackend
from specforge_lite.stages.sample_dtype import decided_dtype, samples_dtype, vllm_dtype

log = logging.getLogger(__name__)


def backend_name(requested, vllm_python: str | None, target_config) -> str:
    """`sample.backend` with `auto` resolved: vllm where an interpreter with vLLM was found (the
    fastest sampler measured here, docs/BENCHMARKS.md "Sampling backends on the demo's settings"),
    else compiled where our static forward runs the target, else hf."""
    name = str(getattr(requested, "value", requested))
    if name != "auto":
        return name
    if vllm_python:
        return "vllm"
    return "hf" if unsupported_reason(target_config) else "compiled"


def open_backend(cfg, log_path: Path, dtype_of):
    """`(backend, tokenizer, name, dtype)`: the sampler of `cfg.sample.backend` (auto resolved), its
    target loaded where it runs in this process, in the dtype `dtype_of(model)` gives as `(model,
    dtype)` (vLLM's dtype: target.dtype as vLLM loads it). vLLM chosen by `auto` on a CPU gets this
    process's torch threads unless sample.vllm.cpu_threads says otherwise; where it cannot start (a
    target its kernels do not run, a broken interpreter) `auto` says why in one line and samples with
    what it picks without vLLM."""
    sample_cfg = cfg.sample
    requested = str(getattr(sample_cfg.backend, "value", sample_cfg.backend))
    config = None
    if requested == "auto":  # only auto reads the interpreter search and the target's config
        config = load_target_config(cfg.target, weights=False)
        name = backend_name(requested, find_python(sample_cfg.vllm.python), config)
    else:
        name = requested
    if name == "vllm":
        if requested == "auto" and not on_gpu() and sample_cfg.vllm.cpu_threads is None:
            sample_cfg = OmegaConf.merge(sample_cfg, {"vllm": {"cpu_threads": torch.get_num_threads()}})
        tokenizer = load_tokenizer(cfg.target)
        if requested != "auto":
            backend = VllmSampleBackend(resolve_target_path(cfg.target.path), cfg.target, sample_cfg, tokenizer,
                                        log_path)
            return backend, tokenizer, name, vllm_dtype(cfg)
        backend, failed = start_vllm(cfg, sample_cfg, tokenizer, log_path)
        if failed is None:
            return backend, tokenizer, name, vllm_dtype(cfg)
        name = backend_name(requested, None, config)  # what auto picks where there is no vLLM
        log.warning("sample.backend=auto: vLLM cannot sample %s (%s); sampling with the %s backend instead",
                    cfg.target.path, failure_reason(failed), name)
    model, tokenizer = load_target(cfg.target)
    model, dtype = dtype_of(model)
    if name in ("static", "compiled"):
        return StaticBackend(model, tokenizer, sample_cfg, compiled=name == "compiled"), tokenizer, name, dtype
    return HFBackend(model, tokenizer, sample_cfg), tokenizer, name, dtype


def start_vllm(cfg, sample_cfg, tokenizer, log_path: Path):
    """`(backend, None)` where vLLM starts and generates a token of the target (its kernels may
    refuse a target only once it runs), else `(None, the error)` with nothing of vLLM left."""
    try:
        backend = VllmSampleBackend(resolve_target_path(cfg.target.path), cfg.target, sample_cfg, tokenizer, log_path)
    except SpecforgeError as err:
        return None, err
    start = next((t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None), 0)
    try:
        backend.engine.generate([[start]], sampling_params(1, 0.0, 1.0, backend.stop_ids))
    except SpecforgeError as err:
        backend.close()
        return None, err
    return backend, None


def failure_reason(err: SpecforgeError) -> str:
    """vLLM's failure in one line: its message, or for a vLLM that exited the last line of its log."""
    first, *rest = str(err).splitlines() or [""]
    last = next((line.strip() for line in reversed(rest) if line.strip() and not line.startswith("---")), "")
    return f"{first}: {last}" if last and first.startswith("vLLM exited") else first


def regenerate(backend, tokenizer, records: list[dict], sample_cfg, max_length: int,
               on_tokens=lambda n: None) -> tuple[list[dict], Counter]:
    """Regenerate the assistant turns of `records`; returns output rows and skip counts.

    Requests of one round (the k-th regenerated turn of every conversation) are sorted
    by prompt length and batched, which keeps left padding small. A conversation whose
    first regenerated turn has a prompt over `max_prompt_length` is skipped; one whose
    later turn no longer fits ends after its last regenerated turn (`later_turns_cut`,
    counted but not a loss of the record).
    """
    skipped: Counter = Counter()
    states = []
    for record in records:
        messages = [dict(m) for m in record["messages"]]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if sample_cfg.turns == "last":
            turns = turns[-1:]
        states.append({"id": record["id"], "messages": messages, "turns": turns, "generated": 0,
                       "finish": [], "alive": True})
    for round_index in range(max((len(s["turns"]) for s in states), default=0)):
        requests = []
        for state in states:
            if state["alive"] and round_index < len(state["turns"]):
                turn = state["turns"][round_index]
                ids = prompt_ids(tokenizer, state["messages"][:turn])
                if len(ids) > sample_cfg.max_prompt_length:
                    if round_index == 0:
                        state["alive"] = False
                        skipped["prompt_too_long"] += 1
                    else:  # keep the turns regenerated so far, end the conversation there
                        state["turns"] = state["turns"][:round_index]
                        skipped["later_turns_cut"] += 1
                    continue
                requests.append((state, turn, ids))
        requests.sort(key=lambda r: len(r[2]))
        for start in range(0, len(requests), sample_cfg.batch_size):
            batch = requests[start:start + sample_cfg.batch_size]
            for (state, turn, _), (gen, finish) in zip(batch, backend.generate([r[2] for r in batch])):
                text = tokenizer.decode(gen, skip_special_tokens=True).strip()
                state["generated"] += len(gen)
                on_tokens(len(gen))
                if not text:
                    state["alive"] = False
                    skipped["empty_reply"] += 1
                    continue
                state["messages"][turn]["content"] = text
                state["finish"].append(finish)
    rows = []
    for state in states:
        if not state["alive"]:
            continue
        last = state["turns"][-1] if state["turns"] else len(state["messages"]) - 1
        messages = state["messages"][: last + 1]  # turns after the last regenerated one no longer fit
        input_ids, loss_mask = tokenize_conversation(tokenizer, messages, max_length)
        rows.append({"id": state["id"], "messages": messages, "input_ids": input_ids,
                     "loss_mask": loss_mask, "num_generated_tokens": state["generated"],
                     "finish_reasons": state["finish"]})
    return rows, skipped


def _rank_and_world(sample_cfg) -> tuple[int, int]:
    rank = sample_cfg.rank if sample_cfg.rank is not None else int(os.environ.get("RANK", 0))
    world = sample_cfg.world_size if sample_cfg.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise SpecforgeError(f"sample.rank={rank} is outside world_size={world}")
    return rank, world


def fingerprint_keys(cfg: DictConfig) -> dict:
    """What decides the content of the shards (`fingerprint` hashes it): the target by its path
    and by its files (another model put in the same folder samples anew)."""
    keys = {
        "target": cfg.target.path, "target_files": target_files(cfg.target.path),
        "chat_template": cfg.target.chat_template,
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "sample": {k: OmegaConf.to_container(cfg.sample, resolve=True)[k] for k in
                   ("max_new_tokens", "max_prompt_length", "temperature", "top_p", "turns", "shard_size", "seed")},
    }
    keys["data"].pop("strict", None)
    return json.loads(json.dumps(keys, default=str))


def fingerprint(cfg: DictConfig) -> str:
    """What decides the content of the shards; a resume with another value is refused."""
    return hashlib.sha256(json.dumps(fingerprint_keys(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def stale_samples(cfg: DictConfig, meta: dict, folder: Path) -> str | None:
    """Why the samples described by `meta` (a samples folder's meta.json) were not made with
    this config's settings, naming the keys that differ; None when they were."""
    stamp = fingerprint(cfg)
    if meta.get("fingerprint") == stamp:
        return None
    then, now = _flatten(meta.get("fingerprint_keys") or {}), _flatten(fingerprint_keys(cfg))
    differ = [f"{k}={then.get(k)!r} then, {now.get(k)!r} now" for k in sorted(set(then) | set(now))
              if then.get(k) != now.get(k)] if then else []
    return (f"{folder} holds samples made with other settings ("
            + ("; ".join(differ[:4]) if differ else f"fingerprint {meta.get('fingerprint')}, now {stamp}")
            + "); use another samples_dir (or run_dir), or delete that folder to sample again")


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = "target.path" if prefix == "" and key == "target" else \
            "target.chat_template" if prefix == "" and key == "chat_template" else f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def run(cfg: DictConfig) -> None:
    rank, world = _rank_and_world(cfg.sample)
    sample_cfg = cfg.sample

    records, read_stats = read_conversations(cfg.data.source, cfg.data.format, cfg.data.strict)
    train, heldout = heldout_split(records, cfg.data.heldout_fraction, cfg.data.split_seed)
    if cfg.data.max_samples is not None:
        train = train[: cfg.data.max_samples]
    if not train:  # the split took every record, or no record was readable (read_stats says why)
        split = (f": data.heldout_fraction={cfg.data.heldout_fraction} held out {len(heldout)} of the "
                 f"{len(records)} read; give a smaller fraction") if heldout else ""
        raise SpecforgeError(f"no training conversations left from {cfg.data.source}{split}")
    out = samples_dir(cfg)  # created once the source has been read and the target loaded
    data_dir = out / "data"

    stamp = fingerprint(cfg)
    meta_path = out / "meta.json"
    shard_size = sample_cfg.shard_size
    num_shards = (len(train) + shard_size - 1) // shard_size
    mine = [j for j in range(num_shards) if j % world == rank]
    if meta_path.exists() and completed_shards(data_dir):
        try:
            problem = stale_samples(cfg, read_json_object(meta_path), out)
        except ArtifactError as err:  # a damaged meta.json: each shard's own record of its settings decides
            log.warning("%s; keeping the shards that record these settings, sampling the others again", err)
            for j in set(mine) & set(completed_shards(data_dir)):
                if shard_fingerprint(data_dir, j) != stamp:
                    remove_shard(data_dir, j)
            problem = None
        if problem:
            raise SpecforgeError(problem)
    dtype, load_cfg = samples_dtype(cfg, out, stamp)  # decided once per samples folder (sample_dtype.py)
    if rank == 0:  # shard files of no shard of these samples (another run's, a copy): not theirs to keep
        for j in [j for j in completed_shards(data_dir) if j >= num_shards]:
            log.warning("%s is not one of these samples' %d shards; removed", shard_path(data_dir, j), num_shards)
            remove_shard(data_dir, j)
    for j, problem in damaged_shards(data_dir, mine).items():  # checked against their recorded sha256
        log.warning("%s; rewriting that shard", problem)
        remove_shard(data_dir, j)
    done = set(completed_shards(data_dir))
    todo = [j for j in mine if j not in done]
    size = lambda j: min(shard_size, len(train) - j * shard_size)  # noqa: E731
    if len(todo) < len(mine):
        log.info("resuming: %d of this rank's %d shards already written", len(mine) - len(todo), len(mine))
    if not todo and samples_meta(out).get("complete"):
        # complete samples of these settings: their meta.json and config.yaml describe the run
        # that made them and stay as they are (another sample.backend names no shard here)
        log.info("%s already holds complete samples made with these settings; nothing to do", out)
        return

    if todo:  # the target loads before anything is written
        # vllm runs in a child process (specforge_lite/serving); auto picks the fastest one installed
        backend, tokenizer, backend_used, dtype = open_backend(
            load_cfg, out / f"vllm-rank{rank}.log", lambda model: decided_dtype(cfg, model, out, stamp, rank, dtype))
        log.info("sample backend: %s", backend_used)
        require_chat_template(tokenizer)
    if rank == 0:
        stage_dir(cfg, "sample")
        write_provenance(out, cfg)
        atomic_write_json(out / "split.json", {"heldout_ids": [r["id"] for r in heldout],
                                               "num_train": len(train), "read": read_stats.to_dict()})
        _write_meta(meta_path, cfg, stamp, train, heldout, read_stats, data_dir, False, dtype)

    if todo:
        started, generated = time.perf_counter(), 0
        bar = tqdm(total=sum(size(j) for j in mine), initial=sum(size(j) for j in mine if j in done),
                   desc=f"sample rank {rank}/{world}", unit="conv", dynamic_ncols=True)

        def count_tokens(n: int) -> None:
            nonlocal generated
            generated += n
            bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - started):.1f}")

        for j in todo:
            torch.manual_seed(sample_cfg.seed * 1_000_003 + j)  # same shard, same draws, after any restart
            chunk = train[j * shard_size:(j + 1) * shard_size]
            shard_started = time.perf_counter()
            rows, skipped = regenerate(backend, tokenizer, chunk, sample_cfg, cfg.data.max_length, count_tokens)
            write_shard(data_dir, j, rows, {"records": len(chunk), "written": len(rows), "skipped": dict(skipped),
                                            "generated_tokens": sum(r["num_generated_tokens"] for r in rows),
                                            "seconds": time.perf_counter() - shard_started,
                                            "backend": backend_used, "fingerprint": stamp,
                                            "target_dtype": dtype["used"]})
            bar.update(len(chunk))
        bar.close()
        elapsed = time.perf_counter() - started
        if hasattr(backend, "close"):
            backend.close()
        log.info("rank %d generated %d tokens in %.1f s (%.1f tokens/s)", rank, generated, elapsed,
                 generated / max(elapsed, 1e-9))

    finished = rank == 0 and set(completed_shards(data_dir)) >= set(range(num_shards))
    if finished and (damaged := damaged_shards(data_dir)):  # another rank's, not rewritten yet
        log.warning("%d shard(s) damaged (%s): not complete until the ranks that own them rewrite them",
                    len(damaged), next(iter(damaged.values())))
        finished = False
    if finished:
        meta = _write_meta(meta_path, cfg, stamp, train, heldout, read_stats, data_dir, True, dtype)
        log.info("samples: %d conversations, %d assistant tokens in %s (skipped: %s)", meta["num_rows"],
                 meta["num_loss_tokens"], data_dir, meta["skipped"] or "none")
        if not meta["num_rows"]:
            log.warning("every prompt was skipped (%s): these samples hold no conversation to train on",
                        meta["skipped"] or "no reason recorded")
    elif rank == 0:
        log.info("rank 0 done; %d shards of %d written so far (other ranks still working)",
                 len(completed_shards(data_dir)), num_shards)


def _write_meta(path: Path, cfg, stamp, train, heldout, read_stats, data_dir: Path, complete: bool,
                dtype: dict | None) -> dict:
    skipped: Counter = Counter()
    backends: Counter = Counter()  # which backend made each shard (a resume may use another)
    num_rows = num_tokens = num_loss = generated = 0
    seconds = 0.0
    if complete:
        import pyarrow.parquet as pq

        for j in completed_shards(data_dir):
            stats = read_json_object(stats_path(data_dir, j))
            skipped.update(stats["skipped"])
            generated += stats["generated_tokens"]
            seconds += stats.get("seconds", 0.0)
            backends[stats.get("backend", "unrecorded")] += 1
            table = pq.read_table(shard_path(data_dir, j), columns=["input_ids", "loss_mask"])
            num_rows += table.num_rows
            for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
                num_tokens += len(ids)
                num_loss += sum(mask)
    meta = {
        "complete": complete, "fingerprint": stamp, "fingerprint_keys": fingerprint_keys(cfg),
        "target": cfg.target.path,
        "sampling": {k: v for k, v in OmegaConf.to_container(cfg.sample, resolve=True).items()
                     if k not in ("rank", "world_size", "vllm")},
        "data": {"source": cfg.data.source, "num_train": len(train), "num_heldout": len(heldout),
                 "read": read_stats.to_dict()},
        "num_rows": num_rows, "num_tokens": num_tokens, "num_loss_tokens": num_loss,
        "num_generated_tokens": generated, "skipped": dict(skipped), "versions": package_versions(),
        "target_dtype": dtype,  # the target's dtype, decided once for these samples (`decided_dtype`)
        # generation time summed over the shards (whichever command or rank made them), start-up excluded:
        # what the target's own answers cost, next to what training on them buys
        "generation_s": seconds,
    }
    if backends:  # the backends that made the shards, not only the one of this command
        meta["shard_backends"] = dict(backends)
        if len(backends) == 1 and "unrecorded" not in backends:
            meta["sampling"]["backend"] = next(iter(backends))
    atomic_write_json(path, meta)
    return meta
