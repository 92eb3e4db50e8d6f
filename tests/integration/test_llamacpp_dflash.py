"""DFlash in real llama.cpp (marker `llamacpp`): our DFlash export written as a `dflash` GGUF
runs in llama.cpp's `draft-dflash` (xllamacpp, in-process) beside the tiny target, its greedy
output equals llama.cpp's plain output, and it drafts and accepts what our own engine does with
the same drafter (a wrong tensor layout, rope, tap layer or mask would change the accepted
counts). The export stage writes it with `export.gguf=true` and the `llamacpp_dflash` evaluate
method serves it; what llama.cpp cannot read is refused before anything is written.

Needs xllamacpp (`make llamacpp`); skipped without it, an error with
SPECFORGE_LITE_REQUIRE_LLAMACPP=1 (CI). The door and writer refusals need no llama.cpp.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite.decoding.engine import generate_plain, generate_speculative
from specforge_lite.drafters import dflash
from specforge_lite.drafters.dflash.export import load_speculators_dir, write_speculators_dir
from specforge_lite.serving.llamacpp.dflash_gguf import dflash_to_gguf
from specforge_lite.serving.llamacpp.gguf_export import llama_to_gguf
from specforge_lite.serving.llamacpp.gguf_read import GGUFExportError, field_value, read_gguf
from specforge_lite.serving.llamacpp.runner import INSTALL_HINT, LlamaCppRunner, available
from specforge_lite.targets.loading import resolve_target_path
from tests.integration.test_bad_inputs import assert_user_error, cli, in_process

pytestmark = [pytest.mark.llamacpp]

AUX, BLOCK, NEW_TOKENS = [1, 3, 4], 4, 32
PROMPTS = [[257, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100],  # <|im_start|> "Hello world"
           [257, 84, 104, 101, 32, 99, 97, 116]]  # <|im_start|> "The cat"
TRAIN_STEPS = 25  # enough for a partly right drafter: both engines then accept some drafts, not all


def needs_llamacpp():
    if not available():
        if os.environ.get("SPECFORGE_LITE_REQUIRE_LLAMACPP") == "1":
            pytest.fail(f"SPECFORGE_LITE_REQUIRE_LLAMACPP=1 but xllamacpp is not installed: {INSTALL_HINT}")
        pytest.skip(f"xllamacpp is not installed ({INSTALL_HINT})")


def options(causal: bool = False, draft_vocab_size: int = 64):
    return OmegaConf.create({
        "drafter": {"draft_vocab_size": draft_vocab_size, "aux_layer_ids": AUX, "num_layers": 2, "block_size": BLOCK,
                    "num_anchors": 8, "causal": causal, "mask_token_id": None, "position_weight": "exp_decay",
                    "decay_gamma": 4.0, "dpace_alpha": 0.5, "loss": "forward_kl"},
        "train": {"seed": 0}, "data": {"max_length": 64}})


def fitted_drafter(model, sequences: list[list[int]], steps: int):
    """A DFlash drafter fitted for `steps` Adam steps to the target's own continuations (every
    anchor, cross-entropy on block rows 1..S-1): partly right, so acceptance counts mean something."""
    vocab = model.config.vocab_size
    counts = sum(torch.bincount(torch.tensor(s), minlength=vocab) for s in sequences)
    torch.manual_seed(0)
    drafter = dflash.build(options(), model, counts)
    draft_index = torch.full((vocab,), -100)
    draft_index[drafter.draft_vocab] = torch.arange(drafter.config.draft_vocab_size)
    batches = []
    for seq in sequences:
        ids = torch.tensor([seq])
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states
        anchors = torch.arange(1, len(seq) - 1)[None]
        positions = anchors[..., None] + torch.arange(BLOCK)
        labels = torch.tensor(seq + [0] * BLOCK)[positions]
        labels = torch.where(positions < len(seq), draft_index[labels], -100)[..., 1:]
        batches.append((ids, torch.cat([hidden[k] for k in AUX], -1), anchors, labels))
    optim = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    drafter.train()
    for _ in range(steps):
        loss = 0.0
        for ids, aux, anchors, labels in batches:
            logits = drafter(ids, aux, anchors, torch.ones_like(ids, dtype=torch.bool))[:, :, 1:]
            loss = loss + torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny target (HF fp32 model, f32 GGUF) and a fitted non-causal DFlash speculators export."""
    needs_llamacpp()
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("llamacpp_dflash")
    hf_dir = Path(resolve_target_path("builtin:tiny-llama"))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    target_gguf = llama_to_gguf(hf_dir, out / "target.gguf", precision="f32")
    sequences = [p + generate_plain(model, p, NEW_TOKENS + BLOCK).tokens for p in PROMPTS]
    drafter = fitted_drafter(model, sequences, TRAIN_STEPS)
    write_speculators_dir(drafter, out / "speculators", BLOCK - 1, "tiny", ["LlamaForCausalLM"])
    return model, target_gguf, out


