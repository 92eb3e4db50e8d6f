"""Distillation losses on identities and hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from specforge_lite.drafters.common import stepwise_loss
from specforge_lite.training.losses import (LOSSES, forward_kl, jsd, reverse_kl, soft_cross_entropy, total_variation,
                                   training_loss)
from specforge_lite.config.fields import Divergence


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_zero_on_equal_distributions(name):
    logits = torch.randn(3, 5, 11)
    assert torch.allclose(LOSSES[name](logits, logits.clone()), torch.zeros(3, 5), atol=1e-6)
    assert torch.allclose(LOSSES[name](logits, logits + 7.0), torch.zeros(3, 5), atol=1e-5)  # shift-invariant


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_positive_on_different_distributions(name):
    a, b = torch.randn(4, 9), torch.randn(4, 9)
    assert (LOSSES[name](a, b) > 0).all()


def test_hand_computed_values():
    p = torch.tensor([0.5, 0.5]).log()  # teacher
    q = torch.tensor([0.9, 0.1]).log()  # student
    kl_pq = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    kl_qp = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert forward_kl(q, p).item() == pytest.approx(kl_pq, rel=1e-5)
    assert reverse_kl(q, p).item() == pytest.approx(kl_qp, rel=1e-5)
    assert total_variation(q, p).item() == pytest.approx(0.4, rel=1e-5)
    m = torch.tensor([0.7, 0.3])
    js = 0.5 * (0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)) + \
        0.5 * (0.9 * math.log(0.9 / 0.7) + 0.1 * math.log(0.1 / 0.3))
    assert jsd(q, p).item() == pytest.approx(js, rel=1e-5)
    assert soft_cross_entropy(q, p).item() == pytest.approx(kl_pq + math.log(2), rel=1e-5)


def test_known_limits():
    teacher = torch.tensor([[10.0, 0.0, 0.0]])
    assert total_variation(torch.tensor([[0.0, 10.0, 0.0]]), teacher).item() == pytest.approx(1.0, abs=1e-3)
    assert jsd(torch.tensor([[0.0, 30.0, 0.0]]), teacher).item() == pytest.approx(math.log(2), abs=1e-3)


def test_temperature_softens():
    a, b = torch.tensor([[4.0, 0.0]]), torch.tensor([[0.0, 4.0]])
    assert forward_kl(a, b, temperature=4.0) < forward_kl(a, b, temperature=1.0)


@pytest.mark.parametrize("name", list(Divergence))
def test_every_loss_option_trains_with_its_divergence(name):
    """forward_kl trains through soft cross-entropy (the same gradient); the others through LOSSES."""
    teacher = torch.randn(6, 13)
    student = torch.randn(6, 13, requires_grad=True)
    training_loss(name)(student, teacher).sum().backward()
    got = student.grad.clone()
    student.grad = None
    LOSSES[name.value](student, teacher).sum().backward()
    assert torch.allclose(got, student.grad, atol=1e-6)
    assert training_loss(name.value) is training_loss(name)  # the string and the enum alike
    assert (training_loss("forward_kl") is soft_cross_entropy) and name.value in LOSSES


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd"])
def test_stepwise_loss_sums_the_named_divergence_over_masked_positions_by_step_weight(name):
    torch.manual_seed(0)
    masks = [torch.tensor([[1, 1, 0, 1]]), torch.tensor([[0, 1, 0, 1]])]
    teachers = [torch.randn(1, 4, 7) for _ in masks]
    students = [torch.randn(1, 4, 7) for _ in masks]
    loss, count, metrics = stepwise_loss(students, list(zip(teachers, masks)), 0.5, name)
    expected = sum(0.5 ** j * training_loss(name)(s[m.bool()], t[m.bool()]).sum()
                   for j, (s, t, m) in enumerate(zip(students, teachers, masks)))
    assert loss.item() == pytest.approx(float(expected), rel=1e-6)
    assert count == 3 and metrics["total"] == [3, 2]
    other = stepwise_loss(students, list(zip(teachers, masks)), 0.5, "tvd")[0]
    assert other.item() != pytest.approx(loss.item(), rel=1e-3)  # the option reaches the loss
