"""Regenerate the DFlash golden folders with the peers' own code (then review the diff):

    python -m venv peers && peers/bin/pip install torch==2.13.0 transformers==5.19.0 speculators==0.9.0
    peers/bin/pip install --no-deps specforge==0.2.0
    peers/bin/python tests/golden/make_dflash_golden.py

Writes tests/golden/dflash/:
- `target/`: a tiny random Qwen3 target (transformers' `save_pretrained`);
- `specforge/`: a tiny random drafter made and saved by SpecForge's `DFlashDraftModel` (its HF
  export is `save_pretrained` plus `apply_legacy_rope_scaling`, both called here);
- `speculators/`: that folder converted by speculators' `DFlashConverter` against `target/`
  (a full-vocabulary draft: it saves neither the embedding nor the lm_head, both the target's);
- `reference.safetensors`: SpecForge's forward on one block (inputs and output), which the
  drafter we read from either folder must reproduce (tests/unit/test_dflash_golden.py);
- `versions.json`: the packages that wrote them.
Nothing of ours is imported: the folders are the peers' reading of their formats, not ours.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

OUT = Path(__file__).resolve().parent / "dflash"
VOCAB, HIDDEN, TARGET_LAYERS = 96, 32, 5
TARGET_LAYER_IDS = [0, 2, 3]  # SpecForge counts decoder-layer outputs: hidden_states[i + 1]
BLOCK, MASK, CONTEXT = 4, VOCAB - 1, 6


def target() -> Path:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=TARGET_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=False)
    path = OUT / "target"
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def specforge_drafter():
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.modeling.draft.dflash import DFlashDraftModel

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=False)
    config.architectures = ["DFlashDraftModel"]
    config.block_size = BLOCK
    config.num_target_layers = TARGET_LAYERS
    config.dflash_config = {"target_layer_ids": TARGET_LAYER_IDS, "mask_token_id": MASK}
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    model = DFlashDraftModel(config).eval()
    with torch.no_grad():  # norms away from 1 and weights of a trained scale, so a misread shows
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.3)
    path = OUT / "specforge"
    model.save_pretrained(path)
    apply_legacy_rope_scaling(str(path))
    return model, path


def reference(model, target_path: Path) -> None:
    """SpecForge's forward on a block after CONTEXT context positions, no mask (every row sees the
    context and the whole block: DFlash's non-causal block)."""
    target_model = Qwen3ForCausalLM.from_pretrained(target_path).eval()
    generator = torch.Generator().manual_seed(2)
    aux = torch.randn(1, CONTEXT, len(TARGET_LAYER_IDS) * HIDDEN, generator=generator)
    anchor = torch.randint(0, MASK, (1, 1), generator=generator)
    block = torch.cat([anchor, torch.full((1, BLOCK - 1), MASK)], dim=1)
    positions = torch.arange(CONTEXT + BLOCK)[None]
    with torch.no_grad():
        hidden = model(position_ids=positions, noise_embedding=target_model.get_input_embeddings()(block),
                       target_hidden=aux)
        logits = target_model.lm_head(hidden)
    save_file({"aux": aux.contiguous(), "block": block.contiguous(), "positions": positions.contiguous(),
               "hidden": hidden.contiguous(), "logits": logits.contiguous()}, str(OUT / "reference.safetensors"))


def speculators_folder() -> None:
    """Converted from inside OUT, so the config names its verifier `target`, not a path of this machine;
    the converter also copies its config class's source (`config.py`, for remote code), which we do not keep."""
    from speculators.convert.dflash.converter import DFlashConverter

    os.chdir(OUT)
    DFlashConverter().convert("specforge", "speculators", base_model="target", validate=True)
    (OUT / "speculators" / "config.py").unlink()


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    target_path = target()
    model, specforge_path = specforge_drafter()
    reference(model, target_path)
    speculators_folder()
    packages = ("torch", "transformers", "speculators", "specforge")
    (OUT / "versions.json").write_text(json.dumps({p: version(p) for p in packages}, indent=2) + "\n")
    print("wrote", sorted(str(p.relative_to(OUT)) for p in OUT.rglob("*") if p.is_file()))


if __name__ == "__main__":
    main()
