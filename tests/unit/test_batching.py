"""training/batching.py: every rank gets real rows, packing keeps padding low, the choice line
and its refusals; training/throughput.py: the GPU table and the MFU arithmetic."""

from __future__ import annotations

import random

import pytest

from specforge_lite import SpecforgeError
from specforge_lite.training.batching import (BatchChoice, borrowed, choose, deal, pack, padding_share, parse_tokens,
                                              plan, plan_batches)
from specforge_lite.training.throughput import flops_per_token, gpu_key, peak_tflops, rank_report


def lengths_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(16, 512) for _ in range(n)]


def test_a_batch_below_the_world_size_is_raised_and_said():
    choice = choose(None, 1, 2, 512, world=8)
    assert (choice.batch_size, choice.per_rank, choice.raised_from) == (8, 1, 1)
    assert "train.batch_size=1 raised to 8, the world size" in choice.line()
    assert choice.tokens_per_step == 8 * 512 * 2
    kept = choose(None, 16, 1, 512, world=8)
    assert (kept.batch_size, kept.per_rank, kept.raised_from) == (16, 2, None) and "raised" not in kept.line()


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("tokens", [None, "auto", 4096])
def test_every_rank_has_real_rows_in_every_micro_batch(world, tokens):
    lengths = lengths_of(37)  # not a multiple of any world size: short tails are filled
    choice = choose(tokens, 1, 1, 512, world)
    micro = plan(lengths, choice, seed=3, epochs=2)
    assert micro and all(len(ranks) == world and all(ranks) for ranks in micro)
    assert micro == plan(lengths, choice, seed=3, epochs=2)  # a resumed run replays the same plan
    if choice.token_budget:  # no rank's pack over its budget (a row longer than it goes alone)
        assert all(len(rows) * max(lengths[i] for i in rows) <= choice.token_budget or len(rows) == 1
                   for ranks in micro for rows in ranks)
    seen = {i for ranks in micro for rows in ranks for i in rows}
    assert seen == set(range(len(lengths)))  # two epochs cover every row


def test_fewer_rows_than_ranks_still_gives_every_rank_a_row():
    assert deal([2], world=4, rows=3) == [[2], [0], [1], [0]]
    assert deal([0, 1, 2, 3, 4], world=2, rows=5) == [[0, 2, 4], [1, 3]]


def test_borrowed_rows_are_the_lowest_free_ones_then_repeat():
    """The rule as written: the lowest rows not taken, cycled when there are fewer than needed, and
    any row when every one is taken (it stops scanning at the rows it needs: a run's plan deals
    every batch, and the scan of all rows per batch made planning quadratic in the dataset)."""

    def rule(taken, count, rows):
        free = [i for i in range(rows) if i not in taken] or list(range(rows))
        return [free[k % len(free)] for k in range(count)]

    rng = random.Random(0)
    for _ in range(300):
        rows = rng.randint(1, 40)
        taken = rng.sample(range(rows), rng.randint(0, rows))
        count = rng.randint(0, 45)
        assert borrowed(taken, count, rows) == rule(set(taken), count, rows), (taken, count, rows)
    assert borrowed([0, 1], 3, 4) == [2, 3, 2] and borrowed([0, 1, 2], 2, 3) == [0, 1] and borrowed([5], 0, 9) == []


def test_packing_fills_the_budget_with_short_rows_and_pads_less():
    lengths = [10, 10, 10, 10, 100, 400]
    assert pack([0, 1, 2, 3, 4, 5], lengths, budget=400) == [[0, 1, 2, 3], [4], [5]]
    long_tail = lengths_of(400, seed=1)
    by_sequence = plan(long_tail, choose(None, 8, 1, 512, 2), seed=0, epochs=1)
    packed = plan(long_tail, choose("auto", 8, 1, 512, 2), seed=0, epochs=1)
    unsorted = [[b[r::2] for r in range(2)] for b in [list(range(i, i + 8)) for i in range(0, 400, 8)]]
    assert padding_share(long_tail, packed) < padding_share(long_tail, unsorted)
    assert padding_share(long_tail, by_sequence) < padding_share(long_tail, unsorted)
    assert padding_share([5, 5], [[[0, 1]]]) == 0 and padding_share([1, 3], [[[0, 1]]]) == pytest.approx(1 / 3)


