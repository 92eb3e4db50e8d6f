"""P-EAGLE drafter module: its config, the layers, the drop-token layout and the parallel forward.

Shapes: B batch, T sequence, N sampled entries of a row, H hidden, V target vocab, V_d draft vocab.

EAGLE-3's feature fusion (the target's hidden states at `aux_layer_ids`, concatenated and
fused by `fc`) feeds `num_layers` Llama-style decoder layers; the first is EAGLE-3's 2H-wide
layer, which reads `cat(input_layernorm(embed(token)), hidden_norm(features))`. An entry is
an (anchor t, depth d) pair at position t + d:

- depth 0 reads token x[t+1] and the target's fused features at t, and predicts x[t+2];
- depth d >= 1 reads `mask_token_id` and the learned `mask_hidden` (1 x 1 x 3H, fused like
  target features), and predicts x[t+2+d].

Depth-d entries of anchor t attend to the depth-0 entries of anchors <= t and to their own
anchor's entries of depths <= d (`parallel_attention_mask`): what the k - 1 mask positions
appended after the newest committed position see when all k drafts are computed in one
forward at inference (vLLM's parallel drafting; `decode.py` here).

Training keeps every depth-0 entry (they are the context) but only a sample of the deeper
ones (`drop_token_layout`: conditional drop-token sampling, depth d keeps about
n * max(r^d, floor) anchors of the n depth-0 loss positions, each one an anchor kept at
depth d - 1), so a row holds about T * (1 + r + r^2 + ...) entries instead of T * D.

Parameter names equal the speculators P-EAGLE checkpoint names (`embed_tokens.weight`,
`fc.weight`, `mask_hidden`, `layers.{i}.self_attn.q_proj.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`); layers 1.. are plain Llama layers without `hidden_norm`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specforge_lite.drafters.eagle_family import FusedFirstLayer, LlamaLayer, RMSNorm, rotary, target_fields


@dataclass
class PEagleConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    num_layers: int = 4
    num_depths: int = 4
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    norm_before_fc: bool = False

    @classmethod
    def from_target(cls, target_config, drafter_cfg, mask_token_id: int) -> "PEagleConfig":
        """The drafter for a target (its HF config) with the run's `drafter` settings."""
        return cls(**target_fields(target_config, drafter_cfg), num_layers=int(drafter_cfg.num_layers),
                   num_depths=int(drafter_cfg.num_depths), mask_token_id=int(mask_token_id))

    def to_dict(self) -> dict:
        return asdict(self)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention; allowed [B, Nq, Nk] bool (every query allows at least one key)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class PEagleDrafter(nn.Module):
    gradient_checkpointing = False  # trainer.gradient_checkpointing: recompute each layer in backward

    def __init__(self, cfg: PEagleConfig, train_embeddings: bool = True):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(train_embeddings)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * h, cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, 3 * h))
        # layer 0 is EAGLE-3's layer (same weight names; `init_from_eagle3` copies it)
        self.layers = nn.ModuleList([FusedFirstLayer(cfg)] + [LlamaLayer(cfg) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    # ------------------------------------------------------------------ set-up

    @torch.no_grad()
    def init_from_target(self, target, draft_vocab: torch.Tensor) -> None:
        """The target's embeddings, final norm and lm_head rows of the draft vocab; d2t / t2d."""
        from specforge_lite.drafters.vocab import copy_target_head

        copy_target_head(self, target, draft_vocab, self.config.vocab_size)

    @torch.no_grad()
    def init_residual_path(self) -> None:
        """Depth 0 starts as the target's read-out of its highest aux layer (EAGLE-3's start,
        `Eagle3Drafter.init_residual_path`): fc passes that layer's block through and every
        layer's attention and MLP add zero."""
        h = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * h:] = torch.eye(h, dtype=self.fc.weight.dtype)
        for layer in self.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp["down_proj"].weight.zero_()

    @property
    def draft_vocab(self) -> torch.Tensor:
        """[V_d] target ids of the draft vocabulary (`i + d2t[i]`)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., 3H] concatenated target hidden states (or mask_hidden) -> [..., H]."""
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        return self.fc(features)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def entry_inputs(self, next_tokens: torch.Tensor, features: torch.Tensor, is_mask: torch.Tensor):
        """Layer-0 inputs: embeddings [B, N, H] and fused features [B, N, H]; rows where
        `is_mask` [B, N] read mask_token_id and mask_hidden instead of the given token and features."""
        tokens = torch.where(is_mask, torch.full_like(next_tokens, self.config.mask_token_id), next_tokens)
        features = torch.where(is_mask[..., None], self.mask_hidden.to(features.dtype), features)
        return self.embed_tokens(tokens), self.fuse(features)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype):
        return rotary(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def layer_forward(self, index: int, embeds, hidden, cos, sin, attention) -> torch.Tensor:
        """Decoder layer `index`; `attention(layer_index, q, k, v) -> attended` supplies the keys
        (training: this forward's own under a mask; decoding: a cache plus the new ones)."""
        layer = self.layers[index]
        x, residual = layer.attention_input(embeds, hidden) if index == 0 else layer.attention_input(hidden)
        q, k, v = layer.self_attn.project(x, cos, sin)
        return layer.finish(residual, layer.self_attn.output(attention(index, q, k, v)))

    # ------------------------------------------------------------------ training

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, anchor: torch.Tensor,
                depth: torch.Tensor, loss_rows: torch.Tensor) -> torch.Tensor:
        """All depths of a drop-token layout in one pass.

        input_ids [B, T]; aux_hidden [B, T, 3H]; anchor, depth [B, N] from `drop_token_layout`
        (depth -1: padding); loss_rows [B, N] bool. Returns draft-vocab logits [M, V_d] of the
        M entries where loss_rows is set, in row-major order.
        """
        next_tokens = F.pad(input_ids[:, 1:], (0, 1)).gather(1, anchor)  # x[t+1] at anchor t
        features = aux_hidden.gather(1, anchor[..., None].expand(-1, -1, aux_hidden.shape[-1]))
        embeds, hidden = self.entry_inputs(next_tokens, features, depth > 0)
        cos, sin = self.rotation(anchor + depth.clamp(min=0), hidden.dtype)
        allowed = parallel_attention_mask(anchor, depth)

        def attention(_, q, k, v):
            return attend(q, k, v, allowed, self.scale)

        for index in range(len(self.layers)):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                hidden = checkpoint(self.layer_forward, index, embeds, hidden, cos, sin, attention,
                                    use_reentrant=False)
            else:
                hidden = self.layer_forward(index, embeds, hidden, cos, sin, attention)
        return self.logits(hidden[loss_rows])


