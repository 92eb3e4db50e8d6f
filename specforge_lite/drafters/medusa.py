"""Medusa-1 heads: config, module, training objective, decoding drafter, vLLM export.

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

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specforge_lite import SpecforgeError
from specforge_lite.drafters.common import (draft_vocab_preparer, load_drafter_dir, save_drafter, select_weights,
                                            shifted_targets, stepwise_loss)

log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------- training objective

def build(cfg, target, token_counts: torch.Tensor) -> MedusaHeads:
    from specforge_lite.drafters.vocab import target_draft_vocab

    if cfg.drafter.num_heads < 1 or cfg.drafter.num_layers < 1:
        raise SpecforgeError(f"drafter.num_heads and drafter.num_layers must be >= 1, got "
                             f"{cfg.drafter.num_heads} and {cfg.drafter.num_layers}")
    medusa_cfg = MedusaConfig.from_target(target.config, cfg.drafter)
    draft_vocab = target_draft_vocab(target, token_counts, medusa_cfg.draft_vocab_size)
    heads = MedusaHeads(medusa_cfg)
    heads.init_from_target(target, draft_vocab)
    return heads.to(target.device)


def describe(heads: MedusaHeads) -> str:
    c = heads.config
    return f"{c.num_heads} heads x {c.num_layers} residual blocks, draft vocab {c.draft_vocab_size} of {c.vocab_size}"


def target_layers(heads: MedusaHeads) -> list[int]:
    return []  # only the final hidden state


def batch_preparer(heads: MedusaHeads, target):
    return draft_vocab_preparer(target, heads.draft_vocab, heads.t2d)


def loss_and_metrics(heads, batch: dict, cfg):
    """Head i at anchor t against the target's distribution of x[t+2+i], weighted
    cfg.train.step_weight ** i, only at positions whose token is learnable (`valid`)."""
    raw = heads.module if hasattr(heads, "module") else heads
    targets = shifted_targets(batch["target_logits"], batch["valid"], raw.config.num_heads)
    outputs = heads(batch["last_hidden"], [mask.bool() for _, mask in targets])
    return stepwise_loss(outputs, targets, cfg.train.step_weight)


# ---------------------------------------------------------------------- save / load

def trained_weights(heads: nn.Module) -> dict[str, torch.Tensor]:
    return select_weights(heads, set())


def save(heads: MedusaHeads, directory: Path, extra: dict | None = None) -> None:
    """Training output: `config.json` (MedusaConfig + `extra`) and `model.safetensors`."""
    save_drafter(directory, "medusa", trained_weights(heads), heads.config.to_dict(), extra)


def load(directory: Path, target) -> MedusaHeads:
    heads = load_drafter_dir(directory, lambda raw: MedusaHeads(MedusaConfig(
        **{k: v for k, v in raw.items() if k in MedusaConfig.__dataclass_fields__})))
    return heads.to(target.device).eval()


# ---------------------------------------------------------------------- decoding

class MedusaDecodeDrafter:
    """Medusa in the decoding engine (batch 1, a chain of each head's top token).

    After every target forward the last committed position t has hidden state h[t]
    (the final-norm output, HF hidden-state index -1); the pending token x[t+1] came from
    the target's lm_head and head i proposes x[t+2+i]. In sampling mode head i's token is
    drawn from its own warped distribution, which keeps rejection sampling exact (the
    proposal q may be any distribution that does not depend on the target's draws).
    At most `num_heads` tokens per step; nothing to roll back.
    """

    name = "medusa"
    sequential = False
    hidden_state_layers = (-1,)

    def __init__(self, heads: MedusaHeads):
        self.heads = heads.eval()
        self.full_vocab = heads.config.draft_vocab_size == heads.config.vocab_size

    def reset(self) -> None:
        pass

    @torch.inference_mode()
    def propose(self, ctx, k: int):
        from specforge_lite.decoding.drafters import DraftProposal
        from specforge_lite.decoding.verify import warp_probs

        k = min(k, self.heads.config.num_heads)
        hidden = ctx.hidden_states.get(-1)
        if k == 0 or hidden is None or hidden.shape[1] == 0:
            return DraftProposal([])
        h = hidden[0, -1].to(self.heads.lm_heads[0].weight.dtype)
        tokens, probs = [], []
        for block, lm_head in list(zip(self.heads.blocks, self.heads.lm_heads))[:k]:
            logits = lm_head(block(h))
            if ctx.sampling.greedy:
                tokens.append(int(self.heads.token_map[logits.argmax()]))
                continue
            full = logits if self.full_vocab else logits.new_full((self.heads.config.vocab_size,), float("-inf"))
            if not self.full_vocab:
                full[self.heads.token_map] = logits
            q = warp_probs(full, ctx.sampling)
            tokens.append(int(torch.multinomial(q, 1, generator=ctx.generator)))
            probs.append(q)
        return DraftProposal(tokens, torch.stack(probs) if probs else None)

    def accept(self, num_accepted: int) -> None:
        pass


# ---------------------------------------------------------------------- export (vLLM <= 0.32)

def vllm_config(heads: MedusaHeads) -> dict:
    """The config.json vLLM's Medusa loader reads (its MedusaConfig maps any key holding
    "num" and "heads" / "layers" to num_heads / num_hidden_layers: keep no other such key)."""
    c = heads.config
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
            "truncated_vocab_size": c.draft_vocab_size, "medusa_fc_bias": c.bias, "original_lm_head": False}


def export_weights(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """vLLM names; `token_map` only when the vocabulary is reduced (vLLM requires it then
    and would otherwise ignore it)."""
    state = trained_weights(heads)
    if heads.config.draft_vocab_size == heads.config.vocab_size:
        state.pop("token_map")
    return state


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, heads, layers = config["hidden_size"], config["num_heads"], config["num_hidden_layers"]
    shapes = {}
    for i in range(heads):
        for j in range(layers):
            shapes[f"blocks.{i}.layers.{j}.weight"] = (h, h)
            if config["medusa_fc_bias"]:
                shapes[f"blocks.{i}.layers.{j}.bias"] = (h,)
        shapes[f"lm_heads.{i}.weight"] = (config["truncated_vocab_size"], h)
    if config["truncated_vocab_size"] < config["vocab_size"]:
        shapes["token_map"] = (config["truncated_vocab_size"],)
    return shapes


def write_vllm_dir(heads: MedusaHeads, directory: Path) -> dict:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = vllm_config(heads)
    save_file(export_weights(heads), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return config


def load_vllm_dir(directory: Path, target) -> MedusaHeads:
    """Strict reload of an exported directory: typed config fields, every key and shape,
    nothing missing or extra (vLLM itself skips unknown names and never reports missing ones)."""
    from specforge_lite.artifact_io import load_safetensors, read_json_object

    directory = Path(directory)
    config = read_json_object(directory / "config.json")
    types = {"model_type": str, "hidden_size": int, "vocab_size": int, "num_heads": int, "num_hidden_layers": int,
             "truncated_vocab_size": int, "medusa_fc_bias": bool}
    for key, kind in types.items():
        if not isinstance(config.get(key), kind):
            raise SpecforgeError(f"{directory}/config.json: {key} should be a {kind.__name__}, got {config.get(key)!r}")
    if config["model_type"] != "medusa":
        raise SpecforgeError(f"{directory}/config.json: model_type {config['model_type']!r}, expected 'medusa'")
    weights = load_safetensors(directory / "model.safetensors")
    expected = expected_shapes(config)
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = [f"{k} {tuple(weights[k].shape)} != {expected[k]}" for k in expected if k in weights
             and tuple(weights[k].shape) != expected[k]]
    if missing or extra or wrong:
        raise SpecforgeError(f"{directory}: missing {missing}, unexpected {extra}, wrong shapes {wrong}")
    heads = MedusaHeads(MedusaConfig(hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                                     draft_vocab_size=config["truncated_vocab_size"], num_heads=config["num_heads"],
                                     num_layers=config["num_hidden_layers"], bias=config["medusa_fc_bias"]))
    weights.setdefault("token_map", torch.arange(config["truncated_vocab_size"]))
    heads.load_state_dict(weights, strict=True)
    return heads.to(target.device).eval()


@torch.no_grad()
def max_logit_difference(a: MedusaHeads, b: MedusaHeads) -> float:
    torch.manual_seed(0)
    hidden = torch.randn(2, 16, a.config.hidden_size, device=a.token_map.device)
    return max(float((x - y).abs().max()) for x, y in zip(a(hidden), b(hidden)))


def export(cfg, trained: Path, out: Path, target, k: int, k_source: str, verifier: str) -> dict:
    """Write `out/medusa` for vLLM <= 0.32, reload it strictly, compare logits, write a README."""
    from specforge_lite.artifacts import atomic_write_text

    heads = load(trained, target)
    directory = out / "medusa"
    config = write_vllm_dir(heads, directory)
    diff = max_logit_difference(heads, load_vllm_dir(directory, target))
    if diff != 0.0:
        raise SpecforgeError(f"{directory}: reloaded heads differ from the trained ones (max |dlogit| {diff})")
    log.info("Medusa export passed its strict reload (every key and shape; logits identical)")
    k = min(k, heads.config.num_heads)
    atomic_write_text(directory / "README.md", f"""# Medusa heads for {verifier}

Trained by specforge_lite (recipe `{cfg.recipe_name}`): {config['num_heads']} Medusa-1 heads of
{config['num_hidden_layers']} residual block(s) over the frozen target's last hidden state,
draft vocabulary {config['truncated_vocab_size']} of {config['vocab_size']} tokens
(`token_map` holds the target ids when it is reduced). Speculative tokens k = {k} ({k_source}).

**vLLM version:** vLLM loads this format up to **0.32**; vLLM 0.33 removed Medusa. Pin
`vllm<=0.32` to serve it, or train an EAGLE-3 drafter (`+recipe=eagle_...`) for newer vLLM.

```bash
vllm serve {verifier} \\
  --speculative-config '{{"method": "medusa", "model": "<this directory>", "num_speculative_tokens": {k}}}'
```

Check it offline: `python -m specforge_lite export +recipe={cfg.recipe_name}` reloads this directory
strictly (every field, key and shape) and compares logits with the trained heads.
""")
    return {"format": "medusa (vLLM <= 0.32)", "path": str(directory), "speculative_tokens": k}
