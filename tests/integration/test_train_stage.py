"""The train stage end to end on the smoke recipe: outputs, offline features, and a
SIGKILL mid-run that resumes to the same weights as an uninterrupted run."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import pytest
from safetensors.torch import load_file

from specforge_lite.training.checkpoints import latest_checkpoint
from tests.conftest import REPO, run_cli


# longer answers than the smoke recipe's; every train call says so too (train refuses samples
# made with other sample.* settings)
SAMPLED = "sample.max_new_tokens=48"


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sampled")
    run_cli("sample", "+recipe=smoke", f"run_dir={run_dir}", SAMPLED, check=True)
    return run_dir


def fresh_run(sampled, tmp_path, name):
    run_dir = tmp_path / name
    shutil.copytree(sampled, run_dir)
    return run_dir


def weights(run_dir):
    return load_file(str(run_dir / "train" / "drafter" / "model.safetensors"))


def test_train_writes_drafter_metrics_and_checkpoints(sampled, tmp_path):
    run_dir = fresh_run(sampled, tmp_path, "a")
    run_cli("train", "+recipe=smoke", SAMPLED, f"run_dir={run_dir}", check=True)
    out = run_dir / "train"
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["drafter"] == "eagle3" and config["draft_vocab_size"] == 128
    assert config["aux_layer_ids"] == [1, 3, 4] and config["trained_steps"] == 12
    assert set(weights(run_dir)) >= {"fc.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight", "d2t", "t2d"}
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert len(history) == 6 and history[-1]["loss"] < history[0]["loss"]  # it learns something
    assert {"loss", "acc", "simulated_tau", "tokens_per_s", "lr", "target_share"} <= set(history[0])
    assert latest_checkpoint(out / "checkpoints").name == "step-0000008"
    assert (out / "learning_curve.png").stat().st_size > 0
    assert [h["tokens_seen"] for h in history] == sorted({h["tokens_seen"] for h in history})
    assert (out / "config.yaml").exists() and (out / "versions.json").exists()


def test_offline_mode_matches_online_closely(sampled, tmp_path):
    online = fresh_run(sampled, tmp_path, "on")
    offline = fresh_run(sampled, tmp_path, "off")
    run_cli("train", "+recipe=smoke", SAMPLED, f"run_dir={online}", check=True)
    proc = run_cli("train", "+recipe=smoke", SAMPLED, f"run_dir={offline}", "train.mode=offline", check=True)
    assert "about" in proc.stdout + proc.stderr and "GB on disk" in proc.stdout + proc.stderr
    assert list((offline / "train" / "features").glob("shard-*.safetensors"))
    a, b = weights(online), weights(offline)
    # features are stored in bf16, so the runs differ by rounding only
    for name in a:
        assert (a[name].float() - b[name].float()).abs().max() < 5e-2, name


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_kill_and_resume_gives_identical_weights(sampled, tmp_path, optimizer, rank_python):
    """Killed (SIGKILL, through rank_python's shim: the forked process's session is killed) once
    step 10's checkpoint is written, well before step 60; resumed, the same weights as a clean run."""
    args = ["train.max_steps=60", "train.checkpoint_every=5", "train.log_every=50", f"train.optimizer={optimizer}"]
    killed = fresh_run(sampled, tmp_path, "killed")
    proc = subprocess.Popen([rank_python, "-m", "specforge_lite", "train", "+recipe=smoke", SAMPLED,
                             f"run_dir={killed}", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = killed / "train" / "checkpoints"
    deadline = time.time() + 300
    while latest_checkpoint(ckpts) is None or latest_checkpoint(ckpts).name < "step-0000010":
        assert proc.poll() is None, "training ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = latest_checkpoint(ckpts).name
    assert not (killed / "train" / "drafter").exists() and at_kill < "step-0000060"
    resumed = run_cli("train", "+recipe=smoke", SAMPLED, f"run_dir={killed}", *args, check=True)
    assert "resuming from" in resumed.stdout + resumed.stderr

    clean = fresh_run(sampled, tmp_path, "clean")
    run_cli("train", "+recipe=smoke", SAMPLED, f"run_dir={clean}", *args, check=True)
    got, want = weights(killed), weights(clean)
    assert set(got) == set(want)
    for name in want:
        assert (got[name] == want[name]).all(), name


def test_wandb_offline_run_is_recorded(sampled, tmp_path):
    run_dir = fresh_run(sampled, tmp_path, "wandb")
    run_cli("train", "+recipe=smoke", SAMPLED, f"run_dir={run_dir}", "train.tracker=wandb", "train.max_steps=4",
            "train.log_every=2", check=True)
    runs = list((run_dir / "train" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), "an offline wandb run with its data file"


def test_a_finished_run_is_not_trained_again_unless_settings_change(sampled, tmp_path):
    run_dir = fresh_run(sampled, tmp_path, "again")
    args = ["+recipe=smoke", f"run_dir={run_dir}", SAMPLED, "train.max_steps=4", "train.checkpoint_every=0"]
    run_cli("train", *args, check=True)
    before = weights(run_dir)
    proc = run_cli("train", *args, "train.log_every=1", check=True)  # logging does not change the weights
    assert "already holds a eagle3 drafter trained with these settings" in proc.stdout + proc.stderr
    proc = run_cli("train", *args, "train.lr=5e-3", check=True)
    assert "already holds" not in proc.stdout + proc.stderr
    after = weights(run_dir)
    assert any(not (before[k] == after[k]).all() for k in before)
    # a truncated drafter (a copy cut short) is not a trained one: it is trained again, saying why
    model = run_dir / "train" / "drafter" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-1000])
    proc = run_cli("train", *args, "train.lr=5e-3", check=True)
    assert "already holds" not in proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    assert f"{model}: " in said and "truncated; training again replaces it" in said
    assert weights(run_dir).keys() == after.keys()


def test_source_conversations_only_never_touch_the_sample_stage(tmp_path):
    """train.use_samples=false trains on source conversations without running or reading samples."""
    from tests.conftest import run_cli

    samples = tmp_path / "no_samples_here"
    proc = run_cli("train", "+recipe=smoke", f"run_dir={tmp_path / 'run'}", f"samples_dir={samples}",
                   "train.use_samples=false", "train.source_conversations=6", "train.max_steps=2", check=True)
    assert not samples.exists()
    assert "training on 0 sampled + 6 source conversations" in proc.stdout + proc.stderr
    assert (tmp_path / "run" / "train" / "drafter" / "model.safetensors").exists()


def test_evaluate_says_when_the_targets_weights_changed_after_training(tmp_path, caplog):
    """Issue 52: a trained drafter records the target weights it was trained for (by content);
    evaluate with the weights changed in place since says so, naming the drafter's folder, and
    says which value of a training setting given on its command line it used."""
    from safetensors.torch import save_file

    from specforge_lite.drafters.registry import say_what_the_trained_folder_decides
    from tests.conftest import compose
    from specforge_lite.targets.loading import resolve_target_path

    target = tmp_path / "target"
    shutil.copytree(resolve_target_path("builtin:tiny-llama"), target)
    drafter = tmp_path / "run" / "train" / "drafter"
    args = ["+recipe=smoke", f"run_dir={tmp_path / 'run'}", f"target.path={target}", "train.use_samples=false",
            "train.source_conversations=4", "train.max_steps=1", "train.checkpoint_every=0", "train.tracker=none"]
    run_cli("train", *args, check=True)
    say_what_the_trained_folder_decides(drafter, "ours", compose(["stage=evaluate", *args]))  # the same weights
    assert "trained for other weights" not in caplog.text
    tensors = load_file(str(target / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    # and a training setting on evaluate's command line is said to be the trained folder's, not the line's
    changed = run_cli("evaluate", *args, "eval.methods=[plain,eagle3]", "eval.max_prompts=1", "eval.max_new_tokens=8",
                      "eval.plots=false", "eval.warmup=0", "drafter.norm_before_residual=false", check=True)
    said = changed.stdout + changed.stderr
    assert f"{drafter} was trained for other weights than the target's at {target} now" in said
    assert (f"drafter.norm_before_residual=false is a training setting: the drafter in {drafter} was trained with "
            "norm_before_residual=true, which is used") in said
