"""Medusa-1 heads: their config and module.

Shapes: B batch, T sequence, H hidden, V target vocab, V_d draft vocab, K heads.

The target stays frozen. Its final hidden state h[t] (after the model's norm) gives
x[t+1] through the target's own lm_head; head i (i = 0..K-1) is `num_layers` residual
blocks `x + SiLU(W x)` followed by its own lm_head and predicts x[t+2+i]. Each head's
lm_head starts as the target's rows of the draft vocabulary and each block's W as
zero, so an untrained head repeats the target's next-token guess. The loss of head i
is the soft cross-entropy to the target's distribution of x[t+2+i] (the target's
logits at position t+1+i), weighted 0.8^i, on assistant tokens.

Parameter names are vLLM's Medusa names (`blocks.{i}.layers.{l}.weight`,
`lm_heads.{i}.weight`, and `token_map` [V_d] when the vocabulary is reduced), so the
export is the state dict plus a config. vLLM served Medusa up to 0.32 and dropped it
in 0.33.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specforge_lite.drafters.common import load_drafter_dir, save_drafter, select_weights


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # rows of each head's lm_head (== vocab_size: the full vocabulary)
    num_heads: int = 4
    num_layers: int = 1
    bias: bool = False

    @classmethod
    def from_target(cls, target_config, drafter_cfg) -> "MedusaConfig":
        """Heads for a target (its HF config) with the run's `drafter` settings."""
        return cls(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
                   draft_vocab_size=min(drafter_cfg.draft_vocab_size, target_config.vocab_size),
                   num_heads=drafter_cfg.num_heads, num_layers=drafter_cfg.num_layers)

    def to_dict(self) -> dict:
        return asdict(self)


class ResidualBlock(nn.Module):
    """`num_layers` times x <- x + SiLU(W x)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers)])
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.config = cfg
        self.blocks = nn.ModuleList([ResidualBlock(cfg.hidden_size, cfg.num_layers, cfg.bias)
                                     for _ in range(cfg.num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
                                       for _ in range(cfg.num_heads)])
        # draft id -> target id (sorted target ids); the identity for a full-vocab head
        self.register_buffer("token_map", torch.arange(cfg.draft_vocab_size, dtype=torch.long))

    @torch.no_grad()
    def init_from_target(self, target, draft_vocab: torch.Tensor) -> None:
        head = target.get_output_embeddings().weight
        for lm_head in self.lm_heads:
            lm_head.weight.copy_(head[draft_vocab])
        for block in self.blocks:
            for layer in block.layers:
                nn.init.zeros_(layer.weight)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)
        self.token_map.copy_(draft_vocab)

    @property
    def draft_vocab(self) -> torch.Tensor:
        return self.token_map

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.token_map.device)
        mask[self.token_map] = True
        return mask

    def forward(self, hidden: torch.Tensor, masks: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """hidden: [B, T, H] the target's final hidden states. With `masks` (one [B, T] bool
        per head) head i only runs at its masked positions and returns [N_i, V_d];
        otherwise every head returns [B, T, V_d]."""
        outputs = []
        for i, (block, lm_head) in enumerate(zip(self.blocks, self.lm_heads)):
            x = hidden if masks is None else hidden[masks[i]]
            outputs.append(lm_head(block(x)))
        return outputs


# ---------------------------------------------------------------------- save / load

def trained_weights(heads: nn.Module) -> dict[str, torch.Tensor]:
    return select_weights(heads, set())


def save(heads: MedusaHeads, directory: Path, extra: dict | None = None) -> None:
    """Training output: `config.json` (MedusaConfig + `extra`) and `model.safetensors`."""
    save_drafter(directory, "medusa", trained_weights(heads), heads.config.to_dict(), extra)


def load(directory: Path, target) -> MedusaHeads:
    """Heads saved by `save`, every file checked by name (`common.load_drafter_dir`)."""
    heads = load_drafter_dir(directory, lambda raw: MedusaHeads(MedusaConfig(
        **{k: v for k, v in raw.items() if k in MedusaConfig.__dataclass_fields__})))
    return heads.to(target.device).eval()
