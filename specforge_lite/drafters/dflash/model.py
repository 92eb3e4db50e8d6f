"""DFlash drafter module: its config, the Qwen3-style layers, the anchor-block mask and the block forward.

Shapes: B batch, T sequence, A aux layers, N anchors per row, S block size, Q = N * S block
positions, H hidden, V target vocab, V_d draft vocab.

The target's hidden states at `aux_layer_ids` (concatenated, [.., A*H]) are fused by `fc` and
normalised by `hidden_norm` into one context state per committed position. Every drafter
layer projects those states with its own `k_proj` / `v_proj` (then `k_norm` and the rotary
embedding at their positions): they are keys and values the layer's queries attend to, never
rows the layers compute.

A block starts at an anchor: the last accepted token at position p (its target hidden state
is not known yet), followed by S - 1 `mask_token_id` positions p+1 .. p+S-1. The block's rows
run through every layer (pre-norm attention with per-head `q_norm` / `k_norm`, SiLU MLP);
each row attends to the context at positions < p and to the rows of its own block: all of
them (non-causal, DFlash) or those at or before it (`causal`). After the final `norm` and
the frozen `lm_head` over the draft vocabulary, block row j >= 1 predicts the token at
position p + j: one forward drafts S - 1 tokens. With `sample_from_anchor` (speculators'
option, DSpark's default) row j >= 0 predicts x[p + j + 1] instead: S tokens.

Parameter names are those of vLLM's DFlash loader (`qwen3_dflash.py`) and speculators'
checkpoints: `fc.weight`, `hidden_norm.weight`, `layers.{i}.input_layernorm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.post_attention_layernorm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight`, `embed_tokens.weight`, `d2t`, `t2d`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specforge_lite.drafters.eagle_family import RMSNorm, default_aux_layers, rotary
from specforge_lite.runtime.static_llama import apply_rotary


@dataclass
class DFlashConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    num_layers: int = 5
    block_size: int = 16
    causal: bool = False
    sample_from_anchor: bool = False  # row j predicts x[p + j + 1] (the anchor row drafts too), not x[p + j]
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"

    @classmethod
    def from_target(cls, target_config, opts, mask_token_id: int) -> "DFlashConfig":
        """The drafter for a target (its HF config) with the run's `drafter` settings."""
        rope = getattr(target_config, "rope_parameters", None) or {}
        head_dim = getattr(target_config, "head_dim", None) or \
            target_config.hidden_size // target_config.num_attention_heads
        aux = opts.aux_layer_ids
        return cls(hidden_size=target_config.hidden_size, num_attention_heads=target_config.num_attention_heads,
                   num_key_value_heads=target_config.num_key_value_heads, head_dim=head_dim,
                   intermediate_size=target_config.intermediate_size, vocab_size=target_config.vocab_size,
                   draft_vocab_size=min(int(opts.draft_vocab_size), target_config.vocab_size),
                   aux_layer_ids=list(aux) if aux else default_aux_layers(target_config.num_hidden_layers),
                   num_layers=int(opts.num_layers), block_size=int(opts.block_size), causal=bool(opts.causal),
                   sample_from_anchor=bool(getattr(opts, "sample_from_anchor", False)), mask_token_id=int(mask_token_id), rms_norm_eps=target_config.rms_norm_eps,
                   rope_theta=rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)),
                   max_position_embeddings=target_config.max_position_embeddings,
                   hidden_act="silu")  # its own SiLU-gated MLP, whatever the target's activation

    def to_dict(self) -> dict:
        return asdict(self)


