"""A bf16 target, the default on GPUs, through every stage for every drafter (issue 52): the
export after a bf16 target once stopped on a dtype error in EAGLE-3's reload check. Each drafter's
smoke recipe runs sample, train, evaluate and export on the tiny Llama loaded in bf16, at the
smallest settings; the drafter decodes identically to plain and the export's strict reload passes."""

from __future__ import annotations

import json

import pytest

from specforge_lite.drafters.registry import DRAFTERS
from tests.conftest import run_cli
from tests.unit.test_export_bf16 import smoke_recipe

SMALL = ["data.max_samples=4", "sample.max_new_tokens=8", "train.max_steps=2", "train.checkpoint_every=0",
         "eval.warmup=0", "eval.cost_repeats=1", "eval.plots=false", "eval.bootstrap.resamples=100",
         "eval.max_prompts=2"]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a tiny model: two threads only contend with the other worker


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_every_stage_runs_every_drafter_on_a_bf16_target(kind, tmp_path):
    run_dir = tmp_path / "run"
    run_cli("run", f"+recipe={smoke_recipe(kind)}", "target.dtype=bfloat16", f"run_dir={run_dir}",
            f"eval.methods=[plain,{kind}]", *SMALL, check=True, timeout=900)
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["dtype"] == "bfloat16", report["dtype"]
    assert {m: e["identical_to_plain"] for m, e in report["methods"].items()} == {"plain": True, kind: True}
    export = json.loads((run_dir / "export" / "export.json").read_text())
    assert export["drafter"] == kind and export["strict_reload"] == "passed", export
