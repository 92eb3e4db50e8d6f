"""`make gpu-check` on a CPU machine: its no-GPU path, the results file it writes step by step
(driven with real step functions that succeed, fail and run out of memory), the overrides its
steps pass compose with the real config, and the projection benchmark at a tiny shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specforge_lite.measurement.metrics import expected_tokens_per_step
from specforge_lite.records import gpu_check, gpu_section, projection
from tests.conftest import REPO, compose


def test_without_cuda_it_says_so_in_one_line_and_writes_nothing(tmp_path):
    results = {p: p.stat().st_mtime_ns for p in (REPO / "benchmarks" / "results").glob("*")}
    done = subprocess.run(["make", "-s", "gpu-check", f"PY={sys.executable}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA device" in lines[0], lines
    assert {p: p.stat().st_mtime_ns for p in (REPO / "benchmarks" / "results").glob("*")} == results


def test_an_unknown_step_is_one_line_exit_2():
    done = subprocess.run([sys.executable, "-m", "specforge_lite", "gpu-check", "--steps", "tests,typo"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: unknown gpu-check step(s) typo")


def test_results_file_keeps_what_was_measured_when_a_step_fails(tmp_path):
    path = tmp_path / "gpu_check_test.json"
    seen = []

    def measures(record, doc):
        record["tokens_per_s"] = 123.0
        seen.append(json.loads(path.read_text())["steps"]["measures"]["status"])  # written before it runs

    def runs_out_of_memory(record, doc):
        record["batch1_tokens_per_s"] = 50.0  # measured before the larger batch failed
        torch.empty(1).new_empty(2 ** 62)  # a real allocation failure on the CPU ("not enough memory")

    def oom_error(record, doc):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def reads_earlier(record, doc):
        record["earlier"] = doc["steps"]["measures"]["tokens_per_s"]

    steps = [gpu_check.Step("measures", measures), gpu_check.Step("allocates", runs_out_of_memory),
             gpu_check.Step("oom", oom_error), gpu_check.Step("reads_earlier", reads_earlier)]
    doc = gpu_check.run_steps(steps, path, {"gpu": "test"})
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(doc, default=str))
    assert seen == ["running"]
    assert on_disk["steps_planned"] == ["measures", "allocates", "oom", "reads_earlier"]
    assert on_disk["failed_steps"] == ["allocates", "oom"] and on_disk["complete"] is False
    steps_on_disk = on_disk["steps"]
    assert steps_on_disk["measures"]["status"] == "ok" and steps_on_disk["measures"]["tokens_per_s"] == 123.0
    failed = steps_on_disk["allocates"]
    assert failed["status"] == "failed" and failed["batch1_tokens_per_s"] == 50.0 and failed["error"]
    assert steps_on_disk["oom"]["out_of_memory"] is True and "CUDA out of memory" in steps_on_disk["oom"]["error"]
    assert steps_on_disk["reads_earlier"] == {"status": "ok", "earlier": 123.0,
                                              "date": steps_on_disk["reads_earlier"]["date"],
                                              "run": steps_on_disk["measures"]["run"],
                                              "seconds": steps_on_disk["reads_earlier"]["seconds"]}
    for record in steps_on_disk.values():
        assert isinstance(record["seconds"], float)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_rerun_keeps_the_other_steps_and_is_complete_only_with_every_step(tmp_path, monkeypatch):
    """`--keep`: the earlier records of the steps not run now stay, with their dates; a step run
    again replaces its record; `complete` needs every step of STEPS recorded and ok."""
    path = tmp_path / "gpu_check_test.json"
    monkeypatch.setattr(gpu_check, "STEPS", ("first", "second", "third"))
    monkeypatch.setattr(gpu_check, "source_state", lambda: {"commit": "a" * 40, "tree_clean": True})

    def ok(record, doc):
        record["value"] = 1

    def fails(record, doc):
        raise gpu_check.StepFailed("time limit of 1 s reached")

    doc = gpu_check.run_steps([gpu_check.Step("first", ok), gpu_check.Step("second", fails)], path, {"gpu": "g"})
    assert doc["failed_steps"] == ["second"] and not doc["complete"]
    first = dict(doc["steps"]["first"], date="2026-11-26 19:00")  # an earlier run's record keeps its date
    doc = gpu_check.run_steps([gpu_check.Step("second", ok)], path, {"gpu": "g"}, {"first": first})
    assert list(doc["steps"]) == ["first", "second"] and doc["failed_steps"] == []
    assert doc["steps"]["first"] == first and doc["steps"]["second"]["value"] == 1
    assert not doc["complete"]  # "third" was never run
    doc = gpu_check.run_steps([gpu_check.Step("third", ok)], path, {"gpu": "g"}, doc["steps"])
    assert doc["complete"] and json.loads(path.read_text())["complete"]
    doc = gpu_check.run_steps([gpu_check.Step("first", fails)], path, {"gpu": "g"}, doc["steps"])
    assert doc["failed_steps"] == ["first"] and not doc["complete"]


def test_steps_of_other_code_or_a_missing_tool_are_not_complete(tmp_path, monkeypatch):
    """Issue 52: a record joined steps from runs on different commits, and counted the vLLM probe
    that found no vLLM as ok, and said `complete: true`. Each step now names its run; complete
    needs one commit on a clean tree, and a step that cannot run here is `skipped`."""
    path = tmp_path / "gpu_check_test.json"
    monkeypatch.setattr(gpu_check, "STEPS", ("first", "second"))

    def ok(record, doc):
        record["value"] = 1

    def no_tool(record, doc):
        raise gpu_check.StepSkipped("no vLLM on this machine")

    monkeypatch.setattr(gpu_check, "source_state", lambda: {"commit": "a" * 40, "tree_clean": True})
    doc = gpu_check.run_steps([gpu_check.Step("first", ok)], path, {"gpu": "g", "date": "d1"})
    monkeypatch.setattr(gpu_check, "source_state", lambda: {"commit": "b" * 40, "tree_clean": True})
    doc = gpu_check.run_steps([gpu_check.Step("second", ok)], path, {"gpu": "g", "date": "d2"}, doc["steps"])
    assert not doc["complete"] and [r["steps"] for r in doc["runs"]] == [["first"], ["second"]]
    said = gpu_section.completeness(doc)
    assert said.startswith("no (steps of different or unknown commits (d1, aaaaaaaaaa: first; d2, bbbbbbbbbb: second")
    doc = gpu_check.run_steps([gpu_check.Step("first", ok)], path, {"gpu": "g", "date": "d3"}, doc["steps"])
    assert doc["complete"]  # two runs of one commit
    assert gpu_section.completeness(doc) == "yes (steps from 2 runs of one commit: d3, bbbbbbbbbb: first; " \
                                           "d2, bbbbbbbbbb: second)"
    doc = gpu_check.run_steps([gpu_check.Step("second", no_tool)], path, {"gpu": "g", "date": "d4"}, doc["steps"])
    assert doc["steps"]["second"]["status"] == "skipped" and doc["skipped_steps"] == ["second"]
    assert not doc["complete"] and not doc["failed_steps"]
    assert gpu_section.completeness(doc).startswith("no (skipped: second")


def test_a_failing_child_names_its_last_line(tmp_path):
    record = {}
    with pytest.raises(gpu_check.StepFailed, match="CUDA out of memory"):
        gpu_check._child([sys.executable, "-c", "import sys; print('step 1 ok'); "
                          "sys.exit('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1 GiB')"],
                         60, record)
    assert record["log_tail"][0] == "step 1 ok"
    with pytest.raises(gpu_check.StepFailed, match="time limit of 1 s"):
        gpu_check._child([sys.executable, "-c", "import time; time.sleep(30)"], 1, {})


def test_step_overrides_compose_with_the_real_config(tmp_path):
    steps = gpu_check.TRAIN_STEPS["train_batched"]
    cfg = compose(["stage=train", *gpu_check.train_overrides(tmp_path / "t", ["train.tokens_per_step=auto"], "cpu",
                                                             steps)])
    assert cfg.train.max_steps == steps and cfg.train.use_samples is False
    assert steps // cfg.train.log_every == 5  # tokens/s leaves out the first window (warm-up)
    cfg = compose(["stage=evaluate", *gpu_check.eval_overrides(tmp_path / "e", "bfloat16", "24", "auto",
                                                               str(tmp_path / "d"), "cpu")])
    assert list(cfg.eval.methods) == ["plain", "eagle3", "ngram"] and cfg.target.dtype == "bfloat16"
    assert cfg.eval.drafter_dirs.eagle3 == str(tmp_path / "d")
    assert sum(gpu_check.STEP_LIMITS_S.values()) <= 9 * 60
    assert gpu_check.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


def test_summarise_report_keeps_the_verdicts():
    report = {"dtype": "bfloat16", "settings": {"engine": {"used": "compiled"}},
              "forward_costs": {"ms_by_num_tokens": {"1": 1.2, "4": 1.5}},
              "methods": {"eagle3": {"tau": 1.4, "speedup": 0.9, "speedup_ci": [0.8, 1.0], "lossless": True,
                                     "identity": {"identical": 15, "rounding": 9, "mismatch": 0, "answers": 24,
                                                  "text": "24/24: 15 identical, 9 rounding, 0 mismatch"}}}}
    out = gpu_check.summarise_report(report)
    assert out["methods"]["eagle3"]["identity"]["text"] == "24/24: 15 identical, 9 rounding, 0 mismatch"
    assert out["forward_ms_by_width"] == {"1": 1.2, "4": 1.5} and out["engine"] == {"used": "compiled"}


def test_projection_at_a_tiny_shape():
    stated = projection.stated_profile()
    assert expected_tokens_per_step(stated, 3) == pytest.approx(3.0, abs=1e-6)
    payload = projection.project(projection.SMALL, "cpu", "float32", context=32, repeats=1,
                                 profiles={"stated": stated, "demo_measured": projection.demo_profile()})
    assert "projection" in payload["label"] and payload["device"].startswith("cpu")
    tiny = payload["shapes"]["tiny"]
    assert sorted(tiny["forward_ms_by_width"]) == list(range(1, 9))
    assert sorted(tiny["drafter_ms_by_k"]) == list(range(1, 8))
    assert all(ms > 0 for ms in [*tiny["forward_ms_by_width"].values(), *tiny["drafter_ms_by_k"].values()])
    stated_table = tiny["projections"]["stated"]["table"]
    assert [row["k"] for row in stated_table] == list(range(1, 8))
    assert stated_table[2]["expected_tokens_per_step"] == pytest.approx(3.0, abs=1e-6)
    assert len(tiny["projections"]["demo_measured"]["table"]) == 3  # the demo decoded at k = 3
    assert "(projection)" in projection.markdown(payload, "cmd")


def test_docs_show_a_gpu_row_when_a_results_file_exists(tmp_path, monkeypatch):
    from specforge_lite.records import docs, results

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    assert docs.gpu_rows() == []
    methods = {"eagle3": {"tau": 1.44, "tau_ci": [1.4, 1.5], "speedup": 1.3, "speedup_ci": [1.2, 1.4],
                          "tokens_per_s": 500.0, "identity": {"text": "24/24: 15 identical, 9 rounding, 0 mismatch"}}}
    gpu_check.write(tmp_path / "gpu_check_nvidia_h100.json", {
        "gpu": "NVIDIA H100", "date": "2026-11-26 10:00", "commit": "0123456789", "failed_steps": ["projection"],
        "steps": {"eval_bfloat16": {"status": "ok", "engine": {"used": "compiled"}, "methods": methods}}})
    rows = docs.gpu_rows()
    # an earlier file's sentence is said again without calling answers within rounding identical
    assert len(rows) == 1 and "NVIDIA H100" in rows[0] and "no mismatch 24/24 (15 identical, 9 within rounding)" in rows[0]
    assert "1.30x [1.20, 1.40]" in rows[0] and "`gpu_check_nvidia_h100`" in rows[0]


def test_a_stage_child_runs_the_cli_and_names_its_error(monkeypatch):
    """`_stage` runs the real CLI in a child (the one that reports peak memory): a bad recipe is
    the CLI's one-line error, recorded as the step's failure."""
    monkeypatch.setenv("GPU_CHECK_ARGS", "")
    record = {}
    with pytest.raises(gpu_check.StepFailed, match="no_such_recipe"):
        gpu_check._stage(["train", "+recipe=no_such_recipe"], 120, record)
    assert record["log_tail"] and "peak_memory_gib" not in record  # no CUDA: no peak to report


def test_the_benchmarks_section_shows_every_step_and_the_verdicts():
    methods = {"eagle3": {"tau": 1.43, "tau_ci": [1.39, 1.48], "speedup": 0.89, "speedup_ci": [0.57, 1.32],
                          "tokens_per_s": 269.0, "draft_time_share": 0.42,
                          "identity": {"text": "24/24: 9 identical, 15 rounding, 0 mismatch"}}}
    doc = {"gpu": "NVIDIA H200", "complete": False, "failed_steps": ["eval_float32"], "limits_s": {"tests": 80},
           "steps": {"tests": {"status": "ok", "date": "2026-11-26 19:04", "seconds": 67.7},
                     "train_batched": {"status": "ok", "overrides": ["train.tokens_per_step=auto"], "steps": 20,
                                       "tokens_per_s": 204160.5, "peak_memory_gib": 92.81},
                     "eval_bfloat16": {"status": "ok", "dtype": "bfloat16", "prompts": 24, "methods": methods,
                                       "engine": {"used": "compiled"}},
                     "eval_float32": {"status": "failed", "dtype": "float32"}}}
    text = gpu_section.section("gpu_check_nvidia_h200", doc)
    assert "Complete: no (failed: eval_float32; recorded before each step named its run" in text
    assert "| tests | ok | 2026-11-26 19:04 | 67.7 | 80 |" in text
    assert "| train_batched | train.tokens_per_step=auto | 20 | 204,160 | 92.81 |" in text
    assert "| bfloat16 | eagle3 | 1.43 [1.39, 1.48] | 0.89x [0.57, 1.32] | 269 | 42% | " \
           "no mismatch 24/24 (9 identical, 15 within rounding) |" in text
