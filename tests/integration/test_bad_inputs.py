"""Bad inputs are stopped at the door: one parametrised test per category of issue 13.

Every case runs the real CLI (`specforge_lite.__main__.main`, in this process: no new
interpreter per case) on the smoke recipe and the tiny random Llama, and checks the exit
status (2), the message, and that nothing was written or lost. One subprocess test proves
the status and the absence of a traceback from a real interpreter.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from specforge_lite.__main__ import main
from tests.conftest import REPO, compose, run_cli

SMOKE_DATA = REPO / "data" / "smoke_conversations.jsonl"


def cli(capsys, *args: str) -> tuple[int, str]:
    """Run `python -m specforge_lite ARGS` in this process; returns (exit status, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as done:
        code = done.code
    return code, capsys.readouterr().err


def written(run_dir: Path) -> set[str]:
    """Top-level folders a run wrote under run_dir (Hydra's own logs/ aside)."""
    return {p.name for p in run_dir.iterdir() if p.name != "logs"} if run_dir.exists() else set()


def digest(folder: Path) -> dict[str, str]:
    """Content hash of every file under `folder` (logs aside): proves nothing was lost or changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "logs" not in p.relative_to(folder).parts}


def assert_user_error(code: int, err: str, message: str) -> None:
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err, err


# --------------------------------------------------------------------------- 1. ranges

RANGE_CASES = [
    ("sample", ["sample.batch_size=0"], "sample.batch_size=0: must be >= 1"),
    ("sample", ["sample.batch_size=-1"], "sample.batch_size=-1: must be >= 1"),
    ("sample", ["sample.shard_size=0"], "sample.shard_size=0: must be >= 1"),
    ("sample", ["sample.max_new_tokens=0"], "sample.max_new_tokens=0: must be >= 1"),
    ("sample", ["data.max_length=0"], "data.max_length=0: must be >= 2"),
    ("sample", ["data.max_samples=-1"], "data.max_samples=-1: must be >= 1"),
    ("sample", ["data.heldout_fraction=1.0"], "data.heldout_fraction=1.0: must be < 1.0"),
    ("sample", ["sample.top_p=0"], "sample.top_p=0.0: must be > 0.0"),
    ("train", ["train.batch_size=-1"], "train.batch_size=-1: must be >= 1"),
    ("train", ["train.lr=0"], "train.lr=0.0: must be > 0.0"),
    ("train", ["train.epochs=0"], "train.epochs=0.0: must be > 0.0"),
    ("train", ["train.max_steps=-5"], "train.max_steps=-5: must be >= 1"),
    ("train", ["train.grad_accum=0"], "train.grad_accum=0: must be >= 1"),
    ("train", ["train.checkpoint_every=-1"], "train.checkpoint_every=-1: must be >= 0 (0 disables)"),
    ("train", ["train.keep_checkpoints=0"], "train.keep_checkpoints=0: must be >= 1"),
    ("train", ["drafter.draft_vocab_size=0"], "drafter.draft_vocab_size=0: must be >= 1"),
    ("train", ["drafter.ttt_steps=0"], "drafter.ttt_steps=0: must be >= 1"),
    ("train", ["drafter.aux_layer_ids=[1,3]"], "drafter.aux_layer_ids=[1, 3]: needs exactly 3 values, got 2"),
    ("train", ["drafter.aux_layer_ids=[1,3,-1]"], "every value must be >= 0"),
    ("evaluate", ["eval.max_new_tokens=0"], "eval.max_new_tokens=0: must be >= 1"),
    ("evaluate", ["eval.ngram_min=3", "eval.ngram_max=2"], "eval.ngram_min=3 is above eval.ngram_max=2"),
    ("evaluate", ["eval.methods=[plain,eagle4]"], "unknown ['eagle4']"),
    ("sample", ["target.device=tpu"], "target.device='tpu': allowed: auto, cpu, cuda or cuda:N"),
    ("sample", ["sample.rank=2", "sample.world_size=2"], "the rank must be below the world size"),
    # the second pass, against the target's own config (the tiny Llama has 6 layers)
    ("train", ["drafter.aux_layer_ids=[1,3,6]"], "the target has num_hidden_layers=6, so every value must be below 6"),
    ("run", ["drafter.aux_layer_ids=[1,3,60]"], "must be below 6"),
    ("train", ["drafter.name=draft_model", "drafter.student_layers=6"], "drafter.student_layers=6: the target has"),
]


@pytest.mark.parametrize("stage,overrides,message", RANGE_CASES, ids=[" ".join(c[1]) for c in RANGE_CASES])
def test_out_of_range_settings_are_refused_before_anything_runs(capsys, tmp_path, stage, overrides, message):
    code, err = cli(capsys, stage, "+recipe=smoke", f"run_dir={tmp_path}", *overrides)
    assert_user_error(code, err, message)
    assert written(tmp_path) == set()


def test_every_recipe_passes_validation_and_zero_disables_checkpoints():
    from specforge_lite.validate import config_problems

    for recipe in sorted(p.stem for p in (REPO / "conf" / "recipe").glob("*.yaml")):
        assert config_problems(compose([f"+recipe={recipe}"])) == [], recipe
    assert config_problems(compose(["+recipe=smoke", "train.checkpoint_every=0"])) == []


def test_a_user_error_from_a_real_interpreter_is_one_line_and_status_2(tmp_path):
    proc = run_cli("train", "+recipe=smoke", f"run_dir={tmp_path}", "train.batch_size=-1", "+train.lr_typo=1")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0] == "error: 2 invalid settings:" and len(lines) == 3, proc.stderr
    assert written(tmp_path) == set()


# --------------------------------------------------------------------------- 2. +key=value

PLUS_CASES = [
    (["+sample.foo=1"], "sample.foo=1: unknown key (SampleConfig has no such field)"),
    (["+bar=2"], "bar=2: unknown key (Config has no such field)"),
    (["+drafter.x.y=3"], "drafter.x={'y': 3}: unknown key (DrafterConfig has no such field)"),
    (["+train.lr_typo=1"], "did you mean train.lr?"),
    (["+eval.drafter_dirs.eagle=x"], "did you mean eval.drafter_dirs.eagle3?"),
]


@pytest.mark.parametrize("overrides,message", PLUS_CASES, ids=[c[0][0] for c in PLUS_CASES])
def test_plus_keys_outside_the_schema_are_refused(capsys, tmp_path, overrides, message):
    code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={tmp_path}", *overrides)
    assert_user_error(code, err, message)
    assert written(tmp_path) == set()
