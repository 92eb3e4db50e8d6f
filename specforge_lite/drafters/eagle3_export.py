"""EAGLE-3 checkpoints in the formats serving engines load.

- speculators (vLLM >= 0.10, `speculators` 0.9): `config.json` without a top-level
  `model_type`, weights under the names our module already uses;
- SGLang (optional): a Llama-style config with `LlamaForCausalLMEagle3` and the
  decoder layer's weights under `midlayer.*`.

`check_speculators_dir` reloads a speculators directory strictly: every config field
present and typed, every weight present with the shape the config implies, nothing
extra (vLLM reports unexpected weights but silently ignores missing ones, so this
check is ours to make).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge_lite.artifact_io import load_safetensors, read_json_object
from specforge_lite.drafters.eagle3 import FROZEN, Eagle3Config, Eagle3Drafter, trained_weights

# Built-in targets whose weights also live on the hub under this id (for `vllm serve DRAFT_DIR`).
HUB_IDS = {"builtin:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def transformer_layer_config(cfg: Eagle3Config) -> dict[str, Any]:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }


def speculators_config(cfg: Eagle3Config, speculative_tokens: int, verifier: str,
                       verifier_architectures: list[str]) -> dict[str, Any]:
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3DraftModel"],
        "speculators_version": "0.9.0",
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": bool(cfg.norm_before_residual),
        "norm_before_fc": bool(cfg.norm_before_fc),
        "fc_norm": False,
        "norm_output": False,
        "transformer_layer_config": transformer_layer_config(cfg),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight a speculators EAGLE-3 directory must hold, with its shape."""
    layer = config["transformer_layer_config"]
    h, v, vd = layer["hidden_size"], layer["vocab_size"], config["draft_vocab_size"]
    q = layer["num_attention_heads"] * layer["head_dim"]
    kv = layer["num_key_value_heads"] * layer["head_dim"]
    inter = layer["intermediate_size"]
    shapes = {
        "fc.weight": (h, 3 * h),
        "layers.0.input_layernorm.weight": (h,), "layers.0.hidden_norm.weight": (h,),
        "layers.0.self_attn.q_proj.weight": (q, 2 * h), "layers.0.self_attn.k_proj.weight": (kv, 2 * h),
        "layers.0.self_attn.v_proj.weight": (kv, 2 * h), "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.mlp.gate_proj.weight": (inter, h), "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,), "lm_head.weight": (vd, h),
    }
    if config.get("norm_before_fc"):
        shapes["input_norm.weight"] = (3 * h,)
    if vd != v:
        shapes["d2t"] = (vd,)
        shapes["t2d"] = (v,)
    return shapes


REQUIRED_FIELDS = {
    "speculators_model_type": str, "architectures": list, "draft_vocab_size": int,
    "eagle_aux_hidden_state_layer_ids": list, "norm_before_residual": bool, "norm_before_fc": bool,
    "fc_norm": bool, "norm_output": bool, "transformer_layer_config": dict, "speculators_config": dict,
}


