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
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge_lite import SpecforgeError
from specforge_lite.run_folders import atomic_write_text
from specforge_lite.drafters.eagle_family import default_aux_layers, transformer_layer_config
from specforge_lite.drafters.eagle_family import speculators_config as family_config
from specforge_lite.drafters.eagle3.model import FROZEN, Eagle3Config, Eagle3Drafter, load, trained_weights

log = logging.getLogger(__name__)


def speculators_config(cfg: Eagle3Config, speculative_tokens: int, verifier: str,
                       verifier_architectures: list[str]) -> dict[str, Any]:
    return family_config(cfg, "eagle3", "Eagle3DraftModel", 1, speculative_tokens, verifier, verifier_architectures)


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
    if config.get("fc_norm"):
        shapes.update({f"fc_norm.{i}.weight": (h,) for i in range(3)})
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


def check_speculators_dir(directory: Path, strict: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Check a speculators EAGLE-3 directory; returns (config, weights) or raises SpecforgeError
    naming the file and the first problem.

    strict (our own exports): every field present and typed, speculators_config complete.
    Otherwise (a folder written by speculators or another trainer) the optional fields take
    the defaults vLLM applies: norm_before_residual true when absent, the other switches false.
    Either way every weight the config implies must be there with its shape, and nothing else
    (an `embed_tokens.weight` of the target's shape is allowed).
    """
    directory = Path(directory)
    name = f"{directory.name}/config.json"
    config = read_json(directory / "config.json")
    if "model_type" in config:
        raise SpecforgeError(f"{name}: speculators configs have no top-level model_type")
    fields = REQUIRED_FIELDS if strict else {k: REQUIRED_FIELDS[k] for k in (
        "speculators_model_type", "draft_vocab_size", "transformer_layer_config")}
    for key, kind in fields.items():
        if key not in config:
            raise SpecforgeError(f"{name}: missing field {key!r}")
        if not isinstance(config[key], kind):
            raise SpecforgeError(f"{name}: {key!r} should be {kind.__name__}, got {type(config[key]).__name__}")
    if config["speculators_model_type"] != "eagle3":
        raise SpecforgeError(f"{name}: speculators_model_type {config['speculators_model_type']!r}, not eagle3")
    if strict and config["architectures"] != ["Eagle3DraftModel"]:
        raise SpecforgeError(f"{name}: architectures {config['architectures']}, expected ['Eagle3DraftModel']")
    config = {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
              **{k: v for k, v in config.items() if v is not None}}
    if config["norm_before_fc"] and config["fc_norm"]:
        raise SpecforgeError(f"{name}: norm_before_fc and fc_norm are both true; they exclude each other")
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and len(aux) != 3:
        raise SpecforgeError(f"{name}: Llama drafts need exactly 3 aux layers, got {aux}")
    layer = config["transformer_layer_config"]
    if layer.get("model_type", "llama") != "llama" or layer.get("num_hidden_layers", 1) != 1:
        raise SpecforgeError(f"{name}: transformer_layer_config must be a 1-layer llama config (got model_type "
                             f"{layer.get('model_type')!r}, {layer.get('num_hidden_layers')} layers); other draft "
                             "layer types are not supported")
    layer_config = llama_layer_config(layer)
    if config.get("target_hidden_size") not in (None, layer_config.hidden_size):
        raise SpecforgeError(f"{name}: target_hidden_size {config['target_hidden_size']} differs from the draft "
                             f"layer's hidden size {layer_config.hidden_size}; such drafters are not supported")
    if strict:
        spec = config["speculators_config"]
        proposal = (spec.get("proposal_methods") or [{}])[0]
        if spec.get("algorithm") != "eagle3" or not isinstance(proposal.get("speculative_tokens"), int) \
                or proposal["speculative_tokens"] < 1 or not spec.get("verifier", {}).get("name_or_path"):
            raise SpecforgeError(f"{name}: speculators_config is incomplete")
    weights = read_weights(directory)
    check_weights(directory, weights, expected_shapes({**config, "transformer_layer_config": {
        "hidden_size": layer_config.hidden_size, "vocab_size": layer_config.vocab_size,
        "num_attention_heads": layer_config.num_attention_heads, "num_key_value_heads": layer_config.num_key_value_heads,
        "head_dim": layer_config.head_dim, "intermediate_size": layer_config.intermediate_size}}),
        config["draft_vocab_size"], layer_config.vocab_size)
    return config, weights


def llama_layer_config(layer: dict):
    """The draft layer's config as transformers reads it (defaults filled, `rope_parameters` or
    `rope_theta`, `head_dim` derived when absent)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("architectures", "model_type")})
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def read_json(path: Path) -> dict:
    from specforge_lite.checked_io import read_json_object

    return read_json_object(path)


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (each checked by name), floating ones as float32."""
    from specforge_lite.checked_io import ArtifactError, load_safetensors

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ArtifactError(Path(directory), "holds no .safetensors weights")
    weights = {}
    for path in files:
        weights.update(load_safetensors(path))
    return {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}


def check_weights(directory: Path, weights: dict, expected: dict, draft_vocab_size: int, vocab_size: int) -> None:
    """Names, shapes and finite values (an embedding of the target's shape may come along),
    then the draft-vocab maps."""
    from specforge_lite.checked_io import check_weights as check_names_and_shapes

    where = Path(directory) / "model.safetensors"
    if FROZEN in weights:
        expected = {**expected, FROZEN: (vocab_size, expected["fc.weight"][0])}
    check_names_and_shapes(where, weights, expected)
    if "d2t" in weights:
        if weights["d2t"].dtype != torch.int64 or weights["t2d"].dtype != torch.bool:
            raise SpecforgeError(f"{where.parent.name}/{where.name}: d2t must be int64 and t2d bool")
        ids = torch.arange(draft_vocab_size) + weights["d2t"]
        if int(weights["t2d"].sum()) != draft_vocab_size or not bool(weights["t2d"][ids].all()):
            raise SpecforgeError(f"{where.parent.name}/{where.name}: d2t and t2d disagree")


def build_loaded(config: dict, layer: dict, weights: dict, target, dtype: torch.dtype | None = None) -> Eagle3Drafter:
    """Our module from a checked folder's settings and weights, on the target's device, in `dtype`
    (None: the target's, what it is served in). The folder's `embed_tokens` is used when it has
    one (what vLLM serves), else the target's."""
    from types import SimpleNamespace

    layer_config = llama_layer_config(layer)
    aux = config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.config.num_hidden_layers)
    options = SimpleNamespace(draft_vocab_size=config["draft_vocab_size"], aux_layer_ids=list(aux),
                              norm_before_residual=config["norm_before_residual"],
                              norm_before_fc=config["norm_before_fc"], fc_norm=config["fc_norm"],
                              norm_output=config["norm_output"])
    cfg = Eagle3Config.from_target(layer_config, options)
    if cfg.vocab_size != target.config.vocab_size:
        raise SpecforgeError(f"the drafter's vocabulary ({cfg.vocab_size}) is not the target's "
                             f"({target.config.vocab_size})")
    drafter = Eagle3Drafter(cfg)
    if "d2t" not in weights:  # full vocab: identity maps
        weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        weights["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    weights.setdefault(FROZEN, target.get_input_embeddings().weight.detach().cpu().float())
    drafter.load_state_dict(weights, strict=True)
    return drafter.to(device=target.device, dtype=dtype or target.dtype).eval()


def load_speculators_dir(directory: Path, target, strict: bool = True, dtype: torch.dtype | None = None
                         ) -> Eagle3Drafter:
    """Build our module from a speculators directory (checked first; `strict` for our own exports;
    `dtype` as `build_loaded` takes it)."""
    config, weights = check_speculators_dir(directory, strict)
    return build_loaded(config, config["transformer_layer_config"], weights, target, dtype)


def load_sglang_dir(directory: Path, target) -> Eagle3Drafter:
    """An SGLang / SpecForge `LlamaForCausalLMEagle3` folder: `midlayer.*` weights, aux layer ids
    counted as decoder-layer outputs (one less than ours), no norm_before_residual."""
    directory = Path(directory)
    config = read_json(directory / "config.json")
    name = f"{directory.name}/config.json"
    if not isinstance(config.get("draft_vocab_size"), int):
        raise SpecforgeError(f"{name}: missing field 'draft_vocab_size'")
    sglang_aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ours = {"draft_vocab_size": config["draft_vocab_size"], "norm_before_residual": False, "norm_before_fc": False,
            "fc_norm": False, "norm_output": False,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in sglang_aux] if sglang_aux else None}
    layer = {k: v for k, v in config.items() if k not in ("architectures", "eagle_config", "draft_vocab_size")}
    layer_config = llama_layer_config(layer)
    weights = {k.replace("midlayer.", "layers.0.", 1): v for k, v in read_weights(directory).items()}
    check_weights(directory, weights, expected_shapes({**ours, "transformer_layer_config": {
        "hidden_size": layer_config.hidden_size, "vocab_size": layer_config.vocab_size,
        "num_attention_heads": layer_config.num_attention_heads, "num_key_value_heads": layer_config.num_key_value_heads,
        "head_dim": layer_config.head_dim, "intermediate_size": layer_config.intermediate_size}}),
        config["draft_vocab_size"], layer_config.vocab_size)
    return build_loaded(ours, layer, weights, target)


def layout(config: dict) -> str | None:
    """Which EAGLE-3 layout a folder's config.json describes, or None: `ours` (a train
    folder), `speculators` (vLLM's format) or `sglang` (SGLang / SpecForge)."""
    if config.get("drafter") == "eagle3":
        return "ours"
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        return "sglang"
    return None


def load_any(directory: Path, target) -> Eagle3Drafter:
    """An EAGLE-3 drafter from a folder in any layout `layout` recognises."""
    directory = Path(directory)
    found = layout(read_json(directory / "config.json"))
    if found == "ours":
        return load(directory, target)
    if found == "speculators":
        return load_speculators_dir(directory, target, strict=False)
    if found == "sglang":
        return load_sglang_dir(directory, target)
    raise SpecforgeError(f"{directory.name}/config.json describes no EAGLE-3 layout we read (our train folder, "
                         "speculators, SGLang LlamaForCausalLMEagle3)")


def sglang_problem(cfg: Eagle3Config) -> str | None:
    """Why SGLang's layout cannot hold this drafter, or None when it can."""
    if cfg.norm_before_residual or cfg.norm_before_fc or cfg.fc_norm or cfg.norm_output:
        return ("the SGLang layout has no norm_before_residual / norm_before_fc / fc_norm / norm_output switch; "
                "this drafter was trained with one, so export it for vLLM only (export.sglang=false)")
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
              # SGLang counts aux layers as decoder-layer outputs: our (and vLLM's) id k is its k - 1
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids]}}
    state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in trained_weights(drafter).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def max_logit_difference(a: Eagle3Drafter, b: Eagle3Drafter) -> float:
    """Largest |logit difference| over the TTT steps of random inputs, made in `a`'s dtype (a
    drafter loaded for a bf16 target computes in bf16)."""
    torch.manual_seed(0)
    device, dtype = a.fc.weight.device, a.fc.weight.dtype
    ids = torch.randint(0, a.config.vocab_size, (2, 24), device=device)
    aux = torch.randn(2, 24, 3 * a.config.hidden_size, device=device, dtype=dtype)
    return max(float((x - y).abs().max()) for x, y in zip(a.ttt_forward(ids, aux, 3), b.ttt_forward(ids, aux, 3)))


