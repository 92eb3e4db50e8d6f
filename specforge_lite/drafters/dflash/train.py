"""DFlash training: build for a target, the per-position weighted block loss, the saved training folder."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specforge_lite import SpecforgeError
from specforge_lite.drafters.common import draft_vocab_preparer, save_drafter, select_weights
from specforge_lite.drafters.dflash.model import DFlashConfig, DFlashDrafter, select_anchors
from specforge_lite.drafters.peagle.train import default_mask_token, layout_seed


def check_options(opts, target_config, max_length: int | None) -> None:
    """What the schema's per-field rules cannot say, refused with one line each: the block
    against the context, the anchor count, the aux layers against the target's depth."""
    block = int(opts.block_size)
    if block < 2:
        raise SpecforgeError(f"drafter.block_size={block}: a block is the anchor and at least one mask position (>= 2)")
    if max_length is not None and block > max_length:
        raise SpecforgeError(f"drafter.block_size={block} is above the context of data.max_length={max_length}")
    if int(opts.num_anchors) < 1:
        raise SpecforgeError(f"drafter.num_anchors={opts.num_anchors}: at least one anchor per sequence")
    aux = list(opts.aux_layer_ids) if opts.aux_layer_ids else []
    layers = target_config.num_hidden_layers
    if opts.aux_layer_ids is not None and not aux:
        raise SpecforgeError("drafter.aux_layer_ids=[]: DFlash reads at least one target layer (null: [2, L//2, L-3])")
    for layer_id in aux:
        if not 0 <= layer_id < layers:
            raise SpecforgeError(f"drafter.aux_layer_ids: aux layer {layer_id} is outside the target's decoder "
                                 f"layers 0..{layers - 1}")


def build(cfg, target, token_counts: torch.Tensor, kind=(DFlashConfig, DFlashDrafter)) -> DFlashDrafter:
    """A drafter for `target`: draft vocab from loss-masked token counts, the target's embeddings,
    final norm and draft-vocab head rows (embeddings and head frozen), the rest random. kind:
    (config class, module class), DFlash's or a variant's (DSpark's, with its heads)."""
    config_class, drafter_class = kind
    from specforge_lite.drafters.vocab import target_draft_vocab

    opts = cfg.drafter
    data = cfg.get("data")
    check_options(opts, target.config, int(data.max_length) if data is not None else None)
    mask_token = opts.mask_token_id if opts.mask_token_id is not None else default_mask_token(token_counts)
    draft_cfg = config_class.from_target(target.config, opts, mask_token)
    if not 0 <= draft_cfg.mask_token_id < draft_cfg.vocab_size:
        raise SpecforgeError(f"drafter.mask_token_id={draft_cfg.mask_token_id} is not a target token id")
    torch.manual_seed(cfg.train.seed)
    drafter = drafter_class(draft_cfg)
    std = target.config.initializer_range
    for module in drafter.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
    for module in drafter.modules():  # trained embeddings (DSpark's Markov head); the target's is copied below
        if isinstance(module, nn.Embedding) and module.weight.requires_grad:
            nn.init.normal_(module.weight, std=std)
    drafter.init_from_target(target, target_draft_vocab(target, token_counts, draft_cfg.draft_vocab_size))
    return drafter.to(target.device)


def target_layers(drafter: DFlashDrafter) -> list[int]:
    return list(drafter.config.aux_layer_ids)


def describe(drafter: DFlashDrafter) -> str:
    c = drafter.config
    return (f"{c.num_layers} layers, block {c.block_size} ({'causal' if c.causal else 'non-causal'}), mask token "
            f"{c.mask_token_id}, draft vocab {c.draft_vocab_size} of {c.vocab_size}, aux layers {c.aux_layer_ids}")


def batch_preparer(drafter: DFlashDrafter, target):
    return draft_vocab_preparer(target, drafter.draft_vocab, drafter.t2d)


# ---------------------------------------------------------------------- position weights

