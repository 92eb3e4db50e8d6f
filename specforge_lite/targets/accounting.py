"""Per-rank accounting of the target's weights held in each stage.

Every place that loads the target calls `record_target(model)` (a stage that keeps the target
out of its process, `record_no_target(config)`); while a stage runs
(`begin_stage`, called by the stage runner in every rank) that writes what this rank holds
to `run_dir/accounting/STAGE.rank<R>.json`: the bytes of the target's decoder-layer weights
it holds (a sharded weight's local shard only), the layers' total over all ranks, this
rank's share of them (the rows FSDP's even split gives it) and the bytes of everything else
(embeddings, final norm, lm_head). Where vLLM holds the target, its tensor-parallel workers
report what each holds (`record_vllm_workers`, `STAGE.vllm-tp<R>.json`). A stage that loads
the target several times keeps the peak. `stage_summary(run_dir)` reads them back, one verdict per stage: does every rank hold
at most its share of the layer weights? (`make rehearse` asserts it; `specforge_lite/scale/rehearse.py`.)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from specforge_lite.run_folders import atomic_write_text

ACCOUNTING_DIR = "accounting"
_stage: dict = {}  # {"run_dir": Path, "stage": str} while a stage runs


def begin_stage(run_dir, stage: str) -> None:
    """From here on `record_target` writes under `run_dir/accounting` for `stage` (what its records
    held before is kept, for `undo_stage`)."""
    _stage.clear()
    folder = Path(run_dir) / ACCOUNTING_DIR
    before = {p: p.read_bytes() for p in folder.glob(f"{stage}.*.json")} if folder.is_dir() else {}
    _stage.update(run_dir=Path(run_dir), stage=stage, before=before, folder_existed=folder.is_dir())


def current_stage() -> str | None:
    """The stage this process runs now (`begin_stage`), or None before the first."""
    return _stage.get("stage")


def undo_stage() -> None:
    """A stage refused its input after recording what it loaded: its records go back to what they
    were when it began (a refused command leaves the run folder as it found it)."""
    if not _stage:
        return
    folder = _stage["run_dir"] / ACCOUNTING_DIR
    for path in folder.glob(f"{_stage['stage']}.*.json") if folder.is_dir() else ():
        if path in _stage["before"]:
            path.write_bytes(_stage["before"][path])
        else:
            path.unlink()
    if not _stage["folder_existed"] and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def is_layer_weight(name: str) -> bool:
    """A decoder layer's weight (`model.layers.N.*`, `layers.N.*`), as opposed to the
    embeddings, the final norm and the lm_head."""
    parts = name.split(".")
    return any(p == "layers" and i + 1 < len(parts) and parts[i + 1].isdigit() for i, p in enumerate(parts))


def target_weights(model, world: int) -> dict:
    """Bytes of `model`'s parameters this rank holds, split into decoder layers and the rest,
    with the layers' total and this rank's share of them over `world` ranks."""
    from torch.distributed.tensor import DTensor

    held = layers_total = other = 0
    shapes: dict[str, int] = {}  # "rows x row_bytes" -> how many layer weights have that shape
    vectors: dict[str, int] = {}  # the same for the 1-D ones (norms, biases)
    seen = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:  # tied embeddings count once
            continue
        seen.add(id(param))
        local = param.to_local() if isinstance(param, DTensor) else getattr(param, "ds_tensor", param)
        size = param.element_size()
        local_bytes = 0 if local.device.type == "meta" else local.numel() * size
        if not is_layer_weight(name):
            other += local_bytes
            continue
        held += local_bytes
        shape = tuple(getattr(param, "ds_shape", None) or param.shape)
        numel = math.prod(shape)
        layers_total += numel * size
        rows = shape[0] if shape else 1
        key = f"{rows}x{numel // max(rows, 1) * size}"
        shapes[key] = shapes.get(key, 0) + 1
        if len(shape) == 1:
            vectors[key] = vectors.get(key, 0) + 1
    return {"layer_bytes_held": held, "layer_bytes_total": layers_total,
            "layer_bytes_share": share_bytes(shapes, world), "other_bytes_held": other, "layer_shapes": shapes,
            "layer_vector_shapes": vectors}


def share_bytes(shapes: dict, world: int) -> int:
    """The layer bytes one rank holds when every layer weight is split by rows over `world`
    ranks the way FSDP2 splits them (chunks of ceil(rows / world)): the largest chunk."""
    total = 0
    for key, count in shapes.items():
        rows, row_bytes = (int(x) for x in key.split("x"))
        total += math.ceil(rows / world) * row_bytes * count
    return total


def _keep_peak(path: Path, entry: dict) -> dict:
    """Write `entry` to `path` unless an earlier record there (same world size) holds more."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # keep the peak over this stage's loads
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError):
            before = None
        if before and before.get("world_size") == entry["world_size"] \
                and before["layer_bytes_held"] >= entry["layer_bytes_held"]:
            return before
    atomic_write_text(path, json.dumps(entry, indent=1))  # its own temporary file: samplers of one rank write at once
    return entry