def test_auto_takes_what_the_device_holds_or_a_small_cpu_batch():
    assert choose("auto", 1, 2, 2048, 8, fits=6, memory="80.0 GiB").per_rank == 6
    cpu = choose("auto", 1, 2, 2048, 8)
    assert cpu.per_rank == 2 and "auto on a device of unknown memory" in cpu.line()
    assert choose("auto", 1, 1, 2048, 8, fits=6, memory="80.0 GiB").token_budget == 6 * 2048


def test_a_token_count_below_one_sequence_or_above_memory_is_refused_naming_the_fix():
    with pytest.raises(SpecforgeError, match=r"train.tokens_per_step=100 is below one sequence of data.max_length=512"):
        choose(100, 1, 1, 512, 2)
    with pytest.raises(SpecforgeError, match=r"holds 2: set train.grad_accum=8 or train.tokens_per_step=auto"):
        choose(8 * 2 * 2 * 512, 1, 1, 512, 2, fits=2, memory="a GPU")
    fitted = choose(8 * 2 * 2 * 512, 1, 8, 512, 2, fits=2, memory="a GPU")
    assert fitted.per_rank == 2 and fitted.tokens_per_step == 8 * 2 * 2 * 512
    assert parse_tokens("65_536") == 65536 and parse_tokens("AUTO") == "auto" and parse_tokens(None) is None


def test_a_token_count_raised_to_whole_sequences_says_both_values():
    """Issue 52: train.tokens_per_step=256 on 2 ranks of 256-token sequences trains 512 tokens a
    step; the line used to quote 512 as if the user had set it."""
    raised = choose(256, 8, 1, 256, 2)
    assert raised.tokens_per_step == 512 and raised.record()["tokens_per_step_asked"] == 256
    assert raised.line().startswith("batch: train.tokens_per_step=256 raised to 512 (whole 256-token sequences")
    assert choose(1024, 8, 1, 256, 2).line().startswith("batch: train.tokens_per_step=1024: ")


def test_plan_batches_keeps_its_old_home():
    from specforge_lite.stages import train

    assert train.plan_batches is plan_batches
    assert isinstance(choose(None, 4, 1, 64, 1), BatchChoice)


def test_known_gpus_have_a_peak_and_unknown_ones_none():
    assert gpu_key("NVIDIA H100 80GB HBM3") == "h100_sxm" and gpu_key("NVIDIA H100 PCIe") == "h100_pcie"
    assert gpu_key("NVIDIA H200") == "h200" and gpu_key("NVIDIA GH200 480GB") == "gh200"
    assert gpu_key("NVIDIA A100-SXM4-40GB") == "a100_40gb" and gpu_key("NVIDIA A100 80GB PCIe") == "a100_80gb"
    assert gpu_key("cpu") is None and peak_tflops(None, "cpu")[0] is None
    assert peak_tflops("h200")[0] == peak_tflops(None, "NVIDIA H200")[0] > 0
    assert peak_tflops("400")[0] == 400.0
    with pytest.raises(SpecforgeError, match=r"train.peak_tflops='b300': not a positive TFLOP/s figure nor a known GPU"):
        peak_tflops("b300")


def test_mfu_is_model_flops_per_second_over_the_peak():
    per_token = flops_per_token(trainable_params=1000, drafter_passes=2, target_params=500, target_forward=True)
    assert per_token == 6 * 1000 * 2 + 2 * 500
    assert flops_per_token(1000, 2, 500, target_forward=False) == 12000
    report = rank_report([1000, 0], [2.0, 2.0], [0, 3], steps=3, per_token_flops=1e9, peak=1.0)
    assert report["ranks"][0]["tokens_per_s"] == 500 and report["ranks"][0]["mfu"] == pytest.approx(0.5)
    assert report["ranks"][1]["steps_without_real_tokens"] == 3 and report["ranks_idle_in_some_step"] == 1
    assert rank_report([10], [1.0], [0], 1, 1e9, None)["ranks"][0]["mfu"] is None
