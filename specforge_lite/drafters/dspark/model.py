"""DSpark drafter module: DFlash's block drafter (`dflash/model.py`) and two small heads on its
last hidden states (after the final `norm`).

- The Markov head adds a low-rank bias to each block row's draft-vocab logits from the token
  before the one the row predicts: `markov_w2(markov_w1[previous])` (vanilla), the embedding
  gated by the row's hidden state first (gated), or a recurrent state carried down the block
  (rnn). Block rows are drafted in one forward; the bias then makes row j depend on the token
  drafted at row j - 1, so the rows are read out in order (`decode.py`).
- The confidence head predicts each row's acceptance probability (a logit) from its hidden
  state and, by default, the previous token's Markov embedding.

Which token a row predicts (`sample_from_anchor`): true, row j at position p + j predicts
x[p + j + 1] and its previous token is x[p + j] (the anchor's for row 0); false, DFlash's way,
row j >= 1 predicts x[p + j] and its previous token is x[p + j - 1] (row 0 predicts nothing;
its previous token is the anchor, which still steps the rnn state).

Parameter names are speculators' (`models/dspark`) and vLLM's (`qwen3_dspark.py`):
`markov_head.markov_w1.weight` [V, r] (indexed by target ids), `markov_head.markov_w2.weight`
[V_d, r], `markov_head.gate_proj.*` [r, H + r] (gated), `markov_head.joint_proj.*`
[3r, 2r + H] (rnn), `confidence_head.proj.{weight,bias}` [1, H (+ r)].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specforge_lite.drafters.dflash.model import DFlashConfig, DFlashDrafter, block_positions


@dataclass
class DSparkConfig(DFlashConfig):
    sample_from_anchor: bool = True
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True

    @classmethod
    def from_target(cls, target_config, opts, mask_token_id: int) -> "DSparkConfig":
        base = DFlashConfig.from_target(target_config, opts, mask_token_id).to_dict()
        return cls(**{**base, "markov_rank": int(opts.markov_rank), "markov_head_type": str(opts.markov_head_type),
                      "confidence_head": bool(opts.confidence_head),
                      "confidence_with_markov": bool(opts.confidence_with_markov)})


class MarkovHead(nn.Module):
    """The low-rank bias of a row's logits from its previous token (see the module docstring)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        r, h = cfg.markov_rank, cfg.hidden_size
        self.kind, self.rank = cfg.markov_head_type, r
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = nn.Linear(r, cfg.draft_vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(h + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r)

    def embed(self, previous: torch.Tensor) -> torch.Tensor:
        """[...] target ids -> [..., r] embeddings, in the projection's dtype."""
        return self.markov_w1(previous).to(self.markov_w2.weight.dtype)

    def step(self, emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One row: emb [..., r], hidden [..., H] (normed) and the rnn state [..., r] before it
        (None: zeros) -> (its logit bias [..., V_d], the state after it)."""
        if self.kind == "vanilla":
            return self.markov_w2(emb), state
        hidden = hidden.to(emb.dtype)
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], -1))) * emb), state
        state = torch.zeros_like(emb) if state is None else state
        gate, candidate, out = self.joint_proj(torch.cat([state, emb, hidden], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(out)), state

    def block_bias(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Every row of blocks at once: emb [..., S, r], hidden [..., S, H] -> [..., S, V_d]
        (the rnn state runs down each block from zeros)."""
        if self.kind != "rnn":
            return self.step(emb, hidden, None)[0]
        state, rows = None, []
        for j in range(emb.shape[-2]):
            bias, state = self.step(emb[..., j, :], hidden[..., j, :], state)
            rows.append(bias)
        return torch.stack(rows, dim=-2)


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.with_markov = cfg.confidence_with_markov
        self.proj = nn.Linear(cfg.hidden_size + (cfg.markov_rank if self.with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Acceptance logits [...] of rows with normed hidden [..., H] and Markov embeddings [..., r]."""
        features = torch.cat([hidden, emb.to(hidden.dtype)], -1) if self.with_markov else hidden
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg)
        self.confidence_head = ConfidenceHead(cfg) if cfg.confidence_head else None

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, anchors: torch.Tensor,
                context_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every anchor's block in one pass (training), teacher-forced: each row's previous token
        is the sequence's own. Returns draft-vocab logits [B, N, S, V_d] with the Markov bias and
        confidence logits [B, N, S] (None without the head); see the module docstring for which
        token row j predicts."""
        b, t = input_ids.shape
        s, n = self.config.block_size, anchors.shape[1]
        hidden = self.norm(self.block_states(input_ids, aux_hidden, anchors, context_valid)).view(b, n, s, -1)
        shift = 0 if self.config.sample_from_anchor else 1
        previous = (block_positions(anchors, s).view(b, n, s) - shift).clamp(min=0, max=t - 1)
        previous[..., 0] = anchors  # row 0's previous token is the anchor either way
        emb = self.markov_head.embed(input_ids.gather(1, previous.flatten(1)).view(b, n, s))
        logits = self.lm_head(hidden) + self.markov_head.block_bias(emb, hidden)
        confidence = self.confidence_head(hidden, emb) if self.confidence_head is not None else None
        return logits, confidence