def tensor_parallel_share(entry: dict, world: int) -> int:
    """The layer bytes one tensor-parallel worker holds: every matrix split over `world`
    workers, the 1-D weights (norms) whole on each, as tensor parallelism keeps them."""
    vectors = entry.get("layer_vector_shapes", {})
    matrices = {k: n - vectors.get(k, 0) for k, n in entry["layer_shapes"].items() if n > vectors.get(k, 0)}
    whole = sum(int(k.split("x")[0]) * int(k.split("x")[1]) * n for k, n in vectors.items())
    return share_bytes(matrices, world) + whole


def share_of(entry: dict, world: int | None = None) -> int:
    """An accounting record's share of the layer bytes over `world` ranks (its own world size
    when None), by its rule: FSDP's even split of every weight, or tensor parallelism's."""
    world = world or entry["world_size"]
    if entry.get("share_rule") == "tensor_parallel":
        return tensor_parallel_share(entry, world)
    return share_bytes(entry["layer_shapes"], world)


def record_target(model, how: str) -> dict | None:
    """Record what this rank holds of the target just loaded (`how`: which loader). A no-op
    outside a stage. Returns the record written."""
    if not _stage:
        return None
    rank, world = _rank_world()
    entry = dict(target_weights(model, world), stage=_stage["stage"], rank=rank, world_size=world, loaded_by=how)
    return _keep_peak(_stage["run_dir"] / ACCOUNTING_DIR / f"{_stage['stage']}.rank{rank}.json", entry)


def recording() -> bool:
    """Whether a stage is being accounted (so a caller can skip work only the records need)."""
    return bool(_stage)


def _meta_model(config, dtype=None):
    """The target built from its HF config on the meta device (shapes only, nothing read)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def record_vllm_workers(config, workers: list[dict], dtype, how: str) -> list[dict]:
    """Record what each of vLLM's tensor-parallel workers holds of the target, as the workers
    report it (`serving.vllm_engine.VllmEngine.held_weights`), one record per worker
    (`STAGE.vllm-tpR.json`), against the layers' total and share computed from `config` in
    `dtype` (the dtype vLLM loaded): the workers are this stage's ranks for the target; their
    share is tensor parallelism's (`tensor_parallel_share`: matrices split, norms whole)."""
    if not _stage or not workers:  # no stage begun, or vLLM reported no worker: nothing to record
        return []
    reference = target_weights(_meta_model(config, dtype), len(workers))
    written = []
    for worker in workers:
        entry = dict(reference, layer_bytes_held=worker["layer_bytes"], other_bytes_held=worker["other_bytes"],
                     stage=_stage["stage"], rank=worker["rank"], process=f"vllm-tp{worker['rank']}",
                     world_size=len(workers), loaded_by=how, share_rule="tensor_parallel")
        entry["layer_bytes_share"] = share_of(entry)
        path = _stage["run_dir"] / ACCOUNTING_DIR / f"{_stage['stage']}.vllm-tp{worker['rank']}.json"
        written.append(_keep_peak(path, entry))
    return written


def record_no_target(config, how: str) -> dict | None:
    """Record that this rank holds none of the target's weights in this stage (an evaluate of
    vLLM methods only: vLLM's own processes hold the target, `record_vllm_workers`). The layers' total and share come
    from `config` (the target's HF config), the model built on the meta device: nothing read."""
    if not _stage:
        return None
    return record_target(_meta_model(config), how)


def clear(run_dir) -> None:
    """Forget earlier records (a rehearsal starts from none)."""
    folder = Path(run_dir) / ACCOUNTING_DIR
    for path in folder.glob("*.json") if folder.is_dir() else ():
        path.unlink()


def stage_summary(run_dir, world: int | None = None) -> dict:
    """`{stage: {world_size, ranks: {rank: layer bytes held}, peak, total, share, within_share}}`
    over the records under `run_dir/accounting`. `world`: the share is 1/world of the layers
    even for a stage that ran in fewer processes (one process holding the whole target is
    over its share of an 8-device layout); null: each stage's own world size."""
    folder = Path(run_dir) / ACCOUNTING_DIR
    records: dict[str, list[dict]] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        entry = json.loads(path.read_text())
        records.setdefault(entry["stage"], []).append(entry)
    out = {}
    for stage, entries in records.items():
        peak = max(e["layer_bytes_held"] for e in entries)
        share = max(share_of(e, world) for e in entries)
        out[stage] = {
            "world_size": max(e["world_size"] for e in entries),
            "loaded_by": sorted({e["loaded_by"] for e in entries}),
            "ranks": {e.get("process", str(e["rank"])): e["layer_bytes_held"]
                      for e in sorted(entries, key=lambda e: (e.get("process", ""), e["rank"]))},
            "other_bytes_held_peak": max(e["other_bytes_held"] for e in entries),
            "layer_bytes_peak": peak, "layer_bytes_total": max(e["layer_bytes_total"] for e in entries),
            "layer_bytes_share": share, "within_share": peak <= share}
    return out
