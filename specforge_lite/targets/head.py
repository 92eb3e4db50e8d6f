"""The target as the export stage's checks need it: its input embeddings, final norm and
lm_head, read by name from its safetensors files, and nothing else.

The model is built on the meta device; only the weights outside the decoder layers are
read (through `model.safetensors.index.json` where the target is split into several
files, so the files holding only layers are never opened, nor downloaded for a hub id).
The decoder layers stay on the meta device: a forward through them fails loudly instead of
computing with weights that were never read. What the drafters' exports use of the
target (config, dtype, device, embeddings, lm_head, generation config) is all there.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from specforge_lite import SpecforgeError
from specforge_lite.targets.accounting import is_layer_weight, record_target
from specforge_lite.checked_io import safetensors_header
from specforge_lite.targets.loading import load_tokenizer, resolve_device, resolve_dtype, resolve_target_path

INDEX = "model.safetensors.index.json"


def weight_files(path: str, names: list[str]) -> tuple[Path, dict[str, Path]]:
    """The target's folder and, for each tensor name, the safetensors file that holds it (only
    the files needed are fetched for a hub id)."""
    from safetensors import safe_open

    folder = Path(path)
    if not folder.is_dir():  # a hub id: its json files first, then only the shards that hold `names`
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path, allow_patterns=["*.json"]))
    index = folder / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: weight_map[name] for name in names if name in weight_map}
    else:
        files = {}
        if (folder / "model.safetensors").exists() or not Path(path).is_dir():
            files = dict.fromkeys(names, "model.safetensors")
    if not Path(path).is_dir() and files:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path, allow_patterns=sorted(set(files.values()))))
    found = {}
    for file in sorted(set(files.values())):
        if (folder / file).exists():
            safetensors_header(folder / file)  # complete, as its header says: one line naming a damaged file
    for name, file in files.items():
        if (folder / file).exists():
            with safe_open(str(folder / file), framework="pt") as handle:
                if name in handle.keys():
                    found[name] = folder / file
    return folder, found


def load_target_head(target_cfg):
    """`(model, tokenizer)`: the target with its embeddings, final norm and lm_head read from its
    safetensors files and its decoder layers left on the meta device (never read)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = resolve_target_path(target_cfg.path)
    device = resolve_device(target_cfg.device)
    dtype = resolve_dtype(target_cfg.dtype, device)
    tokenizer = load_tokenizer(target_cfg)
    config = AutoConfig.from_pretrained(path, trust_remote_code=target_cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=target_cfg.trust_remote_code)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    needed = [name for name, _ in model.named_parameters() if not is_layer_weight(name)]  # tied: counted once
    folder, files = weight_files(path, needed)
    missing = [name for name in needed if name not in files]
    if missing:
        raise SpecforgeError(f"target.path={target_cfg.path!r}: no safetensors file in {folder} holds "
                             f"{', '.join(missing)} (export reads the embeddings, final norm and lm_head by name)")
    with torch.no_grad():
        for name in needed:
            with safe_open(str(files[name]), framework="pt") as handle:
                tensor = handle.get_tensor(name).to(device=device, dtype=dtype)
            owner, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            setattr(owner, attr, torch.nn.Parameter(tensor, requires_grad=False))
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.eval()
    model.requires_grad_(False)
    model.read_tensors = sorted(needed)  # what was read from the files, for the record and the tests
    record_target(model, "target_head.load_target_head (embeddings, final norm, lm_head)")
    return model, tokenizer
