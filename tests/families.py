"""Tiny random targets of the model families users bring, built from transformers' configs.

Each keeps what sets its family apart from the Llama the rest of the suite uses (experts and a
router, attention sinks, sliding-window layers, per-head q/k norms, a tied or untied head) and
is otherwise scaled down to the tiny Llama's size, so a test runs every stage on it in seconds.
A family is one entry of `FAMILIES`; `family_target` builds each folder once per session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# the tiny Llama's shape (specforge_lite/assets/tiny_llama/config.json) and its byte-level
# tokenizer's ids, so every family takes the same prompts, samples and smoke recipes
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5,
             bos_token_id=257, eos_token_id=258, pad_token_id=258, initializer_range=0.1)
# the families our static (and compiled) forward covers; the others run on transformers' forward
STATIC_FAMILIES = ("qwen3", "qwen3_moe", "mistral")
# a window shorter than the smoke prompts, so sliding layers really drop positions while decoding
WINDOW = 16

FAMILIES: dict[str, tuple[str, dict]] = {
    # per-head q/k RMS norms, untied head
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    # experts with a top-k router in every layer, q/k norms
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=1, norm_topk_prob=True)),
    # attention sinks, alternating sliding and full layers, experts with a clamped SwiGLU, biases
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                     sliding_window=WINDOW, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 150000.0})),
    # a sliding window on every layer (the static forward masks what it left)
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    # five sliding layers to one full, tied head, GELU, scaled embeddings, q/k norms
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=WINDOW, query_pre_attn_scalar=16,
                                             tie_word_embeddings=True)),
    # multi-head latent attention (low-rank q and kv, a rotary part of each head), a dense first
    # layer, then routed experts beside a shared one
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                                             qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)),
    # chunked attention on three layers of four (keys of the row's own chunk), no rotary embedding
    # on the others, experts in every layer
    "llama4_text": ("Llama4TextConfig", dict(attention_chunk_size=WINDOW, num_local_experts=4, num_experts_per_tok=1,
                                             intermediate_size=32, intermediate_size_mlp=176,
                                             interleave_moe_layer_step=1)),
}
# families every stage runs on but the untrained draft (the target's first layers cut out as a draft
# model), whose cut transformers' config refuses: tested with the other methods
SHARED_KV_FAMILIES: dict[str, tuple[str, dict]] = {
    # KV sharing: the last two layers reuse the keys and values of earlier ones (their cache layers
    # are transformers' DummyLayer, holding nothing), per-layer input embeddings, sliding and full layers
    "gemma4_text": ("Gemma4TextConfig", dict(sliding_window=WINDOW, num_kv_shared_layers=2, global_head_dim=16,
                                             layer_types=["sliding_attention", "sliding_attention",
                                                          "full_attention"] * 2,
                                             vocab_size_per_layer_input=320, hidden_size_per_layer_input=8)),
}
# families the door refuses for speculative decoding, each for the reason the test checks
REFUSED_FAMILIES: dict[str, tuple[str, dict]] = {
    # gated-delta-net linear attention on three layers of four: a recurrent state, no rollback
    "qwen3_next": ("Qwen3NextConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32, linear_num_value_heads=4,
                                           linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                           full_attention_interval=4)),
    # Mamba-2 heads beside attention in every layer: transformers' hybrid cache layer, a DynamicLayer
    # subclass that also keeps a recurrent state
    "falcon_h1": ("FalconH1Config", dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                                         mamba_d_state=16, mamba_chunk_size=16)),
}


def build_family(name: str, out: Path) -> Path:
    """Save a tiny random `name` target (weights seeded, byte-level tokenizer) into `out`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from specforge_lite.targets.loading import byte_level_tokenizer

    config_class, extra = {**FAMILIES, **SHARED_KV_FAMILIES, **REFUSED_FAMILIES}[name]
    config = getattr(transformers, config_class)(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    byte_level_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def family_target(tmp_path_factory):
    """`family_target(name)`: the folder of a tiny random target of that family, built once."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(f"family_{name}"))
        return built[name]

    return get
