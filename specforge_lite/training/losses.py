"""Distillation losses as pure functions. They return per-position values [...];
callers mask and reduce (by the global count of loss tokens)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """-sum_v p(v) log q(v): [..., V] x [..., V] -> [...]. Same gradient as forward KL."""
    p = F.softmax(teacher_logits.float() / temperature, dim=-1)
    return -(p * F.log_softmax(student_logits.float() / temperature, dim=-1)).sum(-1)


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
               ) -> torch.Tensor:
    """KL(p_teacher || q_student): [..., V] x [..., V] -> [...]; zero iff equal distributions."""
    log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
               ) -> torch.Tensor:
    """KL(q_student || p_teacher): [..., V] x [..., V] -> [...]."""
    return forward_kl(teacher_logits, student_logits, temperature)


def total_variation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
                    ) -> torch.Tensor:
    """0.5 * sum_v |p(v) - q(v)|: [..., V] x [..., V] -> [...] in [0, 1]."""
    p = F.softmax(teacher_logits.float() / temperature, dim=-1)
    q = F.softmax(student_logits.float() / temperature, dim=-1)
    return 0.5 * (p - q).abs().sum(-1)


def jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
        beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence with mixture m = beta p + (1 - beta) q: [...]."""
    log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_m = torch.logsumexp(torch.stack([log_p + torch.log(torch.tensor(beta)),
                                         log_q + torch.log(torch.tensor(1 - beta))]), dim=0)
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return beta * kl_pm + (1 - beta) * kl_qm


LOSSES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "tvd": total_variation, "jsd": jsd}


def training_loss(name) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-position loss a drafter trains on for the option value `name` (a `Divergence` or
    its string): forward KL as soft cross-entropy (the same gradient, without the teacher's entropy)."""
    name = getattr(name, "value", name)
    return soft_cross_entropy if name == "forward_kl" else LOSSES[name]


def loss_bytes(logit_rows: int, scored_rows: int, vocab: int) -> int:
    """Peak bytes of a step's logits [logit_rows, vocab] and of a divergence above over
    `scored_rows` of them: the logits (fp32 at most), and the loss's masked copy, gathered fp32
    teacher rows, softmax, log-softmax and their product (tests/integration/test_memory_estimate.py)."""
    return (logit_rows + 5 * scored_rows) * vocab * 4
