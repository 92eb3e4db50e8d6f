"""eval.temperature as a list (issue 66): each temperature measured whole on the same prompts,
the report's tables at the first, and tau and speedup of every method by temperature."""

from __future__ import annotations

import json

from tests.integration.test_bad_inputs import in_process


def test_each_temperature_is_measured_and_reported(capsys, tmp_path):
    code = in_process("evaluate", "+recipe=smoke", f"run_dir={tmp_path}", "eval.methods=[plain,ngram]",
                      "eval.temperature=[0,0.7]", "eval.max_prompts=2", "eval.warmup=0", "eval.max_new_tokens=8",
                      "eval.plots=false", "eval.rounding_baseline=false", "eval.engine=static", "eval.cost_widths=4",
                      "eval.cost_repeats=1")
    said = "".join(capsys.readouterr())
    assert code in (0, None) and "Traceback" not in said, said[-3000:]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["settings"]["temperature"] == 0.0  # the report's own tables: the first temperature
    by_t = report["by_temperature"]
    assert list(by_t) == ["0.0", "0.7"]
    for figures in by_t.values():
        assert set(figures["methods"]) == {"plain", "ngram"}
        assert figures["methods"]["plain"]["speedup"] == 1.0 and figures["methods"]["ngram"]["tau"] >= 1.0
        assert figures["methods"]["ngram"]["speedup_ci"] is not None
    assert by_t["0.0"]["methods"]["ngram"]["identical_to_plain"] is True
    assert by_t["0.7"]["methods"]["ngram"]["identical_to_plain"] is None  # sampled: the law, not the tokens
    assert by_t["0.0"]["methods"]["ngram"]["tau"] == report["methods"]["ngram"]["tau"]
    assert "## By temperature" in (tmp_path / "eval" / "report.md").read_text()
