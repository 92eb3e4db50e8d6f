"""DFlash checkpoints in the speculators format vLLM 0.32 serves (`method: "dflash"`).

What vLLM's loader reads (`transformers_utils/configs/speculators/algos.py`, `update_dflash`;
`model_executor/models/qwen3_dflash.py`): `speculators_model_type: "dflash"` ->
architecture `DFlashDraftModel` (Qwen3-style layers: per-head `q_norm` / `k_norm`);
`aux_hidden_state_layer_ids` (required) is used as-is to pick the target's hidden states (the
input of decoder layer i, our ids) and shifted to `dflash_config.target_layer_ids = i - 1`
(the output of layer i - 1, the same tensor); `mask_token_id` (required); `draft_vocab_size`
with `d2t` (`t2d` is skipped); `sample_from_anchor` (false: block row 0 is the anchor,
rows 1.. predict, k = S - 1); `sliding_window_non_causal` (default true; false makes every
draft layer causal, our `causal` variant). The layer shapes come from
`transformer_layer_config` (a Qwen3 config; its `vocab_size` is the target's, its rope is
written out because vLLM defaults a missing theta to 1e6). Unexpected weight names fail
vLLM's load and `mask_hidden` is refused outright; missing ones are not reported, so
`check_speculators_dir` checks every name and shape here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge_lite import SpecforgeError
from specforge_lite.run_folders import atomic_write_text
from specforge_lite.drafters.dflash.model import DFLASH, DFlashConfig, DFlashDrafter, Format, select_anchors
from specforge_lite.drafters.dflash.interop import load_any
from specforge_lite.drafters.eagle_family import check_weights, proposal_config

log = logging.getLogger(__name__)


def transformer_layer_config(cfg: DFlashConfig) -> dict[str, Any]:
    return {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": cfg.hidden_act,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
    }


def speculators_config(cfg: DFlashConfig, speculative_tokens: int, verifier: str,
                       verifier_architectures: list[str], fmt: Format = DFLASH) -> dict[str, Any]:
    return {
        "speculators_model_type": fmt.model_type,
        "architectures": [fmt.architecture],
        "speculators_version": "0.9.0",
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "mask_token_id": int(cfg.mask_token_id),
        "block_size": cfg.block_size,
        "sample_from_anchor": bool(cfg.sample_from_anchor),
        "sliding_window_non_causal": not cfg.causal,
        **fmt.fields(cfg),
        "transformer_layer_config": transformer_layer_config(cfg),
        "speculators_config": proposal_config(fmt.model_type, speculative_tokens, verifier, verifier_architectures),
    }


def expected_shapes(config: dict[str, Any], fmt: Format = DFLASH) -> dict[str, tuple[int, ...]]:
    """Every weight a speculators directory of `fmt` must hold, with its shape."""
    layer = config["transformer_layer_config"]
    h, v, vd = layer["hidden_size"], layer["vocab_size"], config["draft_vocab_size"]
    d = layer["head_dim"]
    q, kv = layer["num_attention_heads"] * d, layer["num_key_value_heads"] * d
    inter = layer["intermediate_size"]
    shapes = {"embed_tokens.weight": (v, h), "fc.weight": (h, len(config["aux_hidden_state_layer_ids"]) * h),
              "hidden_norm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (vd, h)}
    for i in range(layer["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
    if vd != v:
        shapes["d2t"] = (vd,)
        shapes["t2d"] = (v,)
    return {**shapes, **fmt.shapes(config)}


REQUIRED_FIELDS = {
    "speculators_model_type": str, "architectures": list, "draft_vocab_size": int,
    "aux_hidden_state_layer_ids": list, "mask_token_id": int, "block_size": int, "sample_from_anchor": bool,
    "sliding_window_non_causal": bool, "transformer_layer_config": dict, "speculators_config": dict,
}


def write_speculators_dir(drafter: DFlashDrafter, out: Path, speculative_tokens: int, verifier: str,
                          verifier_architectures: list[str], fmt: Format = DFLASH) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    config = speculators_config(drafter.config, speculative_tokens, verifier, verifier_architectures, fmt)
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}  # embed_tokens included
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        state.pop("d2t"), state.pop("t2d")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def check_speculators_dir(directory: Path, fmt: Format = DFLASH) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Strict reload; raises ValueError naming the first problem. Returns (config, weights)."""
    from specforge_lite.checked_io import load_safetensors, read_json_object

    directory = Path(directory)
    where = f"{directory}/config.json"
    config = read_json_object(directory / "config.json")
    if "model_type" in config:
        raise ValueError(f"{where}: speculators configs have no top-level model_type")
    for key, kind in REQUIRED_FIELDS.items():
        if key not in config:
            raise ValueError(f"{where}: missing field {key!r}")
        if not isinstance(config[key], kind) or (kind is int and isinstance(config[key], bool)):
            raise ValueError(f"{where}: {key!r} should be {kind.__name__}, got {type(config[key]).__name__}")
    if config["speculators_model_type"] != fmt.model_type or config["architectures"] != [fmt.architecture]:
        raise ValueError(f"{where}: not a {fmt.model_type} speculators config")
    fmt.read(config, where)
    layer = config["transformer_layer_config"]
    if layer.get("model_type") != "qwen3" or not isinstance(layer.get("num_hidden_layers"), int) \
            or layer["num_hidden_layers"] < 1:
        raise ValueError(f"{where}: transformer_layer_config must be a qwen3 config with >= 1 layer")
    if not config["aux_hidden_state_layer_ids"] or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in config["aux_hidden_state_layer_ids"]):
        raise ValueError(f"{where}: aux_hidden_state_layer_ids must be a non-empty list of layer ids >= 0")
    if not 0 <= config["mask_token_id"] < layer["vocab_size"]:
        raise ValueError(f"{where}: mask_token_id {config['mask_token_id']} is not a target token id")
    spec = config["speculators_config"]
    proposal = spec["proposal_methods"][0]
    most = config["block_size"] - (0 if config["sample_from_anchor"] else 1)
    if spec.get("algorithm") != fmt.model_type or not isinstance(proposal.get("speculative_tokens"), int) \
            or not 1 <= proposal["speculative_tokens"] <= most or not spec.get("verifier", {}).get("name_or_path"):
        raise ValueError(f"{where}: speculators_config is incomplete (speculative_tokens in 1..{most})")
    weights = load_safetensors(directory / "model.safetensors")
    check_weights(directory / "model.safetensors", weights, expected_shapes(config, fmt), config["draft_vocab_size"])
    return config, weights


