"""Pieces two or more drafters share: draft-vocab soft labels, the stepwise chained loss,
the saved-weights selection."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specforge_lite.training.feature_formats import SparseTeacher
from specforge_lite.training.features import draft_vocab_targets


def draft_vocab_preparer(target, draft_vocab: torch.Tensor, t2d: torch.Tensor):
    """`prepare(batch, aux, last, own)` for drafters that predict over a draft vocab.

    Adds `target_logits` [B, T, V_d] (the target's logits restricted to the draft vocab,
    position i predicting x[i+1]), `valid` [B, T] (token i is an assistant token whose
    target prediction, made at i-1, the draft vocab can express) and `num_positions`
    (valid tokens two ahead of an anchor: the step-0 / head-0 loss positions).
    The target head's draft-vocab rows are gathered once, here.
    """
    head = target.get_output_embeddings().weight
    draft_head = head[draft_vocab]

    def prepare(batch: dict, aux, last: torch.Tensor | SparseTeacher, own: bool) -> None:
        batch["aux_hidden"] = aux
        if isinstance(last, SparseTeacher):  # train.feature_format=int4_topk: the cache stored the teacher
            batch["last_hidden"] = None
            batch["target_logits"], in_draft = last.logits(draft_head.shape[0]), last.in_draft
        else:
            batch["last_hidden"] = last
            batch["target_logits"], in_draft = draft_vocab_targets(head, draft_head, last, t2d, batch["loss_mask"])
        batch["valid"] = torch.zeros_like(batch["loss_mask"])
        batch["valid"][:, 1:] = batch["loss_mask"][:, 1:] * in_draft[:, :-1] * int(own)
        batch["num_positions"] = batch["valid"][:, 2:].sum().float()

    return prepare


def shifted_targets(target_logits: torch.Tensor, valid: torch.Tensor, steps: int):
    """Align target soft labels with drafts that look `step + 2` tokens ahead of an anchor.

    target_logits: [B, T, V_d] (position i predicts x[i+1]); valid: [B, T] token-indexed.
    Returns per step j `(target_logits_j [B, T, V_d], mask_j [B, T])`: at anchor t, the
    target's logits at position t+1+j and valid[t+2+j] (0 past the end). EAGLE-3's TTT
    step j and Medusa's head j both predict x[t+2+j] from anchor t.
    """
    out = []
    for step in range(steps):
        shift = step + 1
        logits = torch.nn.functional.pad(target_logits[:, shift:], (0, 0, 0, shift))
        mask = torch.nn.functional.pad(valid[:, shift + 1:], (0, shift + 1))
        out.append((logits, mask))
    return out


def stepwise_loss(outputs, targets, step_weight: float, loss_name="forward_kl"):
    """Summed loss and counts over draft steps (or heads).

    outputs: per step j, draft logits [N_j, V_d] at that step's masked positions, or
    [B, T, V_d] for all positions; targets: per step `(target_logits [B, T, V_d],
    mask [B, T])` from `shifted_targets`. Loss of step j: `loss_name` (`losses.training_loss`:
    forward KL as soft cross-entropy by default) at the masked positions, weighted step_weight ** j.
    Returns `(loss_sum, positions of step 0, metrics)`; metrics hold per step the
    `correct` / `total` counts and `chain`, the anchors whose steps 0..j are all correct.
    """
    from specforge_lite.training.losses import training_loss

    divergence = training_loss(loss_name)
    loss = targets[0][0].new_zeros(())
    metrics = {"correct": [], "total": [], "chain": []}
    chain = None
    for j, (logits, (target_logits, mask)) in enumerate(zip(outputs, targets)):
        mask = mask.bool()
        teacher = target_logits[mask]
        student = logits if logits.dim() == 2 else logits[mask]
        loss = loss + (step_weight ** j) * divergence(student, teacher).sum()
        correct = torch.zeros_like(mask)
        correct[mask] = student.argmax(-1) == teacher.argmax(-1)
        metrics["correct"].append(int(correct.sum()))
        metrics["total"].append(int(mask.sum()))
        chain = correct if chain is None else chain & correct
        metrics["chain"].append(int(chain.sum()))
    return loss, metrics["total"][0], metrics


def select_weights(module: nn.Module, frozen: set[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict but the `frozen` names, on CPU, contiguous."""
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items() if k not in frozen}


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an inf, in name order."""
    return [name for name in sorted(tensors) if torch.is_tensor(tensors[name])
            and tensors[name].is_floating_point() and not bool(tensors[name].isfinite().all())]


def require_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Refuse to write `what` (one line, SpecforgeError) when a tensor holds a NaN or an inf:
    every drafter and export is checked here before it is written."""
    from specforge_lite import SpecforgeError

    if bad := nonfinite_tensors(tensors):
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise SpecforgeError(f"{what}: NaN or inf values in {', '.join(bad[:5])}{more}; nothing written (a "
                             "training run that diverged: lower train.lr, or rebuild damaged samples / features)")


def save_drafter(directory: Path, kind: str, weights: dict[str, torch.Tensor], config: dict,
                 extra: dict | None = None) -> None:
    """A train/drafter folder: `model.safetensors` and `config.json` = {"drafter": kind, **config, **extra};
    weights with a NaN or an inf are refused (`require_finite`)."""
    from safetensors.torch import save_file

    require_finite(weights, f"the {kind} drafter for {directory}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"drafter": kind, **config, **(extra or {})}, indent=2))


def drafter_info(directory: Path) -> dict:
    """What a train/drafter folder says about itself (`drafter.json`, else config.json), or {}
    when it has neither; a damaged one is an `ArtifactError` naming the file."""
    from specforge_lite.checked_io import read_json_object

    directory = Path(directory)
    for name in ("drafter.json", "config.json"):
        path = directory / name
        if path.exists():
            info = read_json_object(path)
            if info.get("drafter"):
                return info
    return {}


def load_drafter_dir(directory: Path, build, frozen: set[str] = frozenset()):
    """A drafter module from a train/drafter folder written by `save_drafter`.

    build(config dict) -> module. Every file is checked by name: config.json (valid JSON
    that describes the drafter), model.safetensors (complete, every name and shape the
    module has but the `frozen` ones, finite values). The `frozen` weights are left as
    built (the caller copies them from the target)."""
    from specforge_lite.checked_io import ArtifactError, check_weights, load_safetensors, read_json_object

    directory = Path(directory)
    config = read_json_object(directory / "config.json")
    try:
        module = build(config)
    except (TypeError, ValueError, KeyError, RuntimeError) as err:
        raise ArtifactError(directory / "config.json", f"does not describe a {config.get('drafter', 'drafter')} "
                            f"drafter ({err})") from None
    weights = load_safetensors(directory / "model.safetensors")
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items() if k not in frozen}
    check_weights(directory / "model.safetensors", weights, expected)
    module.load_state_dict(weights, strict=False)
    return module

