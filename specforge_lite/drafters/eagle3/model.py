"""EAGLE-3 drafter module: its config, the decoder layer and the training-time-test forward.

Shapes: B batch, T sequence, H hidden, V target vocab, V_d draft vocab.

The target's hidden states from three layers (`aux_layer_ids`, Hugging Face
`output_hidden_states` indices) are concatenated and fused by `fc` (3H -> H). At
anchor position t the decoder layer reads `cat(input_layernorm(embed(x[t+1])),
hidden_norm(g[t]))` (2H wide) and predicts x[t+2] over the draft vocabulary. Step
j > 0 of the training-time test (TTT) feeds the layer's own output at step j-1 back
in place of g and reads x[t+1+j]; its query sits at position t+j and attends to the
step-0 keys at positions <= t plus the keys of steps 1..j at anchor t, which is
exactly what it sees when drafting at inference.

Parameter names equal the speculators checkpoint names (`fc.weight`,
`layers.0.self_attn.q_proj.weight`, `lm_head.weight`, `d2t`, `t2d`, ...), so export
is `state_dict()` less the frozen embedding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specforge_lite.drafters.common import load_drafter_dir, save_drafter, select_weights
from specforge_lite.drafters.eagle_family import FusedFirstLayer, RMSNorm, default_aux_layers, target_fields  # noqa: F401



@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    # speculators / vLLM options (both read by vLLM's EAGLE-3 loader):
    norm_before_residual: bool = False  # the residual stream starts from hidden_norm(g), not g
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`, 3H) over the concatenated aux states
    # EAGLE-3.1 options (speculators, vLLM): one RMSNorm per aux state before fc (`fc_norm.{i}`),
    # and the normalised layer output (not the raw one) fed to the next step
    fc_norm: bool = False
    norm_output: bool = False

    @classmethod
    def from_target(cls, target_config, drafter_cfg) -> "Eagle3Config":
        """The drafter for a target (its HF config) with the run's `drafter` settings."""
        return cls(**target_fields(target_config, drafter_cfg),
                   fc_norm=bool(getattr(drafter_cfg, "fc_norm", False)),
                   norm_output=bool(getattr(drafter_cfg, "norm_output", False)))

    def to_dict(self) -> dict:
        return asdict(self)


class Eagle3Drafter(nn.Module):
    gradient_checkpointing = False  # trainer.gradient_checkpointing: recompute TTT attention in backward

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        if cfg.norm_before_fc and cfg.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other (one norm over the concatenation, "
                             "or one per aux state)")
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in range(3)])
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([FusedFirstLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    # ------------------------------------------------------------------ set-up

    @torch.no_grad()
    def init_from_target(self, target, draft_vocab: torch.Tensor) -> None:
        """Copy the target's embeddings and its lm_head rows of the draft vocab; set d2t/t2d.

        draft_vocab: [V_d] sorted target ids.
        """
        from specforge_lite.drafters.vocab import vocab_maps

        self.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        self.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_vocab])
        final_norm = getattr(getattr(target, "model", None), "norm", None)
        if final_norm is not None and final_norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(final_norm.weight)  # lm_head rows expect the target's output scale
        d2t, t2d = vocab_maps(draft_vocab, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.init_std = target.config.initializer_range

    @torch.no_grad()
    def init_residual_path(self) -> None:
        """Start as the target's own read-out of its highest aux layer: `fc` passes that
        layer's block through unchanged and the attention and MLP branches add zero
        (`o_proj`, `down_proj` at zero), so step 0 begins from the logit lens of layer
        aux_layer_ids[-1] instead of a random projection (ahead of a random layer on SmolLM2:
        docs/BENCHMARKS.md "EAGLE-3 training options")."""
        h = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * h:] = torch.eye(h, dtype=self.fc.weight.dtype)
        self.layers[0].self_attn.o_proj.weight.zero_()
        self.layers[0].mlp["down_proj"].weight.zero_()

    @property
    def draft_vocab(self) -> torch.Tensor:
        """[V_d] target ids of the draft vocabulary (`i + d2t[i]`)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 3H] concatenated target hidden states -> [B, T, H]."""
        if self.config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.config.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def readout(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] layer output -> ([..., V_d] draft-vocab logits, the hidden state the next
        step consumes: the layer output itself, or its normalised form with norm_output)."""
        normed = self.norm(hidden)
        return self.lm_head(normed), normed if self.config.norm_output else hidden

    # ------------------------------------------------------------------ training

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        return self.ttt_forward(input_ids, aux_hidden, steps)

    def ttt_forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int,
                    positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time test unroll.

        input_ids: [B, T] the sequence x; aux_hidden: [B, T, 3H] target features at each position.
        Returns `steps` tensors [B, T, V_d]: entry j at anchor t is the drafter's prediction of
        x[t+2+j] (compare with the target's distribution at position t+1+j). Inputs past the
        end of the sequence are padded with token 0; mask those positions in the loss.
        """
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        layer = self.layers[0]
        attn = layer.self_attn
        scale = 1.0 / math.sqrt(self.config.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()

        hidden = self.fuse(aux_hidden)
        tokens = input_ids
        keys, values = [], []
        outputs = []
        for step in range(steps):
            tokens = F.pad(tokens[:, 1:], (0, 1))  # x[t+1+step] at anchor t
            x, residual = layer.attention_input(self.embed_tokens(tokens), hidden)
            q, k, v = attn.project_at(x, positions + step)
            keys.append(k)
            values.append(v)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # the [B, h, T, T] scores of every step are the largest activations: recompute them
                attended = checkpoint(ttt_attention, q, tuple(keys), tuple(values), causal, scale,
                                      use_reentrant=False)
            else:
                attended = ttt_attention(q, tuple(keys), tuple(values), causal, scale)
            logits, hidden = self.readout(layer.finish(residual, attn.output(attended)))
            outputs.append(logits)
        return outputs


def ttt_attention(q: torch.Tensor, keys: tuple, values: tuple, causal: torch.Tensor, scale: float) -> torch.Tensor:
    """One TTT step's attention. q: [B, h, T, d]; keys / values: one [B, h, T, d] per step so far.
    Step-0 keys are attended causally over positions; later steps' keys only at the same anchor."""
    t = q.shape[-2]
    scores = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, T, T]
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # each [B, h, T, 1]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    attended = probs[..., :t] @ values[0]
    for i, vv in enumerate(values[1:]):
        attended = attended + probs[..., t + i: t + i + 1] * vv
    return attended


# ---------------------------------------------------------------------- save / load

FROZEN = "embed_tokens.weight"  # the target's own embedding: never saved, copied back on load
FROZEN_WEIGHTS = {FROZEN}


def trained_weights(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict but the frozen embedding, on CPU, contiguous."""
    return select_weights(drafter, FROZEN_WEIGHTS)


def save(drafter: Eagle3Drafter, directory: Path, extra: dict | None = None) -> None:
    """Our training output: `config.json` (Eagle3Config + `extra`) and `model.safetensors`
    (every weight but the frozen embedding, under the speculators names)."""
    save_drafter(directory, "eagle3", trained_weights(drafter), drafter.config.to_dict(), extra)


def load(directory: Path, target) -> Eagle3Drafter:
    """A drafter saved by `save`, with the target's embedding, on the target's device; every
    file is checked by name (`common.load_drafter_dir`)."""
    fields = set(Eagle3Config.__dataclass_fields__)
    drafter = load_drafter_dir(directory, lambda raw: Eagle3Drafter(Eagle3Config(
        **{k: v for k, v in raw.items() if k in fields})), FROZEN_WEIGHTS)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return drafter.to(target.device).eval()
