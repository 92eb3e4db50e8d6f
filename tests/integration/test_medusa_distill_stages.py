"""Medusa and draft-model distillation through the real CLI on the smoke target: every
stage end to end, resume from a checkpoint, and one evaluate run comparing the trained
drafters of several runs."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from tests.conftest import run_cli

MEDUSA = ["+recipe=smoke_medusa"]
DISTILL = ["+recipe=smoke_distilled"]


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared") / "samples"
    run_cli("sample", "+recipe=smoke", f"samples_dir={path}", check=True)
    return path


def test_medusa_recipe_runs_every_stage(samples, tmp_path):
    run_dir = tmp_path / "medusa"
    proc = run_cli("run", *MEDUSA, f"run_dir={run_dir}", f"samples_dir={samples}", check=True)
    assert "3 heads x 1 residual blocks, draft vocab 128" in proc.stdout + proc.stderr
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["methods"]["medusa"]["identical_to_plain"] is True
    assert report["recommendation"]["deploy"] in report["methods"]
    export = json.loads((run_dir / "export" / "export.json").read_text())
    assert export["drafter"] == "medusa" and export["strict_reload"] == "passed"
    assert 1 <= export["speculative_tokens"] <= 3
    config = json.loads((run_dir / "export" / "medusa" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["truncated_vocab_size"] == 128
    assert "0.33" in (run_dir / "export" / "medusa" / "README.md").read_text()
    assert "export" in proc.stdout and "medusa" in proc.stdout


def test_lora_distillation_runs_every_stage(samples, tmp_path):
    run_dir = tmp_path / "distill"
    proc = run_cli("run", *DISTILL, f"run_dir={run_dir}", f"samples_dir={samples}",
                   "drafter.lora=true", "drafter.lora_rank=4", check=True)
    assert "with LoRA adapters" in proc.stdout + proc.stderr
    history = json.loads((run_dir / "train" / "metrics.json").read_text())["history"]
    assert history[-1]["loss"] < history[0]["loss"]
    weights = load_file(str(run_dir / "train" / "drafter" / "model.safetensors"))
    assert not any("lora" in name for name in weights)  # merged at save
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["methods"]["distilled"]["identical_to_plain"] is True
    export = json.loads((run_dir / "export" / "export.json").read_text())
    assert export["drafter"] == "distilled" and export["strict_reload"] == "passed"
    assert (run_dir / "export" / "draft_model" / "tokenizer.json").exists()


@pytest.mark.parametrize("drafter", [MEDUSA, DISTILL], ids=["medusa", "distilled"])
def test_resume_from_checkpoint_ends_with_the_same_weights(samples, tmp_path, drafter):
    args = [*drafter, f"samples_dir={samples}", "train.max_steps=6", "train.checkpoint_every=3"]
    whole = tmp_path / "whole"
    run_cli("train", *args, f"run_dir={whole}", check=True)
    # a second run that finds the step-3 checkpoint of the first and trains steps 4-6 again
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "train" / "checkpoints", resumed / "train" / "checkpoints")
    proc = run_cli("train", *args, f"run_dir={resumed}", check=True)
    assert "resuming from" in proc.stdout + proc.stderr and "step 3 of 6" in proc.stdout + proc.stderr
    a = load_file(str(whole / "train" / "drafter" / "model.safetensors"))
    b = load_file(str(resumed / "train" / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name].float() - b[name].float()).abs().max() == 0, name
    # a checkpoint of other settings is not silently continued
    shutil.rmtree(resumed / "train" / "drafter")
    proc = run_cli("train", *args, f"run_dir={resumed}", "train.lr=1e-2")
    assert proc.returncode == 2 and "was written with train.lr=" in proc.stderr and "(now 0.01)" in proc.stderr


def test_one_evaluate_compares_drafters_of_several_runs(samples, tmp_path):
    dirs = {}
    for name, extra in (("eagle3", ["+recipe=smoke"]), ("medusa", MEDUSA), ("distilled", DISTILL)):
        run_dir = tmp_path / name
        run_cli("train", *extra, f"run_dir={run_dir}", f"samples_dir={samples}",
                "train.max_steps=4", check=True)
        dirs[name] = run_dir / "train" / "drafter"
    compare = tmp_path / "compare"
    run_cli("evaluate", "+recipe=smoke", f"run_dir={compare}", f"samples_dir={samples}", "eval.truncate_layers=2",
            "eval.methods=[plain,ngram,untrained_draft,distilled,medusa,eagle3]",
            *(f"eval.drafter_dirs.{k}={v}" for k, v in dirs.items()),
            check=True)
    report = json.loads((compare / "eval" / "report.json").read_text())
    assert list(report["methods"]) == ["plain", "ngram", "untrained_draft", "distilled", "medusa", "eagle3"]
    assert all(m["identical_to_plain"] for m in report["methods"].values())
    markdown = (compare / "eval" / "report.md").read_text()
    assert "## Recommendation" in markdown and f"Deploy **{report['recommendation']['deploy']}**" in markdown
    # a folder holding another kind of drafter is named in the error
    proc = run_cli("evaluate", "+recipe=smoke", f"run_dir={compare}", f"samples_dir={samples}",
                   "eval.methods=[plain,medusa]", "eval.best_k_method=medusa",
                   f"eval.drafter_dirs.medusa={dirs['eagle3']}")
    assert proc.returncode == 2 and "holds a eagle3 drafter, not medusa" in proc.stderr
