"""The target's dtype for a samples folder: decided once, recorded, and the same for every shard.

`target.dtype=auto` times float32 against bf16 on a CPU with native bf16 (`runtime/dtype_choice`),
and two processes timing apart may choose apart: ranks would mix float32 and bf16 shards, and so
would a resume whose choice went the other way. So the choice is made once per samples folder and
recorded in its meta.json and in every shard's stats: rank 0 makes it (the other ranks wait for its
record where the choice is timed), a resume with `auto` keeps the recorded dtype, and a resume that
names another dtype is refused before the target loads (`data.samples.dtype_problem`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.data.samples import dtype_problem, recorded_dtype, samples_meta, wait_for_recorded_dtype
from specforge_lite.runtime.dtype_choice import chosen_dtype, timed_choice
from specforge_lite.serving.vllm.interpreter import on_gpu
from specforge_lite.targets.loading import resolve_dtype


def requested_dtype(cfg) -> str:
    return str(getattr(cfg.target.dtype, "value", cfg.target.dtype))


def samples_dtype(cfg, out: Path, stamp: str) -> tuple:
    """`(record, load_cfg)`: the dtype the samples of settings `stamp` in `out` record (None: none yet),
    and the config to load the target with (target.dtype=auto becomes the recorded dtype). A recorded
    dtype other than the one target.dtype names, with shards written, is refused."""
    recorded, requested = recorded_dtype(out, stamp), requested_dtype(cfg)
    if problem := dtype_problem(out, recorded, requested):
        raise SpecforgeError(problem)
    if not recorded:
        return None, cfg
    record = {**(samples_meta(out).get("target_dtype") or {}), "used": recorded}
    return record, OmegaConf.merge(cfg, {"target": {"dtype": recorded}}) if requested == "auto" else cfg


def decided_dtype(cfg, model, out: Path, stamp: str, rank: int, record: dict | None) -> tuple:
    """`(model, record)`: the target in the one dtype these samples are drawn in: the recorded one
    (target.dtype=auto keeps it), else rank 0's choice (`chosen_dtype`, as evaluate chooses it),
    which the other ranks wait for where it is timed (`timed_choice`)."""
    requested = requested_dtype(cfg)
    if requested == "auto" and not record and rank and timed_choice(cfg.target, model):
        record = {"requested": "auto", "used": wait_for_recorded_dtype(out, stamp, rank), "reason": "rank 0's"}
    if requested == "auto" and record:
        return model.to(getattr(torch, record["used"])), record
    return chosen_dtype(cfg.target, model, [1, cfg.sample.batch_size])


def vllm_dtype(cfg) -> dict:
    """What vLLM samples in: target.dtype as named, auto resolved (`resolve_dtype`)."""
    requested = requested_dtype(cfg)
    used = resolve_dtype(requested, torch.device("cuda" if on_gpu() else "cpu"))
    return {"requested": requested, "used": str(used).removeprefix("torch."), "reason": "as vLLM loads target.dtype"}
