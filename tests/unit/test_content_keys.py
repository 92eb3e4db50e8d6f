"""Reuse keys that mean what they say: a target's weights are keyed by content (a tensor rewritten
in place with the file size unchanged is another target), and the files we write and reuse
(sample shards, feature shards, the converted target GGUF) are checked before they are reused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specforge_lite import SpecforgeError
from specforge_lite.targets.digest import file_digest, target_files
from specforge_lite.targets.loading import resolve_target_path


@pytest.fixture
def target_copy(tmp_path, monkeypatch):
    """A copy of the tiny target in its own folder; kept digests go to this test's model cache."""
    source = Path(resolve_target_path("builtin:tiny-llama"))  # materialised before the cache moves
    folder = tmp_path / "target"
    shutil.copytree(source, folder)
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    return folder


def data_span(path: Path, name: str) -> tuple[int, int]:
    """The byte range of tensor `name` in a safetensors file."""
    with path.open("rb") as fh:
        length = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(length))
    begin, end = header[name]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def rewrite_byte(path: Path, offset: int) -> None:
    """Flip one byte at `offset` in place: same file, same size, another value."""
    with path.open("r+b") as fh:
        fh.seek(offset)
        value = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([value ^ 0x5A]))


def middle_of(path: Path, name: str) -> int:
    begin, end = data_span(path, name)
    return begin + (end - begin) // 2


WEIGHT = "model.layers.1.mlp.up_proj.weight"


def test_one_weight_byte_rewritten_in_place_changes_the_target_key(target_copy):
    weights = target_copy / "model.safetensors"
    before, size = target_files(str(target_copy)), weights.stat().st_size
    with safe_open(str(weights), framework="pt") as handle:
        assert WEIGHT in handle.keys()
    rewrite_byte(weights, middle_of(weights, WEIGHT))
    assert weights.stat().st_size == size
    after = target_files(str(target_copy))
    assert after["weights"]["model.safetensors"] != before["weights"]["model.safetensors"]
    assert after["config_sha256"] == before["config_sha256"] and after["path"] == before["path"]


