"""Target surgery: draft models cut from the target itself (`truncated_copy`, the target's first
layers sharing its modules) or loaded beside it (`load_untrained_draft`, the `untrained_draft`
method's model: eval.untrained_draft_path or a truncated copy)."""

from __future__ import annotations

import copy

import torch

from specforge_lite import SpecforgeError


def decoder_of(model):
    """The decoder stack of a causal LM: `get_decoder()`, or `model.model` where that returns the
    LM itself (Llama 4's text model in transformers 5)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not hasattr(decoder, "layers"):
        decoder = getattr(model, "model", decoder)
    return decoder


def truncated_copy(target, num_layers: int):
    """A causal LM made of the target's first `num_layers` decoder layers, its final
    norm and lm_head. The modules are shared with the target, not copied (no extra
    memory); the copy has its own config and is used with its own KV cache."""
    decoder = decoder_of(target)
    layers = getattr(decoder, "layers", None)
    if layers is None or not hasattr(decoder, "norm") or not hasattr(decoder, "embed_tokens"):
        raise SpecforgeError(
            f"eval.truncate_layers needs a Llama-style decoder (model.layers, model.norm); "
            f"{type(target).__name__} has another layout: pass eval.untrained_draft_path=PATH instead")
    total = len(layers)
    if not 1 <= num_layers < total:
        raise SpecforgeError(f"eval.truncate_layers={num_layers} must be in [1, {total - 1}] for this target")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        draft = type(target)(config)
    draft_decoder = decoder_of(draft)
    for name, module in decoder.named_children():
        if name == "layers":
            module = torch.nn.ModuleList(list(layers[:num_layers]))
        setattr(draft_decoder, name, module)
    if target.get_output_embeddings() is not None:
        draft.set_output_embeddings(target.get_output_embeddings())
    meta = [n for n, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if meta:
        raise SpecforgeError(f"truncated copy of {type(target).__name__} left tensors unset: {meta[:5]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    # The layers are shared with the target: keep HF from installing a second set of
    # hidden-state capture hooks on them (they would record every shared layer twice).
    draft._output_capturing_hooks_installed = True
    draft.eval()
    return draft


def load_untrained_draft(eval_cfg, target):
    """The `untrained_draft` method's LM: eval.untrained_draft_path or a truncated copy
    of the target (eval.truncate_layers; null picks min(4, L // 4), at least 1)."""
    if eval_cfg.untrained_draft_path:
        from specforge_lite.targets.loading import load_causal_lm, resolve_target_path

        path = resolve_target_path(eval_cfg.untrained_draft_path, "eval.untrained_draft_path")
        model = load_causal_lm(path, target.dtype, f"eval.untrained_draft_path={eval_cfg.untrained_draft_path!r}")
        model = model.to(target.device).eval()
        model.requires_grad_(False)
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        target_vocab = target.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab:
            raise SpecforgeError(f"eval.untrained_draft_path={eval_cfg.untrained_draft_path} has vocab {draft_vocab}, "
                                 f"the target {target_vocab}: a draft model must share the target's vocabulary")
        return model
    layers = eval_cfg.truncate_layers
    if layers is None:
        layers = max(1, min(4, target.config.num_hidden_layers // 4))
    return truncated_copy(target, layers)
