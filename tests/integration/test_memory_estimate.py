"""The training memory estimate (scale/dry_run.py `estimate`, each drafter's `dry_size`) against
the memory one real training step takes.

`train.tokens_per_step=auto` fills a device with as many sequences as this estimate says fit, so a
term it misses grows with the batch until the device runs out (an H200 at the demo's auto batch
did, in `make gpu-check`). Here one step of each demo recipe's drafter (the train stage's own
pieces: target features, the drafter's batch preparation, loss and backward under bf16 autocast
as on a GPU) runs on the CPU on the recipe's real target and drafter (SmolLM2, its whole
vocabulary) under a dispatch mode that counts the bytes of every tensor storage made in the step
and still alive; the growth of its peak per sequence, from SMALL to LARGE sequences, must stay
within what the estimate charges per sequence. Weights' terms are left out on both sides (the
estimate's are zeroed; tensors of a weight's shape are not counted, nor is the optimizer's step):
when they were counted they set the peak at these batches, and the test passed with the drafter's
activations left out of the estimate. The sequences are `SEQ` tokens instead of the recipe's
512: every term of the estimate grows with the length (a term it misses is missed at any length),
and a step at 512 costs minutes on a CPU without bf16.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from specforge_lite.drafters.registry import chosen_drafter
from specforge_lite.scale.dry_run import estimate
from specforge_lite.targets.loading import sizing_config
from specforge_lite.training.features import collate, target_hidden
from tests.conftest import compose

pytestmark = pytest.mark.slow

SMALL, LARGE = 2, 4
SEQ = 32
RECIPES = ["eagle_smollm2", "medusa_smollm2", "dflash_smollm2", "peagle_smollm2"]


class LiveBytes(TorchDispatchMode):
    """The bytes of tensor storages created inside the mode and still alive, and their peak; a
    tensor of a weight's shape (a gradient, a weight's bf16 copy under autocast) is a weights' term
    and is not counted."""

    def __init__(self, weight_shapes: set[tuple[int, ...]]):
        super().__init__()
        self.now = self.peak = 0
        self.live: set[int] = set()
        self.weight_shapes = weight_shapes

    def _freed(self, key: int, size: int) -> None:
        self.now -= size
        self.live.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or in-place result shares an input's storage: made before the mode (a weight's
        # transpose) it is no new memory, made inside it is counted already
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.live or key in inputs or tuple(t.shape) in self.weight_shapes:
                continue
            self.live.add(key)
            self.now += size
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key, size)
        return out


def step_peak(cfg, target, tokenizer, batch_size: int, bf16: bool) -> int:
    """Peak bytes of the tensors made during one training step of `batch_size` full rows."""
    module = chosen_drafter(cfg)
    torch.manual_seed(0)
    drafter = module.build(cfg, target, torch.ones(target.config.vocab_size))
    aux_ids = module.target_layers(drafter)
    prepare = module.batch_preparer(drafter, target)
    gen = torch.Generator().manual_seed(1)
    seq = cfg.data.max_length
    rows = [{"input_ids": torch.randint(0, target.config.vocab_size - 2, (seq,), generator=gen).tolist(),
             "loss_mask": [1] * seq} for _ in range(batch_size)]
    counter = LiveBytes({tuple(p.shape) for model in (drafter, target) for p in model.parameters() if p.dim() > 1})
    with counter:
        batch = collate(rows, tokenizer.pad_token_id, torch.device("cpu"))
        aux, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], aux_ids,
                                  torch.bfloat16 if bf16 else None)
        prepare(batch, aux, last, True)
        del aux, last
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as the train stage's loop
            loss, num, _ = module.loss_and_metrics(drafter, batch, cfg)
            (loss / num).backward()
    return counter.peak


def estimated(cfg, config, batch_size: int) -> float:
    """The estimate's bytes of one rank at `batch_size` sequences; the weights' terms are left at
    zero (they do not grow with the batch, and only the difference of two batches is compared)."""
    at = OmegaConf.merge(cfg, {"train": {"batch_size": batch_size}, "trainer": {"dry_run_gpus": 1}})
    size = chosen_drafter(at).dry_size(at, config, batch_size, cfg.data.max_length)
    return estimate(at, config, size, 0, 0)["total_gib"] * 1024 ** 3


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_estimate_charges_every_byte_a_sequence_adds(recipe, smollm2_target):
    target, tokenizer = smollm2_target
    cfg = compose(["stage=train", f"+recipe={recipe}", f"data.max_length={SEQ}"])
    config = sizing_config(cfg.target.path)
    grown = step_peak(cfg, target, tokenizer, LARGE, True) - step_peak(cfg, target, tokenizer, SMALL, True)
    measured = grown / (LARGE - SMALL)
    charged = (estimated(cfg, config, LARGE) - estimated(cfg, config, SMALL)) / (LARGE - SMALL)
    print(f"{recipe}: one step takes {measured / 2**20:.1f} MiB a sequence, the estimate charges "
          f"{charged / 2**20:.1f}")  # the figures the notes quote (pytest -s)
    assert charged >= measured, f"{recipe}: the estimate charges {charged / 2**20:.0f} MiB a sequence, " \
                                f"one step takes {measured / 2**20:.0f} MiB more a sequence"