def test_the_sampled_digest_of_a_large_file_sees_a_byte_in_the_middle(target_copy):
    """Past WHOLE_BYTES a file is sampled (header, each tensor's start, middle and end, fixed
    offsets): forced here on the tiny file, a byte in the middle of a tensor and the byte in the
    middle of the file each change the digest, while the file size stays."""
    weights = target_copy / "model.safetensors"
    size = weights.stat().st_size
    first = file_digest(weights, whole_bytes=0)
    rewrite_byte(weights, middle_of(weights, WEIGHT))
    second = file_digest(weights, whole_bytes=0)
    rewrite_byte(weights, size // 2)
    third = file_digest(weights, whole_bytes=0)
    assert weights.stat().st_size == size and len({first, second, third}) == 3


def test_a_file_past_whole_bytes_is_sampled_where_the_digest_says(tmp_path, monkeypatch):
    """Issue 52: at the real threshold (a 72 MiB file, past WHOLE_BYTES): what a fine-tune
    rewritten in place changes (each tensor's start, middle and end, the header) changes the
    digest, the file is not read whole, and a byte between the sampled windows is the documented
    limit (targets/digest.py): it leaves the digest as it was."""
    from safetensors.torch import save_file

    from specforge_lite.targets import digest

    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "model.safetensors"
    torch.manual_seed(0)
    save_file({"a": torch.randn(9 << 20), "b": torch.randn(9 << 20)}, str(weights))  # 2 x 36 MiB
    assert weights.stat().st_size > digest.WHOLE_BYTES
    reads, sampled = [], digest._spans

    def spy(*args):
        reads.append(sampled(*args))
        return reads[-1]

    monkeypatch.setattr(digest, "_spans", spy)
    file_digest(weights)
    assert sum(end - begin for begin, end in reads[0][1]) < weights.stat().st_size // 8  # sampled, not whole
    begin, end = data_span(weights, "b")
    for offset, seen in ((begin + 5, True), (begin + (end - begin) // 2, True), (end - 3, True),
                         (begin + (end - begin) // 4, False)):  # the last: between the windows
        before = file_digest(weights)
        rewrite_byte(weights, offset)
        assert (file_digest(weights) != before) is seen, offset


def test_a_digest_is_kept_by_file_version_and_a_rewrite_with_its_old_mtime_is_seen(target_copy, tmp_path):
    weights = target_copy / "model.safetensors"
    first = file_digest(weights)
    kept = list((tmp_path / "cache" / "digests").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["digest"] == first
    assert file_digest(weights) == first  # the kept record, same version
    stat = weights.stat()
    rewrite_byte(weights, middle_of(weights, WEIGHT))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # size and mtime as before
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns and file_digest(weights) != first


def test_offline_features_and_the_trained_drafter_key_on_the_weights(target_copy, tmp_path):
    from specforge_lite.stages import train
    from specforge_lite.training.features import cache_key
    from tests.conftest import compose

    rows = [{"id": "a", "input_ids": [3, 4, 5], "loss_mask": [0, 1, 1]}]
    cfg = compose(["+recipe=smoke", f"target.path={target_copy}", f"run_dir={tmp_path / 'run'}"])
    features, drafter = cache_key(rows, str(target_copy), "torch.float32", [1]), train.fingerprint(cfg)
    weights = target_copy / "model.safetensors"
    rewrite_byte(weights, middle_of(weights, WEIGHT))
    assert cache_key(rows, str(target_copy), "torch.float32", [1]) != features
    assert train.fingerprint(cfg) != drafter


# ------------------------------------------------------------------ shards we write and reuse

ROWS = [{"id": f"r{i}", "messages": [{"role": "user", "content": "hi"}], "input_ids": list(range(3, 40 + i)),
         "loss_mask": [0] * 5 + [1] * (32 + i), "num_generated_tokens": 3, "finish_reasons": ["stop"]}
        for i in range(6)]


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_damaged_sample_shard_is_found_and_named(tmp_path, damage):
    from specforge_lite.data.samples import damaged_shards, readable_shards, shard_path, write_shard

    data = tmp_path / "samples" / "data"
    write_shard(data, 0, ROWS[:3], {"records": 3})
    write_shard(data, 1, ROWS[3:], {"records": 3})
    assert damaged_shards(data) == {} and len(readable_shards(tmp_path / "samples")) == 2
    path = shard_path(data, 1)
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    else:  # same size, one byte of the row data changed
        rewrite_byte(path, len(raw) // 3)
    assert list(damaged_shards(data)) == [1] and str(path) in damaged_shards(data)[1]
    with pytest.raises(SpecforgeError, match="run the sample stage again"):
        readable_shards(tmp_path / "samples")


def test_an_overwritten_feature_shard_is_rebuilt(tmp_path, tiny_target):
    from specforge_lite.training.features import FeatureCache, cache_key

    target, _ = tiny_target
    rows = [{"id": f"c{i}", "input_ids": list(range(3, 12 + i)), "loss_mask": [1] * (9 + i)} for i in range(4)]

    def build():
        cache = FeatureCache(tmp_path, shard_size=2)
        cache.prepare(rows, target.config.hidden_size, [1, 2], cache_key(rows, "builtin:tiny-llama",
                                                                          "torch.float32", [1, 2]))
        cache.build(target, rows, [1, 2], pad_id=0, batch_size=2)
        return cache

    want = build().get(3)
    shard = tmp_path / "shard-00001.safetensors"
    size = shard.stat().st_size
    with shard.open("r+b") as fh:  # the second half of the data: 0xFF bytes are NaN in bf16
        fh.seek(size // 2)
        fh.write(b"\xff" * (size - size // 2))
    assert not FeatureCache(tmp_path, shard_size=2)._intact(shard)  # its tensors differ from its checksum
    got = build().get(3)  # what a resumed run does: the shard is written again
    assert shard.stat().st_size == size
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].isfinite().all()


# ------------------------------------------------------------------ nothing non-finite is written

def test_a_drafter_with_a_nan_is_not_written(tmp_path):
    from specforge_lite.drafters.common import save_drafter

    weights = {"fc.weight": torch.ones(2, 2), "norm.weight": torch.tensor([1.0, float("nan")])}
    with pytest.raises(SpecforgeError, match="NaN or inf values in norm.weight"):
        save_drafter(tmp_path / "drafter", "eagle3", weights, {})
    assert not (tmp_path / "drafter" / "model.safetensors").exists()


# ------------------------------------------------------------------ the converted target GGUF

def test_a_truncated_cached_target_gguf_is_converted_again(target_copy, caplog):
    from specforge_lite.serving.llamacpp.files import target_gguf
    from specforge_lite.serving.llamacpp.gguf_read import gguf_summary

    first, _ = target_gguf(str(target_copy))
    size = first.stat().st_size
    first.write_bytes(first.read_bytes()[: size // 2])
    again, _ = target_gguf(str(target_copy))
    assert again == first and again.stat().st_size == size and gguf_summary(again)["block_count"]
    assert any("not a readable GGUF" in r.getMessage() and "converting the target again" in r.getMessage()
               for r in caplog.records)
    weights = target_copy / "model.safetensors"  # rewritten in place: another target, another file
    rewrite_byte(weights, middle_of(weights, WEIGHT))
    assert target_gguf(str(target_copy))[0] != first


class FakeHub:
    """A hub cache in a folder: `snapshot_download` as huggingface_hub's, serving the tiny Llama
    as `org/tiny`. It starts with nothing cached (`state="absent"`) or, as after the door read
    the target's config alone, with config.json only (`"config"`); a download fills it."""

    def __init__(self, root: Path, state: str):
        self.source = Path(resolve_target_path("builtin:tiny-llama"))
        self.snapshot = root / "models--org--tiny" / "snapshots" / "0"
        self.downloads = 0
        if state == "config":
            self.snapshot.mkdir(parents=True)
            shutil.copy(self.source / "config.json", self.snapshot / "config.json")

    def __call__(self, repo_id, local_files_only=False, allow_patterns=None, **_):
        from fnmatch import fnmatch

        from huggingface_hub.errors import LocalEntryNotFoundError

        assert repo_id == "org/tiny"
        if local_files_only:
            if not self.snapshot.is_dir():
                raise LocalEntryNotFoundError("not in the cache")
            return str(self.snapshot)
        self.downloads += 1
        self.snapshot.mkdir(parents=True, exist_ok=True)
        for f in self.source.iterdir():
            if f.is_file() and any(fnmatch(f.name, p) for p in allow_patterns or ["*"]):
                shutil.copy(f, self.snapshot / f.name)
        return str(self.snapshot)


@pytest.mark.parametrize("state", ["absent", "config"])
def test_a_hub_target_is_keyed_by_its_files_on_the_run_that_downloads_it(tmp_path, monkeypatch, state):
    """The GPU user's first run: the target is a hub id not downloaded yet (or whose config alone
    the door fetched). The samples' and the training's content keys computed then equal the ones
    every later run computes from the cached files: the later stage takes the samples as its own
    instead of refusing them as made with other settings."""
    import huggingface_hub
    from huggingface_hub import constants

    from specforge_lite.stages import sample, train
    from specforge_lite.targets import loading
    from tests.conftest import compose

    hub = FakeHub(tmp_path / "hub", state)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(loading, "_check_hub_id", lambda repo_id, key: None)  # the hub answers
    cfg = compose(["stage=train", "+recipe=smoke", "target.path=org/tiny", f"run_dir={tmp_path / 'run'}"])

    first = sample.fingerprint_keys(cfg), train.fingerprint(cfg)
    assert hub.downloads >= 1 and first[0]["target_files"].get("weights"), first[0]["target_files"]
    later = sample.fingerprint_keys(cfg), train.fingerprint(cfg)  # the target cached now, as on every later run
    assert later == first and hub.downloads == 1  # downloaded once, on the first run
    # offline with nothing cached, the id is the key (and the loader then fails on it, naming it)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    shutil.rmtree(tmp_path / "hub")
    assert target_files("org/tiny") == {"path": "org/tiny"}
