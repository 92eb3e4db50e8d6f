"""Dry runs size the big recipes from their configs, with no download and no weights."""

from __future__ import annotations

import json

import pytest

from specforge_lite.scale.dry_run import dry_run
from tests.conftest import compose


@pytest.mark.parametrize("recipe,target_b,fits", [("eagle_llama8b", 8.03, True), ("eagle_llama70b", 70.55, True),
                                                  ("eagle_qwen3_8b", 8.19, True), ("eagle_qwen3_30b_a3b", 30.53, True)])
def test_big_recipes_dry_run(tmp_path, recipe, target_b, fits):
    cfg = compose([f"+recipe={recipe}", f"run_dir={tmp_path}", "train.dry_run=true"])
    result = dry_run(cfg)
    assert result["target_params_b"] == pytest.approx(target_b, abs=0.01)
    assert result["draft_vocab_size"] == 32000 and len(result["aux_layer_ids"]) == 3
    memory = result["per_gpu_memory"]
    assert memory["total_gib"] == pytest.approx(sum(v for k, v in memory.items() if k != "total_gib"))
    assert result["fits_80gb"] is fits
    assert json.loads((tmp_path / "train" / "dry_run.json").read_text())["target"] == cfg.target.path


def test_online_70b_would_not_fit_one_gpu(tmp_path):
    cfg = compose(["+recipe=eagle_llama70b", f"run_dir={tmp_path}", "train.mode=online"])
    result = dry_run(cfg)
    assert result["per_gpu_memory"]["target_weights_gib"] > 130 and not result["fits_80gb"]


def test_drafter_size_matches_the_architecture(tmp_path):
    cfg = compose(["+recipe=eagle_llama8b", f"run_dir={tmp_path}"])
    h, inter, v_d = 4096, 14336, 32000
    expected = (3 * h * h  # fc
                + 2 * h * 32 * 128 + 2 * 2 * h * 8 * 128 + 32 * 128 * h  # q, k, v, o
                + 3 * h * inter + v_d * h + 4 * h)  # mlp, lm_head, norms
    assert dry_run(cfg)["drafter_trainable_params_m"] == pytest.approx(expected / 1e6, rel=1e-6)


def test_distill_llama70b_sizes_the_1b_student(tmp_path):
    cfg = compose(["+recipe=distill_llama70b", f"run_dir={tmp_path}"])
    result = dry_run(cfg)
    assert result["drafter"] == "distilled" and result["student_params_b"] == pytest.approx(1.24, abs=0.01)
    assert result["drafter_trainable_params_m"] == pytest.approx(1e3 * result["student_params_b"], rel=1e-6)
    # offline: the target that built the features stays loaded, its decoder layers split over the
    # 8 GPUs (the recipe's trainer.shard_target), embeddings and lm_head (128256 x 8192 each) whole
    embed_head = 2 * 128256 * 8192
    layers = result["target_params_b"] * 1e9 - embed_head - 8192  # less the final norm
    assert result["per_gpu_memory"]["target_weights_gib"] == pytest.approx(
        (layers / 8 + embed_head + 8192) * 2 / 1024 ** 3, rel=1e-6)
    assert result["fits_80gb"]
    lora = dry_run(compose(["+recipe=distill_llama70b", f"run_dir={tmp_path}", "drafter.lora=true"]))
    assert lora["drafter_trainable_params_m"] < 20  # rank-16 adapters on 16 layers x 7 projections
    assert lora["per_gpu_memory"]["drafter_weights_grads_adam_gib"] < \
        result["per_gpu_memory"]["drafter_weights_grads_adam_gib"] / 4


def test_medusa_llama8b_head_count_and_size(tmp_path):
    result = dry_run(compose(["+recipe=medusa_llama8b", f"run_dir={tmp_path}"]))
    h, v = 4096, 32000
    assert result["num_heads"] == 4 and result["draft_vocab_size"] == v
    assert result["drafter_trainable_params_m"] == pytest.approx(4 * (h * h + v * h) / 1e6)
    assert result["fits_80gb"]


def test_student_with_another_vocabulary_fails_the_dry_run(tmp_path):
    from specforge_lite import SpecforgeError

    cfg = compose(["+recipe=distill_llama70b", f"run_dir={tmp_path}", "drafter.student=builtin:tiny-llama"])
    with pytest.raises(SpecforgeError, match="must share the target's vocabulary"):
        dry_run(cfg)


def test_sharded_strategies_fit_online_70b_on_eight_gpus(tmp_path):
    """Online EAGLE-3 for the 70B target fits 80 GB GPUs once its layers are split 8 ways."""
    per_gpu = {}
    for trainer in ("ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"):
        cfg = compose(["+recipe=eagle_llama70b", f"run_dir={tmp_path}", "train.mode=online", f"trainer={trainer}",
                       "trainer.dry_run_gpus=8"])
        result = dry_run(cfg)
        assert result["strategy"] == trainer and result["num_gpus"] == 8
        per_gpu[trainer] = result["per_gpu_memory"]
        assert result["fits_80gb"] is (trainer in ("deepspeed_zero3", "fsdp"))
    ddp, zero2, fsdp = per_gpu["ddp"], per_gpu["deepspeed_zero2"], per_gpu["fsdp"]
    # ZeRO-2 splits gradients and AdamW moments (12 of the 16 bytes per parameter)
    assert zero2["drafter_weights_grads_adam_gib"] == pytest.approx(ddp["drafter_weights_grads_adam_gib"] * (4 + 12 / 8) / 16)
    # the layers (all but ~2.1B embedding + lm_head parameters) split 8 ways
    embed_head_gib = 2 * 128256 * 8192 * 2 / 1024 ** 3
    assert fsdp["target_weights_gib"] == pytest.approx((ddp["target_weights_gib"] - embed_head_gib) / 8 + embed_head_gib,
                                                       rel=1e-3)
    assert fsdp["total_gib"] == pytest.approx(sum(v for k, v in fsdp.items() if k != "total_gib"))


def test_one_gpu_sharding_changes_nothing_but_transients(tmp_path):
    cfgs = [compose(["+recipe=eagle_llama8b", f"run_dir={tmp_path}", "train.mode=online", f"trainer={t}",
                     "trainer.dry_run_gpus=1"]) for t in ("ddp", "fsdp")]
    ddp, fsdp = (dry_run(c)["per_gpu_memory"] for c in cfgs)
    assert fsdp["target_weights_gib"] == pytest.approx(ddp["target_weights_gib"])
    assert fsdp["drafter_weights_grads_adam_gib"] == pytest.approx(ddp["drafter_weights_grads_adam_gib"])


@pytest.mark.parametrize("recipe,layers,aux", [("eagle_qwen3_8b", 36, [2, 18, 33]),
                                               ("eagle_qwen3_30b_a3b", 48, [2, 24, 45])])
def test_qwen3_recipes_size_their_own_family(tmp_path, recipe, layers, aux):
    """The Qwen3 cards are sized from Qwen3's own config class (q/k norms, the MoE's experts
    counted), and EAGLE-3 reads the aux layers of the rule [2, L//2, L-3] of their depth."""
    from specforge_lite.targets.loading import sizing_config

    cfg = compose([f"+recipe={recipe}", f"run_dir={tmp_path}", "train.dry_run=true"])
    config = sizing_config(cfg.target.path)
    assert config.model_type == ("qwen3_moe" if "a3b" in recipe else "qwen3") and config.num_hidden_layers == layers
    assert dry_run(cfg)["aux_layer_ids"] == aux