def load_speculators_dir(directory: Path, target, fmt: Format = DFLASH) -> DFlashDrafter:
    """Build our module from a speculators directory of `fmt` (checked strictly first)."""
    config, weights = check_speculators_dir(directory, fmt)
    layer = config["transformer_layer_config"]
    rope = layer.get("rope_parameters") or {}
    cfg = fmt.config_class(hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
                       num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
                       intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
                       draft_vocab_size=config["draft_vocab_size"],
                       aux_layer_ids=list(config["aux_hidden_state_layer_ids"]),
                       num_layers=layer["num_hidden_layers"], block_size=config["block_size"],
                       causal=not config["sliding_window_non_causal"], mask_token_id=config["mask_token_id"],
                       rms_norm_eps=layer["rms_norm_eps"],
                       rope_theta=rope.get("rope_theta", layer.get("rope_theta", 1e6)),
                       max_position_embeddings=layer["max_position_embeddings"], hidden_act=layer["hidden_act"],
                       sample_from_anchor=config["sample_from_anchor"], **fmt.read(config, directory / "config.json"))
    drafter = fmt.drafter_class(cfg)
    if "d2t" not in weights:  # full vocab: identity maps
        weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        weights["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    drafter.load_state_dict(weights, strict=True)
    return drafter.to(target.device).eval()


@torch.no_grad()
def max_logit_difference(a: DFlashDrafter, b: DFlashDrafter) -> float:
    """Largest |difference| of the training forwards' outputs (logits, and a variant's other outputs,
    DSpark's confidences) over the blocks of random anchors on random inputs (made in `a`'s dtype)."""
    device, dtype = a.fc.weight.device, a.fc.weight.dtype
    gen = torch.Generator().manual_seed(0)
    t = 4 * a.config.block_size
    ids = torch.randint(0, a.config.vocab_size, (2, t), generator=gen).to(device)
    aux = torch.randn(2, t, a.fc.weight.shape[1], generator=gen).to(device, dtype)
    anchors, _ = select_anchors(torch.ones(2, t), 4, gen)
    valid = torch.ones(2, t, dtype=torch.bool, device=device)
    outputs = [a(ids, aux, anchors.to(device), valid), b(ids, aux, anchors.to(device), valid)]
    pairs = zip(*outputs) if isinstance(outputs[0], tuple) else [outputs]
    return max(float((x - y).abs().max()) if x is not None else 0.0 for x, y in pairs)


def export(cfg, trained: Path, out: Path, target, tokenizer, k: int, k_source: str, verifier: str,
           fmt: Format = DFLASH, load=load_any) -> dict:
    """`out/speculators` in `fmt`, reloaded strictly and compared output for output with the
    trained drafter (read by `load`: our train folder or a peer's, interop.py).

    A non-causal drafter is exported with k = its whole block's drafts (block_size - 1, or
    block_size when the anchor row drafts too): vLLM runs the block rows k needs, and rows that
    see each other change when the block is shorter than the one trained on."""
    drafter = load(trained, target)
    most = drafter.config.block_size - (0 if drafter.config.sample_from_anchor else 1)
    whole = "block_size" if drafter.config.sample_from_anchor else "block_size - 1"
    if not drafter.config.causal and k != most:
        log.warning("k=%d (%s): a non-causal %s drafter serves its whole block; exporting k=%d", k, k_source,
                    fmt.label, most)
        k, k_source = most, f"{whole} (non-causal; {k_source} gave {k})"
    elif k > most:
        log.warning("k=%d (%s) is more than %s: exporting k=%d", k, k_source, whole, most)
        k, k_source = most, f"{k_source}, capped at {whole}"
    architectures = list(target.config.architectures or ["LlamaForCausalLM"])
    speculators_dir = out / "speculators"
    config = write_speculators_dir(drafter, speculators_dir, k, verifier, architectures, fmt)
    diff = max_logit_difference(drafter, load_speculators_dir(speculators_dir, target, fmt))
    if diff != 0.0:
        raise SpecforgeError(f"{speculators_dir.name}: reloaded drafter differs from the trained one "
                             f"(max |dlogit| {diff})")
    log.info("speculators %s export passed its strict reload (every key and shape; outputs identical)", fmt.label)
    atomic_write_text(speculators_dir / "README.md", serve_readme(cfg, verifier, k, k_source, config, fmt))
    return {"format": "speculators", "path": "speculators", "speculative_tokens": k}


def serve_readme(cfg, verifier: str, k: int, k_source: str, config: dict, fmt: Format = DFLASH) -> str:
    layer = config["transformer_layer_config"]
    attention = "non-causal" if config["sliding_window_non_causal"] else "causal"
    readout = "the anchor row drafts too" if config["sample_from_anchor"] else "the anchor row drafts nothing"
    return f"""# {fmt.label} drafter for {verifier}

Trained by specforge_lite (recipe `{cfg.recipe_name}`). Format: speculators ({fmt.label},
`speculators_model_type: "{fmt.model_type}"`): {layer['num_hidden_layers']} Qwen3-style decoder layers, block
{config['block_size']} ({attention} within the block), draft vocabulary {config['draft_vocab_size']} of
{layer['vocab_size']} tokens, aux hidden-state layers {config['aux_hidden_state_layer_ids']} (vLLM reads
them as target layers i - 1), mask token id {config['mask_token_id']}{fmt.heads(config)}. One drafter forward
proposes the whole block ({readout}). Speculative tokens k = {k} ({k_source}).

Serve with vLLM (always pass `method`):

```bash
vllm serve {verifier} \\
  --speculative-config '{{"method": "{fmt.model_type}", "model": "<this directory>", "num_speculative_tokens": {k}}}'
```

{fmt.serving}

Check it offline: `python -m specforge_lite export +recipe={cfg.recipe_name}` reloads this directory
strictly (every field, key and shape) and compares logits with the trained drafter.
"""
