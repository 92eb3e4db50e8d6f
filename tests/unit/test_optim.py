"""train.optimizer=muon (specforge_lite/training/optim.py): Muon on the layers' matrices, AdamW on the
rest, in one torch optimiser; checked against torch's own Muon and AdamW."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specforge_lite.training.optim import MuonAdamW, build_optimizer, orthogonalise
from tests.conftest import compose


def test_newton_schulz_pushes_singular_values_towards_one():
    torch.manual_seed(0)
    for shape in ((16, 48), (48, 16)):
        grad = torch.randn(shape) * torch.logspace(-1, 1, shape[1])  # singular values spread
        singular = torch.linalg.svdvals(orthogonalise(grad))
        assert orthogonalise(grad).shape == grad.shape
        assert singular.min() > 0.5 and singular.max() < 1.3, singular


def test_newton_schulz_in_bf16_is_the_fp32_iteration_within_bf16_rounding():
    """The bf16 iteration (train.mixed_precision=bf16) gives the fp32 one's matrix, returned in bf16."""
    torch.manual_seed(0)
    grad = torch.randn(32, 96) * torch.logspace(-1, 1, 96)
    low, full = orthogonalise(grad, dtype=torch.bfloat16), orthogonalise(grad)
    assert low.dtype == torch.bfloat16
    assert ((low.float() - full).norm() / full.norm()) < 0.05
    singular = torch.linalg.svdvals(low.float())
    assert singular.min() > 0.5 and singular.max() < 1.3, singular


def test_low_precision_runs_muons_iteration_in_bf16():
    model = Tiny()
    assert build_optimizer("muon", model, list(model.parameters()), 1e-2, 0.0).ns_dtype == torch.float32
    low = build_optimizer("muon", model, list(model.parameters()), 1e-2, 0.0, low_precision=True)
    assert low.ns_dtype == torch.bfloat16
    steps(model, low, 2)  # steps in bf16 keep the fp32 weights fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 8)
        self.fc = nn.Linear(8, 12, bias=True)
        self.lm_head = nn.Linear(12, 32, bias=False)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.fc(self.embed_tokens(ids))))


def steps(model, optimizer, n=3):
    torch.manual_seed(1)
    for _ in range(n):
        ids = torch.randint(0, 32, (4, 6))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_muon_and_adamw_groups_follow_torchs_own_rules():
    """Our step against torch.optim.Muon (RMS matched to AdamW, Nesterov, no decay; its
    Newton-Schulz runs in bf16, ours in fp32) for fc.weight, and torch's AdamW for the rest."""
    torch.manual_seed(0)
    ours, ref = Tiny(), Tiny()
    ref.load_state_dict(ours.state_dict())
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    optimizer = build_optimizer("muon", ours, list(ours.parameters()), lr=1e-2, weight_decay=0.0)
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 3]  # fc.weight; embed, fc.bias, head
    steps(ours, optimizer, 1)  # one step: every gradient the same in both, so AdamW's groups match exactly
    matrices = [ref.fc.weight]
    rest = [ref.embed_tokens.weight, ref.fc.bias, ref.lm_head.weight]
    muon = torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95))

    class Both:
        def step(self):
            muon.step()
            adamw.step()

        def zero_grad(self, set_to_none=True):
            muon.zero_grad(set_to_none=set_to_none)
            adamw.zero_grad(set_to_none=set_to_none)

    steps(ref, Both(), 1)
    got, want = dict(ours.named_parameters()), dict(ref.named_parameters())
    for name in ("embed_tokens.weight", "fc.bias", "lm_head.weight"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    moved = got["fc.weight"] - start["fc.weight"]
    expected = want["fc.weight"] - start["fc.weight"]
    assert moved.abs().max() > 1e-3  # it trained
    assert nn.functional.cosine_similarity(moved.flatten(), expected.flatten(), dim=0) > 0.99
    assert torch.allclose(moved.norm(), expected.norm(), rtol=0.05)


def test_the_optimizer_state_round_trips_through_a_checkpoint():
    torch.manual_seed(0)
    model = Tiny()
    optimizer = build_optimizer("muon", model, list(model.parameters()), lr=1e-2, weight_decay=0.1)
    steps(model, optimizer, 2)
    again = MuonAdamW([{"params": [model.fc.weight], "muon": True},
                       {"params": [model.embed_tokens.weight, model.fc.bias, model.lm_head.weight]}], lr=1e-2)
    again.load_state_dict(optimizer.state_dict())
    assert torch.equal(again.state[model.fc.weight]["momentum"], optimizer.state[model.fc.weight]["momentum"])
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW([{"params": [model.fc.bias], "muon": True}], lr=1e-2)


def test_muon_with_a_sharding_strategy_is_refused_at_the_door():
    from specforge_lite.stages.door import config_problems

    assert config_problems(compose(["+recipe=smoke", "train.optimizer=muon"])) == []
    problems = config_problems(compose(["+recipe=smoke", "train.optimizer=muon", "trainer=fsdp"]))
    assert len(problems) == 1 and "train.optimizer=muon" in problems[0] and "trainer.strategy=fsdp" in problems[0]
    problems = config_problems(compose(["+recipe=smoke", "train.optimizer=lion"]))
    assert len(problems) == 1 and "train.optimizer" in problems[0]
