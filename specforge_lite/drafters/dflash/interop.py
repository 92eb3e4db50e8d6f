"""DFlash drafters in the layouts users already have, read into our `DFlashDrafter`.

- `ours`: a train folder (`train.save`).
- `speculators`: `speculators_model_type: "dflash"`, written by our export or by speculators'
  trainer (`models/dflash`: `DFlashSpeculatorConfig`, `DFlashDraftModel.save_pretrained`). The
  weight names are ours; `aux_hidden_state_layer_ids` are our ids (the input of decoder layer
  k). A trainer's folder also holds `layer_types` in its Qwen3 `transformer_layer_config`;
  `verifier_norm` / `verifier_lm_head` (training-only) are dropped when present; a missing
  `embed_tokens` is the target's, and so is a missing `lm_head` of a full-vocabulary draft
  (speculators' converter saves neither: tests/golden/dflash).
- `specforge`: SpecForge's (and z-lab's) Hugging Face folder: a Qwen3 config naming
  `DFlashDraftModel`, `block_size` (top level or in `dflash_config`), `dflash_config.
  {target_layer_ids, mask_token_id}`; weights `fc`, `hidden_norm`, `norm`, `layers.*` only
  (the drafter borrows the target's embedding and full-vocabulary lm_head). Its
  `target_layer_ids` count decoder-layer outputs (`hidden_states[i + 1]`): ours are i + 1.

Attention within a block follows the peers' masks (speculators `create_anchor_block_mask_mod`,
SpecForge `create_dflash_block_mask`): full-attention layers see the whole block, sliding-window
layers only the rows before them (unless speculators' `sliding_window_non_causal`). Our drafter
has one `causal` setting for all layers and no sliding window: a folder whose layers differ is
refused with one line naming the file and the key; a window (speculators' trainer default: 2048
tokens on every layer) is read as the whole context, with a warning, as for EAGLE-3. A
speculators config without `layer_types` is one of our exports: `sliding_window_non_causal` is
then the negation of `causal` (`export.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import ArtifactError, check_weights, load_safetensors, read_json_object
from specforge_lite.drafters.dflash.model import DFLASH, DFlashConfig, DFlashDrafter, Format
from specforge_lite.drafters.dflash.train import load
from specforge_lite.drafters.eagle_family import check_weights as check_vocab_maps
from specforge_lite.drafters.vocab import copy_target_head

log = logging.getLogger(__name__)

SPECFORGE_ARCHITECTURE = "DFlashDraftModel"
# tensors speculators' trainer keeps for its loss only (its `_keys_to_ignore_on_save` today)
TRAINING_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")
# what SpecForge's drafter borrows from the target instead of saving (its embedding too, which an
# export may still ship)
TARGET_OWNED = ("lm_head.weight", "d2t", "t2d")
# a SpecForge DSpark export's heads' settings (and loss weight), which its serving script copies from
# dflash_config to the top level
SPECFORGE_HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                       "confidence_head_alpha")
# config.json keys of SpecForge's folder that are not the Qwen3 layer config
SPECFORGE_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "model_type",
                  *SPECFORGE_HEAD_KEYS)
# what older SpecForge DSpark checkpoints put before the heads' weight names
SPECFORGE_OLD_PREFIX = "logit_head."


def layout(config: dict) -> str | None:
    """`ours`, `speculators` or `specforge` (SpecForge / z-lab), or None: the DFlash layout a
    folder's config.json describes."""
    if config.get("drafter") == "dflash":
        return "ours"
    if config.get("speculators_model_type") == "dflash":
        return "speculators"
    if SPECFORGE_ARCHITECTURE in (config.get("architectures") or []) and isinstance(config.get("dflash_config"), dict):
        return "specforge"
    return None


