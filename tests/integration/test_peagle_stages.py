"""P-EAGLE through the real CLI on the smoke target: every stage end to end (lossless
evaluate, speculators P-EAGLE export with its strict reload), a resumed run that ends with
the weights of an uninterrupted one (the drop-token sample depends on seed and batch only),
and a start from a trained EAGLE-3 folder."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from tests.conftest import run_cli

PEAGLE = ["+recipe=smoke_peagle"]


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared") / "samples"
    run_cli("sample", "+recipe=smoke", f"samples_dir={path}", check=True)
    return path


def test_peagle_recipe_runs_every_stage(samples, tmp_path):
    run_dir = tmp_path / "peagle"
    proc = run_cli("run", *PEAGLE, f"run_dir={run_dir}", f"samples_dir={samples}", check=True)
    assert "2 layers, 3 parallel depths" in proc.stdout + proc.stderr
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["methods"]["peagle"]["identical_to_plain"] is True
    export = json.loads((run_dir / "export" / "export.json").read_text())
    assert export["drafter"] == "peagle" and export["strict_reload"] == "passed"
    assert 1 <= export["speculative_tokens"] <= 3
    folder = run_dir / "export" / "speculators"
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and isinstance(config["mask_token_id"], int)
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    weights = load_file(str(folder / "model.safetensors"))
    assert {"mask_hidden", "embed_tokens.weight", "layers.1.self_attn.q_proj.weight"} <= set(weights)
    assert '"parallel_drafting": true' in (folder / "README.md").read_text()


def test_resume_and_start_from_eagle3(samples, tmp_path):
    args = [*PEAGLE, f"samples_dir={samples}", "train.max_steps=6", "train.checkpoint_every=3"]
    whole = tmp_path / "whole"
    run_cli("train", *args, f"run_dir={whole}", check=True)
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "train" / "checkpoints", resumed / "train" / "checkpoints")
    proc = run_cli("train", *args, f"run_dir={resumed}", check=True)
    assert "step 3 of 6" in proc.stdout + proc.stderr
    a = load_file(str(whole / "train" / "drafter" / "model.safetensors"))
    b = load_file(str(resumed / "train" / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[n] - b[n]).abs().max() == 0 for n in a if a[n].is_floating_point())
    # start from an EAGLE-3 drafter of the same target: its layer 0 and lm_head are copied
    eagle = tmp_path / "eagle3"
    run_cli("train", "+recipe=smoke", f"run_dir={eagle}", f"samples_dir={samples}", "train.max_steps=2",
            "drafter.draft_vocab_size=128", "drafter.aux_layer_ids=[1,3,4]", check=True)
    started = tmp_path / "started"
    run_cli("train", *PEAGLE, f"run_dir={started}", f"samples_dir={samples}", "train.max_steps=1", "train.lr=1e-12",
            f"drafter.init_from_eagle3={eagle / 'train' / 'drafter'}", check=True)
    e = load_file(str(eagle / "train" / "drafter" / "model.safetensors"))
    p = load_file(str(started / "train" / "drafter" / "model.safetensors"))
    assert (e["d2t"] == p["d2t"]).all()
    assert (e["layers.0.self_attn.q_proj.weight"] - p["layers.0.self_attn.q_proj.weight"]).abs().max() < 1e-6
