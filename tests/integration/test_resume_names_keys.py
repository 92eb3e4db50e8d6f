"""A checkpoint of other settings is refused naming the keys that changed, with both values: the
real CLI in this process, on the smoke recipe."""

from __future__ import annotations

import json

from tests.integration.test_bad_inputs import assert_user_error, cli

SMALL = ("+recipe=smoke", "data.max_samples=4", "sample.max_new_tokens=4", "train.checkpoint_every=1")


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_refused_resume_names_each_changed_key_with_both_values(capsys, tmp_path):
    run = tmp_path / "run"
    code, err = cli(capsys, "train", *SMALL, f"run_dir={run}", "train.max_steps=3")
    assert code == 0, err
    newest = run / "train" / "checkpoints" / "step-0000002"
    assert json.loads((newest / "state.json").read_text())["fingerprint_settings"]["train"]["max_steps"] == 3

    code, err = cli(capsys, "train", *SMALL, f"run_dir={run}", "train.max_steps=5")
    assert_user_error(code, err, f"checkpoint {newest} was written with train.max_steps=3 (now 5); resuming it")
    line = one_error_line(err)
    assert "learning-rate schedule" in line and "train.resume=false" in line, line

    code, err = cli(capsys, "train", *SMALL, f"run_dir={run}", "train.max_steps=3", "train.lr=5e-3")
    assert_user_error(code, err, "was written with train.lr=0.001 (now 0.005); resuming it would mix two runs")
    line = one_error_line(err)
    assert "learning-rate schedule" not in line and "train.resume=false" in line, line

    # several keys: each named, then "and N more" past the first few
    code, err = cli(capsys, "train", *SMALL, f"run_dir={run}", "train.max_steps=5", "train.lr=5e-3",
                    "train.seed=1", "train.weight_decay=0.1", "train.max_grad_norm=1.0")
    line = one_error_line(err)
    assert code == 2 and "train.lr=0.001 (now 0.005), train.max_grad_norm=0.5 (now 1.0)" in line, line
    assert "and 1 more" in line and "learning-rate schedule" not in line, line

    # a checkpoint from before checkpoints recorded their settings: the part that changed, as before
    state = json.loads((newest / "state.json").read_text())
    del state["fingerprint_settings"]
    (newest / "state.json").write_text(json.dumps(state))
    code, err = cli(capsys, "train", *SMALL, f"run_dir={run}", "train.max_steps=5")
    assert_user_error(code, err, "was written for other inputs: the training settings (train.*) changed since")
