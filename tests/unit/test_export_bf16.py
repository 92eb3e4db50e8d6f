"""Every drafter exports after a bf16 target, the default on GPUs, where users export (issue 52):
EAGLE-3's reload check fed float32 inputs to a drafter reloaded in bf16 and stopped on a dtype
error. Each registered drafter is built for the tiny Llama loaded in bf16 (what the train stage
saves), then exported against that target's head as the export stage loads it; its strict reload
and logit comparison must pass."""

from __future__ import annotations

import pytest
import torch

from specforge_lite.drafters.registry import DRAFTERS
from tests.conftest import CONF_DIR, compose, target_cfg


def smoke_recipe(kind: str) -> str:
    """The smoke recipe of drafter `kind` (smoke itself is EAGLE-3's)."""
    for path in sorted((CONF_DIR / "recipe").glob("smoke*.yaml")):
        if f"override /drafter: {kind}" in path.read_text():
            return path.stem
    return "smoke"


@pytest.fixture(scope="module")
def bf16_target():
    from specforge_lite.targets.loading import load_target

    return load_target(target_cfg("builtin:tiny-llama", dtype="bfloat16"))


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_every_drafter_exports_after_a_bf16_target(bf16_target, tmp_path, kind):
    from specforge_lite.targets.head import load_target_head

    model, _ = bf16_target
    assert model.dtype == torch.bfloat16
    cfg = compose(["stage=export", f"+recipe={smoke_recipe(kind)}", "target.dtype=bfloat16", "target.device=cpu"])
    assert cfg.drafter.name == kind
    module = DRAFTERS[kind]
    counts = torch.arange(model.config.vocab_size, dtype=torch.long)  # every id seen, in a fixed order
    module.save(module.build(cfg, model, counts), tmp_path / "drafter")
    head, tokenizer = load_target_head(cfg.target)
    assert head.dtype == torch.bfloat16
    info = module.export(cfg, tmp_path / "drafter", tmp_path / "export", head, tokenizer, 2, "test", "tiny-llama")
    assert (tmp_path / "export" / info["path"] / "README.md").is_file()
