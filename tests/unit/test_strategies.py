"""The trainer config group and the DeepSpeed config the strategies build from train.*."""

from __future__ import annotations

import json

import pytest

from specforge_lite import SpecforgeError
from specforge_lite.training.strategies import STRATEGIES, deepspeed_config
from tests.conftest import CONF_DIR, REPO


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "trainer").glob("*.yaml")))
def test_every_trainer_option_composes_and_has_a_strategy(compose_cfg, name):
    cfg = compose_cfg(["+recipe=smoke", f"trainer={name}"])
    assert cfg.trainer.strategy.value == name and name in STRATEGIES
    assert cfg.trainer.shard_target is (name in ("deepspeed_zero3", "fsdp"))


def test_default_trainer_is_ddp_and_train_keys_still_work(compose_cfg):
    cfg = compose_cfg(["+recipe=smoke", "train.batch_size=2"])
    assert cfg.trainer.strategy.value == "ddp" and cfg.train.batch_size == 2


def test_unknown_trainer_values_are_rejected(compose_cfg):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="trainer"):
        compose_cfg(["+recipe=smoke", "trainer=zero9"])
    with pytest.raises(ConfigCompositionException, match="strategy"):
        compose_cfg(["+recipe=smoke", "trainer.strategy=zero9"])


def test_deepspeed_config_fills_auto_from_train(compose_cfg, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": True},
                                "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                                "bf16": {"enabled": "auto"}}))
    cfg = compose_cfg(["+recipe=smoke", "trainer=deepspeed_zero3", f"trainer.deepspeed_config={path}",
                       "train.batch_size=4", "train.grad_accum=3", "train.max_grad_norm=0.25"])
    config = deepspeed_config(cfg, 3, world=2, mixed="bf16")
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 12 and config["gradient_clipping"] == 0.25
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert config["zero_allow_untested_optimizer"] is True


@pytest.mark.parametrize("content,message", [
    ({"zero_optimization": {"stage": 2}}, "stage=2 but trainer.strategy=deepspeed_zero3"),
    ({"gradient_clipping": 1.0}, "gradient_clipping=1.0, but train.* gives 0.5"),
    ({"optimizer": {"type": "AdamW"}}, "'optimizer' section"),
    ({"bf16": {"enabled": True}}, "bf16.enabled=True, but train.mixed_precision resolves to 'no'"),
])
def test_deepspeed_config_conflicts_name_the_key(compose_cfg, tmp_path, content, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    cfg = compose_cfg(["+recipe=smoke", "trainer=deepspeed_zero3", f"trainer.deepspeed_config={path}",
                       "train.max_grad_norm=0.5"])
    with pytest.raises(SpecforgeError, match=message.replace("(", r"\(").replace("*", r"\*").replace(".", r"\.")):
        deepspeed_config(cfg, 3, world=2, mixed="no")


def test_recipe_deepspeed_files_match_their_stage(compose_cfg):
    files = sorted((REPO / "recipes").glob("*/ds_zero*.json"))
    assert files, "the multi-GPU recipes ship DeepSpeed configs"
    for path in files:
        stage = int(path.stem[-1])
        cfg = compose_cfg(["+recipe=smoke", f"trainer=deepspeed_zero{stage}", f"trainer.deepspeed_config={path}"])
        config = deepspeed_config(cfg, stage, world=8, mixed="bf16")
        assert config["zero_optimization"]["stage"] == stage and config["bf16"]["enabled"] is True


def saved_bytes_and_grads(drafter, ids, aux, checkpointing: bool):
    """Bytes autograd keeps for backward in one TTT forward, and the gradients after it."""
    import torch

    drafter.gradient_checkpointing = checkpointing
    drafter.zero_grad(set_to_none=True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = drafter(ids, aux, 3)
    sum((o.float() ** 2).mean() for o in outputs).backward()
    return sum(saved), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def test_eagle3_gradient_checkpointing_keeps_gradients_and_saves_memory(tiny_target, compose_cfg):
    import torch

    from specforge_lite.training.strategies import gradient_checkpointing
    from tests.unit.test_eagle3 import tiny_drafter

    drafter = tiny_drafter(tiny_target)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (2, 96))
    aux = torch.randn(2, 96, 3 * drafter.config.hidden_size)
    plain_bytes, plain_grads = saved_bytes_and_grads(drafter, ids, aux, False)
    gradient_checkpointing(drafter, compose_cfg(["+recipe=smoke", "trainer.gradient_checkpointing=true"]))
    assert drafter.gradient_checkpointing is True
    ckpt_bytes, ckpt_grads = saved_bytes_and_grads(drafter, ids, aux, True)
    assert set(ckpt_grads) == set(plain_grads)
    for name, grad in plain_grads.items():
        assert torch.allclose(ckpt_grads[name], grad, atol=1e-6, rtol=1e-5), name
    # the per-step [B, h, T, T] scores and probabilities are no longer kept
    heads, t = drafter.config.num_attention_heads, 96
    assert plain_bytes - ckpt_bytes >= 3 * 2 * 2 * heads * t * t * 4 * 0.9


@pytest.mark.parametrize("rows,world", [(64, 2), (5, 2), (1, 2), (6, 4), (7, 3), (2, 8)])
def test_shard_rows_match_fsdp2_chunks(rows, world):
    """Each rank reads exactly the rows `torch.chunk` (FSDP2's split) gives it, possibly none."""
    import torch

    from specforge_lite.targets.sharded import shard_rows

    chunks = torch.arange(rows).chunk(world)
    for rank in range(world):
        local = chunks[rank] if rank < len(chunks) else torch.arange(0)
        start, stop = shard_rows(rows, len(local), rank, world)
        assert torch.arange(rows)[start:stop].tolist() == local.tolist()
    with pytest.raises(RuntimeError, match="holds"):
        shard_rows(rows, rows + 1, 0, world)


def test_auto_precision_is_bf16_exactly_where_the_cpu_computes_it(compose_cfg):
    from specforge_lite.training.strategies.base import mixed_precision, native_cpu_bf16

    cfg = compose_cfg(["+recipe=smoke", "target.device=cpu"])
    assert mixed_precision(cfg) == ("bf16" if native_cpu_bf16() else "no")
    assert mixed_precision(compose_cfg(["+recipe=smoke", "train.mixed_precision=no"])) == "no"


def test_a_bf16_training_step_follows_the_fp32_one():
    """The EAGLE-3 TTT loss and its gradients under CPU bf16 autocast (the weights stay fp32)
    against the fp32 step on the same weights and batch: the same loss to 2% and gradients
    pointing the same way (cosine > 0.99)."""
    import torch

    from specforge_lite.drafters.common import shifted_targets, stepwise_loss
    from specforge_lite.drafters.eagle3.model import Eagle3Config, Eagle3Drafter

    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         intermediate_size=128, vocab_size=256, draft_vocab_size=128,
                                         aux_layer_ids=[1, 2, 3]))
    ids = torch.randint(0, 256, (2, 32))
    aux, teacher = torch.randn(2, 32, 192), torch.randn(2, 32, 128) * 3

    def step(bf16: bool):
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = stepwise_loss(drafter(ids, aux, 3), shifted_targets(teacher, torch.ones(2, 32), 3), 0.8)[0]
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None])
        return float(loss), grads

    (loss32, grad32), (loss16, grad16) = step(False), step(True)
    assert abs(loss16 - loss32) <= 0.02 * abs(loss32)
    assert torch.nn.functional.cosine_similarity(grad16, grad32, dim=0) > 0.99
    assert not torch.equal(grad16, grad32)  # autocast did run the products in bf16
