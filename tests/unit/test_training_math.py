"""The training math that exact resume and the logs rest on: the batch plan, the learning-rate
schedule, the simulated acceptance length and the draft-vocab soft labels."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite.drafters.vocab import vocab_maps
from specforge_lite.training.features import draft_vocab_targets
from specforge_lite.stages.train import lr_at, plan_batches
from specforge_lite.training.tracking import empty_window, summarise_window


# --------------------------------------------------------------------------- batch plan

def test_plan_covers_every_sequence_once_per_epoch_and_is_deterministic():
    lengths = [5, 50, 7, 300, 12, 9, 100, 3, 42, 8]
    plan = plan_batches(lengths, batch_size=3, seed=7, epochs=2)
    assert plan == plan_batches(lengths, batch_size=3, seed=7, epochs=2)  # resume replays the same plan
    assert plan != plan_batches(lengths, batch_size=3, seed=8, epochs=2)
    per_epoch = math.ceil(len(lengths) / 3)
    assert len(plan) == 2 * per_epoch
    for epoch in range(2):
        seen = sorted(i for batch in plan[epoch * per_epoch:(epoch + 1) * per_epoch] for i in batch)
        assert seen == list(range(len(lengths)))
    assert all(1 <= len(b) <= 3 for b in plan)


def test_plan_sorts_by_length_within_a_window():
    lengths = list(range(64, 0, -1))  # one window of 16 batches of 4: every batch is length-sorted
    for batch in plan_batches(lengths, batch_size=4, seed=0, epochs=1):
        spread = [lengths[i] for i in batch]
        assert max(spread) - min(spread) == 3  # 4 neighbours in length, least padding


@pytest.mark.parametrize("epochs,expected", [(0.5, 2), (1.0, 4), (1.25, 5), (0.01, 1)])
def test_fractional_epochs_round_up_to_whole_batches(epochs, expected):
    assert len(plan_batches([1] * 8, batch_size=2, seed=0, epochs=epochs)) == expected


# --------------------------------------------------------------------------- schedule

def schedule(lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1):
    return OmegaConf.create({"lr": lr, "warmup_ratio": warmup_ratio, "min_lr_ratio": min_lr_ratio})


def test_lr_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    cfg, total = schedule(), 100
    warmup = 10
    assert [lr_at(s, total, cfg) for s in range(warmup)] == pytest.approx([1e-3 * (s + 1) / warmup
                                                                             for s in range(warmup)])
    assert lr_at(warmup, total, cfg) == pytest.approx(1e-3)  # the peak right after warm-up
    middle = warmup + (total - warmup) // 2
    assert lr_at(middle, total, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-6)
    assert lr_at(total, total, cfg) == pytest.approx(1e-4)  # the floor: lr * min_lr_ratio
    values = [lr_at(s, total, cfg) for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_lr_with_no_warmup_steps_still_starts_at_a_warmup_of_one():
    cfg = schedule(warmup_ratio=0.0)
    assert lr_at(0, 10, cfg) == pytest.approx(1e-3)


# --------------------------------------------------------------------------- simulated tau

def test_simulated_tau_counts_consecutive_correct_steps_plus_the_bonus_token():
    window = empty_window()
    # 10 anchors: 8 have step 0 right, 4 of those also step 1, 1 also step 2
    window.update(loss=5.0, positions=10, tokens=100, time=2.0, target_time=0.5,
                  correct={"correct": [8, 6, 3], "total": [10, 10, 10], "chain": [8, 4, 1]})
    stats = summarise_window(window, lr=1e-3, grad_norm=0.5)
    assert stats["simulated_tau"] == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert stats["acc"] == pytest.approx([0.8, 0.6, 0.3])
    assert stats["loss"] == pytest.approx(0.5)
    assert stats["tokens_per_s"] == pytest.approx(50.0) and stats["target_share"] == pytest.approx(0.25)


def test_simulated_tau_of_a_drafter_that_is_never_right_is_one():
    window = empty_window()
    window.update(correct={"correct": [0, 0], "total": [7, 7], "chain": [0, 0]}, positions=7)
    assert summarise_window(window, 1e-3, 0.0)["simulated_tau"] == 1.0
    assert summarise_window(empty_window(), 1e-3, 0.0)["simulated_tau"] == 1.0  # nothing logged yet


# --------------------------------------------------------------------------- draft-vocab soft labels

def test_draft_vocab_targets_are_the_target_logits_restricted_to_the_draft_vocab():
    torch.manual_seed(0)
    vocab, hidden = 12, 6
    head = torch.randn(vocab, hidden)
    draft_vocab = torch.tensor([1, 4, 5, 9])
    _, t2d = vocab_maps(draft_vocab, vocab)
    last = torch.randn(2, 5, hidden)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    logits, in_draft = draft_vocab_targets(head, head[draft_vocab], last, t2d, loss_mask)
    full = last @ head.T
    assert torch.allclose(logits, full[..., draft_vocab])
    # position i is checked when token i+1 is an assistant token; its argmax must be in the draft vocab
    expected = torch.zeros(2, 5, dtype=torch.bool)
    for b in range(2):
        for i in range(4):
            if loss_mask[b, i + 1]:
                expected[b, i] = bool(t2d[full[b, i].argmax()])
    assert torch.equal(in_draft, expected)


def test_draft_vocab_maps_round_trip():
    draft_vocab = torch.tensor([0, 3, 7])
    d2t, t2d = vocab_maps(draft_vocab, 10)
    assert torch.equal(torch.arange(3) + d2t, draft_vocab)
    assert t2d.sum() == 3 and t2d[draft_vocab].all()
