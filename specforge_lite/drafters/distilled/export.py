"""The distilled student as vLLM's `draft_model`: a plain Hugging Face directory with the
target's tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from specforge_lite import SpecforgeError
from specforge_lite.drafters.distilled.model import load_student
from specforge_lite.drafters.distilled.train import load

log = logging.getLogger(__name__)


@torch.no_grad()
def max_logit_difference(a: nn.Module, b: nn.Module, vocab_size: int) -> float:
    torch.manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 16), device=a.device)
    return float((a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max())


def export(cfg, trained: Path, out: Path, target, tokenizer, k: int, k_source: str, verifier: str) -> dict:
    """Copy the student to `out/draft_model` with the target's tokenizer, reload it strictly
    (same keys and shapes, same logits) and write a README with the vLLM command."""
    from specforge_lite.checked_io import load_safetensors
    from specforge_lite.run_folders import atomic_write_text

    trained_model = load(trained, target)
    directory = out / "draft_model"
    directory.mkdir(parents=True, exist_ok=True)
    trained_model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    reloaded = load_student(str(directory), target, tokenizer).to(target.device).eval()
    written = {}
    for f in sorted(directory.glob("*.safetensors")):
        written.update(load_safetensors(f))
    expected = {k: tuple(v.shape) for k, v in trained_model.state_dict().items()}
    bad = [k for k in written if k not in expected or tuple(written[k].shape) != expected[k]]
    untied_missing = [k for k in expected if k not in written and k != "lm_head.weight"]
    if bad or untied_missing:
        raise SpecforgeError(f"{directory.name}: unexpected or misshapen {bad}, missing {untied_missing}")
    diff = max_logit_difference(trained_model, reloaded, trained_model.config.vocab_size)
    if diff != 0.0:
        raise SpecforgeError(f"{directory.name}: reloaded draft model differs from the trained one (max |dlogit| {diff})")
    log.info("draft-model export passed its strict reload (keys, shapes, tokenizer vocab; logits identical)")
    layers = trained_model.config.num_hidden_layers
    atomic_write_text(directory / "README.md", f"""# Draft model for {verifier}

Distilled by specforge_lite (recipe `{cfg.recipe_name}`): a {layers}-layer causal LM with the
target's tokenizer, trained on the target's own answers with {getattr(cfg.drafter.loss, 'value', cfg.drafter.loss)}
at temperature {cfg.drafter.temperature}{' (LoRA, merged)' if cfg.drafter.lora else ''}. Speculative tokens k = {k} ({k_source}).

```bash
vllm serve {verifier} \\
  --speculative-config '{{"method": "draft_model", "model": "<this directory>", "num_speculative_tokens": {k}}}'
```

The draft and the target must share the vocabulary (vLLM checks the sizes). It is also a
plain Hugging Face model: `AutoModelForCausalLM.from_pretrained("<this directory>")`, usable
as `assistant_model` in `transformers` assisted generation.
""")
    return {"format": "draft_model (Hugging Face causal LM)", "path": "draft_model", "speculative_tokens": k}
