"""DFlash folders written by the peers' own code (tests/golden/dflash, made by
tests/golden/make_dflash_golden.py with SpecForge 0.2.0 and speculators 0.9.0): our readers take
them, read the layer ids the tools recorded, and reproduce SpecForge's forward on the same block;
the drafter then decodes the tiny target losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specforge_lite.decoding.engine import generate_plain, generate_speculative
from specforge_lite.drafters import dflash
from specforge_lite.drafters.registry import detect_drafter

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "dflash"


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(GOLDEN / "target", dtype=torch.float32).eval()


def test_the_golden_folders_were_written_by_the_peers():
    versions = json.loads((GOLDEN / "versions.json").read_text())
    assert versions["speculators"] == "0.9.0" and versions["specforge"] == "0.2.0"


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_a_peer_folder_reproduces_specforge_forward(target, layout):
    """speculators' converter saves a full-vocabulary draft without embedding or lm_head (the target's)."""
    folder = GOLDEN / layout
    assert detect_drafter(folder) == ("dflash", layout)
    drafter = dflash.load(folder, target)
    # SpecForge's target_layer_ids [0, 2, 3] count decoder-layer outputs; speculators' converter wrote ours
    assert drafter.config.aux_layer_ids == [1, 3, 4] and drafter.config.block_size == 4
    assert drafter.config.causal is False and drafter.config.mask_token_id == 95
    ref = load_file(str(GOLDEN / "reference.safetensors"))
    context_len = ref["aux"].shape[1]
    positions = ref["positions"]
    with torch.no_grad():
        context = drafter.context_kv(drafter.context(ref["aux"]), positions[:, :context_len])
        rows = ref["block"].shape[1]
        allowed = torch.ones(1, rows, context_len + rows, dtype=torch.bool)
        hidden = drafter.norm(drafter.block_hidden(ref["block"], positions[:, context_len:], context, allowed))
        logits = drafter.lm_head(hidden)
    torch.testing.assert_close(hidden, ref["hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)


def test_both_peer_folders_draft_alike_and_decode_losslessly(target):
    """The two folders hold one drafter (speculators' converter wrote the second from the first): read
    by our two readers, they must propose the same drafts from the same contexts, step by step, and
    each decode equals plain decoding (a random drafter's drafts are rejected, so identity alone
    could not tell a misread folder: the proposals can)."""
    proposals = {}
    for layout in ("specforge", "speculators"):
        decoder = dflash.decoder(dflash.load(GOLDEN / layout, target))
        seen, propose = proposals.setdefault(layout, []), decoder.propose

        def recording(ctx, k, propose=propose, seen=seen):
            proposal = propose(ctx, k)
            seen.append(proposal.tokens)
            return proposal
        decoder.propose = recording
        for seed in range(2):
            prompt = torch.randint(0, 95, (5 + 4 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            out = generate_speculative(target, decoder, prompt, 16, 3)
            assert out.tokens == generate_plain(target, prompt, 16).tokens and sum(out.draft_lengths) > 0
    assert sum(len(p) == 3 for p in proposals["specforge"]) > 8  # k = 3 but near an answer's end
    assert proposals["specforge"] == proposals["speculators"]
