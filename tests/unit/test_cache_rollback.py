"""What the runner makes of each kind of transformers cache layer (issue 65): recurrent layers beside
attention (Falcon-H1's hybrid, a linear-plus-sliding layer) are refused, KV-sharing layers
(`DummyLayer`) pass, only transformers' own sliding layer is replaced, and a layer type or class
nothing knows is named in one line (runtime/hf_runner.py `rollback_problem`, `rollback_cache`)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite.runtime.hf_runner import cache_problem, keep_tree_rows, layer_role, rollback_cache, rollback_problem

cache_utils = pytest.importorskip("transformers.cache_utils")
if not hasattr(cache_utils, "LinearAttentionCacheLayerMixin"):
    pytest.skip("this transformers has no linear-attention cache layers", allow_module_level=True)


def llama(layer_types: list[str], window: int = 8):
    """A tiny Llama config whose cache layers are built from `layer_types` (set past the config's own check)."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=len(layer_types), hidden_size=32, intermediate_size=32,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    config.layer_types, config.sliding_window = list(layer_types), window
    return config


def kinds(config) -> list[str]:
    return [type(layer).__name__ for layer in rollback_cache(config).layers]


def test_a_hybrid_layer_of_linear_and_full_attention_is_refused():
    """Falcon-H1's layer type: a subclass of DynamicLayer, yet it keeps a Mamba state."""
    problem = rollback_problem(llama(["full_attention", "hybrid"]))
    assert problem == ("its cache layers ['LinearAttentionAndFullAttentionLayer'] keep a recurrent state, which "
                       "cannot be rolled back to drop a rejected draft")


def test_a_linear_plus_sliding_layer_is_kept_and_refused_while_a_plain_sliding_one_is_replaced():
    config = llama(["sliding_attention", "hybrid_sliding", "full_attention"])
    assert kinds(config) == ["DynamicLayer", "LinearAttentionAndSlidingWindowAttentionLayer", "DynamicLayer"]
    assert "['LinearAttentionAndSlidingWindowAttentionLayer'] keep a recurrent state" in rollback_problem(config)


def gemma4_shared(shared: int = 2):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(num_hidden_layers=6, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, global_head_dim=16, vocab_size=64,
                            vocab_size_per_layer_input=64, hidden_size_per_layer_input=4, sliding_window=8,
                            num_kv_shared_layers=shared,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)


def test_kv_sharing_layers_hold_nothing_and_pass():
    """Gemma 4's last layers reuse earlier layers' keys and values: `DummyLayer`s, croppable."""
    config = gemma4_shared()
    assert kinds(config) == ["DynamicLayer"] * 4 + ["DummyLayer"] * 2
    assert rollback_problem(config) is None


def test_a_tree_keeps_its_rows_past_kv_sharing_layers():
    """`keep_tree_rows` moves the rows of the layers that hold some and skips the DummyLayers."""
    config = gemma4_shared()
    cache = rollback_cache(config)
    keys = torch.arange(6.0).reshape(1, 1, 6, 1).expand(1, 1, 6, 16).contiguous()
    for layer in cache.layers[:4]:
        layer.update(keys.clone(), keys.clone())
    keep_tree_rows(cache, 3, [0, 2])
    assert cache.get_seq_length() == 5
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 5.0]


def test_a_layer_type_the_cache_does_not_know_is_one_line():
    config = llama(["full_attention", "mystery_attention"])
    message = rollback_problem(config)
    assert message == cache_problem(config)
    assert message.startswith("its layer type 'mystery_attention' (config.json layer_types) is not one transformers ")
    assert "\n" not in message


class Compressed(cache_utils.DynamicSlidingWindowLayer):
    """A family's own sliding layer (DeepSeek-V4 keeps compressed keys in one)."""

    def __init__(self, **kwargs):
        super().__init__(sliding_window=4)


class Foreign:
    """A cache layer of neither of transformers' kinds."""

    is_compileable = is_croppable = False

    def __init__(self, **kwargs):
        self.keys = self.values = None
        self.is_initialized = False


def test_other_layer_classes_are_refused_by_name(monkeypatch):
    monkeypatch.setitem(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, "test_compressed", Compressed)
    monkeypatch.setitem(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, "test_foreign", Foreign)
    layers = (cache_utils.DynamicLayer(), cache_utils.DynamicSlidingWindowLayer(sliding_window=4), Compressed(),
              Foreign(), cache_utils.DummyLayer(), cache_utils.LinearAttentionLayer())
    assert [layer_role(layer) for layer in layers] == ["full", "window", "windowed", "unknown", "empty", "recurrent"]
    config = llama(["full_attention", "test_compressed", "test_foreign"])
    assert kinds(config) == ["DynamicLayer", "Compressed", "Foreign"]  # only transformers' own window is replaced
    assert rollback_problem(config) == (
        "its cache layers ['Foreign'] are neither transformers' DynamicLayer nor its DummyLayer, so our decoder "
        "does not know how to roll them back; its cache layers ['Compressed'] drop the positions past their window, "
        "which a rolled-back draft needs again")


@pytest.mark.parametrize("layer_types,methods,opening", [
    (["full_attention", "hybrid"], ["plain", "ngram"], "eval.methods=['ngram']: model_type 'llama' cannot run them on "
                                                       "our decoder: its cache layers"),
    (["full_attention", "hybrid"], ["plain", "hf_generate", "vllm_ngram"], None),
    (["full_attention", "mystery_attention"], ["plain", "hf_generate"],
     "eval.methods=['plain', 'hf_generate']: model_type 'llama' cannot run them on transformers' forward: its layer "
     "type 'mystery_attention'"),
], ids=["hybrid_drafting", "hybrid_plain", "unknown_type"])
def test_the_door_says_what_each_cache_cannot_run(layer_types, methods, opening):
    from specforge_lite.stages.door import engine_problem

    problem = engine_problem(OmegaConf.create({"methods": methods, "engine": "hf"}), llama(layer_types))
    if opening is None:
        assert problem is None, problem
    else:
        assert problem.startswith(opening) and "\n" not in problem, problem