def parallel_attention_mask(anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool, query x key: an entry (anchor a, depth d) sees the depth-0 entries of
    anchors <= a (the committed context) and the entries of its own anchor with depth <= d
    (itself and the masks before it). Padding entries (depth -1) see only themselves."""
    real = depth >= 0
    a_q, a_k = anchor[:, :, None], anchor[:, None, :]
    d_q, d_k = depth[:, :, None], depth[:, None, :]
    context = (d_k == 0) & (a_k <= a_q)
    rollout = (a_k == a_q) & (d_k <= d_q)
    allowed = (context | rollout) & real[:, :, None] & real[:, None, :]
    eye = torch.eye(anchor.shape[1], dtype=torch.bool, device=anchor.device)
    return allowed | (eye & ~real[:, :, None])


def depth_keep(n: int, depth: int, ratio: float, floor: float) -> int:
    """Anchors depth `depth` >= 1 keeps from a row with n depth-0 loss positions: n * max(r^d, floor), rounded."""
    return int(n * max(ratio ** depth, floor) + 0.5)


def drop_token_layout(valid: torch.Tensor, num_depths: int, ratio: float, floor: float,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conditional drop-token sampling of the entries one training forward computes.

    valid [B, T]: token i carries a loss (see `common.draft_vocab_preparer`); depth d at
    anchor t predicts x[t+2+d], so it has a loss iff valid[t+2+d]. Per row: every anchor
    0..T-1 at depth 0 (the context every deeper entry attends to); at depth d >= 1 a random
    subset of `depth_keep(n, d)` anchors (n = depth-0 loss positions) drawn from the anchors
    kept with a loss at depth d - 1 that have a loss at depth d (all of them when fewer), so
    depth d of an anchor always comes with its depths 0..d-1. Returns anchor, depth and
    loss_rows, each [B, N] (rows padded with depth -1 to the longest row), entries ordered
    by depth then anchor.
    """
    valid = valid.bool().cpu()
    b, t = valid.shape
    rows = []
    for row in valid:
        has_loss = [F.pad(row[2 + d:], (0, 2 + d)) if 2 + d < t else torch.zeros(t, dtype=torch.bool)
                     for d in range(num_depths)]
        n = int(has_loss[0].sum())
        anchors, depths = [torch.arange(t)], [torch.zeros(t, dtype=torch.long)]
        kept = has_loss[0].nonzero().flatten()
        for d in range(1, num_depths):
            candidates = kept[has_loss[d][kept]]
            keep = min(len(candidates), depth_keep(n, d, ratio, floor))
            if keep == 0:
                break
            pick = torch.randperm(len(candidates), generator=generator)[:keep]
            kept = candidates[pick].sort().values
            anchors.append(kept)
            depths.append(torch.full((keep,), d, dtype=torch.long))
        anchor, depth = torch.cat(anchors), torch.cat(depths)
        loss = torch.stack(has_loss)[depth, anchor]
        rows.append((anchor, depth, loss))
    width = max(len(r[0]) for r in rows)
    anchor = torch.zeros(b, width, dtype=torch.long)
    depth = torch.full((b, width), -1, dtype=torch.long)
    loss_rows = torch.zeros(b, width, dtype=torch.bool)
    for i, (a, d, loss) in enumerate(rows):
        anchor[i, :len(a)], depth[i, :len(a)], loss_rows[i, :len(a)] = a, d, loss
    return anchor, depth, loss_rows
