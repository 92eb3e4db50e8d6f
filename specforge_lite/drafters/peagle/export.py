"""P-EAGLE checkpoints in the speculators format vLLM serves with parallel drafting.

speculators writes P-EAGLE as an EAGLE-3 config with `speculators_model_type: "peagle"`,
`mask_token_id` and `embed_requires_grad`, a `transformer_layer_config` of N layers and
the weights of EAGLE-3 plus `mask_hidden` [1, 1, 3H], `embed_tokens.weight` and
`layers.{1..N-1}.*` (plain Llama layers: no `hidden_norm`, H-wide q/k/v). vLLM maps
`mask_token_id` to its `pard_token`, loads the weights into its EAGLE-3 Llama model (layer 0
2H wide, the others H wide), reads `mask_hidden` as [1, 3H] and passes it through `fc` for
the parallel slots; it refuses a parallel-drafting load without `mask_hidden`, reports
unexpected weights and silently ignores missing ones, so `check_speculators_dir` checks
every name and shape here. For `peagle` vLLM defaults `norm_before_residual` to false:
the config always states it.
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
from specforge_lite.drafters.eagle_family import check_weights, speculators_config as family_config
from specforge_lite.drafters.peagle.model import PEagleConfig, PEagleDrafter, drop_token_layout
from specforge_lite.drafters.peagle.train import load

log = logging.getLogger(__name__)


def speculators_config(cfg: PEagleConfig, speculative_tokens: int, verifier: str,
                       verifier_architectures: list[str]) -> dict[str, Any]:
    return family_config(cfg, "peagle", "PEagleDraftModel", cfg.num_layers, speculative_tokens, verifier,
                         verifier_architectures, embed_requires_grad=True, mask_token_id=int(cfg.mask_token_id))


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight a speculators P-EAGLE directory must hold, with its shape."""
    layer = config["transformer_layer_config"]
    h, v, vd = layer["hidden_size"], layer["vocab_size"], config["draft_vocab_size"]
    q = layer["num_attention_heads"] * layer["head_dim"]
    kv = layer["num_key_value_heads"] * layer["head_dim"]
    inter = layer["intermediate_size"]
    shapes = {"embed_tokens.weight": (v, h), "fc.weight": (h, 3 * h), "mask_hidden": (1, 1, 3 * h),
              "norm.weight": (h,), "lm_head.weight": (vd, h)}
    for i in range(layer["num_hidden_layers"]):
        width = 2 * h if i == 0 else h
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, width), p + "self_attn.k_proj.weight": (kv, width),
            p + "self_attn.v_proj.weight": (kv, width), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
    shapes["layers.0.hidden_norm.weight"] = (h,)
    if config.get("norm_before_fc"):
        shapes["input_norm.weight"] = (3 * h,)
    if vd != v:
        shapes["d2t"] = (vd,)
        shapes["t2d"] = (v,)
    return shapes


REQUIRED_FIELDS = {
    "speculators_model_type": str, "architectures": list, "draft_vocab_size": int,
    "eagle_aux_hidden_state_layer_ids": list, "norm_before_residual": bool, "norm_before_fc": bool,
    "fc_norm": bool, "norm_output": bool, "mask_token_id": int, "transformer_layer_config": dict,
    "speculators_config": dict,
}


