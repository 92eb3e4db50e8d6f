"""Hugging Face's own forward as a target runner: the model's dynamic KV cache, extended
by each forward and cropped when drafts are rejected.

Families with sliding-window layers (gpt-oss, Gemma 3, Mistral with its window) or Llama 4's
chunked attention get a cache whose every layer keeps all past positions (`rollback_cache`): transformers' own sliding
layers drop what falls out of the window, and a rejected draft then cannot be rolled back.
The window itself is kept by the attention masks: the model builds them on a chain forward,
and `window_masks` does on a tree forward. A cache with recurrent layers cannot be rolled back at
all (`rollback_problem`): the door refuses speculative methods on such a target. Each layer is
asked what it is (`layer_role`) before any is replaced: transformers 5.x's linear-attention layers
beside full or sliding attention are subclasses of its attention layers, and its `DummyLayer`s
(KV-sharing consumers, attention-free layers) hold nothing to crop."""

from __future__ import annotations

import functools
import inspect
from typing import Iterable

import torch


def cache_kwargs(model, cache) -> dict:
    """The KV cache as the keyword this transformers' forward takes: `cache` in the versions
    that renamed it (they warn on the old name), `past_key_values` before."""
    forward = getattr(model, "forward", model)
    return {"cache": cache} if "cache" in inspect.signature(forward).parameters else {"past_key_values": cache}


