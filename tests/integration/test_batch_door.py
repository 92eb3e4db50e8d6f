"""The training's layout refused at the door (issue 38): a hub id for a sharded target, a token
budget below one sequence or above what the device holds, an unknown GPU for the MFU estimate.
Each: one line, exit status 2, nothing written (the pattern of test_bad_inputs.py)."""

from __future__ import annotations

import pytest

from tests.integration.test_bad_inputs import assert_user_error, cli, in_process, written

DOOR_CASES = [
    (["trainer.shard_target=true", "target.path=meta-llama/Llama-3.1-70B-Instruct"],
     "trainer.shard_target=true reads the target's safetensors files from a local directory, and "
     "target.path='meta-llama/Llama-3.1-70B-Instruct' is none: download it first (huggingface-cli download "
     "meta-llama/Llama-3.1-70B-Instruct --local-dir DIR) and give target.path=DIR"),
    (["train.tokens_per_step=100"], "train.tokens_per_step=100 is below one sequence of data.max_length=256: "
                                    "give at least 256 (or auto)"),
    (["train.tokens_per_step=lots"], "train.tokens_per_step='lots': allowed: a token count or auto"),
    # a device this small holds only a few of the smoke recipe's sequences (scale/sizing.py)
    (["train.tokens_per_step=65536", "device_memory_gib=0.05"],
     "train.tokens_per_step=65536 needs 256 sequences of 256 tokens per rank per micro-batch on 1 rank(s) with "
     "train.grad_accum=1; 51.2 MiB (device_memory_gib=0.05) holds 3: set train.grad_accum=86 or "
     "train.tokens_per_step=auto"),
    (["train.peak_tflops=b300"], "train.peak_tflops='b300': not a positive TFLOP/s figure nor a known GPU"),
]


@pytest.mark.parametrize("stage", ["train", "run"])
@pytest.mark.parametrize("overrides,message", DOOR_CASES, ids=[" ".join(c[0]) for c in DOOR_CASES])
def test_the_training_layout_is_refused_at_the_door(capsys, tmp_path, stage, overrides, message):
    code, err = cli(capsys, stage, "+recipe=smoke", f"run_dir={tmp_path}", *overrides)
    assert_user_error(code, err, message)
    assert err.count("error:") == 1
    assert written(tmp_path) == set()


def test_a_dry_run_sizes_a_hub_target_it_would_refuse_to_train(capsys, tmp_path):
    """The card sizes the 70B recipe anywhere (nothing downloaded): the hub id passes a dry run."""
    code = in_process("train", "+recipe=eagle_llama70b", "train.dry_run=true", f"run_dir={tmp_path}")
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "batch: train.tokens_per_step=auto" in out and "x 8 rank(s)" in out