def write_speculators_dir(drafter: Eagle3Drafter, out: Path, speculative_tokens: int, verifier: str,
                          verifier_architectures: list[str]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    config = speculators_config(drafter.config, speculative_tokens, verifier, verifier_architectures)
    state = trained_weights(drafter)
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        state.pop("d2t"), state.pop("t2d")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def check_speculators_dir(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Strict reload; raises ValueError naming the first problem. Returns (config, weights)."""
    directory = Path(directory)
    config = read_json_object(directory / "config.json")
    if "model_type" in config:
        raise ValueError(f"{directory}/config.json: speculators configs have no top-level model_type")
    for key, kind in REQUIRED_FIELDS.items():
        if key not in config:
            raise ValueError(f"{directory}/config.json: missing field {key!r}")
        if not isinstance(config[key], kind):
            raise ValueError(f"{directory}/config.json: {key!r} should be {kind.__name__}, "
                             f"got {type(config[key]).__name__}")
    if config["speculators_model_type"] != "eagle3" or config["architectures"] != ["Eagle3DraftModel"]:
        raise ValueError(f"{directory}/config.json: not an eagle3 speculators config")
    if len(config["eagle_aux_hidden_state_layer_ids"]) != 3:
        raise ValueError(f"{directory}/config.json: Llama drafts need exactly 3 aux layers")
    for key in ("fc_norm", "norm_output"):
        if config[key]:
            raise ValueError(f"{directory}/config.json: {key}=true is a variant this project does not build")
    layer = config["transformer_layer_config"]
    if layer.get("model_type") != "llama" or layer.get("num_hidden_layers") != 1:
        raise ValueError(f"{directory}/config.json: transformer_layer_config must be a 1-layer llama config")
    spec = config["speculators_config"]
    proposal = spec["proposal_methods"][0]
    if spec.get("algorithm") != "eagle3" or not isinstance(proposal.get("speculative_tokens"), int) \
            or proposal["speculative_tokens"] < 1 or not spec.get("verifier", {}).get("name_or_path"):
        raise ValueError(f"{directory}/config.json: speculators_config is incomplete")
    weights = load_safetensors(directory / "model.safetensors")
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected) - {FROZEN})
    if missing or extra:
        raise ValueError(f"{directory}/model.safetensors: missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{directory}/model.safetensors: {name} has shape {tuple(weights[name].shape)}, "
                             f"expected {shape}")
    if "d2t" in weights:
        if weights["d2t"].dtype != torch.int64 or weights["t2d"].dtype != torch.bool:
            raise ValueError(f"{directory}/model.safetensors: d2t must be int64 and t2d bool")
        ids = torch.arange(config["draft_vocab_size"]) + weights["d2t"]
        if int(weights["t2d"].sum()) != config["draft_vocab_size"] or not bool(weights["t2d"][ids].all()):
            raise ValueError(f"{directory}/model.safetensors: d2t and t2d disagree")
    return config, weights


def load_speculators_dir(directory: Path, target) -> Eagle3Drafter:
    """Build our module from a speculators directory (checked strictly first)."""
    config, weights = check_speculators_dir(directory)
    layer = config["transformer_layer_config"]
    cfg = Eagle3Config(hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
                       num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
                       intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
                       draft_vocab_size=config["draft_vocab_size"],
                       aux_layer_ids=list(config["eagle_aux_hidden_state_layer_ids"]),
                       rms_norm_eps=layer["rms_norm_eps"], rope_theta=layer["rope_theta"],
                       max_position_embeddings=layer["max_position_embeddings"], hidden_act=layer["hidden_act"],
                       norm_before_residual=config["norm_before_residual"], norm_before_fc=config["norm_before_fc"])
    drafter = Eagle3Drafter(cfg)
    if "d2t" not in weights:  # full vocab: identity maps
        weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        weights["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    weights.setdefault(FROZEN, target.get_input_embeddings().weight.detach().cpu())
    drafter.load_state_dict(weights, strict=True)
    return drafter.to(target.device).eval()


def sglang_problem(cfg: Eagle3Config) -> str | None:
    """Why SGLang's layout cannot hold this drafter, or None when it can."""
    if cfg.norm_before_residual or cfg.norm_before_fc:
        return ("the SGLang layout has no norm_before_residual / norm_before_fc switch; this drafter was "
                "trained with one, so export it for vLLM only (export.sglang=false)")
    return None


def write_sglang_dir(drafter: Eagle3Drafter, out: Path) -> None:
    """SGLang's EAGLE-3 layout: a Llama config naming LlamaForCausalLMEagle3, `midlayer.*` weights."""
    cfg = drafter.config
    problem = sglang_problem(cfg)
    if problem:
        raise ValueError(problem)
    out.mkdir(parents=True, exist_ok=True)
    config = {**transformer_layer_config(cfg), "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": cfg.draft_vocab_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}}
    state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in trained_weights(drafter).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
