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
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    if key not in params:
                        continue
                    param = params[key]
                    if isinstance(param, DTensor):  # read this rank's rows only
                        local = param.to_local()
                        start, stop = shard_rows(param.shape[0], local.shape[0], rank, world)
                        if stop > start:
                            local.copy_(handle.get_slice(key)[start:stop].to(dtype))
                    else:
                        param.copy_(handle.get_tensor(key).to(dtype))
                    loaded.add(key)
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
