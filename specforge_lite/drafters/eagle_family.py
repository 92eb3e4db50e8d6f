"""What the EAGLE family (EAGLE-3 and P-EAGLE) shares: the aux-layer rule, the config fields
read from the target, RMSNorm, Llama's rotary embedding, attention, the fused first decoder
layer (2H wide, over `cat(input_layernorm(embed), hidden_norm(features))`), the plain Llama
layer after it, and the speculators config blocks both exports write.

Weight names are speculators' and vLLM's (`input_layernorm`, `hidden_norm`, `self_attn.q_proj`,
`post_attention_layernorm`, `mlp.gate_proj`, ...): a drafter built from these modules saves and
loads under those names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specforge_lite.runtime.static_llama import apply_rotary, rms_norm


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle and high layers: `[2, L//2, L-3]` (the EAGLE-3 default)."""
    return [2, num_layers // 2, num_layers - 3]


def target_fields(target_config, drafter_cfg) -> dict[str, Any]:
    """The config fields an EAGLE-family drafter takes from its target (HF config) and the run's
    `drafter` settings shared by the family."""
    rope = getattr(target_config, "rope_parameters", None) or {}
    head_dim = getattr(target_config, "head_dim", None) or \
        target_config.hidden_size // target_config.num_attention_heads
    aux = drafter_cfg.aux_layer_ids
    return dict(hidden_size=target_config.hidden_size, num_attention_heads=target_config.num_attention_heads,
                num_key_value_heads=target_config.num_key_value_heads, head_dim=head_dim,
                intermediate_size=target_config.intermediate_size, vocab_size=target_config.vocab_size,
                draft_vocab_size=min(drafter_cfg.draft_vocab_size, target_config.vocab_size),
                aux_layer_ids=list(aux) if aux else default_aux_layers(target_config.num_hidden_layers),
                rms_norm_eps=target_config.rms_norm_eps,
                rope_theta=rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)),
                max_position_embeddings=target_config.max_position_embeddings,
                hidden_act="silu",  # the drafter's own SiLU-gated MLP (`_Layer`), whatever the target's
                norm_before_residual=bool(drafter_cfg.norm_before_residual),
                norm_before_fc=bool(drafter_cfg.norm_before_fc))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, N, D] of Llama's rotate-half rotary embedding at positions [B, N]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = positions[:, None, :, None].float() * inv_freq
    return torch.cat([angles.cos()] * 2, dim=-1).to(dtype), torch.cat([angles.sin()] * 2, dim=-1).to(dtype)


class Attention(nn.Module):
    """Llama attention projections over inputs of `width` (2H for the fused first layer, H after)."""

    def __init__(self, cfg, width: int):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, heads, N, D], k and v [B, heads, N, D] (kv heads repeated), rotary applied."""
        cfg = self.cfg
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q, k, v

    def project_at(self, x: torch.Tensor, positions: torch.Tensor):
        """`project` with the rotary tables of positions [B, N] computed here."""
        return self.project(x, *rotary(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype))

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(b, n, -1))


def _mlp(cfg) -> nn.ModuleDict:
    return nn.ModuleDict({
        "gate_proj": nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
        "up_proj": nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
        "down_proj": nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False),
    })


class _Layer(nn.Module):
    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual plus attention output, then the SiLU MLP block."""
        hidden = residual + attn_out
        x = self.post_attention_layernorm(hidden)
        return hidden + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](x)) * self.mlp["up_proj"](x))


class FusedFirstLayer(_Layer):
    """The family's first decoder layer: attention over `cat(input_layernorm(embeds),
    hidden_norm(features))`, 2H wide."""

    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual
        self.mlp = _mlp(cfg)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cat(input_layernorm(embeds), hidden_norm(hidden)) [.., 2H], residual [.., H])`: the
        residual is the hidden input, or its normalised form when `norm_before_residual`
        (target features carry outliers that would otherwise ride the residual)."""
        normed = self.hidden_norm(hidden)
        return (torch.cat([self.input_layernorm(embeds), normed], dim=-1),
                normed if self.norm_before_residual else hidden)


class LlamaLayer(_Layer):
    """A plain Llama decoder layer (pre-norm attention and SiLU MLP), H wide."""

    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _mlp(cfg)

    def attention_input(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_layernorm(hidden), hidden


# --------------------------------------------------------------------------- speculators config

def transformer_layer_config(cfg, num_layers: int = 1) -> dict[str, Any]:
    """The Llama config of the draft decoder layers (`num_layers` of them; EAGLE-3 has one)."""
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": num_layers,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }


def proposal_config(algorithm: str, speculative_tokens: int, verifier: str,
                    verifier_architectures: list[str]) -> dict[str, Any]:
    """speculators' `speculators_config`: one greedy proposal of k tokens and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
    }


def speculators_config(cfg, model_type: str, architecture: str, num_layers: int, speculative_tokens: int,
                       verifier: str, verifier_architectures: list[str], **extra) -> dict[str, Any]:
    """The speculators `config.json` of an EAGLE-family drafter (`extra`: the type's own keys)."""
    return {
        "speculators_model_type": model_type,
        "architectures": [architecture],
        "speculators_version": "0.9.0",
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": bool(cfg.norm_before_residual),
        "norm_before_fc": bool(cfg.norm_before_fc),
        "fc_norm": bool(getattr(cfg, "fc_norm", False)),
        "norm_output": bool(getattr(cfg, "norm_output", False)),
        **extra,
        "transformer_layer_config": transformer_layer_config(cfg, num_layers),
        "speculators_config": proposal_config(model_type, speculative_tokens, verifier, verifier_architectures),
    }


def check_weights(path: Path, weights: dict, expected: dict, draft_vocab_size: int) -> None:
    """A speculators checkpoint's tensors checked strictly (vLLM reports no missing weight):
    exactly the `expected` {name: shape}, and d2t / t2d, where present, int64 / bool maps that
    agree; ValueError naming the file otherwise."""
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise ValueError(f"{path}: missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{path}: {name} has shape {tuple(weights[name].shape)}, expected {shape}")
    if "d2t" in weights:
        if weights["d2t"].dtype != torch.int64 or weights["t2d"].dtype != torch.bool:
            raise ValueError(f"{path}: d2t must be int64 and t2d bool")
        ids = torch.arange(draft_vocab_size) + weights["d2t"]
        if int(weights["t2d"].sum()) != draft_vocab_size or not bool(weights["t2d"][ids].all()):
            raise ValueError(f"{path}: d2t and t2d disagree")