def as_variant(pair, causal: bool) -> Path:
    """The export, flagged causal or not (the same weights: the flag alone changes what runs)."""
    _, _, out = pair
    folder = out / f"speculators_causal_{causal}"
    if not folder.exists():
        shutil.copytree(out / "speculators", folder)
        config = json.loads((folder / "config.json").read_text())
        config["sliding_window_non_causal"] = not causal
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("causal", [False, True], ids=["non_causal", "causal"])
def test_dflash_gguf_drafts_in_llamacpp_as_our_engine_does(pair, causal):
    model, target_gguf, out = pair
    folder = as_variant(pair, causal)
    gguf = dflash_to_gguf(folder, target_gguf, out / f"dflash_{causal}.gguf", precision="f32")
    reader = read_gguf(gguf)
    assert field_value(reader, "general.architecture") == "dflash"
    assert list(field_value(reader, "dflash.target_layers")) == AUX
    assert field_value(reader, "dflash.block_size") == BLOCK
    assert bool(field_value(reader, "dflash.attention.causal")) == causal
    drafter = load_speculators_dir(folder, model)
    assert field_value(reader, "tokenizer.ggml.mask_token_id") == drafter.config.mask_token_id
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["d2t"] == "I64" and "token_embd.weight" not in kinds  # the target's embeddings are shared
    decoder = dflash.decoder(drafter)
    for prompt in PROMPTS:
        with LlamaCppRunner(target_gguf, "llamacpp_plain") as runner:
            plain = runner.complete(prompt, NEW_TOKENS)
        with LlamaCppRunner(target_gguf, "llamacpp_dflash", draft_gguf=gguf, speculative_tokens=BLOCK - 1) as runner:
            assert runner.refusal is None
            spec = runner.complete(prompt, NEW_TOKENS)
        ours = generate_speculative(model, decoder, prompt, NEW_TOKENS, BLOCK - 1)
        assert spec.tokens == plain.tokens == ours.tokens
        assert 0 < spec.accepted < spec.drafted, "llama.cpp must have drafted, and a partly fitted drafter misses some"
        # the same drafter in both engines drafts and accepts alike (a near-tie in the drafter's
        # argmax may round differently in llama.cpp's kernels: a token or two of slack)
        assert abs(spec.drafted - sum(ours.draft_lengths)) <= 2, (spec.drafted, ours.draft_lengths)
        assert abs(spec.accepted - sum(ours.accepted_lengths)) <= 2, (spec.accepted, ours.accepted_lengths)


def test_full_draft_vocabulary_writes_no_d2t_and_runs(pair, tmp_path):
    model, target_gguf, _ = pair
    drafter = dflash.build(options(draft_vocab_size=10_000), model, torch.ones(model.config.vocab_size))
    write_speculators_dir(drafter.eval(), tmp_path / "full", BLOCK - 1, "tiny", ["LlamaForCausalLM"])
    gguf = dflash_to_gguf(tmp_path / "full", target_gguf, tmp_path / "full.gguf", precision="q8_0")
    kinds = {t.name: t.tensor_type.name for t in read_gguf(gguf).tensors}
    assert "d2t" not in kinds and kinds["output.weight"] == "Q8_0" and kinds["blk.0.attn_q_norm.weight"] == "F32"
    with LlamaCppRunner(target_gguf, "llamacpp_plain") as runner:
        plain = runner.complete(PROMPTS[0], 16)
    with LlamaCppRunner(target_gguf, "llamacpp_dflash", draft_gguf=gguf, speculative_tokens=BLOCK - 1) as runner:
        spec = runner.complete(PROMPTS[0], 16)
    assert spec.tokens == plain.tokens and spec.drafted > 0


def test_what_llamacpp_cannot_read_is_refused_before_writing(pair, tmp_path):
    _, target_gguf, out = pair
    cases = [("sample_from_anchor", True, "sample_from_anchor=true"),
             ("aux_hidden_state_layer_ids", [1, 3, 6], r"aux layers \[1, 3, 6\] are not inputs of this 6-layer"),
             ("mask_token_id", 320, "mask_token_id 320 is not a target token id")]
    for key, value, message in cases:
        folder = tmp_path / key
        shutil.copytree(out / "speculators", folder)
        config = json.loads((folder / "config.json").read_text())
        config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(GGUFExportError, match=message):
            dflash_to_gguf(folder, target_gguf, tmp_path / "refused.gguf")
        assert not list(tmp_path.glob("refused.gguf*"))
    with pytest.raises(GGUFExportError, match="not a speculators DFlash"):
        dflash_to_gguf(tmp_path / "missing_dir_is_not_an_export", target_gguf, tmp_path / "refused.gguf")


# --------------------------------------------------------------------------- through the stages

SMOKE = ["+recipe=smoke_dflash", "train.max_steps=2"]


def test_export_gguf_and_llamacpp_dflash_method_through_the_stages(tmp_path):
    needs_llamacpp()
    for stage in (["train", *SMOKE], ["export", *SMOKE, "export.gguf=true"]):
        assert in_process(*stage, f"run_dir={tmp_path}") == 0, stage
    info = json.loads((tmp_path / "export" / "gguf" / "gguf.json").read_text())
    assert info["draft"] == "dflash.gguf" and info["spec_type"] == "draft-dflash"
    assert info["extract_layers"] == [1, 3, 4] and info["load_check"]["identical_to_plain"]
    assert info["load_check"]["drafted"] > 0
    assert in_process("evaluate", *SMOKE, f"run_dir={tmp_path}", "eval.max_prompts=1", "eval.max_new_tokens=16",
                      "eval.num_draft_tokens=3", "eval.plots=false", "eval.best_k_method=null",
                      "eval.methods=[llamacpp_dflash]") == 0
    section = json.loads((tmp_path / "eval" / "report.json").read_text())["llamacpp"]
    assert section["failed"] == {}
    entry = section["methods"]["llamacpp_dflash"]
    assert entry["identical_to_llamacpp_plain"] is True and entry["drafted"] > 0


def test_llamacpp_dflash_without_its_gguf_is_refused_at_the_door(capsys, tmp_path):
    code, err = cli(capsys, "evaluate", *SMOKE, f"run_dir={tmp_path}", "eval.methods=[llamacpp_dflash]",
                    "eval.best_k_method=null")
    assert_user_error(code, err, f"llamacpp_dflash needs {tmp_path}/export/gguf/dflash.gguf")
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "eval").exists()