def export(cfg, trained: Path, out: Path, target, tokenizer, k: int, k_source: str, verifier: str) -> dict:
    """`out/speculators` (plus SGLang's layout in `out/sglang` with export.sglang=true),
    reloaded strictly and compared logit for logit with the trained drafter."""
    drafter = load_any(trained, target)
    if cfg.export.sglang and (problem := sglang_problem(drafter.config)):  # before anything is written
        raise SpecforgeError(f"{trained}: {problem}")
    architectures = list(target.config.architectures or ["LlamaForCausalLM"])
    speculators_dir = out / "speculators"
    config = write_speculators_dir(drafter, speculators_dir, k, verifier, architectures)
    # reloaded in the trained drafter's dtype: a bf16 target's copy would differ by its rounding
    diff = max_logit_difference(drafter, load_speculators_dir(speculators_dir, target, dtype=drafter.fc.weight.dtype))
    if diff != 0.0:
        raise SpecforgeError(f"{speculators_dir.name}: reloaded drafter differs from the trained one "
                             f"(max |dlogit| {diff})")
    log.info("speculators export passed its strict reload (every key and shape; logits identical)")
    if cfg.export.sglang:
        write_sglang_dir(drafter, out / "sglang")
    atomic_write_text(speculators_dir / "README.md", serve_readme(cfg, verifier, k, k_source, config))
    return {"format": "speculators", "path": "speculators", "speculative_tokens": k,
            "sglang": "sglang" if cfg.export.sglang else None}


def serve_readme(cfg, verifier: str, k: int, k_source: str, config: dict) -> str:
    return f"""# EAGLE-3 drafter for {verifier}

Trained by specforge_lite (recipe `{cfg.recipe_name}`). Format: speculators (EAGLE-3),
draft vocabulary {config['draft_vocab_size']} of {config['transformer_layer_config']['vocab_size']} tokens,
aux hidden-state layers {config['eagle_aux_hidden_state_layer_ids']}.
Speculative tokens k = {k} ({k_source}).

Serve with vLLM (long form, works with any local target path):

```bash
vllm serve {verifier} \\
  --speculative-config '{{"method": "eagle3", "model": "<this directory>", "num_speculative_tokens": {k}}}'
```

Short form (needs `verifier.name_or_path` in config.json to be a hub id vLLM can fetch):

```bash
vllm serve <this directory>
```

Check it offline: `python -m specforge_lite export +recipe={cfg.recipe_name}` reloads this directory
strictly (every field, key and shape) and compares logits with the trained drafter.
"""
