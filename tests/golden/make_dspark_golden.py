"""Regenerate the DSpark golden folders with speculators' own code (then review the diff):

    python -m venv peers && peers/bin/pip install torch==2.13.0 transformers==5.19.0 speculators==0.9.0
    peers/bin/python tests/golden/make_dspark_golden.py

Writes tests/golden/dspark/, for the tiny Qwen3 target of tests/golden/dflash/target:
- `vanilla/`, `gated/`, `rnn/`: a tiny random drafter per Markov head type, made by speculators'
  `DSparkDraftModel` and saved by its `save_pretrained` (vanilla with a reduced draft vocabulary
  and its d2t / t2d maps; rnn without the Markov embedding in the confidence head);
- `reference/<type>.safetensors` (beside the folders: a reader takes every safetensors file in a
  drafter folder as its weights): speculators' own training forward on one block (one anchor),
  the logits with the Markov bias and the confidence logits it hands to its loss (captured at
  `compute_metrics`), with the inputs, which the drafter we read from the folder must reproduce
  (tests/unit/test_dspark.py);
- `versions.json`: the packages that wrote them.
Nothing of ours is imported: the folders are speculators' reading of its format, not ours.
"""

from __future__ import annotations

import json
import shutil
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3Config

HERE = Path(__file__).resolve().parent
OUT = HERE / "dspark"
TARGET = HERE / "dflash" / "target"
AUX = [1, 3, 4]  # speculators' aux_hidden_state_layer_ids (the input of decoder layer i)
BLOCK, CONTEXT, RANK = 4, 6, 8
VARIANTS = {  # head type: (draft vocab size or None for the target's, confidence head reads the Markov embedding)
    "vanilla": (64, True),
    "gated": (None, True),
    "rnn": (None, False),
}


def drafter(kind: str, draft_vocab: int | None, with_markov: bool):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    target = AutoConfig.from_pretrained(TARGET)
    layers = Qwen3Config(vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=128, tie_word_embeddings=False)
    layers._attn_implementation = "eager"
    vocab = draft_vocab or target.vocab_size
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layers, draft_vocab_size=vocab, block_size=BLOCK, aux_hidden_state_layer_ids=AUX,
        mask_token_id=target.vocab_size - 1, sliding_window_non_causal=False, sample_from_anchor=True,
        markov_rank=RANK, markov_head_type=kind, enable_confidence_head=True, confidence_head_with_markov=with_markov,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="target", architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(len(kind))
    model = DSparkDraftModel(config).eval()
    if vocab < target.vocab_size:  # every other target id, then the rest of the lowest
        d2t_ids = torch.cat([torch.arange(0, target.vocab_size, 2), torch.arange(1, 2 * vocab - target.vocab_size, 2)])
        d2t_ids = d2t_ids.sort().values[:vocab]
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[d2t_ids] = True
        model.load_vocab_mappings(t2d, d2t_ids - torch.arange(vocab))
    with torch.no_grad():  # norms away from 1 and weights of a trained scale, so a misread shows
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.3)
        # the verifier's embedding, as its trainer loads it (`load_verifier_weights`): save_pretrained leaves it out
        verifier = load_file(str(TARGET / "model.safetensors"))
        model.embed_tokens.weight.copy_(verifier["model.embed_tokens.weight"])
        if vocab == target.vocab_size:  # a full-vocabulary head is the verifier's: not saved either
            model.lm_head.weight.copy_(verifier["lm_head.weight"])
    return model


def reference(model, out: Path) -> None:  # out: the file
    """speculators' forward with one anchor at position CONTEXT (the loss mask allows no other),
    the Markov-biased logits and confidence logits captured where its loss reads them."""
    from speculators.models.dspark import core

    captured = {}
    original = core.compute_metrics

    def capture(logits, targets, confidence_logits, *args, **kwargs):  # its loss (fused: Triton) is not needed
        captured.update(logits=logits.detach().clone(), confidence=confidence_logits.detach().clone())
        return torch.zeros(()), {}

    core.compute_metrics = capture
    generator = torch.Generator().manual_seed(2)
    length = CONTEXT + 2 * BLOCK
    hidden = model.config.transformer_layer_config.hidden_size
    vocab = model.config.transformer_layer_config.vocab_size
    aux = torch.randn(1, length, len(AUX) * hidden, generator=generator)
    ids = torch.randint(0, vocab - 1, (1, length), generator=generator)
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, CONTEXT] = 1
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, loss_mask=loss_mask,
              verifier_last_hidden_states=torch.randn(1, length, hidden, generator=generator),
              document_ids=torch.zeros(1, length, dtype=torch.long), max_anchors=1)
    core.compute_metrics = original
    save_file({"aux": aux.contiguous(), "input_ids": ids.contiguous(), "anchor": torch.tensor([CONTEXT]),
               "logits": captured["logits"].contiguous(), "confidence": captured["confidence"].contiguous()},
              str(out))


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "reference").mkdir(parents=True)
    for kind, (draft_vocab, with_markov) in VARIANTS.items():
        model = drafter(kind, draft_vocab, with_markov)
        model.save_pretrained(OUT / kind)
        (OUT / kind / "config.py").unlink()  # its config class's source, for remote code: not kept
        reference(model, OUT / "reference" / f"{kind}.safetensors")
    packages = ("torch", "transformers", "speculators")
    (OUT / "versions.json").write_text(json.dumps({p: version(p) for p in packages}, indent=2) + "\n")
    print("wrote", sorted(str(p.relative_to(OUT)) for p in OUT.rglob("*") if p.is_file()))


if __name__ == "__main__":
    main()
