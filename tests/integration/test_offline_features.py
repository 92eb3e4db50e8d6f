"""The offline feature cache holds the features of the rows being trained on: a train with
other rows (more conversations, or as many but other ones) rebuilds it instead of reading
features cached for other conversations."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from specforge_lite.targets.accounting import stage_summary
from specforge_lite.training.features import collate, target_hidden
from specforge_lite.stages.train import training_rows
from specforge_lite.training.strategies.base import target_compute
from specforge_lite.targets.loading import load_target
from specforge_lite.scale.rendezvous import free_port
from tests.conftest import REPO, compose, run_cli
from tests.families import family_target  # noqa: F401  (a fixture)

# the source conversations only (no sample stage), one optimizer step, no checkpoints
OFFLINE = ["+recipe=smoke", "train.mode=offline", "train.use_samples=false", "train.max_steps=1",
           "train.log_every=1", "train.checkpoint_every=0", "target.dtype=float32"]


def cached_last(run_dir) -> list[torch.Tensor]:
    """Every cached `last.<i>` tensor, in sequence order."""
    found = {}
    for shard in sorted((run_dir / "train" / "features").glob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            found.update({int(k.split(".")[1]): handle.get_tensor(k) for k in handle.keys() if k.startswith("last.")})
    return [found[i] for i in sorted(found)]


def expected_last(*overrides: str) -> list[torch.Tensor]:
    """The target's last hidden states, as the cache stores them, for the rows these settings train on,
    computed the way the cache computes them: the same batches within the same shards. Rows batched
    another way (with other padding) round differently where the CPU computes bf16 natively (AMX)."""
    cfg = compose(["stage=train", *OFFLINE, *overrides])
    target, tokenizer = load_target(cfg.target)
    rows = training_rows(cfg, tokenizer)
    shard, size = cfg.train.offline_shard_size, cfg.train.batch_size
    out = []
    for lo in range(0, len(rows), shard):
        hi = min(lo + shard, len(rows))
        for start in range(lo, hi, size):
            group = rows[start:min(start + size, hi)]
            batch = collate(group, tokenizer.pad_token_id, target.device)
            _, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], [], target_compute(cfg))
            out += [last[k, :len(row["input_ids"])].to(torch.bfloat16) for k, row in enumerate(group)]
    return out


def assert_same(cached, expected):
    assert len(cached) == len(expected)
    for a, b in zip(cached, expected):
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("change", [["data.split_seed=7"], ["train.source_conversations=6"]],
                         ids=["as_many_other_rows", "more_rows"])
def test_other_rows_rebuild_the_features(tmp_path, change):
    run_dir = tmp_path / "run"
    run_cli("train", *OFFLINE, "train.source_conversations=4", f"run_dir={run_dir}", check=True)
    first = cached_last(run_dir)
    assert_same(first, expected_last("train.source_conversations=4"))
    proc = run_cli("train", *OFFLINE, "train.source_conversations=4", *change, f"run_dir={run_dir}", check=True)
    second = cached_last(run_dir)
    expected = expected_last("train.source_conversations=4", *change)
    assert_same(second, expected)
    assert "rebuilding them" in proc.stdout + proc.stderr
    assert len(second) != len(first) or any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(first, second))


def train_ranks(run_dir, ranks: int, *overrides: str, python: str = sys.executable) -> None:
    """The real train stage on `ranks` torchrun processes (gloo) of `python` (conftest's rank_python),
    as tests/integration/test_strategies.py runs it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_port", str(free_port()), "--no-python", python] if ranks > 1 else [python]
    proc = subprocess.run([*launcher, "-m", "specforge_lite", "train", *OFFLINE, *overrides, f"run_dir={run_dir}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def cached(run_dir) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted((run_dir / "train" / "features").glob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


@pytest.mark.parametrize("family", [None, "qwen3_moe"], ids=["llama", "qwen3_moe"])
def test_two_ranks_with_the_target_sharded_build_the_one_rank_features(tmp_path, family, family_target,  # noqa: F811
                                                                       rank_python):
    """Also for a mixture of experts, whose checkpoint saves each expert by name while the model
    holds them fused: each rank reads its own experts (`sharded.expert_rows`)."""
    # 7 conversations in shards of 2: rank 0 writes shards 0 and 2, rank 1 shards 1 and 3 (one
    # conversation), so rank 1 runs one empty-handed forward for rank 0's last batch
    rows = ["train.source_conversations=7", "train.offline_shard_size=2", "train.batch_size=1"]
    if family:
        rows.append(f"target.path={family_target(family)}")
    train_ranks(tmp_path / "one", 1, *rows, python=rank_python)
    train_ranks(tmp_path / "two", 2, *rows, "trainer.shard_target=true", python=rank_python)
    one, two = cached(tmp_path / "one"), cached(tmp_path / "two")
    assert set(one) == set(two) and len([k for k in one if k.startswith("aux.")]) == 7
    for name in one:  # bf16 on disk: equal up to one rounding step of a float32 difference
        assert torch.allclose(one[name].float(), two[name].float(), rtol=1e-2, atol=1e-3), name
    held = stage_summary(tmp_path / "two")["train"]
    assert held["world_size"] == 2 and held["within_share"], held  # no rank held more than half the layers
    assert all(0 < b <= held["layer_bytes_total"] / 2 for b in held["ranks"].values()), held
