"""A run succeeds only if its output is good, reuses only what is still what it was made from,
and counts what it trained on truly; each with a real fault, through the real CLI on the tiny
target: a learning rate that makes the loss NaN, answers cut to no loss position, a feature
shard overwritten, target weights rewritten in place with the same size, a truncated sample
shard, and a rank left without a sequence on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from specforge_lite.data.samples import completed_shards, load_samples, shard_path
from specforge_lite.scale.rendezvous import free_port
from tests.conftest import REPO, run_cli
from tests.unit.test_content_keys import WEIGHT, middle_of, rewrite_byte

FEW = ["train.max_steps=2", "train.log_every=1", "train.checkpoint_every=0"]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sampled")
    run_cli("sample", "+recipe=smoke", f"run_dir={run_dir}", check=True)
    return run_dir


def fresh_run(sampled, tmp_path, name):
    run_dir = tmp_path / name
    shutil.copytree(sampled, run_dir)
    return run_dir


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def all_finite(path: Path) -> bool:
    return all(t.isfinite().all() for t in load_file(str(path)).values() if t.is_floating_point())


def test_a_diverging_run_stops_with_one_line_and_keeps_the_last_good_checkpoint(sampled, tmp_path):
    run_dir = fresh_run(sampled, tmp_path, "diverges")
    # 1e30, not 1e6: on some CPUs a 1e6 step blew the loss up and back to a finite value (AVX2 EPYC)
    proc = run_cli("train", "+recipe=smoke", f"run_dir={run_dir}", "train.lr=1e30", "train.checkpoint_every=1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = error_lines(proc)
    assert "stopped being finite at step" in line and "train.lr=1e+30" in line and "last good checkpoint" in line
    assert not (run_dir / "train" / "drafter").exists() and "drafter written to" not in proc.stdout + proc.stderr
    kept = sorted((run_dir / "train" / "checkpoints").glob("step-*"))
    assert kept and kept[-1].name in line and all(all_finite(c / "drafter.safetensors") for c in kept)


def test_a_run_without_a_loss_position_writes_no_drafter(tmp_path):
    proc = run_cli("train", "+recipe=smoke", f"run_dir={tmp_path}", "data.max_length=4", "data.max_samples=4", *FEW)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = error_lines(proc)
    assert "loss position" in line and "data.max_length=4" in line
    assert not (tmp_path / "train" / "drafter").exists()


def test_an_overwritten_feature_shard_is_rebuilt_not_trained_on(sampled, tmp_path):
    run_dir = fresh_run(sampled, tmp_path, "features")
    run_cli("train", "+recipe=smoke", f"run_dir={run_dir}", "train.mode=offline", *FEW, check=True)
    shard = sorted((run_dir / "train" / "features").glob("shard-*.safetensors"))[0]
    size = shard.stat().st_size
    with shard.open("r+b") as fh:  # the second half of its data: 0xFF bytes are NaN in bf16
        fh.seek(size // 2)
        fh.write(b"\xff" * (size - size // 2))
    proc = run_cli("train", "+recipe=smoke", f"run_dir={run_dir}", "train.mode=offline", *FEW[1:],
                   "train.max_steps=3", check=True)  # other steps: trained again on the same features
    logged = proc.stdout + proc.stderr
    assert f"{shard}: its tensors differ from the checksum" in logged and "rebuilding that shard" in logged
    assert shard.stat().st_size == size and all_finite(run_dir / "train" / "drafter" / "model.safetensors")


def test_weights_rewritten_in_place_are_another_target(tmp_path):
    from specforge_lite.targets.loading import resolve_target_path

    target = tmp_path / "target"
    shutil.copytree(resolve_target_path("builtin:tiny-llama"), target)
    args = ["sample", "+recipe=smoke", f"run_dir={tmp_path / 'run'}", f"target.path={target}", "data.max_samples=4"]
    run_cli(*args, check=True)
    weights = target / "model.safetensors"
    size = weights.stat().st_size
    rewrite_byte(weights, middle_of(weights, WEIGHT))
    assert weights.stat().st_size == size
    proc = run_cli(*args)
    assert proc.returncode == 2 and "holds samples made with other settings" in proc.stderr
    assert "target_files.weights.model.safetensors" in proc.stderr


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_damaged_sample_shard_is_rewritten_on_resume(sampled, tmp_path, damage):
    run_dir = fresh_run(sampled, tmp_path, damage)
    want = {row["id"]: row["input_ids"] for row in load_samples(run_dir / "samples")}
    data = run_dir / "samples" / "data"
    path = shard_path(data, completed_shards(data)[0])
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    else:
        rewrite_byte(path, len(raw) // 3)
    proc = run_cli("sample", "+recipe=smoke", f"run_dir={run_dir}", check=True)
    logged = proc.stdout + proc.stderr
    assert f"{path}:" in logged and "rewriting that shard" in logged and "nothing to do" not in logged
    assert path.read_bytes() == raw  # the same draws, written again
    assert {row["id"]: row["input_ids"] for row in load_samples(run_dir / "samples")} == want


def test_two_ranks_count_the_tokens_of_one_rank(sampled, tmp_path, rank_python):
    """The same global batch on 1 and on 2 gloo ranks: tokens seen (the learning curve's axis) are
    the same, and the per-rank counts in metrics.json add up to them."""
    one, two = fresh_run(sampled, tmp_path, "one"), fresh_run(sampled, tmp_path, "two")
    args = ["+recipe=smoke", *FEW, "train.batch_size=2"]
    run_cli("train", *args, f"run_dir={one}", check=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([rank_python, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "--no-python", rank_python,
                           "-m", "specforge_lite", "train", *args, f"run_dir={two}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m1 = json.loads((one / "train" / "metrics.json").read_text())
    m2 = json.loads((two / "train" / "metrics.json").read_text())
    assert m1["tokens_per_rank"] == [m1["tokens_seen"]] and m1["idle_steps_per_rank"] == [0]
    assert len(m2["tokens_per_rank"]) == 2 and all(n > 0 for n in m2["tokens_per_rank"])
    assert m2["tokens_seen"] == sum(m2["tokens_per_rank"]) == m2["history"][-1]["tokens_seen"] == m1["tokens_seen"]
    assert [h["tokens_seen"] for h in m2["history"]] == [h["tokens_seen"] for h in m1["history"]]


IDLE_RANK = """
import json, sys
import torch.distributed
from accelerate import Accelerator
from specforge_lite.training.health import RankCounts

accelerator = Accelerator(cpu=True)
counts = RankCounts()
for step in range(3):  # rank 1 gets a real sequence in step 0 only; its dummy ones count zero
    counts.add_step(10 + step if accelerator.process_index == 0 or step == 0 else 0)
gathered = counts.gathered(accelerator, batch_size=1)
if accelerator.is_main_process:
    json.dump(gathered, open(sys.argv[1], "w"))
accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()  # stop gloo before exit: otherwise a rank may abort at teardown
"""


def test_an_idle_rank_counts_zero_tokens_on_two_gloo_ranks(tmp_path):
    script, out = tmp_path / "idle_rank.py", tmp_path / "counts.json"
    script.write_text(IDLE_RANK)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), str(script), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == {"tokens_per_rank": [33, 10], "idle_steps_per_rank": [0, 2], "steps": 3}
    assert "rank 1 trained on no real token in 2 of 3 steps" in proc.stdout + proc.stderr


def test_a_checkpoint_of_other_weights_names_them_before_features_are_built(tmp_path):
    """After the target's weights change, a checkpoint made for the old ones is refused naming the
    weights (it said "other training settings", none having changed), and before offline
    features are built again for nothing."""
    from specforge_lite.targets.loading import resolve_target_path

    target = tmp_path / "target"
    shutil.copytree(resolve_target_path("builtin:tiny-llama"), target)
    args = ["train", "+recipe=smoke", f"run_dir={tmp_path / 'run'}", f"target.path={target}", "data.max_samples=4",
            "train.use_samples=false", "train.source_conversations=4", "train.mode=offline", "train.max_steps=4",
            "train.checkpoint_every=2"]
    run_cli(*args, check=True)  # leaves its step-2 checkpoint (none at the last step)
    shutil.rmtree(tmp_path / "run" / "train" / "drafter")
    features = tmp_path / "run" / "train" / "features"
    built = {p.name: p.stat().st_mtime_ns for p in features.glob("shard-*")}
    rewrite_byte(target / "model.safetensors", middle_of(target / "model.safetensors", WEIGHT))
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = error_lines(proc)
    assert "was written for other inputs: the target's weights (the files of target.path) changed since" in line
    assert "train.resume=false" in line
    assert {p.name: p.stat().st_mtime_ns for p in features.glob("shard-*")} == built  # nothing rebuilt first
