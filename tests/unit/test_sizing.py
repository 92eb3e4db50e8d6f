"""Sizing at the door (specforge_lite/scale/sizing.py): every stage's per-device memory from the
target's config, the dry run of any stage, and stages refused before they load anything."""

from __future__ import annotations

import json

import pytest

from specforge_lite.scale.sizing import GiB, stage_table
from specforge_lite.targets.loading import sizing_config
from tests.conftest import compose, run_cli


def llama_params(c) -> tuple[int, int]:
    """(all parameters, decoder-layer parameters) of a Llama config, counted by hand."""
    head_dim = c.hidden_size // c.num_attention_heads
    attn = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * c.num_key_value_heads * head_dim
    layer = attn + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    layers = c.num_hidden_layers * layer
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return layers + c.vocab_size * c.hidden_size + head + c.hidden_size, layers


def test_70b_rows_follow_the_config(tmp_path):
    cfg = compose(["+recipe=eagle_llama70b", f"run_dir={tmp_path}", "trainer.dry_run_gpus=8"])
    config = sizing_config(cfg.target.path)
    params, layers = llama_params(config)
    table = stage_table(cfg, config, disk=False)
    rows = table["stages"]
    assert table["target_bytes"] == 2 * params and table["layer_bytes"] == 2 * layers
    assert rows["sample"]["bytes"] == pytest.approx(2 * params / 8)  # vLLM, tensor parallelism 8
    assert rows["evaluate"]["bytes"] > 2 * params  # our engine: the whole target and a KV cache
    # export reads the embeddings, final norm and lm_head, no decoder layer: its drafter (a layer and
    # a head, fp32, trained and reloaded) is well under an eighth of the target's layers
    assert 2 * (params - layers) < rows["export"]["bytes"] < 2 * (params - layers) + 2 * layers / 8
    sharded = rows["features"]["bytes"]  # the recipe shards the target's layers over its ranks
    whole = stage_table(compose(["+recipe=eagle_llama70b", f"run_dir={tmp_path}", "trainer.shard_target=false"]),
                        config, disk=False)["stages"]["features"]["bytes"]
    assert whole > 2 * params and sharded < 2 * layers / 8 + 2 * (params - layers) + 2 * 2 * layers / 80 + 2 * GiB
    assert sharded < 80e9 * 0.9 < whole  # what trainer.shard_target buys on an 80 GB GPU


def test_offline_disk_is_bytes_per_token_times_tokens(tmp_path):
    cfg = compose(["+recipe=eagle_llama8b", f"run_dir={tmp_path}", "data.max_samples=1000", "train.mode=offline"])
    config = sizing_config(cfg.target.path)
    disk = stage_table(cfg, config)["offline_features"]
    assert disk["bytes_per_token"] == (3 + 1) * config.hidden_size * 2  # 3 aux layers + the last, bf16
    assert disk["tokens_at_most"] == 1000 * cfg.data.max_length
    assert disk["bytes_at_most"] == disk["tokens_at_most"] * disk["bytes_per_token"] and disk["used"]


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4_topk"])
def test_offline_disk_uses_the_feature_format(tmp_path, fmt):
    from specforge_lite.training.feature_formats import bytes_per_token

    cfg = compose(["+recipe=eagle_llama8b", f"run_dir={tmp_path}", "data.max_samples=1000", "train.mode=offline",
                   f"train.feature_format={fmt}"])
    config = sizing_config(cfg.target.path)
    disk = stage_table(cfg, config)["offline_features"]
    assert disk["format"] == fmt and disk["bytes_per_token"] == bytes_per_token(fmt, config.hidden_size, 3)
    assert disk["bytes_per_token"] < (3 + 1) * config.hidden_size * 2
    assert disk["bytes_at_most"] == int(disk["tokens_at_most"] * disk["bytes_per_token"])


def test_the_offline_eagle_recipes_store_compact_features():
    for recipe in ("eagle_llama70b", "eagle_smollm2_full"):
        assert compose([f"+recipe={recipe}"]).train.feature_format == "int4_topk"


def test_dry_run_of_a_stage_loads_nothing(tmp_path):
    proc = run_cli("evaluate", "+recipe=eagle_llama70b", "dry_run=true", f"run_dir={tmp_path}", check=True)
    for stage in ("sample ", "features ", "train ", "evaluate ", "export ", "offline features:"):
        assert f"  {stage}" in proc.stdout, proc.stdout
    table = json.loads((tmp_path / "dry_run.json").read_text())
    assert set(table["stages"]) == {"sample", "features", "train", "evaluate", "export"}
    assert {p.name for p in tmp_path.iterdir()} <= {"dry_run.json", "logs"}  # no stage folder, no accounting


@pytest.mark.parametrize("stage,extra,setting", [
    ("evaluate", [], "eval.vllm.tensor_parallel_size"),
    ("train", ["train.mode=offline"], "trainer.shard_target=true"),
    ("sample", [], "sample.backend=vllm"),
])
def test_a_stage_that_cannot_fit_stops_before_loading(tmp_path, stage, extra, setting):
    # the tiny target (a few MB) against a declared 1 MB device
    proc = run_cli(stage, "+recipe=smoke", "device_memory_gib=0.001", *extra, f"run_dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and setting in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert {p.name for p in tmp_path.iterdir()} <= {"logs"} if tmp_path.exists() else True


def test_run_sizes_the_stages_it_keeps_before_sampling(tmp_path):
    """`run` sizes every stage it keeps in this process before the first starts: it stops when
    one cannot fit (here the first, sample), not after sampling and training."""
    proc = run_cli("run", "+recipe=smoke", "device_memory_gib=0.001", f"run_dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "sample: sample needs" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "train").exists() and not (tmp_path / "samples").exists()


def test_the_allocator_setting_is_left_to_the_user_and_to_cuda(monkeypatch):
    """settle_allocator changes nothing where the user set PYTORCH_CUDA_ALLOC_CONF or where there is no CUDA."""
    import torch

    from specforge_lite.scale.sizing import settle_allocator

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert settle_allocator() is None
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert settle_allocator() == (None if not torch.cuda.is_available() else "expandable_segments:True")
