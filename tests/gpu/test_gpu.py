"""Checks that need a GPU (`pytest -m gpu`): they run wherever CUDA is, and are skipped,
saying why, everywhere else.

- one EAGLE-3 training step in bf16 autocast against the same step in fp32 (the train
  stage's own pieces: target features, soft labels over the draft vocabulary, TTT loss);
- the compiled decode (static KV cache, compiled widths) against the eager one;
- the train stage on 2 GPUs (NCCL), started as one plain process that launches its ranks,
  against 1 GPU with the same global batch.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import run_cli

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: GPU checks run "
                                 "wherever one is (pytest -m gpu)")]

# bf16 keeps 8 bits of mantissa (relative rounding 2**-8 = 0.4%) on every product; over a 6-layer
# target's features, one drafter layer and 3 TTT steps the loss moves by well under 2%, and the
# gradient keeps its direction (cosine 0.99)
BF16_LOSS_RTOL = 2e-2
BF16_GRAD_COSINE = 0.99


@pytest.fixture(scope="module")
def cuda_target(tiny_target):
    model, tokenizer = tiny_target
    return model.to("cuda"), tokenizer


def eagle3_step(target, autocast: bool) -> tuple[float, torch.Tensor]:
    """Loss per position and the flattened gradient of one EAGLE-3 step on fixed random rows."""
    from specforge_lite.drafters import eagle3
    from specforge_lite.training.features import collate, target_hidden

    cfg = OmegaConf.create({"drafter": {"draft_vocab_size": 64, "aux_layer_ids": [1, 3, 4], "ttt_steps": 3,
                                        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
                                        "norm_output": False, "loss": "forward_kl"},
                            "train": {"seed": 0, "step_weight": 0.8}})
    torch.manual_seed(0)
    drafter = eagle3.build(cfg, target, torch.arange(target.config.vocab_size).flip(0)).to("cuda")
    gen = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 256, (48,), generator=gen).tolist(), "loss_mask": [0] * 8 + [1] * 40}
            for _ in range(4)]
    batch = collate(rows, 258, torch.device("cuda"))
    aux, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], list(drafter.config.aux_layer_ids))
    eagle3.batch_preparer(drafter, target)(batch, aux, last, True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss, num, _ = eagle3.loss_and_metrics(drafter, batch, cfg)
    per_position = loss / max(1, num)
    per_position.backward()
    grad = torch.cat([p.grad.float().flatten() for p in drafter.parameters() if p.grad is not None])
    return per_position.item(), grad


def test_bf16_training_step_against_fp32(cuda_target):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    target, _ = cuda_target
    loss32, grad32 = eagle3_step(target, autocast=False)
    loss16, grad16 = eagle3_step(target, autocast=True)
    assert abs(loss16 - loss32) <= BF16_LOSS_RTOL * abs(loss32), (loss16, loss32)
    assert torch.nn.functional.cosine_similarity(grad16, grad32, dim=0) >= BF16_GRAD_COSINE


def test_compiled_decode_equals_eager(cuda_target, forbid_recompiles):
    from specforge_lite.decoding.drafters import NgramDrafter
    from specforge_lite.decoding.engine import generate_plain, generate_speculative
    from specforge_lite.runtime.fast_engine import FastEngine

    target, _ = cuda_target
    eager = FastEngine(target, capacity=128, hidden_layers=(), max_width=4)
    compiled = FastEngine(target, capacity=128, hidden_layers=(), max_width=4, compiled=True)
    assert compiled.compile() > 0
    forbid_recompiles()  # the graphs built are the ones used
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 256, (20,), generator=gen).tolist()
        want = generate_plain(target, ids, 40, runner=eager.runner()).tokens
        assert generate_plain(target, ids, 40, runner=compiled.runner()).tokens == want
        assert generate_speculative(target, NgramDrafter(), ids, 40, 3, runner=compiled.runner()).tokens == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for a 2-rank NCCL run")
def test_two_gpu_ranks_match_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["+recipe=smoke", "target.device=auto", "train.mixed_precision=no", "train.checkpoint_every=0",
            "train.max_steps=6", "train.log_every=2"]
    run_cli("sample", *args, f"run_dir={one}", check=True)
    shutil.copytree(one / "samples", two / "samples")
    run_cli("train", *args, "trainer.num_processes=1", f"run_dir={one}", check=True)
    proc = run_cli("train", *args, "trainer.num_processes=2", f"run_dir={two}", check=True)
    assert "starting 2 rank(s)" in proc.stdout + proc.stderr and "trainer ddp on 2 rank(s)" in proc.stdout + proc.stderr
    curve_one = json.loads((one / "train" / "metrics.json").read_text())["history"]
    curve_two = json.loads((two / "train" / "metrics.json").read_text())["history"]
    assert [h["step"] for h in curve_one] == [h["step"] for h in curve_two]
    for a, b in zip(curve_one, curve_two):  # NCCL's reduction order only (TF32 off in fp32 matmuls by default)
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(a["loss"])
