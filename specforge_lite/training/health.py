"""What makes a training run's output worth keeping, checked while it runs: every step's loss
and gradient norm finite, at least one loss position in the run, and true counts of the real
tokens each rank trained on (a rank left without a sequence runs a dummy one so that the
ranks stay in step; its tokens count zero)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from specforge_lite import SpecforgeError

log = logging.getLogger(__name__)


def no_loss_position(rows: list[dict], max_length) -> str | None:
    """Why no row can give a loss position (no assistant token after a row's first token), or None."""
    if any(any(mask[1:]) for mask in (r["loss_mask"] for r in rows)):
        return None
    return (f"none of the {len(rows)} training conversations has a loss position (an assistant token after "
            f"its first token): data.max_length={max_length} may cut every answer off; raise it, or check the "
            "samples' loss_mask")


def nonfinite_flags(accelerator, loss: float, grad_norm: float) -> tuple[bool, bool]:
    """(the loss is not finite on some rank, the gradient norm is not finite on some rank): every
    rank gets the same answer, so every rank stops at the same step."""
    flags = [not math.isfinite(loss), not math.isfinite(grad_norm)]
    if accelerator.num_processes > 1:
        summed = accelerator.reduce(torch.tensor(flags, dtype=torch.float32, device=accelerator.device), "sum")
        flags = [bool(x > 0) for x in summed.tolist()]
    return flags[0], flags[1]


def diverged_message(step: int, total: int, loss: float, grad_norm: float, bad: tuple[bool, bool], lr: float,
                     first_step: bool, data_hint: str, checkpoint: Path | None) -> str:
    """One line for a run whose loss or gradient norm stopped being finite at `step`."""
    what = " and ".join(name for name, flag in (("loss", bad[0]), ("gradient norm", bad[1])) if flag)
    lr_hint = f"train.lr={lr:g} may be too high (lower it)"
    likely = f"{data_hint}, or {lr_hint}" if first_step else f"{lr_hint}, or {data_hint}"
    kept = f"the last good checkpoint {checkpoint} is kept" if checkpoint else "no checkpoint was written before"
    return (f"train: the {what} stopped being finite at step {step} of {total} (loss {loss:g}, gradient norm "
            f"{grad_norm:g}): {likely}; no drafter written, {kept}")


def require_loss_positions(accelerator, positions: int, total_steps: int, max_length) -> None:
    """A run whose steps (all ranks') had no loss position trained nothing: an error on every rank."""
    if total_steps and int(accelerator.reduce(torch.tensor(positions, device=accelerator.device), "sum")) == 0:
        raise SpecforgeError(f"train: no step of the {total_steps} had a loss position (every target token the "
                             "drafter could learn was masked out or outside its draft vocab); no drafter written: "
                             f"check data.max_length={max_length} and the samples' loss_mask")


def require_finite_drafter(accelerator, nonfinite: list[str], lr: float) -> None:
    """`nonfinite`: the drafter's tensors with a NaN or an inf, as rank 0 found them; every rank stops."""
    if int(accelerator.reduce(torch.tensor(len(nonfinite), device=accelerator.device), "sum")):
        where = ", ".join(nonfinite[:5]) or "found on rank 0"
        raise SpecforgeError(f"train: the trained drafter holds NaN or inf values ({where}); no drafter written "
                             f"(lower train.lr={lr:g}, or check the samples / features)")


class RankCounts:
    """This rank's real tokens and the steps in which it trained on none, over this run's steps."""

    def __init__(self):
        self.tokens = self.idle_steps = self.steps = 0

    def add_step(self, real_tokens: int) -> None:
        self.tokens += real_tokens
        self.idle_steps += real_tokens == 0
        self.steps += 1

    def gathered(self, accelerator, batch_size: int) -> dict:
        """Every rank's counts as lists by rank (collective); warns about ranks that idled."""
        mine = torch.tensor([self.tokens, self.idle_steps, self.steps], dtype=torch.int64, device=accelerator.device)
        every = accelerator.gather(mine).view(-1, 3).tolist() if accelerator.num_processes > 1 else [mine.tolist()]
        counts = {"tokens_per_rank": [r[0] for r in every], "idle_steps_per_rank": [r[1] for r in every],
                  "steps": every[0][2]}
        for rank, idle in enumerate(counts["idle_steps_per_rank"]):
            if idle and accelerator.is_main_process:
                log.warning("rank %d trained on no real token in %d of %d steps (it ran a dummy sequence): "
                            "train.batch_size=%d leaves it without a sequence; a batch of at least %d sequences "
                            "gives every rank one", rank, idle, counts["steps"], batch_size, accelerator.num_processes)
        return counts
