"""The frozen target sharded over ranks for online training (`trainer.shard_target=true`).

The model is built on the meta device, each decoder layer is wrapped with FSDP2's
`fully_shard`, and each rank reads only its own rows of every layer weight from the
target's safetensors files (memory-mapped), so no rank ever holds the whole target:
per-rank weights are 1/N of the layers plus the embeddings, final norm and lm_head,
which stay whole (the drafter copies them and the loss reads the lm_head directly).
Each layer is gathered for its forward and freed after it; every rank must run every
target forward.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from specforge_lite import SpecforgeError
from specforge_lite.targets.accounting import record_target


def load_sharded_target(target_cfg, device: torch.device):
    """`(model, tokenizer)` with every decoder layer `fully_shard`-ed over all ranks.

    Built on the meta device, then each rank reads only its own rows of each layer weight
    from the safetensors files (memory-mapped), so no rank ever holds the whole target.
    """
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from specforge_lite.targets.loading import load_tokenizer, resolve_dtype, resolve_target_path

    path = Path(resolve_target_path(target_cfg.path))
    if not path.is_dir():
        raise SpecforgeError(f"trainer.shard_target=true reads the target's safetensors files: target.path "
                             f"{target_cfg.path!r} must be a local directory (download it first)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecforgeError(f"trainer.shard_target=true: no *.safetensors files in {path}")
    dtype = resolve_dtype(target_cfg.dtype, device)
    tokenizer = load_tokenizer(target_cfg)
    config = AutoConfig.from_pretrained(path, trust_remote_code=target_cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=target_cfg.trust_remote_code)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise SpecforgeError(f"trainer.shard_target=true: {type(model).__name__} has no model.layers to shard")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    model.to_empty(device=device)
    # non-persistent buffers (rotary frequencies) are not in the files: build them again
    for name, module in list(model.named_modules()):
        if name.endswith("rotary_emb"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], type(module)(config=model.config).to(device))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    params = dict(model.named_parameters())
    loaded = set()
    with contextlib.ExitStack() as stack, torch.no_grad():
        handles = [stack.enter_context(safe_open(str(file), framework="pt")) for file in files]
        where = {key: handle for handle in handles for key in handle.keys()}  # tensor name -> its file
        for name, param in params.items():
            local = param.to_local() if isinstance(param, DTensor) else param
            if param.dim() == 0 and name in where:
                local.copy_(where[name].get_tensor(name).to(dtype))
                loaded.add(name)
                continue
            start, stop = shard_rows(param.shape[0], local.shape[0], rank, world) if isinstance(param, DTensor) \
                else (0, param.shape[0])
            if name in where:  # this rank's rows only
                if stop > start:
                    local.copy_(where[name].get_slice(name)[start:stop].to(dtype))
                loaded.add(name)
            elif (rows := expert_rows(name, where, start, stop)) is not None:  # experts saved one by one
                if stop > start:
                    local.copy_(rows.to(dtype))
                loaded.add(name)
    missing = set(params) - loaded
    if tied:
        missing.discard(next(n for n, p in params.items() if p is model.get_output_embeddings().weight))
    if missing:
        raise SpecforgeError(f"target files in {path} lack {sorted(missing)[:5]} (and {max(0, len(missing) - 5)} more)")
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    model.requires_grad_(False)
    record_target(model, "sharded_target.load_sharded_target (FSDP2 per layer)")
    return model, tokenizer


def expert_rows(name: str, where: dict, start: int, stop: int) -> torch.Tensor | None:
    """Experts `start..stop-1` of a fused expert weight (`...mlp.experts.gate_up_proj` [E, 2I, H]
    or `down_proj` [E, H, I], as transformers holds a mixture of experts) from a checkpoint that
    saves each expert's projections by name (`...experts.{e}.gate_proj.weight`, `up_proj`,
    `down_proj`); None when `name` is no such weight or the files do not hold it."""
    prefix, _, fused = name.rpartition(".experts.")
    if fused not in ("gate_up_proj", "down_proj"):
        return None
    parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
    keys = [[f"{prefix}.experts.{e}.{part}.weight" for part in parts] for e in range(start, stop)]
    if not all(key in where for row in keys for key in row):
        return None
    return torch.stack([torch.cat([where[key].get_tensor(key) for key in row]) for row in keys]) if keys \
        else torch.empty(0)


def shard_rows(rows: int, local_rows: int, rank: int, world: int) -> tuple[int, int]:
    """`[start, stop)` of dim 0 that FSDP2 gives `rank` (its `torch.chunk` split: chunks of
    ceil(rows / world), the last ones shorter or empty)."""
    chunk = math.ceil(rows / world)
    start = min(rows, rank * chunk)
    stop = min(rows, start + chunk)
    if stop - start != local_rows:
        raise RuntimeError(f"FSDP2 shard of {rows} rows on rank {rank}/{world} holds {local_rows}, "
                           f"expected rows [{start}, {stop})")
    return start, stop