def rollback_cache(config):
    """A `DynamicCache` for `config` that `crop_cache` can take back to any length: its
    sliding-window layers are full ones (the model's masks still apply each window), the
    others (full attention, and whatever else the family has) are transformers' own."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if layer_role(layer) == "window" else layer for layer in cache.layers]
    return cache


def layer_role(layer) -> str:
    """What rolling back makes of one cache layer: "recurrent" (a linear-attention, convolution or
    SSM state, nothing per position to crop), "empty" (a `DummyLayer`: holds nothing), "window"
    (transformers' own sliding-window layer, which `rollback_cache` replaces by a full one),
    "windowed" (another layer that drops positions past a window), "full" (a `DynamicLayer`,
    cropped as it is) or "unknown"."""
    from transformers import cache_utils

    # older transformers lack these classes: their recurrent layers are "unknown", refused all the same
    linear = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    dummy = getattr(cache_utils, "DummyLayer", None)
    if linear is not None and isinstance(layer, linear):  # checked first: hybrids subclass the attention layers
        return "recurrent"
    if dummy is not None and isinstance(layer, dummy):
        return "empty"
    if type(layer) is cache_utils.DynamicSlidingWindowLayer:
        return "window"
    if isinstance(layer, cache_utils.DynamicSlidingWindowLayer):
        return "windowed"
    return "full" if isinstance(layer, cache_utils.DynamicLayer) else "unknown"


def sliding_windows(config) -> dict[str, int]:
    """{layer type: window} for the layers of `config` that attend over a sliding window:
    gpt-oss' and Gemma 3's `sliding_attention` layers, or every layer of a family that has
    a window and no layer types (Mistral; Qwen2 only with `use_sliding_window`)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return {}
    types = getattr(config, "layer_types", None)
    if types is None:
        return {"": int(window)}  # no layer types: the model applies its window to every layer
    return {"sliding_attention": int(window)} if "sliding_attention" in types else {}


def attention_chunks(config) -> int | None:
    """Llama 4's `chunked_attention` layers: a position sees only the keys of its own
    `attention_chunk_size`-aligned chunk (transformers keeps them in a sliding cache layer)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    chunk = getattr(config, "attention_chunk_size", None)
    return int(chunk) if chunk and "chunked_attention" in (getattr(config, "layer_types", None) or ()) else None


def cache_problem(config) -> str | None:
    """Why transformers cannot build this target's dynamic cache at all, or None: a layer type
    (config.json `layer_types`) its cache has no layer class for."""
    from transformers import DynamicCache, __version__

    _import_model_code(config)
    try:
        DynamicCache(config=config)
    except KeyError as err:  # the layer type the cache's mapping lacks
        return (f"its layer type {err.args[0]!r} (config.json layer_types) is not one transformers {__version__}'s "
                "cache knows, so no KV cache can be built for it")
    except (TypeError, ValueError, AttributeError):  # a config transformers' cache cannot read
        pass
    return None


def _import_model_code(config) -> None:
    """Import the model's own module: a family can register its cache layer types there."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # no causal-LM class for it, or its module does not import: the cache says what it knows
        pass


def role_problem(role: str, classes: list[str]) -> str | None:
    """Why cache layers of a `layer_role` (their class names: `classes`) cannot be rolled back, or None."""
    if role == "recurrent":
        return (f"its cache layers {classes} keep a recurrent state, which cannot be rolled back to drop a rejected "
                "draft")
    if role == "windowed":
        return (f"its cache layers {classes} drop the positions past their window, which a rolled-back draft "
                "needs again")
    if role == "unknown":
        return (f"its cache layers {classes} are neither transformers' DynamicLayer nor its DummyLayer, so our "
                "decoder does not know how to roll them back")
    return None


def rollback_problem(config) -> str | None:
    """Why a rejected draft cannot be taken back out of this target's cache, or None: a layer
    keeping a recurrent state (Qwen3-Next's linear attention, Falcon-H1's Mamba beside its
    attention), one whose window drops positions, a layer class we do not know, or a cache
    transformers cannot build (`cache_problem`)."""
    problem = cache_problem(config)
    if problem:
        return problem
    try:
        layers = rollback_cache(config).layers
    except (TypeError, ValueError, AttributeError):  # a config transformers' cache cannot read
        return None
    kinds: dict[str, set] = {}
    for layer in layers:
        kinds.setdefault(layer_role(layer), set()).add(type(layer).__name__)
    problems = [role_problem(role, sorted(classes)) for role, classes in sorted(kinds.items())]
    return "; ".join(p for p in problems if p) or None


def window_masks(config, mask: torch.Tensor, positions: torch.Tensor):
    """A tree forward's boolean `mask` [t, length + t] as the model's forward takes it: one
    mask, or {layer type: mask} where some layers see only a sliding window. A tree row at
    position p then also loses the keys at positions p - window and before, as it would in
    plain decoding (the cache slots before `length` hold positions 0.., the tree's rows
    `positions`); a 4D mask passed whole would reach every layer unwindowed."""
    windows, chunk = sliding_windows(config), attention_chunks(config)
    if not windows and not chunk:
        return mask
    length = mask.shape[1] - mask.shape[0]
    keys = torch.cat([torch.arange(length, device=positions.device), positions])
    within = {kind: mask & (keys[None, :] > positions[:, None] - window) for kind, window in windows.items()}
    if chunk:  # Llama 4: the keys of the row's own chunk
        within["chunked_attention"] = mask & (keys[None, :] // chunk == positions[:, None] // chunk)
    if "" in within:
        return within[""]
    return {"full_attention": mask, **within}


def crop_cache(cache, keep: int) -> None:
    """Drop all but the first `keep` positions of a KV cache.

    transformers 5.x `Cache.crop(n)` accepts only n <= 0 and removes |n| tokens;
    4.x also reads a negative n as "remove |n|", so this call works in both.
    """
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


class TargetRunner:
    """Forward passes of the target over new tokens, extending its own KV cache.

    Asks the model for exactly the hidden-state layers a drafter declared.
    """

    def __init__(self, model, hidden_state_layers: Iterable[int] = ()):
        self.model = model
        self.device = model.device
        self.layers = tuple(hidden_state_layers)
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.cache = None

    def reset(self) -> None:
        self.cache = rollback_cache(self.model.config)

    @functools.cached_property
    def rolls_back(self) -> bool:
        """Whether `crop` can take this target's cache back (`rollback_problem`); where it cannot,
        timing builds the context's cache anew after each timed forward (`width_timing.back_to_context`)."""
        return rollback_problem(self.model.config) is None

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, token_ids: list[int], last_only: bool = False
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [t, V] for the t new tokens (or [1, V] with last_only) and the
        declared hidden states {layer: [1, t, H]}."""
        kwargs = {}
        if self._keep_arg:
            kwargs["logits_to_keep"] = 1 if last_only else 0
        if self.layers:
            kwargs["output_hidden_states"] = list(self.layers)
        out = self.model(input_ids=torch.tensor([token_ids], device=self.device),
                         use_cache=True, **cache_kwargs(self.model, self.cache), **kwargs)
        logits = out.logits[0, -1:] if last_only else out.logits[0]
        hidden = {layer: out.hidden_states[layer] for layer in self.layers}
        return logits, hidden

    def crop(self, keep: int) -> None:
        crop_cache(self.cache, keep)

    def forward_tree(self, token_ids: list[int], positions: torch.Tensor, mask: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A draft tree's verify forward: t tokens at rotary `positions` [t], row r seeing
        the cache slots where `mask` [t, length + t] (bool) is True. Their keys join the
        cache at slots length .. length + t - 1 (`keep_rows` then keeps a path of them).
        Returns logits [t, V] and the declared hidden states {layer: [1, t, H]}."""
        dtype = self.model.get_output_embeddings().weight.dtype

        def additive(seen: torch.Tensor) -> torch.Tensor:  # eager and sdpa both read it
            blocked = torch.zeros(seen.shape, dtype=dtype, device=self.device)
            return blocked.masked_fill_(~seen.to(self.device), torch.finfo(dtype).min)[None, None]

        masks = window_masks(self.model.config, mask.to(self.device), positions.to(self.device))
        masks = {kind: additive(m) for kind, m in masks.items()} if isinstance(masks, dict) else additive(masks)
        kwargs = {"output_hidden_states": list(self.layers)} if self.layers else {}
        out = self.model(input_ids=torch.tensor([token_ids], device=self.device),
                         position_ids=positions.to(self.device)[None], attention_mask=masks,
                         use_cache=True, **cache_kwargs(self.model, self.cache), **kwargs)
        return out.logits[0], {layer: out.hidden_states[layer] for layer in self.layers}

    def keep_rows(self, base: int, rows: list[int]) -> None:
        """After a tree forward that started at slot `base`: keep the rows `rows` (increasing,
        rows[0] = 0) of it, moved down to slots base .., and drop every later slot."""
        keep_tree_rows(self.cache, base, rows)


def keep_tree_rows(cache, base: int, rows: list[int]) -> None:
    """A Hugging Face cache's `keep_rows` (`TargetRunner.keep_rows`): copy, then crop."""
    source = [base + r for r in rows]
    if source != list(range(base, base + len(rows))):
        for layer in cache.layers:
            if layer.keys is None:  # a DummyLayer (a KV-sharing consumer) holds no rows
                continue
            index = torch.tensor(source, device=layer.keys.device)
            layer.keys[..., base:base + len(rows), :] = layer.keys.index_select(-2, index)
            layer.values[..., base:base + len(rows), :] = layer.values.index_select(-2, index)
    crop_cache(cache, base + len(rows))