def split_heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[B, N, heads * D] -> [B, heads, N, D]."""
    b, n, _ = x.shape
    return x.view(b, n, heads, head_dim).transpose(1, 2)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k (normed, rotated), v: [B, kv_heads, N, D] of inputs x [B, N, H]."""
        cfg = self.cfg
        k = self.k_norm(split_heads(self.k_proj(x), cfg.num_key_value_heads, cfg.head_dim))
        return apply_rotary(k, cos, sin), split_heads(self.v_proj(x), cfg.num_key_value_heads, cfg.head_dim)

    def forward(self, x: torch.Tensor, cos, sin, context_k, context_v, allowed: torch.Tensor) -> torch.Tensor:
        """Rows x [B, Q, H] attend to the context keys [B, kv_heads, C, D] and their own keys;
        allowed [B, Q, C + Q] bool. Returns the o_proj output [B, Q, H]."""
        cfg = self.cfg
        q = apply_rotary(self.q_norm(split_heads(self.q_proj(x), cfg.num_attention_heads, cfg.head_dim)), cos, sin)
        k, v = self.keys(x, cos, sin)
        k, v = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=cfg.head_dim ** -0.5)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads injected context keys and values."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden, cos, sin, context_k, context_v, allowed) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, context_k, context_v, allowed)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    gradient_checkpointing = False  # trainer.gradient_checkpointing: recompute each layer in backward

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)  # the target's, frozen
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)  # the target's draft-vocab rows, frozen
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    @torch.no_grad()
    def init_from_target(self, target, draft_vocab: torch.Tensor) -> None:
        """The target's embeddings, final norm and lm_head rows of the draft vocab; d2t / t2d."""
        from specforge_lite.drafters.vocab import copy_target_head

        copy_target_head(self, target, draft_vocab, self.config.vocab_size)

    @property
    def draft_vocab(self) -> torch.Tensor:
        """[V_d] target ids of the draft vocabulary (`i + d2t[i]`)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [B, 1, N, D] at positions [B, N]."""
        return rotary(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, C, A*H] concatenated target hidden states -> context states [B, C, H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, states: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values [B, kv_heads, C, D] of context states [B, C, H] at positions [B, C]."""
        cos, sin = self.rotation(positions, states.dtype)
        return [layer.self_attn.keys(states, cos, sin) for layer in self.layers]

    def block_hidden(self, tokens: torch.Tensor, positions: torch.Tensor,
                     context: list[tuple[torch.Tensor, torch.Tensor]], allowed: torch.Tensor) -> torch.Tensor:
        """Block rows: tokens, positions [B, Q]; context keys / values per layer over C positions;
        allowed [B, Q, C + Q]. Returns the last layer's hidden states [B, Q, H] (before `norm`)."""
        hidden = self.embed_tokens(tokens).to(self.fc.weight.dtype)
        cos, sin = self.rotation(positions, hidden.dtype)
        for layer, (k, v) in zip(self.layers, context):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                hidden = checkpoint(layer, hidden, cos, sin, k, v, allowed, use_reentrant=False)
            else:
                hidden = layer(hidden, cos, sin, k, v, allowed)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, anchors: torch.Tensor,
                context_valid: torch.Tensor) -> torch.Tensor:
        """Every anchor's block in one pass (training): draft-vocab logits [B, N, S, V_d] of
        `block_states`; row j of anchor a predicts x[a + j] (j >= 1), or x[a + j + 1] with
        `sample_from_anchor`."""
        hidden = self.block_states(input_ids, aux_hidden, anchors, context_valid)
        return self.logits(hidden).view(input_ids.shape[0], anchors.shape[1], self.config.block_size, -1)

    def block_states(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, anchors: torch.Tensor,
                     context_valid: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T]; aux_hidden [B, T, A*H]; anchors [B, N] (positions >= 1; see
        `select_anchors`); context_valid [B, T] bool (the attention mask: padding is no context).
        Returns the last layer's states [B, N * S, H] of every anchor's block rows (before `norm`)."""
        b, t = input_ids.shape
        s = self.config.block_size
        positions = block_positions(anchors, s)  # [B, N*S]
        tokens = torch.full_like(positions, self.config.mask_token_id)
        tokens[:, ::s] = input_ids.gather(1, anchors)
        context_positions = torch.arange(t, device=input_ids.device)[None].expand(b, -1)
        context = self.context_kv(self.context(aux_hidden), context_positions)
        allowed = anchor_block_mask(anchors, s, context_valid.bool(), self.config.causal)
        return self.block_hidden(tokens, positions, context, allowed)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, N] anchors -> [B, N * S] positions a, a+1, .., a+S-1 of each block in turn."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + offsets).flatten(-2)


def anchor_block_mask(anchors: torch.Tensor, block_size: int, context_valid: torch.Tensor,
                      causal: bool) -> torch.Tensor:
    """[B, N*S, T + N*S] bool, block row x key: a row of the block at anchor a sees the context
    positions < a that are valid (context_valid [B, T]) and the rows of its own block (those at
    or before it when `causal`); never another block."""
    b, n = anchors.shape
    t = context_valid.shape[1]
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    context = (torch.arange(t, device=anchors.device)[None, None, :] < row_anchor[..., None]) & context_valid[:, None]
    block = torch.arange(n * block_size, device=anchors.device) // block_size
    slot = torch.arange(n * block_size, device=anchors.device) % block_size
    own = block[:, None] == block[None, :]
    if causal:
        own = own & (slot[None, :] <= slot[:, None])
    return torch.cat([context, own[None].expand(b, -1, -1)], dim=2)


def select_anchors(valid: torch.Tensor, num_anchors: int, generator: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training anchors per row.

    valid [B, T]: token i carries a loss. Anchor a (1 <= a <= T - 2) is a candidate when
    valid[a + 1]: its block's first prediction has a loss (a >= 1 so it has context). Up to
    `num_anchors` candidates per row, drawn without replacement, sorted. Returns anchors and
    anchor_valid [B, N] (N = the most any row drew, at least 1; padding anchors sit at 1 and are invalid).
    """
    valid = valid.bool().cpu()
    b, t = valid.shape
    candidates = torch.zeros_like(valid)
    if t >= 3:
        candidates[:, 1:t - 1] = valid[:, 2:]
    drawn = []
    for row in candidates:
        pool = row.nonzero().flatten()
        pick = torch.randperm(len(pool), generator=generator)[:num_anchors]
        drawn.append(pool[pick].sort().values)
    width = max(1, max(len(d) for d in drawn))
    anchors = torch.full((b, width), min(1, t - 1), dtype=torch.long)
    anchor_valid = torch.zeros(b, width, dtype=torch.bool)
    for i, d in enumerate(drawn):
        anchors[i, :len(d)], anchor_valid[i, :len(d)] = d, True
    return anchors, anchor_valid


