"""P-EAGLE training: build for a target, the parallel per-depth loss, and the saved training folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from specforge_lite import SpecforgeError
from specforge_lite.drafters.common import draft_vocab_preparer, save_drafter, select_weights
from specforge_lite.drafters.peagle.model import PEagleConfig, PEagleDrafter, drop_token_layout


def default_mask_token(token_counts: torch.Tensor) -> int:
    """The highest target id that never occurs in the loss-masked training tokens (the
    rarest one when every id occurs): an input the drafter can give its own meaning."""
    unseen = (token_counts == 0).nonzero().flatten()
    if len(unseen):
        return int(unseen[-1])
    return int(len(token_counts) - 1 - token_counts.flip(0).argmin())


def build(cfg, target, token_counts: torch.Tensor) -> PEagleDrafter:
    """A drafter for `target`: draft vocab from loss-masked token counts (or the EAGLE-3 folder's
    with `drafter.init_from_eagle3`), depth 0 started as the read-out of the top aux layer."""
    from specforge_lite.drafters.eagle3.train import check_aux_layers
    from specforge_lite.drafters.vocab import target_draft_vocab

    opts = cfg.drafter
    mask_token = opts.mask_token_id if opts.mask_token_id is not None else default_mask_token(token_counts)
    draft_cfg = PEagleConfig.from_target(target.config, opts, mask_token)
    check_aux_layers(draft_cfg.aux_layer_ids, target.config, "drafter.aux_layer_ids")
    if draft_cfg.num_layers < 1 or draft_cfg.num_depths < 1:
        raise SpecforgeError("drafter.num_layers and drafter.num_depths must be >= 1")
    if not 0 <= draft_cfg.mask_token_id < draft_cfg.vocab_size:
        raise SpecforgeError(f"drafter.mask_token_id={draft_cfg.mask_token_id} is not a target token id")
    if not (0 < opts.down_sample_ratio <= 1 and 0 <= opts.down_sample_ratio_min <= 1):
        raise SpecforgeError("drafter.down_sample_ratio must be in (0, 1] and down_sample_ratio_min in [0, 1]")
    torch.manual_seed(cfg.train.seed)
    drafter = PEagleDrafter(draft_cfg, train_embeddings=bool(opts.train_embeddings))
    std = target.config.initializer_range
    for module in drafter.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
    nn.init.normal_(drafter.mask_hidden, std=std)
    drafter.init_residual_path()
    if opts.init_from_eagle3:
        eagle = eagle3_folder(Path(opts.init_from_eagle3), draft_cfg)
        drafter.init_from_target(target, torch.arange(len(eagle["d2t"])) + eagle["d2t"])
        copy_eagle3(drafter, eagle)
    else:
        drafter.init_from_target(target, target_draft_vocab(target, token_counts, draft_cfg.draft_vocab_size))
    return drafter.to(target.device)


def eagle3_folder(folder: Path, draft_cfg: PEagleConfig) -> dict[str, torch.Tensor]:
    """The weights of a trained EAGLE-3 folder, after checking it fits this drafter."""
    from safetensors.torch import load_file

    from specforge_lite.drafters.common import drafter_info

    info = drafter_info(folder)
    if info.get("drafter") != "eagle3":
        raise SpecforgeError(f"drafter.init_from_eagle3={folder}: not a trained EAGLE-3 drafter folder")
    for key in ("hidden_size", "aux_layer_ids", "draft_vocab_size", "vocab_size", "norm_before_residual",
                "norm_before_fc", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        if info.get(key) != getattr(draft_cfg, key):
            raise SpecforgeError(f"drafter.init_from_eagle3={folder}: its {key}={info.get(key)} differs from this "
                                 f"drafter's {getattr(draft_cfg, key)}")
    return load_file(str(folder / "model.safetensors"))


@torch.no_grad()
def copy_eagle3(drafter: PEagleDrafter, weights: dict[str, torch.Tensor]) -> None:
    """fc (and input_norm), layer 0, norm and lm_head from EAGLE-3; the other layers stay zero
    residual branches, so depth 0 starts as the EAGLE-3 drafter's first step."""
    state = drafter.state_dict()
    for name, value in weights.items():
        if name in ("d2t", "t2d") or name not in state:
            continue
        state[name].copy_(value)


def target_layers(drafter: PEagleDrafter) -> list[int]:
    return list(drafter.config.aux_layer_ids)


def describe(drafter: PEagleDrafter) -> str:
    c = drafter.config
    return (f"{c.num_layers} layers, {c.num_depths} parallel depths, mask token {c.mask_token_id}, "
            f"draft vocab {c.draft_vocab_size} of {c.vocab_size}, aux layers {c.aux_layer_ids}")


def batch_preparer(drafter: PEagleDrafter, target):
    return draft_vocab_preparer(target, drafter.draft_vocab, drafter.t2d)