def load_any(directory: Path, target) -> DFlashDrafter:
    """A DFlash drafter from a folder in any layout `layout` recognises, on the target's device."""
    directory = Path(directory)
    found = layout(read_json_object(directory / "config.json"))
    if found == "ours":
        return load(directory, target)
    if found == "speculators":
        return load_speculators(directory, target)
    if found == "specforge":
        return load_specforge(directory, target)
    raise SpecforgeError(f"{directory.name}/config.json describes no DFlash layout we read (our train folder, "
                         "speculators dflash, SpecForge DFlashDraftModel)")


# --------------------------------------------------------------------------- speculators

def load_speculators(directory: Path, target, fmt: Format = DFLASH) -> DFlashDrafter:
    """A speculators folder of `fmt` (DFlash's, or a variant's: DSpark), our export or speculators'
    trainer's, every field and weight checked."""
    where = Path(directory) / "config.json"
    config = read_json_object(where)
    raw_layer = config.get("transformer_layer_config")
    if not isinstance(raw_layer, dict):
        raise SpecforgeError(f"{where}: 'transformer_layer_config' should be an object (the drafter's Qwen3 layers)")
    layer = qwen3_layers(raw_layer, f"{where}: transformer_layer_config")
    anchor = config.get("sample_from_anchor", False)
    if not isinstance(anchor, bool):
        raise SpecforgeError(f"{where}: 'sample_from_anchor' should be true or false, got {anchor!r}")
    if config.get("target_hidden_size") not in (None, layer.hidden_size):
        raise SpecforgeError(f"{where}: 'target_hidden_size' {config['target_hidden_size']} differs from the "
                             f"drafter's hidden_size {layer.hidden_size}; our fc reads target states of that width")
    if "layer_types" in raw_layer:  # a speculators trainer's config
        causal = block_causal(layer, bool(config.get("sliding_window_non_causal", False)),
                              f"{where}: transformer_layer_config")
    else:  # our export: sliding_window_non_causal = not causal
        causal = not bool(config.get("sliding_window_non_causal", True))
    cfg = drafter_config(layer, where, aux=config.get("aux_hidden_state_layer_ids"), key="aux_hidden_state_layer_ids",
                         block_size=config.get("block_size"), mask_token_id=config.get("mask_token_id"),
                         draft_vocab_size=config.get("draft_vocab_size"), causal=causal)
    cfg = fmt.config_class(**{**cfg.to_dict(), "sample_from_anchor": anchor, **fmt.read(config, where)})
    check_target(cfg, target, where)
    drafter = fmt.drafter_class(cfg)
    weights = read_weights(Path(directory))
    for name in TRAINING_ONLY:
        weights.pop(name, None)
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    full = cfg.draft_vocab_size == cfg.vocab_size
    if full:  # speculators saves no maps for the full vocabulary
        expected.pop("d2t"), expected.pop("t2d")
    path = weights_path(Path(directory))
    # a full-vocabulary head is the target's own: speculators' converter saves none
    check_weights(path, weights, expected, optional=("embed_tokens.weight",) + (("lm_head.weight",) if full else ()))
    weights.setdefault("embed_tokens.weight", target.get_input_embeddings().weight.detach().cpu())
    if full:
        weights.setdefault("lm_head.weight", target.get_output_embeddings().weight.detach().cpu())
    try:
        check_vocab_maps(path, weights, expected, cfg.draft_vocab_size)
    except ValueError as err:
        raise SpecforgeError(str(err)) from None
    if "d2t" not in weights:  # full vocab: identity maps
        weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        weights["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    drafter.load_state_dict(weights, strict=True)
    return drafter.to(target.device).eval()


# --------------------------------------------------------------------------- SpecForge / z-lab

def load_specforge(directory: Path, target, fmt: Format = DFLASH) -> DFlashDrafter:
    """SpecForge's `DFlashDraftModel` folder (or a variant's of `fmt`: its `DSparkDraftModel`, the
    heads' settings in `dflash_config` or, once made ready to serve, at the top level): its body
    and heads' weights, the target's embedding and full head; it drafts from block position 1."""
    where = Path(directory) / "config.json"
    config = read_json_object(where)
    method = config["dflash_config"]
    projector = method.get("projector_type")
    if projector not in ((None, "dflash") if fmt is DFLASH else (fmt.model_type,)):
        hint = " (read it as drafter=dspark)" if projector == "dspark" else ""
        raise SpecforgeError(f"{where}: dflash_config.projector_type {projector!r} is a DFlash-family variant with "
                             f"heads our {fmt.label} drafter does not implement{hint}")
    layer = qwen3_layers({k: v for k, v in config.items() if k not in SPECFORGE_KEYS}, where)
    ids = method.get("target_layer_ids")
    if ids is None and isinstance(config.get("num_target_layers"), int):  # SpecForge's own default
        ids = spread_layers(config["num_target_layers"], layer.num_hidden_layers)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in ids):
        raise SpecforgeError(f"{where}: dflash_config.target_layer_ids should be a non-empty list of layer ids >= 0")
    cfg = drafter_config(layer, where, aux=[i + 1 for i in ids], key="dflash_config.target_layer_ids",
                         block_size=config.get("block_size", method.get("block_size")),
                         mask_token_id=method.get("mask_token_id"), draft_vocab_size=layer.vocab_size,
                         causal=block_causal(layer, False, where), mask_key="dflash_config.mask_token_id")
    if fmt is not DFLASH:
        cfg = fmt.config_class(**{**cfg.to_dict(), "sample_from_anchor": False,
                                  **fmt.read({**method, **{k: config[k] for k in SPECFORGE_HEAD_KEYS if k in config}},
                                             where)})
    check_target(cfg, target, where)
    drafter = fmt.drafter_class(cfg)
    vocab = torch.arange(cfg.vocab_size, device=target.get_input_embeddings().weight.device)
    copy_target_head(drafter, target, vocab, cfg.vocab_size)
    weights = {k.removeprefix(SPECFORGE_OLD_PREFIX): v for k, v in read_weights(Path(directory)).items()}
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items() if k not in TARGET_OWNED}
    check_weights(weights_path(Path(directory)), weights, expected, optional=("embed_tokens.weight",))
    drafter.load_state_dict(weights, strict=False)
    return drafter.to(target.device).eval()