def exp_decay_weights(block_size: int, gamma: float, shift: int = 0) -> torch.Tensor:
    """[S] weight of block row j by the draft it makes, d = j + shift (shift 1: the anchor row
    drafts too): 0 where it makes none (d = 0), exp(-(d - 1) / gamma) after."""
    j = torch.arange(block_size, dtype=torch.float32) + shift
    return torch.where(j > 0, torch.exp(-(j - 1).clamp(min=0) / gamma), torch.zeros(()))


def dpace_weights(confidence: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [.., S] of block rows from the drafter's confidence [.., S] in each (the
    probability it gives the target's token) and mask [.., S] (rows with a loss).

    c_i = (1 - alpha) q_i + alpha on loss rows, 1 elsewhere; reach_l = prod_{i <= l} c_i (the
    chance a draft chain gets through row l); row j weighs sum_{l >= j, mask} reach_l: what
    getting row j right is worth to the accepted length. Zero where mask is 0."""
    mask = mask.to(confidence.dtype)
    smooth = torch.where(mask > 0, (1 - alpha) * confidence + alpha, torch.ones_like(confidence))
    reach = torch.cumprod(smooth, dim=-1) * mask
    return reach.flip(-1).cumsum(-1).flip(-1) * mask


def loss_and_metrics(drafter, batch: dict, cfg):
    """Summed (not averaged) weighted loss and counts for one micro-batch.

    drafter: a `DFlashDrafter` or its DDP wrapper (called, so gradients synchronise).
    batch: `input_ids` [B, T], `aux_hidden` [B, T, A*H], `target_logits` [B, T, V_d], `valid` [B, T]
    (`common.draft_vocab_preparer`), `attention_mask` [B, T]. Anchors: `select_anchors`, seeded
    by the run's seed and the batch's tokens. Row j >= 1 of anchor a is scored against the
    target's distribution at position a + j - 1 (its prediction of x[a + j]) where valid[a + j],
    by `drafter.loss` weighted per row (`position_weight`). With `sample_from_anchor` every row
    predicts one position further (row j, x[a + j + 1], against the target at a + j; row 0 too).
    A drafter with a confidence head (DSpark: its forward returns (logits, confidence logits))
    adds `confidence_alpha` x the same weighted binary cross-entropy of each row's confidence
    against `confidence_target`: overlap, sum_v min(q_v, p_v) of the row's and the target's laws
    (the chance the target accepts its sampled draft), or greedy, whether their argmaxes agree.
    Returns the anchors with a loss at the first drafting row as the count (the train stage
    divides by their global sum) and per drafting row `correct` / `total` and `chain` (anchors
    whose drafting rows up to it are all correct).
    """
    from specforge_lite.training.losses import training_loss

    opts = cfg.drafter
    core = getattr(drafter, "module", drafter)
    s = core.config.block_size
    shift = 1 if core.config.sample_from_anchor else 0
    first = 1 - shift  # the first row that drafts
    ids, valid = batch["input_ids"], batch["valid"].bool()
    device = ids.device
    b, t = ids.shape
    generator = torch.Generator().manual_seed(layout_seed(cfg.train.seed, ids))
    anchors, anchor_valid = (x.to(device) for x in select_anchors(valid, int(opts.num_anchors), generator))
    context_valid = batch.get("attention_mask", torch.ones_like(ids)).bool()
    out = drafter(ids, batch["aux_hidden"], anchors, context_valid)
    logits, accept_logits = out if isinstance(out, tuple) else (out, None)  # [B, N, S, V_d], [B, N, S]

    index = anchors[..., None] + torch.arange(s, device=device) + shift  # the position each row predicts
    inside = index < t
    index = index.clamp(max=t - 1)
    rows = torch.arange(b, device=device)[:, None, None].expand_as(index)
    mask = valid[rows, index] & inside & anchor_valid[..., None]
    mask[..., :first] = False  # the anchor row predicts nothing (unless sample_from_anchor)
    teacher_index = (index - 1).clamp(min=0)
    student, teacher = logits[mask], batch["target_logits"][rows[mask], teacher_index[mask]]
    per_row = training_loss(opts.loss)(student, teacher)  # [M]

    with torch.no_grad():
        target_token = teacher.argmax(-1)
        hits = student.argmax(-1) == target_token
        if opts.position_weight == "dpace":
            confidence = torch.zeros(mask.shape, device=device)
            confidence[mask] = torch.softmax(student.float(), -1).gather(1, target_token[:, None])[:, 0]
            weights = dpace_weights(confidence, mask, float(opts.dpace_alpha))[mask]
        else:
            weights = exp_decay_weights(s, float(opts.decay_gamma), shift).to(device).expand_as(mask)[mask]
    loss = (weights * per_row).sum()
    if accept_logits is not None:
        with torch.no_grad():
            if opts.confidence_target == "greedy":
                goal = hits.float()
            else:
                goal = torch.minimum(torch.softmax(student.float(), -1), torch.softmax(teacher.float(), -1)).sum(-1)
        bce = F.binary_cross_entropy_with_logits(accept_logits[mask].float(), goal.clamp(0.0, 1.0), reduction="none")
        loss = loss + float(opts.confidence_alpha) * (weights * bce).sum()

    correct = torch.zeros_like(mask)
    correct[mask] = hits
    chain = correct[..., first:].long().cumprod(-1).bool()  # [B, N, drafting rows]
    metrics = {"correct": [int(correct[..., j].sum()) for j in range(first, s)],
               "total": [int(mask[..., j].sum()) for j in range(first, s)],
               "chain": [int(chain[..., j - first].sum()) for j in range(first, s)]}
    return loss, metrics["total"][0], metrics


# ---------------------------------------------------------------------- save / load

FROZEN = "embed_tokens.weight"  # the target's: never saved in our folder, copied back on load


def trained_weights(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict but the target's embedding (the head's draft-vocab rows stay:
    they are what the draft vocab reads)."""
    return select_weights(getattr(drafter, "module", drafter), {FROZEN})


def save(drafter: DFlashDrafter, directory: Path, extra: dict | None = None, name: str = "dflash") -> None:
    """Our training output: `config.json` (the drafter's config and `extra`, `drafter: name`) and
    `model.safetensors`."""
    save_drafter(directory, name, trained_weights(drafter), drafter.config.to_dict(), extra)


def load(directory: Path, target, kind=(DFlashConfig, DFlashDrafter)) -> DFlashDrafter:
    """A drafter saved by `save`, on the target's device, with the target's embedding (kind: as `build`)."""
    from specforge_lite.drafters.common import load_drafter_dir

    config_class, drafter_class = kind
    fields = set(config_class.__dataclass_fields__)
    drafter = load_drafter_dir(Path(directory), lambda raw: drafter_class(config_class(
        **{k: v for k, v in raw.items() if k in fields})), {FROZEN})
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return drafter.to(target.device).eval()


def activation_bytes(cfg: DFlashConfig, batch: int, seq: int, anchors: int, checkpointing: bool) -> int:
    """Largest activations of one micro-batch: per layer ~ [B, Q, 12H] fp32 block rows and
    [B, kv_heads, T, 2D] context keys, the scores [B, heads, Q, T + Q] fp32 x2 (one layer's at a
    time with gradient checkpointing), the logits [B, Q, V_d] and the loss over all rows but the
    anchors' (`losses.loss_bytes`)."""
    from specforge_lite.training.losses import loss_bytes

    q = anchors * cfg.block_size
    layers = cfg.num_layers
    scores = batch * cfg.num_attention_heads * q * (seq + q) * 4 * 2
    rows = layers * batch * (q * 12 * cfg.hidden_size + seq * 2 * cfg.num_key_value_heads * cfg.head_dim) * 4
    logits = loss_bytes(batch * q, batch * anchors * (cfg.block_size - 1), cfg.draft_vocab_size)
    return rows + logits + (scores if checkpointing else layers * scores)


def anchors_per_row(opts, seq: int) -> int:
    """At most `num_anchors`, and no more than the sequence has positions to anchor."""
    return max(1, min(int(opts.num_anchors), seq - 2))

