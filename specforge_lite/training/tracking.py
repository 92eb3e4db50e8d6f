"""What the train stage reports while it runs: windows of step metrics reduced over ranks,
the experiment tracker (wandb or TensorBoard) and the learning-curve plot."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specforge_lite import SpecforgeError


class Tracker:
    def __init__(self, cfg: DictConfig, out: Path, enabled: bool):
        self.kind = cfg.train.tracker if enabled else "none"
        self.run = None
        if self.kind == "wandb":
            import wandb

            w = cfg.train.wandb
            os.environ.setdefault("WANDB_MODE", w.mode)  # offline unless the user says otherwise
            self.run = wandb.init(project=w.project, entity=w.entity, group=w.group or job_id(),
                                  tags=list(w.tags) or None, name=w.name or cfg.recipe_name,
                                  id=w.id or (kept_run_id(out) if w.resume else None), resume=w.resume,
                                  dir=str(out), reinit="finish_previous",
                                  config=OmegaConf.to_container(cfg, resolve=True))
        elif self.kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise SpecforgeError("train.tracker=tensorboard needs: pip install tensorboard") from err
            self.run = SummaryWriter(log_dir=str(out / "tensorboard"))

    def log(self, metrics: dict, step: int) -> None:
        if self.kind == "wandb":
            self.run.log(metrics, step=step)
        elif self.kind == "tensorboard":
            for k, v in metrics.items():
                self.run.add_scalar(k, v, step)

    def close(self) -> None:
        if self.kind == "wandb":
            self.run.finish()
        elif self.kind == "tensorboard":
            self.run.close()


def job_id() -> str | None:
    """The launcher's id of this job (a wandb group for its runs), if any: torchrun's run id
    (also what a stage that launched itself passes), else Slurm's job id."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    return elastic if elastic and elastic != "none" else os.environ.get("SLURM_JOB_ID")  # torchrun's default id: none


def kept_run_id(out: Path) -> str:
    """The wandb run id kept in `out/wandb_run_id` (made on first use), so that a restarted
    job with `train.wandb.resume` set continues the same run."""
    import uuid

    path = out / "wandb_run_id"
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:8]  # wandb's own ids: 8 lowercase letters and digits
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def empty_window() -> dict:
    """Counters of one logging window (summed over its steps, and over ranks when logged)."""
    return {"tokens": 0, "time": 0.0, "target_time": 0.0, "loss": 0.0, "positions": 0, "correct": None}


def plot_learning_curve(history: list[dict], path: Path) -> None:
    """Simulated acceptance length and loss against training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [h["tokens_seen"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(tokens, [h["simulated_tau"] for h in history], marker="o")
    left.set(xlabel="training tokens", ylabel="simulated tau (bonus incl.)", title="acceptance length")
    right.plot(tokens, [h["loss"] for h in history], marker="o", color="tab:red")
    right.set(xlabel="training tokens", ylabel="loss per position", title="loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def global_window(window: dict, accelerator) -> dict:
    """Sum a logging window's counters over ranks (time stays this rank's)."""
    keys = sorted(window["correct"])
    flat = [window["loss"], window["positions"], window["tokens"]] + [x for k in keys for x in window["correct"][k]]
    summed = accelerator.reduce(torch.tensor(flat, dtype=torch.float64, device=accelerator.device), "sum").tolist()
    out = dict(window, loss=summed[0], positions=int(summed[1]), tokens=int(summed[2]))
    rest, out["correct"] = summed[3:], {}
    for k in keys:
        n = len(window["correct"][k])
        out["correct"][k], rest = [int(x) for x in rest[:n]], rest[n:]
    return out


def summarise_window(window: dict, lr: float, grad_norm: float) -> dict:
    """Means over the logging window. simulated_tau = 1 + E[consecutive correct steps from
    step 0] (teacher-forced, bonus token included, as in Spec-Bench's tau)."""
    correct = window["correct"] or {"correct": [0], "total": [1], "chain": [0]}
    totals = correct["total"]
    acc = [c / t if t else 0.0 for c, t in zip(correct["correct"], totals)]
    simulated_tau = 1.0 + sum(c / totals[0] for c in correct["chain"]) if totals[0] else 1.0
    return {"loss": window["loss"] / max(1, window["positions"]), "acc": acc, "simulated_tau": simulated_tau,
            "tokens_per_s": window["tokens"] / max(window["time"], 1e-9),
            "target_share": window["target_time"] / max(window["time"], 1e-9), "lr": lr, "grad_norm": grad_norm}
