"""The 70B recipes' card commands rehearsed on 2 CPU ranks (gloo) with a tiny stand-in target
(`make rehearse RECIPE=NAME`, specforge_lite/scale/rehearse.py), and the self-launch path itself:
a stage started as one plain process starts its ranks, and their exit status is its own."""

from __future__ import annotations

import json
import os

import pytest

from specforge_lite.scale.rehearse import load_spec
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("recipe", ["eagle_llama70b", "distill_llama70b"])
def test_rehearse(tmp_path, recipe, rank_python, capsys):
    """The rehearsal run in this process, each card command in a process forked from the rank server
    (conftest's rank_python); the ranks the train stage launches are fresh interpreters, as the card's."""
    import torch

    from specforge_lite.scale.rehearse import main

    results = tmp_path / "results"
    with torch.random.fork_rng():  # in this process (torch imported once): it seeds the stand-in's weights
        returncode = main([recipe, "--work", str(tmp_path / "work"), "--results", str(results), "--python", rank_python])
    stdout = capsys.readouterr().out
    assert returncode == 0, stdout[-4000:]
    result = json.loads((results / f"rehearse_{recipe}.json").read_text())["runs"]["2"]
    spec = load_spec(recipe)
    assert [c["card"] for c in result["commands"]] == [c["run"] for c in spec["commands"]]
    assert all(c["returncode"] == 0 for c in result["commands"]) and result["passed"]
    by_label = {c["label"]: c for c in result["commands"]}
    # every stage that loads the target in our processes was accounted, on the ranks it ran on
    assert set(by_label["train"]["stages"]) == {"train"} and len(by_label["train"]["stages"]["train"]["ranks"]) == 2
    # every rank trains on real tokens at every step with the card's train.tokens_per_step=auto
    # (issue 38; test_every_rank_trains runs the train.batch_size=1 case)
    train = by_label["train"]
    assert len(train["real_tokens_per_rank"]) == 2 and all(n > 0 for n in train["real_tokens_per_rank"]), train
    assert train["idle_steps_per_rank"] == [0, 0]
    if recipe == "eagle_llama70b":
        assert train["batching"]["mode"] == "auto" and train["batching"]["ranks"] == 2
        assert train["batching"]["micro_batch_per_rank"] >= 1
    assert set(by_label["evaluate"]["stages"]) == {"evaluate"}
    # the sharded path: each of the 2 ranks holds its half of the layer weights, no more
    online = by_label["train_online"]["stages"]["train"]
    assert online["verdict"] == "within share"
    held = list(online["ranks"].values())
    assert len(held) == 2 and all(0 < b <= online["layer_bytes_share"] for b in held)
    assert sum(held) == online["layer_bytes_total"]
    if result["vllm"]:  # sampling and evaluate in vLLM as the card says: each TP worker holds its share
        for label in ("sample", "evaluate"):
            acc = by_label[label]["stages"][label]
            workers = [b for process, b in acc["ranks"].items() if process.startswith("vllm-tp")]
            assert len(workers) == 2 and all(0 < b <= acc["layer_bytes_share"] for b in workers), acc
            assert acc["verdict"] == "within share" and acc["layer_bytes_share"] < acc["layer_bytes_total"]
            assert acc["ranks"].get("0", 0) == 0  # our own process holds none of the target
        assert "NOT YET" not in stdout
    else:
        assert not os.environ.get("SPECFORGE_LITE_REQUIRE_VLLM"), "vLLM required but the rehearsal ran without it"
    # without vLLM, a stage the card does not shard yet is said to be over its share, with the reason
    for key in spec["rehearsal"]["pending"] if not result["vllm"] else ():
        label, stage = key.split("/")
        acc = by_label[label]["stages"][stage]
        if not acc["within_share"]:
            assert acc["verdict"].startswith("NOT YET within share") and acc["layer_bytes_peak"] > acc["layer_bytes_share"]
            assert f"{stage}" in stdout and "NOT YET within share" in stdout
    # one tracker run per training job, however many ranks (only rank 0 logs)
    wandb_runs = list((tmp_path / "work" / "run" / "train" / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2, wandb_runs  # the offline train and the online train_online job


def test_aux_layers_and_draft_vocab_follow_the_recipe_rules(tmp_path):
    """The rehearsal's EAGLE-3 export: aux layers by the rule [2, L//2, L-3] of the stand-in's 8
    layers, and the recipe's draft vocabulary fraction (32000 of 128256) of the stand-in's 320."""
    from specforge_lite.scale.rehearse import build_stand_in

    settings = build_stand_in(load_spec("eagle_llama70b"), tmp_path, ranks=2)
    assert settings["drafter.draft_vocab_size"] == str(round(320 * 32000 / 128256))
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    assert config["num_hidden_layers"] == 8 and config["num_attention_heads"] // config["num_key_value_heads"] == 8
    # one KV head per rank (the recipe's 8 over 8 GPUs), heads vLLM's CPU kernels take
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 32
    rope = config.get("rope_parameters") or config["rope_scaling"]  # transformers 5 writes rope_parameters
    assert rope["rope_type"] == "llama3" and config["tie_word_embeddings"] is False


def test_bad_config_stops_once_before_launching(tmp_path):
    proc = run_cli("train", "+recipe=smoke", "trainer.num_processes=2", "train.lr=-1", f"run_dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.count("error:") == 1 and "train.lr" in proc.stderr
    assert "starting 2 rank(s)" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_a_failed_rank_exit_status_is_the_command_status(tmp_path):
    """A user error raised inside the launched ranks (after validation) ends the command with
    the ranks' own status 2, not the launcher's 1."""
    proc = run_cli("train", "+recipe=smoke", "trainer.num_processes=2", "train.use_samples=false",
                   "train.source_conversations=4", "train.mode=online", "trainer.shard_target=true",
                   f"run_dir={tmp_path}", timeout=300)
    assert "starting 2 rank(s)" in proc.stdout + proc.stderr
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trainer.shard_target=true needs every rank" in proc.stderr
