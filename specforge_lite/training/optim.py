"""The drafter's optimiser: AdamW, or Muon on the layers' matrices with AdamW on the rest.

`train.optimizer=muon` builds one `MuonAdamW`, a single torch optimiser (so accelerate,
checkpoints and resume treat it like AdamW) whose parameter groups say which rule they
follow: Muon (momentum orthogonalised by a Newton-Schulz iteration, the step scaled to
AdamW's RMS so one learning rate serves both rules) for the 2-D weights of the drafter's
layers, AdamW for embeddings, the head, norms and biases. Why Muon: docs/BENCHMARKS.md
"EAGLE-3 training study". Muon needs whole matrices, so it runs where every rank holds the
drafter whole (single process and DDP); validate.py refuses it with sharding strategies.
"""

from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adamw", "muon")
BETAS = (0.9, 0.95)
MUON_MOMENTUM = 0.95
NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic of Muon's authors: fast growth of small singular values


def orthogonalise(update: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An approximately orthogonal matrix with `update`'s singular vectors (singular values
    pushed towards 1) by a quintic Newton-Schulz iteration in `dtype` (the iteration only
    needs singular values near 1, which bf16 keeps: Muon's authors run it in bf16)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups with `muon=True` (2-D weights), AdamW for the others, one step."""

    def __init__(self, groups: list[dict], lr: float, weight_decay: float = 0.0,
                 ns_dtype: torch.dtype = torch.float32):
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay, "muon": False})
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon's groups hold 2-D weights only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                p.mul_(1 - lr * decay)
                if group["muon"]:
                    buf = state.setdefault("momentum", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - MUON_MOMENTUM)
                    update = orthogonalise(p.grad.lerp(buf, MUON_MOMENTUM), dtype=self.ns_dtype)  # Nesterov
                    p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape)))  # AdamW's RMS
                    continue
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                (b1, b2), t = BETAS, state["step"]
                state["exp_avg"].lerp_(p.grad, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(1e-8)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** t))
        return loss


def build_optimizer(kind: str, drafter, params: list, lr: float, weight_decay: float,
                    low_precision: bool = False) -> torch.optim.Optimizer:
    """`train.optimizer`: torch's AdamW over `params`, or MuonAdamW with the 2-D weights of
    the drafter's layers under Muon (not the embeddings or the head, whose rows are tokens).
    low_precision: the run computes in bf16 (train.mixed_precision), so Muon's iteration does too."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=BETAS)
    if kind != "muon":
        raise ValueError(f"train.optimizer={kind!r}; choose {' or '.join(OPTIMIZERS)}")
    token_rows = {id(p) for name, p in drafter.named_parameters()
                  if name.split(".")[0] == "lm_head" or "embed" in name}
    matrices = [p for p in params if p.ndim == 2 and id(p) not in token_rows]
    rest = [p for p in params if p.ndim != 2 or id(p) in token_rows]
    groups = [{"params": matrices, "muon": True}] + ([{"params": rest, "muon": False}] if rest else [])
    return MuonAdamW(groups, lr=lr, weight_decay=weight_decay,
                     ns_dtype=torch.bfloat16 if low_precision else torch.float32)