def layout_seed(seed: int, input_ids: torch.Tensor) -> int:
    """The drop-token sample of a batch depends on the run's seed and the batch's tokens only,
    so a resumed run draws what an uninterrupted one draws."""
    digest = hashlib.sha256(f"{seed}:".encode() + input_ids.cpu().numpy().tobytes()).digest()
    return int.from_bytes(digest[:6], "big")


def loss_and_metrics(drafter, batch: dict, cfg):
    """Summed (not averaged) weighted loss and counts for one micro-batch.

    drafter: a `PEagleDrafter` or its DDP wrapper (called, so gradients synchronise).
    batch: `input_ids` [B, T], `aux_hidden` [B, T, 3H], `target_logits` [B, T, V_d], `valid` [B, T]
    (`common.draft_vocab_preparer`). Loss of the entry (anchor t, depth d): `drafter.loss`
    (forward KL as soft cross-entropy by default) between the target's draft-vocab distribution at position
    t+1+d (its prediction of x[t+2+d]) and the drafter's, where valid[t+2+d] (an assistant
    token whose target argmax is in the draft vocab), weighted depth_weight ** d, summed over
    the entries `drop_token_layout` keeps. Returns the depth-0 positions as the count (the
    train stage divides by their global sum) and per depth `correct` / `total` over the kept
    entries and `chain` (anchors correct at depths 0..d), rescaled from the kept anchors to
    the depth-0 count so the logged simulated tau estimates the undropped value.
    """
    from specforge_lite.training.losses import training_loss

    opts = cfg.drafter
    depths = int(opts.num_depths)
    generator = torch.Generator().manual_seed(layout_seed(cfg.train.seed, batch["input_ids"]))
    device = batch["input_ids"].device
    anchor, depth, loss_rows = (x.to(device) for x in drop_token_layout(
        batch["valid"], depths, opts.down_sample_ratio, opts.down_sample_ratio_min, generator))
    logits = drafter(batch["input_ids"], batch["aux_hidden"], anchor, depth, loss_rows)  # [M, V_d]
    rows = torch.arange(anchor.shape[0], device=device)[:, None].expand_as(anchor)[loss_rows]
    row_anchor, row_depth = anchor[loss_rows], depth[loss_rows]
    teacher = batch["target_logits"][rows, row_anchor + 1 + row_depth]
    weights = opts.depth_weight ** row_depth.to(logits.dtype)
    loss = (weights * training_loss(opts.loss)(logits, teacher)).sum()

    correct = logits.detach().argmax(-1) == teacher.argmax(-1)
    grid = torch.zeros(depths, *batch["input_ids"].shape, dtype=torch.bool, device=device)
    grid[row_depth, rows, row_anchor] = correct
    chain_ok = grid.long().cumprod(0).bool()  # correct at every depth <= d
    totals = [int((row_depth == d).sum()) for d in range(depths)]
    metrics = {"correct": [int(correct[row_depth == d].sum()) for d in range(depths)], "total": totals, "chain": []}
    for d in range(depths):
        chain = int(chain_ok[d][rows[row_depth == d], row_anchor[row_depth == d]].sum())
        metrics["chain"].append(round(chain * totals[0] / totals[d]) if totals[d] else 0)
    return loss, totals[0], metrics


# ---------------------------------------------------------------------- save / load

FROZEN = "embed_tokens.weight"  # saved only when trained (`train_embeddings`), else the target's


def trained_weights(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict, less the embedding when it is the target's, frozen."""
    frozen = set() if drafter.embed_tokens.weight.requires_grad else {FROZEN}
    return select_weights(drafter, frozen)


def save(drafter: PEagleDrafter, directory: Path, extra: dict | None = None) -> None:
    """Our training output: `config.json` (PEagleConfig, `train_embeddings` and `extra`) and
    `model.safetensors` (under the speculators names)."""
    train_embeddings = bool(drafter.embed_tokens.weight.requires_grad)
    save_drafter(directory, "peagle", trained_weights(drafter),
                 {**drafter.config.to_dict(), "train_embeddings": train_embeddings}, extra)


def load(directory: Path, target) -> PEagleDrafter:
    """A drafter saved by `save`, on the target's device (the target's embedding when it was frozen)."""
    from specforge_lite.checked_io import read_json_object
    from specforge_lite.drafters.common import load_drafter_dir

    directory = Path(directory)
    raw = read_json_object(directory / "config.json")
    fields = set(PEagleConfig.__dataclass_fields__)
    train_embeddings = bool(raw.get("train_embeddings", True))
    drafter = load_drafter_dir(directory, lambda raw: PEagleDrafter(PEagleConfig(
        **{k: v for k, v in raw.items() if k in fields}), train_embeddings), set() if train_embeddings else {FROZEN})
    if not train_embeddings:
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return drafter.to(target.device).eval()