def spread_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SpecForge's default capture layers: one per draft layer, evenly from 1 to L - 3 (decoder-layer outputs)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# --------------------------------------------------------------------------- shared checks

def qwen3_layers(raw: dict, where: str):
    """The Qwen3 config of the draft layers as both peers build it (transformers' defaults filled),
    refused where our layers differ: biases, another activation, scaled rotary embeddings."""
    from transformers import Qwen3Config

    if raw.get("model_type", "qwen3") != "qwen3":
        raise SpecforgeError(f"{where}: model_type {raw.get('model_type')!r}; our DFlash layers are Qwen3's")
    try:
        layer = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    except (TypeError, ValueError, KeyError) as err:
        raise SpecforgeError(f"{where}: not a Qwen3 layer config ({err})") from None
    if not isinstance(layer.num_hidden_layers, int) or layer.num_hidden_layers < 1:
        raise SpecforgeError(f"{where}: num_hidden_layers should be an integer >= 1")
    if layer.attention_bias or getattr(layer, "mlp_bias", False):
        raise SpecforgeError(f"{where}: attention_bias / mlp_bias is true; our DFlash layers have no biases")
    if layer.hidden_act != "silu":
        raise SpecforgeError(f"{where}: hidden_act {layer.hidden_act!r}; our DFlash MLP is SiLU-gated")
    rope = getattr(layer, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        raise SpecforgeError(f"{where}: rope_parameters {rope}; our DFlash drafter has the plain rotary embedding "
                             "(rope_type default with a rope_theta)")
    return layer


def block_causal(layer, sliding_non_causal: bool, where: str) -> bool:
    """Whether the layers' block rows see only the rows before them (see the module docstring)."""
    kinds = list(layer.layer_types or ["full_attention"] * layer.num_hidden_layers)
    if len(kinds) != layer.num_hidden_layers or set(kinds) - {"full_attention", "sliding_attention"}:
        raise SpecforgeError(f"{where}: layer_types {kinds} should name full_attention or sliding_attention for "
                             f"each of the {layer.num_hidden_layers} layers")
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    window = getattr(layer, "sliding_window", None)
    if sliding and (not isinstance(window, int) or window < 1):
        raise SpecforgeError(f"{where}: layer_types makes layers {sliding} sliding-window attention but "
                             f"sliding_window is {window!r}")
    if sliding and window < layer.max_position_embeddings:  # as for EAGLE-3's speculators layer (docs/EXPORT.md)
        log.warning("%s: layers %s attend to a %d-token window; ours attend to the whole context: the same "
                    "drafts while prompt plus answer stay under %d tokens", where, sliding, window, window)
    causal = {i in sliding and not sliding_non_causal for i in range(layer.num_hidden_layers)}
    if len(causal) > 1:
        raise SpecforgeError(f"{where}: layer_types makes layers {sliding} causal within the block and the others "
                             "not; our DFlash drafter has one setting for all layers (drafter.causal)")
    return causal.pop()


def drafter_config(layer, where: Path, *, aux, key: str, block_size, mask_token_id, draft_vocab_size,
                   causal: bool, mask_key: str = "mask_token_id") -> DFlashConfig:
    """Our config from a peer's Qwen3 layers and DFlash fields, each field checked by name."""
    def integer(value, name: str, low: int, high: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value >= high):
            bound = f">= {low}" + (f" and < {high}" if high is not None else "")
            raise SpecforgeError(f"{where}: {name!r} should be an integer {bound}, got {value!r}")
        return value

    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in aux):
        raise SpecforgeError(f"{where}: {key!r} should be a non-empty list of layer ids >= 0, got {aux!r}")
    vocab = layer.vocab_size
    return DFlashConfig(hidden_size=layer.hidden_size, num_attention_heads=layer.num_attention_heads,
                        num_key_value_heads=layer.num_key_value_heads,
                        head_dim=layer.head_dim or layer.hidden_size // layer.num_attention_heads,
                        intermediate_size=layer.intermediate_size, vocab_size=vocab,
                        draft_vocab_size=integer(draft_vocab_size, "draft_vocab_size", 1, vocab + 1),
                        aux_layer_ids=list(aux), num_layers=layer.num_hidden_layers,
                        block_size=integer(block_size, "block_size", 2), causal=causal,
                        mask_token_id=integer(mask_token_id, mask_key, 0, vocab), rms_norm_eps=layer.rms_norm_eps,
                        rope_theta=float(layer.rope_parameters["rope_theta"]),
                        max_position_embeddings=layer.max_position_embeddings, hidden_act=layer.hidden_act)


def check_target(cfg: DFlashConfig, target, where: Path) -> None:
    """The drafter reads this target: its vocabulary, hidden width and aux layers."""
    tc = target.config
    if cfg.vocab_size != tc.vocab_size:
        raise SpecforgeError(f"{where}: vocab_size {cfg.vocab_size} is not the target's ({tc.vocab_size})")
    if cfg.hidden_size != tc.hidden_size:
        raise SpecforgeError(f"{where}: hidden_size {cfg.hidden_size} is not the target's ({tc.hidden_size})")
    if max(cfg.aux_layer_ids) >= tc.num_hidden_layers:
        raise SpecforgeError(f"{where}: aux layers {cfg.aux_layer_ids} (our ids) reach past the target's "
                             f"{tc.num_hidden_layers} layers")


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (one file or the shards of an index)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ArtifactError(directory, "holds no .safetensors weights")
    weights = {}
    for path in files:
        weights.update(load_safetensors(path))
    return weights


def weights_path(directory: Path) -> Path:
    """The file a weight problem is reported against: model.safetensors, else the folder (shards)."""
    single = directory / "model.safetensors"
    return single if single.exists() else directory
