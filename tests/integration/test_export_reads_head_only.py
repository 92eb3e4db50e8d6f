"""Export reads only the target tensors its checks need (embeddings, final norm, lm_head):
it works, and writes the same files, with the target's decoder-layer shard deleted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from specforge_lite.targets.accounting import is_layer_weight
from specforge_lite.targets.loading import resolve_target_path
from tests.conftest import run_cli

TRAIN = ["train.use_samples=false", "train.source_conversations=4", "train.max_steps=1", "train.log_every=1",
         "train.checkpoint_every=0"]


def split_target(folder):
    """The tiny target written as two safetensors files with an index: `head` (embeddings, final
    norm, lm_head) and `layers` (every decoder-layer weight)."""
    source = resolve_target_path("builtin:tiny-llama")
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "*.bin"))
    weights = {}
    for file in sorted(Path(source).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    parts = {"layers.safetensors": {k: v for k, v in weights.items() if is_layer_weight(k)},
             "head.safetensors": {k: v for k, v in weights.items() if not is_layer_weight(k)}}
    for name, tensors in parts.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, tensors in parts.items() for k in tensors}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def weights_in(export_dir) -> dict:
    return {f.relative_to(export_dir).as_posix(): load_file(str(f)) for f in sorted(export_dir.rglob("*.safetensors"))}


@pytest.mark.parametrize("recipe", ["smoke", "smoke_distilled"])
def test_export_without_the_layers_file(tmp_path, recipe):
    target = split_target(tmp_path / "target")
    run_dir = tmp_path / "run"
    common = [f"+recipe={recipe}", f"target.path={target}", f"run_dir={run_dir}"]
    run_cli("train", *common, *TRAIN, check=True)
    run_cli("export", *common, check=True)
    whole = weights_in(run_dir / "export")
    (target / "layers.safetensors").unlink()  # what a node without the layers' shards has
    run_cli("export", *common, check=True)
    alone = weights_in(run_dir / "export")
    assert set(alone) == set(whole) and alone
    for file, tensors in whole.items():
        assert set(tensors) == set(alone[file])
        assert all(tensors[k].equal(alone[file][k]) for k in tensors), file
    assert json.loads((run_dir / "export" / "export.json").read_text())["strict_reload"] == "passed"
    held = json.loads((run_dir / "accounting" / "export.rank0.json").read_text())
    assert held["layer_bytes_held"] == 0 and held["other_bytes_held"] > 0, held


@pytest.mark.parametrize("damage,message", [
    (lambda t: (t / "head.safetensors").write_bytes((t / "head.safetensors").read_bytes()[:1000]), "head.safetensors"),
    (lambda t: (t / "head.safetensors").unlink(), "holds model.embed_tokens.weight"),
], ids=["head_truncated", "head_missing"])
def test_a_damaged_head_file_stops_export_in_one_line(tmp_path, damage, message):
    target = split_target(tmp_path / "target")
    run_dir = tmp_path / "run"
    common = ["+recipe=smoke", f"target.path={target}", f"run_dir={run_dir}"]
    run_cli("train", *common, *TRAIN, check=True)
    damage(target)
    proc = run_cli("export", *common)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert not (run_dir / "export").exists()