def write_speculators_dir(drafter: PEagleDrafter, out: Path, speculative_tokens: int, verifier: str,
                          verifier_architectures: list[str]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    config = speculators_config(drafter.config, speculative_tokens, verifier, verifier_architectures)
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}  # embed_tokens included
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        state.pop("d2t"), state.pop("t2d")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def check_speculators_dir(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Strict reload; raises ValueError naming the first problem. Returns (config, weights)."""
    from specforge_lite.checked_io import load_safetensors, read_json_object

    directory = Path(directory)
    config = read_json_object(directory / "config.json")
    if "model_type" in config:
        raise ValueError(f"{directory}/config.json: speculators configs have no top-level model_type")
    for key, kind in REQUIRED_FIELDS.items():
        if key not in config:
            raise ValueError(f"{directory}/config.json: missing field {key!r}")
        if not isinstance(config[key], kind) or (kind is int and isinstance(config[key], bool)):
            raise ValueError(f"{directory}/config.json: {key!r} should be {kind.__name__}, "
                             f"got {type(config[key]).__name__}")
    if config["speculators_model_type"] != "peagle" or config["architectures"] != ["PEagleDraftModel"]:
        raise ValueError(f"{directory}/config.json: not a peagle speculators config")
    if len(config["eagle_aux_hidden_state_layer_ids"]) != 3:
        raise ValueError(f"{directory}/config.json: Llama drafts need exactly 3 aux layers")
    for key in ("fc_norm", "norm_output"):
        if config[key]:
            raise ValueError(f"{directory}/config.json: {key}=true is a variant vLLM's peagle loader does not read")
    layer = config["transformer_layer_config"]
    if layer.get("model_type") != "llama" or not isinstance(layer.get("num_hidden_layers"), int) \
            or layer["num_hidden_layers"] < 1:
        raise ValueError(f"{directory}/config.json: transformer_layer_config must be a llama config with >= 1 layer")
    if not 0 <= config["mask_token_id"] < layer["vocab_size"]:
        raise ValueError(f"{directory}/config.json: mask_token_id {config['mask_token_id']} is not a target token id")
    spec = config["speculators_config"]
    proposal = spec["proposal_methods"][0]
    if spec.get("algorithm") != "peagle" or not isinstance(proposal.get("speculative_tokens"), int) \
            or proposal["speculative_tokens"] < 1 or not spec.get("verifier", {}).get("name_or_path"):
        raise ValueError(f"{directory}/config.json: speculators_config is incomplete")
    weights = load_safetensors(directory / "model.safetensors")
    check_weights(directory / "model.safetensors", weights, expected_shapes(config), config["draft_vocab_size"])
    return config, weights


def layout(config: dict) -> str | None:
    """`ours` (a train folder) or `speculators` (the P-EAGLE format vLLM reads), or None."""
    if config.get("drafter") == "peagle":
        return "ours"
    if config.get("speculators_model_type") == "peagle":
        return "speculators"
    return None


def load_any(directory: Path, target) -> PEagleDrafter:
    """A P-EAGLE drafter from our train folder or a speculators P-EAGLE folder; a folder that
    does not fit is a user error naming it."""
    from specforge_lite.checked_io import read_json_object
    from specforge_lite.drafters.peagle.train import load

    found = layout(read_json_object(Path(directory) / "config.json"))
    if found == "ours":
        return load(directory, target)
    if found == "speculators":
        try:
            return load_speculators_dir(directory, target)
        except ValueError as err:
            raise SpecforgeError(str(err)) from None
    raise SpecforgeError(f"{Path(directory).name}/config.json describes no P-EAGLE layout we read (our train "
                         "folder, speculators peagle)")


def load_speculators_dir(directory: Path, target) -> PEagleDrafter:
    """Build our module from a speculators P-EAGLE directory (checked strictly first)."""
    config, weights = check_speculators_dir(directory)
    layer = config["transformer_layer_config"]
    cfg = PEagleConfig(hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
                       num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
                       intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
                       draft_vocab_size=config["draft_vocab_size"],
                       aux_layer_ids=list(config["eagle_aux_hidden_state_layer_ids"]),
                       num_layers=layer["num_hidden_layers"],
                       num_depths=config["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
                       mask_token_id=config["mask_token_id"], rms_norm_eps=layer["rms_norm_eps"],
                       rope_theta=layer["rope_theta"], max_position_embeddings=layer["max_position_embeddings"],
                       hidden_act=layer["hidden_act"], norm_before_residual=config["norm_before_residual"],
                       norm_before_fc=config["norm_before_fc"])
    drafter = PEagleDrafter(cfg)
    if "d2t" not in weights:  # full vocab: identity maps
        weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        weights["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    drafter.load_state_dict(weights, strict=True)
    return drafter.to(target.device).eval()


@torch.no_grad()
def max_logit_difference(a: PEagleDrafter, b: PEagleDrafter) -> float:
    """Largest |logit difference| over every depth of a drop-token layout of random inputs (made
    in `a`'s dtype)."""
    device, dtype = a.fc.weight.device, a.fc.weight.dtype
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.config.vocab_size, (2, 24), generator=gen).to(device)
    aux = torch.randn(2, 24, 3 * a.config.hidden_size, generator=gen).to(device, dtype)
    layout = [x.to(device) for x in drop_token_layout(torch.ones(2, 24), a.config.num_depths, 0.7, 0.2, gen)]
    return float((a(ids, aux, *layout) - b(ids, aux, *layout)).abs().max())


def export(cfg, trained: Path, out: Path, target, tokenizer, k: int, k_source: str, verifier: str) -> dict:
    """`out/speculators`, reloaded strictly and compared logit for logit with the trained drafter."""
    drafter = load(trained, target)
    if k > drafter.config.num_depths:
        log.warning("k=%d (%s) is more than the %d depths this drafter was trained for: exporting k=%d",
                    k, k_source, drafter.config.num_depths, drafter.config.num_depths)
        k, k_source = drafter.config.num_depths, f"{k_source}, capped at drafter.num_depths"
    architectures = list(target.config.architectures or ["LlamaForCausalLM"])
    speculators_dir = out / "speculators"
    config = write_speculators_dir(drafter, speculators_dir, k, verifier, architectures)
    diff = max_logit_difference(drafter, load_speculators_dir(speculators_dir, target))
    if diff != 0.0:
        raise SpecforgeError(f"{speculators_dir.name}: reloaded drafter differs from the trained one "
                             f"(max |dlogit| {diff})")
    log.info("speculators P-EAGLE export passed its strict reload (every key and shape; logits identical)")
    atomic_write_text(speculators_dir / "README.md", serve_readme(cfg, verifier, k, k_source, config))
    return {"format": "speculators", "path": "speculators", "speculative_tokens": k}


def serve_readme(cfg, verifier: str, k: int, k_source: str, config: dict) -> str:
    layer = config["transformer_layer_config"]
    return f"""# P-EAGLE drafter for {verifier}

Trained by specforge_lite (recipe `{cfg.recipe_name}`). Format: speculators (P-EAGLE,
`speculators_model_type: "peagle"`): {layer['num_hidden_layers']} decoder layers, draft vocabulary
{config['draft_vocab_size']} of {layer['vocab_size']} tokens, aux hidden-state layers
{config['eagle_aux_hidden_state_layer_ids']}, mask token id {config['mask_token_id']} (vLLM's `pard_token`).
All k drafts of a step come from one drafter forward (parallel drafting).
Speculative tokens k = {k} ({k_source}).

Serve with vLLM (P-EAGLE runs on vLLM's EAGLE-3 proposer with parallel drafting; always
pass `method` and `parallel_drafting`):

```bash
vllm serve {verifier} \\
  --speculative-config '{{"method": "eagle3", "model": "<this directory>", "num_speculative_tokens": {k}, "parallel_drafting": true}}'
```

Check it offline: `python -m specforge_lite export +recipe={cfg.recipe_name}` reloads this directory
strictly (every field, key and shape) and compares logits with the trained drafter.
"""