# --------------------------------------------------------------------------- speculators formats
# The speculators formats of the DFlash family (`export.py` writes them, `interop.py` reads them):
# DFlash's own and a variant's (DSpark's), which adds config fields and weights to DFlash's.


def _nothing(*_args) -> dict:
    return {}


@dataclass(frozen=True)
class Format:
    """model_type: `speculators_model_type` (also vLLM's method); architecture: what config.json
    names; config_class / drafter_class: ours; fields(config) -> the variant's config.json fields;
    shapes(config.json) -> its extra weights and their shapes; read(config.json, where) -> our
    config's extra fields, each checked by name; heads(config.json) -> a phrase for the README;
    serving: a line the README adds on serving it."""

    model_type: str
    architecture: str
    config_class: type
    drafter_class: type
    label: str
    fields: Callable[[Any], dict] = _nothing
    shapes: Callable[[dict], dict] = _nothing
    read: Callable[[dict, Any], dict] = _nothing
    heads: Callable[[dict], str] = lambda _config: ""
    serving: str = ""


DFLASH = Format(model_type="dflash", architecture="DFlashDraftModel", config_class=DFlashConfig,
                drafter_class=DFlashDrafter, label="DFlash",
                serving="A non-causal drafter needs an attention backend with non-causal support (vLLM asserts "
                        "it);\nthe causal variant (`drafter.causal=true`) serves on any backend.")
