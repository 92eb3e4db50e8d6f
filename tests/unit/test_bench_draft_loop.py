"""The draft-loop measurement (`records/draft_loop.py`, what benchmarks/decoding/bench_draft_loop.py
records) on the tiny target: every method's time outside the target forward is split into
drafting and loop time, and the shares add up."""

from __future__ import annotations

import pytest

from specforge_lite.records import draft_loop
from tests.conftest import compose


def test_draft_loop_measures_time_outside_the_forward(tiny_target):
    model, _ = tiny_target
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]]
    d = draft_loop.measure(model, prompts, tokens=12, k=3, engine="static",
                           drafter_cfg=compose(["+recipe=eagle_smollm2"]).drafter)
    assert set(d["methods"]) == {"plain", "ngram", "eagle3"} and d["isolated_forward_ms"] > 0
    for name, m in d["methods"].items():
        assert m["outside_forward_ms_per_step"] >= 0 and m["forward_ms_per_step"] > 0, name
        # outside the forward = drafting + the loop's own time (the loop's part clipped at zero per answer)
        assert m["outside_forward_ms_per_step"] == pytest.approx(m["draft_ms_per_step"] + m["loop_ms_per_step"],
                                                                 rel=0.05, abs=0.05), name
        assert 0 <= m["draft_share"] <= 1 and m["draft_share"] + m["verify_share"] <= 1 + 1e-9, name
    assert d["methods"]["plain"]["draft_share"] == 0
    assert d["methods"]["plain"]["decoding_ms_per_token_over_isolated_forward"] > 0
    text = draft_loop.markdown({**d, "machine": "test", "command": "cmd", "num_prompts": 2, "tokens": 12,
                                "k": 3, "dtype": "float32"})
    assert "| eagle3 |" in text and "drafting share" in text
