"""The offline feature cache's key: anything that makes its content (rows, target, layers,
dtype) changed empties it before it is built again; the same key keeps the shards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specforge_lite.training.features import FeatureCache, cache_key

ROWS = [{"id": f"c{i}", "input_ids": list(range(3, 10 + i)), "loss_mask": [1] * (7 + i)} for i in range(4)]


def build(folder, target, rows, layers, dtype="torch.float32"):
    cache = FeatureCache(folder, shard_size=2)
    key = cache_key(rows, "builtin:tiny-llama", dtype, layers)
    cache.prepare(rows, target.config.hidden_size, layers, key)
    cache.build(target, rows, layers, pad_id=0, batch_size=2)
    return cache


@pytest.mark.parametrize("change", ["same", "ids", "tokens", "layers", "dtype"])
def test_a_changed_key_rebuilds(tmp_path, tiny_target, change):
    target, _ = tiny_target
    build(tmp_path, target, ROWS, [1, 2, 3])
    shard = tmp_path / "shard-00000.safetensors"  # a rebuild writes it again: its mtime changes
    os.utime(shard, ns=(0, 0))
    rows, layers, dtype = [dict(r) for r in ROWS], [1, 2, 3], "torch.float32"
    if change == "ids":
        rows[1]["id"] = "other"
    elif change == "tokens":
        rows[1]["input_ids"] = rows[1]["input_ids"][::-1]
    elif change == "layers":
        layers = [0, 2, 3]
    elif change == "dtype":
        dtype = "torch.bfloat16"
    cache = build(tmp_path, target, rows, layers, dtype)
    rebuilt = shard.stat().st_mtime_ns != 0
    assert rebuilt is (change != "same")
    aux, last = cache.get(1)
    assert last.shape[0] == len(rows[1]["input_ids"]) and aux.shape[-1] == 3 * target.config.hidden_size


def test_a_rebuild_removes_only_the_caches_own_files(tmp_path, tiny_target):
    """A changed key empties the cache of its shards and meta.json; a user's file in the folder stays."""
    target, _ = tiny_target
    build(tmp_path, target, ROWS, [1, 2, 3])
    shards = sorted(p.name for p in tmp_path.glob("shard-*.safetensors"))
    mine = tmp_path / "notes.txt"
    mine.write_text("the user's")
    (tmp_path / "shard-00009.safetensors").write_bytes(b"a stale shard of an older, larger build")
    build(tmp_path, target, ROWS[:2], [1, 2, 3])
    assert mine.read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.glob("shard-*.safetensors")) == shards[:1]  # the stale ones gone


def test_the_target_files_are_in_the_key(tmp_path):
    from specforge_lite.targets.loading import resolve_target_path

    key = cache_key(ROWS, "builtin:tiny-llama", "torch.float32", [1])["target"]
    assert key["config_sha256"] and key["weights"]
    assert key["path"] == str(Path(resolve_target_path("builtin:tiny-llama")).resolve())


def test_shards_get_the_umasks_mode(tmp_path, tiny_target):
    """safetensors writes its files 600; a cache shard, like every artifact, gets 644 under umask 022."""
    import os
    import stat

    target, _ = tiny_target
    mask = os.umask(0o022)
    try:
        build(tmp_path, target, ROWS, [1, 2, 3])
    finally:
        os.umask(mask)
    shards = list(tmp_path.glob("*.safetensors"))
    assert shards and all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in shards)


def test_a_bf16_forward_of_an_fp32_target_is_keyed_apart_and_returned_in_fp32(tiny_target):
    """train.mixed_precision=bf16 runs the frozen fp32 target under bf16 autocast: the states come
    back in the weights' dtype, close to the fp32 forward's, and the cache key names the autocast."""
    import torch

    from specforge_lite.training.features import collate, computed_dtype, target_hidden

    target, _ = tiny_target
    batch = collate(ROWS, 0, "cpu")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    aux32, last32 = target_hidden(target, ids, mask, [1, 2])
    aux16, last16 = target_hidden(target, ids, mask, [1, 2], torch.bfloat16)
    assert aux16.dtype == last16.dtype == torch.float32
    assert not torch.equal(last16, last32)  # the forward did compute in bf16
    assert ((last16 - last32).norm() / last32.norm()) < 0.05
    assert ((aux16 - aux32).norm() / aux32.norm()) < 0.05
    assert computed_dtype(target, None) == computed_dtype(target, torch.float32) == "torch.float32"
    assert computed_dtype(target, torch.bfloat16) == "torch.float32 autocast torch.bfloat16"
