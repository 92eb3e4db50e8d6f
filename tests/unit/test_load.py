"""Speedup at load (serving/vllm/load.py, load_report.py) from hand-made measurements: the best
k per load, the schedule vLLM takes, where speculation stops paying, the table, plot and export."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from specforge_lite.serving.vllm import load_report
from specforge_lite.serving.vllm.load import PLAIN, concurrency_problems, schedule_problem
from tests.conftest import compose

BOOT = SimpleNamespace(resamples=400, seed=0, level=0.95)
REQUESTS = 12


def reply(rate: float, level: int, jitter: float = 0.05, tokens: int = 40, drafts: int = 0) -> dict:
    """A runner's `load` reply: REQUESTS requests of `tokens` tokens each at `rate` tokens/s per
    request (a little jitter per request), `level` of them at a time."""
    outputs = []
    for i in range(REQUESTS):
        seconds = tokens / (rate * (1 + jitter * ((i % 3) - 1)))
        start = (i // level) * seconds
        outputs.append({"token_ids": list(range(tokens)), "finish_reason": "length", "start": start,
                        "first": start + 0.01, "end": start + seconds})
    wall = max(o["end"] for o in outputs)
    return {"outputs": outputs, "seconds": wall, "most_in_flight": level,
            "counters": {"num_drafts": drafts, "num_draft_tokens": 2 * drafts, "num_accepted_tokens": drafts}}


def measured(speed: dict[int, dict[int, float]], levels=(1, 4, 16)) -> dict:
    """vllm_plain at 100 tokens/s per request everywhere; vllm_ngram at `speed[k][load]` x that."""
    runs = {PLAIN: {0: {n: reply(100, n) for n in levels}},
            "vllm_ngram": {k: {n: reply(100 * speed[k][n], n, drafts=5) for n in levels} for k in speed}}
    return {"runs": runs, "levels": list(levels), "draft_lengths": sorted(speed)}


def test_the_best_k_per_load_gives_the_schedule_and_where_speculation_stops_paying():
    # k=2 pays most at batch 1, k=1 at 4, nothing at 16 (where both cost throughput)
    speed = {1: {1: 1.3, 4: 1.25, 16: 0.8}, 2: {1: 1.6, 4: 1.1, 16: 0.6}}
    section = load_report.analyse(measured(speed), BOOT, True)
    ngram = section["methods"]["vllm_ngram"]
    assert [ngram["by_load"][n]["best_k"] for n in ("1", "4", "16")] == [2, 1, 0]
    assert ngram["schedule"] == [[1, 3, 2], [4, 15, 1], [16, 16, 0]]
    assert schedule_problem(ngram["schedule"], 2) is None  # vLLM's own rules (test_vllm checks them against vLLM)
    assert ngram["stops_paying_at"] == 16 and ngram["pays_up_to"] == 4
    cell = ngram["by_load"]["1"]["by_k"]["2"]
    assert cell["speedup"] == pytest.approx(1.6, rel=0.05) and cell["speedup_ci"][0] > 1.0
    assert ngram["by_load"]["16"]["by_k"]["1"]["speedup_ci"][1] < 1.0
    assert cell["acceptance_length"] == 2.0 and cell["tpot_ms"] > 0 and cell["identical_to_vllm_plain"]
    # the advice: what to deploy at the expected load, and what changes above it
    assert load_report.advice(section, 1)[0].startswith("at 1 concurrent request(s) (measured at 1): vllm_ngram "
                                                       "with k=2, each request 1.6")
    assert "does not pay at 16 concurrent requests" in load_report.advice(section, 1)[1]
    assert "serve without speculation" in load_report.advice(section, 16)[0]
    assert "measured at 4" in load_report.advice(section, 8)[0]  # the largest measured load at or below


def test_faster_requests_that_cost_the_engine_throughput_are_no_reason_to_draft():
    """A k whose requests each run faster while the whole run takes longer (a long tail) does not pay."""
    tail = measured({1: {1: 1.3, 4: 1.3, 16: 1.3}})
    for n in (1, 4, 16):
        reply_ = tail["runs"]["vllm_ngram"][1][n]
        reply_["seconds"] = 2 * tail["runs"][PLAIN][0][n]["seconds"]  # the engine's wall twice plain's
    section = load_report.analyse(tail, BOOT, True)
    cell = section["methods"]["vllm_ngram"]["by_load"]["4"]["by_k"]["1"]
    assert cell["speedup_ci"][0] > 1.0 and cell["throughput_ratio"] < 1.0
    assert section["methods"]["vllm_ngram"]["schedule"] == [[1, 16, 0]]


def test_a_speedup_inside_noise_is_no_reason_to_draft():
    """A k whose interval reaches below 1 does not enter the schedule, however high its point."""
    noisy = measured({1: {1: 1.03, 4: 1.0, 16: 1.0}})
    for n in (1, 4, 16):  # half the requests faster, half slower: a point above 1, an interval across it
        for i, o in enumerate(noisy["runs"]["vllm_ngram"][1][n]["outputs"]):
            o["end"] = o["start"] + (o["end"] - o["start"]) * (0.6 if i % 2 else 1.4)
    section = load_report.analyse(noisy, BOOT, True)
    assert section["methods"]["vllm_ngram"]["schedule"] == [[1, 16, 0]]
    assert "serve without speculation" in load_report.advice(section, 1)[0]


def test_report_table_plot_and_export_section(tmp_path):
    speed = {1: {1: 1.3, 4: 1.25, 16: 0.8}, 2: {1: 1.6, 4: 1.1, 16: 0.6}}
    section = load_report.analyse(measured(speed), BOOT, True)
    section["schedule_source"] = "measured"
    section["schedule_runs"]["vllm_ngram_schedule"] = {"schedule": section["methods"]["vllm_ngram"]["schedule"],
                                                        "accepted": True, "by_load": {"1": {"speedup": 1.5}}}
    text = load_report.markdown(section)
    assert "| 1 | vllm_ngram | 2 |" in text and "| 16 | vllm_ngram | 0 (fastest: k=1) |" in text
    assert "per-request speedup" in text
    assert "stops paying at 16 concurrent requests" in text and "vLLM ran the schedule" in text
    assert (tmp_path / load_report.write_plot(section, tmp_path)).stat().st_size > 0
    readme = load_report.serve_section({"vllm": {"load": section}}, "vllm_ngram", {"method": "ngram"}, "target")
    config = json.loads(re.search(r"--speculative-config '(.*)'", readme).group(1))
    assert config == {"method": "ngram", "num_speculative_tokens": 2,
                      "num_speculative_tokens_per_batch_size": [[1, 3, 2], [4, 15, 1], [16, 16, 0]]}
    assert "which vLLM ran in that evaluate" in readme
    assert load_report.serve_section({"vllm": {}}, "vllm_ngram", {}, "target") == ""


@pytest.mark.parametrize("schedule, problem", [
    ([[1, 4, 2], [5, 8, 1]], None),
    ([[1, 4, 2], [9, 16, 0]], None),  # a gap: vLLM carries the k before it on
    ([[5, 8, 1], [1, 4, 2]], None),  # vLLM sorts the ranges
    ([], "empty"),
    ([[2, 4, 1]], "start at batch size 1"),
    ([[1, 4, 2], [4, 8, 1]], "overlaps"),
    ([[1, 0, 2]], "no range"),
    ([[1, 4, -1]], "k must be"),
    ([[1, 4, 5]], "k must be"),
    ([[1, 4]], "each entry"),
    ([["a", 4, 1]], "whole numbers"),
])
def test_schedule_rules(schedule, problem):
    found = schedule_problem(schedule, 3)
    assert (found is None) if problem is None else (problem in found), found


def test_door_rules():
    def problems(*overrides):
        return concurrency_problems(compose(["eval.methods=[plain,vllm_ngram]", *overrides]).eval)

    assert problems() == [] and problems("eval.concurrency=[1,4,16]") == []
    assert "has no 1" in problems("eval.concurrency=[4,16]")[0]
    assert "repeats" in problems("eval.concurrency=[1,4,4]")[0]
    assert "vLLM would refuse it" in problems("eval.concurrency=[1,4]", "eval.load_schedule=[[2,4,1]]")[0]
    assert "no speculative vllm_* method" in concurrency_problems(
        compose(["eval.methods=[plain,ngram]", "eval.concurrency=[1,4]"]).eval)[0]


def test_every_load_keeps_its_requests_in_flight():
    """At load N the prompts are sent in turn until at least 4 x N requests: N stay in flight."""
    from specforge_lite.serving.vllm.load import sustained

    assert sustained(16, 1) == list(range(16))
    assert sustained(16, 16) == [i % 16 for i in range(64)]
    assert sustained(3, 2) == [0, 1, 2, 0, 1, 2, 0, 1]


def test_a_methods_batch1_engine_is_its_engine_at_load_where_their_k_agree():
    """`batch1_k`: vllm_plain's batch-1 engine is its k = 0 engine at load; a speculative method's
    (k = eval.num_draft_tokens) is its engine at that k where the loads sweep it; none without a load."""
    from specforge_lite.serving.vllm.load import batch1_k

    def k_of(name, *overrides):
        return batch1_k(name, compose(["eval.methods=[plain,vllm_ngram]", *overrides]).eval)

    load = ["eval.concurrency=[1,4]", "eval.num_draft_tokens=3"]
    assert k_of(PLAIN, *load) == 0 and k_of("vllm_ngram", *load) == 3
    assert k_of("vllm_ngram", *load, "eval.load_draft_tokens=2") is None  # the loads sweep k = 1, 2 only
    assert k_of("vllm_ngram", *load, "eval.load_draft_tokens=5") == 3
    assert k_of("vllm_ngram", "eval.num_draft_tokens=3") is None  # batch 1 alone: no load engine
    assert k_of("ngram", *load) is None  # our engine's method, not vLLM's
