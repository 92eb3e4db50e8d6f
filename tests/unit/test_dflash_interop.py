"""DFlash drafters read back from the peers' layouts: folders written by hand the way
speculators' trainer (`DFlashDraftModel.save_pretrained`) and SpecForge's HF export
(`export/to_hf.py`) write them, from a real tiny drafter's weights; read back, the drafter
gives the same logits and decodes losslessly; a folder that does not fit is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from transformers import Qwen3Config

from specforge_lite import SpecforgeError
from specforge_lite.drafters.registry import detect_drafter
from specforge_lite.decoding.engine import generate_plain, generate_speculative
from specforge_lite.drafters import dflash
from specforge_lite.drafters.dflash.export import max_logit_difference

AUX = [1, 3, 4]  # our ids: the input of decoder layer k (HF hidden_states[k])


def tiny_drafter(tiny_target, draft_vocab_size=64, causal=False):
    """A DFlash drafter for the tiny target, its trainable weights random."""
    model, _ = tiny_target
    opts = OmegaConf.create({"drafter": {
        "draft_vocab_size": draft_vocab_size, "aux_layer_ids": AUX, "num_layers": 2, "block_size": 4,
        "num_anchors": 8, "causal": causal, "mask_token_id": 300, "position_weight": "exp_decay", "decay_gamma": 4.0,
        "dpace_alpha": 0.5, "loss": "forward_kl"}, "train": {"seed": 0}, "data": {"max_length": 64}})
    drafter = dflash.build(opts, model, torch.arange(model.config.vocab_size).flip(0))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if param.requires_grad:
                param.uniform_(0.5, 1.5) if "norm" in name else param.mul_(0.3)
    return drafter.eval()


def qwen3_layers(drafter, **extra) -> Qwen3Config:
    c = drafter.config
    return Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act="silu",
                       max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                       rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                       tie_word_embeddings=False, **extra)


def write_speculators_trainer_dir(drafter, out, layer_types, sliding_window=2048, non_causal=False, drop=()):
    """What speculators' trainer saves: every tensor but verifier_norm / verifier_lm_head (its
    `_keys_to_ignore_on_save`; d2t / t2d only for a reduced vocabulary), and its config with the
    Qwen3 layer config as `to_diff_dict` writes it (layer_types included)."""
    out.mkdir(parents=True)
    c = drafter.config
    layers = qwen3_layers(drafter, layer_types=layer_types, sliding_window=sliding_window,
                          use_sliding_window="sliding_attention" in layer_types)
    config = {"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"],
              "speculators_version": "0.5.0", "transformer_layer_config": layers.to_diff_dict(),
              "draft_vocab_size": c.draft_vocab_size, "block_size": c.block_size, "target_hidden_size": None,
              "aux_hidden_state_layer_ids": AUX, "mask_token_id": c.mask_token_id,
              "sliding_window_non_causal": non_causal, "sample_from_anchor": False,
              "speculators_config": {"algorithm": "dflash", "proposal_methods": [
                  {"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
                  "default_proposal_method": "greedy", "verifier": {"name_or_path": "tiny", "architectures": []}}}
    state = {k: v.contiguous() for k, v in drafter.state_dict().items() if k not in drop}
    if c.draft_vocab_size == c.vocab_size:
        state.pop("d2t"), state.pop("t2d")
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return config


def write_specforge_dir(drafter, out, shards=1, **dflash_config):
    """What SpecForge's HF export saves for `DFlashDraftModel`: the body weights only (no
    embedding, no lm_head: the target's), a Qwen3 config with `block_size` and `dflash_config`
    whose target_layer_ids count decoder-layer outputs (ours - 1)."""
    out.mkdir(parents=True)
    c = drafter.config
    config = {**qwen3_layers(drafter, layer_types=["full_attention"] * c.num_layers).to_dict(),
              "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
              "block_size": c.block_size, "num_target_layers": 6,
              "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in AUX],
                                **dflash_config}}
    body = sorted(k for k in drafter.state_dict() if k not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"))
    for i in range(shards):
        part = {k: drafter.state_dict()[k].contiguous() for k in body[i::shards]}
        save_file(part, str(out / (f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1
                                   else "model.safetensors")))
    (out / "config.json").write_text(json.dumps(config))
    return config


def assert_lossless(model, drafter):
    decoder = dflash.decoder(drafter)
    for seed in range(2):
        prompt = torch.randint(0, 256, (6 + 5 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        assert generate_speculative(model, decoder, prompt, 20, 3).tokens == generate_plain(model, prompt, 20).tokens


# --------------------------------------------------------------------------- speculators

@pytest.mark.parametrize("causal", [False, True])
def test_a_speculators_trainer_folder_reads_back(tiny_target, tmp_path, causal):
    """Full-attention layers see their whole block; sliding-window layers (a window that never
    binds) only the rows before them, as speculators' trainer masks them."""
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, causal=causal)
    kind = "sliding_attention" if causal else "full_attention"
    write_speculators_trainer_dir(drafter, tmp_path / "spec", [kind, kind])
    assert detect_drafter(tmp_path / "spec") == ("dflash", "speculators")
    loaded = dflash.load(tmp_path / "spec", model)
    assert loaded.config == drafter.config
    assert max_logit_difference(drafter, loaded) == 0.0
    assert_lossless(model, loaded)


def test_speculators_trainer_defaults_read_with_a_warning(tiny_target, tmp_path, caplog):
    """Its default: every layer a 2048-token window, causal within the block; read as the whole
    context (the same drafts below 2048 tokens), causal."""
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, causal=True)
    config = write_speculators_trainer_dir(drafter, tmp_path / "spec", ["sliding_attention"] * 2)
    config["transformer_layer_config"]["max_position_embeddings"] = 8192
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    loaded = dflash.load(tmp_path / "spec", model)
    assert loaded.config.causal is True and "2048-token window" in caplog.text
    assert max_logit_difference(drafter, loaded) == 0.0  # 16 positions: inside the window


def test_a_full_vocabulary_speculators_folder_without_embedding(tiny_target, tmp_path):
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, draft_vocab_size=1000)
    assert drafter.config.draft_vocab_size == drafter.config.vocab_size
    write_speculators_trainer_dir(drafter, tmp_path / "spec", ["full_attention"] * 2, drop=("embed_tokens.weight",))
    assert max_logit_difference(drafter, dflash.load(tmp_path / "spec", model)) == 0.0


def test_our_export_still_reads_back_with_its_causality(tiny_target, tmp_path):
    from specforge_lite.drafters.dflash.export import write_speculators_dir

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, causal=True)
    write_speculators_dir(drafter, tmp_path / "spec", 3, "tiny", ["LlamaForCausalLM"])
    loaded = dflash.load(tmp_path / "spec", model)
    assert loaded.config == drafter.config and max_logit_difference(drafter, loaded) == 0.0


# --------------------------------------------------------------------------- SpecForge

@pytest.mark.parametrize("shards", [1, 2])
def test_a_specforge_folder_reads_back(tiny_target, tmp_path, shards):
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, draft_vocab_size=1000)
    write_specforge_dir(drafter, tmp_path / "sf", shards=shards)
    assert detect_drafter(tmp_path / "sf") == ("dflash", "specforge")
    loaded = dflash.load(tmp_path / "sf", model)
    assert loaded.config == drafter.config  # aux ids shifted by one, full vocabulary, non-causal
    assert max_logit_difference(drafter, loaded) == 0.0
    assert_lossless(model, loaded)


def test_a_specforge_folder_converts_to_the_speculators_layout(tiny_target, tmp_path):
    """export.drafter_dir may name a peer's folder: the export reads it as evaluate does."""
    from specforge_lite.drafters.dflash.export import export

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, draft_vocab_size=1000)
    write_specforge_dir(drafter, tmp_path / "sf")
    cfg = OmegaConf.create({"recipe_name": "tiny"})
    export(cfg, tmp_path / "sf", tmp_path / "out", model, None, 3, "test", "tiny")
    converted = dflash.load(tmp_path / "out" / "speculators", model)
    assert converted.config == drafter.config and max_logit_difference(drafter, converted) == 0.0


# --------------------------------------------------------------------------- refusals

def refusal(folder, model, *needles):
    with pytest.raises(SpecforgeError) as err:
        dflash.load(folder, model)
    line = str(err.value)
    assert "\n" not in line and all(needle in line for needle in needles), line


def test_folders_that_do_not_fit_are_refused_in_one_line(tiny_target, tmp_path):
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, draft_vocab_size=1000)
    # SpecForge: two target layers for an fc that fuses three
    write_specforge_dir(drafter, tmp_path / "fc", target_layer_ids=[0, 2])
    refusal(tmp_path / "fc", model, "fc/model.safetensors", "fc.weight")
    # SpecForge: no mask token
    config = write_specforge_dir(drafter, tmp_path / "mask")
    del config["dflash_config"]["mask_token_id"]
    (tmp_path / "mask" / "config.json").write_text(json.dumps(config))
    refusal(tmp_path / "mask", model, "mask/config.json", "dflash_config.mask_token_id")
    # SpecForge: a DSpark draft (heads we do not implement)
    write_specforge_dir(drafter, tmp_path / "dspark", projector_type="dspark")
    refusal(tmp_path / "dspark", model, "dspark/config.json", "projector_type")
    # speculators: sliding-window layers without a window
    write_speculators_trainer_dir(drafter, tmp_path / "window", ["sliding_attention"] * 2, sliding_window=0)
    refusal(tmp_path / "window", model, "window/config.json", "sliding_window")
    # speculators: mixed causality across layers
    write_speculators_trainer_dir(drafter, tmp_path / "mixed", ["sliding_attention", "full_attention"])
    refusal(tmp_path / "mixed", model, "mixed/config.json", "one setting for all layers")
    # speculators: a weight missing
    write_speculators_trainer_dir(drafter, tmp_path / "missing", ["full_attention"] * 2,
                                  drop=("layers.1.self_attn.q_norm.weight",))
    refusal(tmp_path / "missing", model, "missing/model.safetensors", "layers.1.self_attn.q_norm.weight")
    # speculators: anchor-row sampling (DSpark-style) is read as such; a value that is no boolean is refused
    config = write_speculators_trainer_dir(drafter, tmp_path / "anchor", ["full_attention"] * 2)
    (tmp_path / "anchor" / "config.json").write_text(json.dumps({**config, "sample_from_anchor": True}))
    assert dflash.load(tmp_path / "anchor", model).config.sample_from_anchor is True
    (tmp_path / "anchor" / "config.json").write_text(json.dumps({**config, "sample_from_anchor": "yes"}))
    refusal(tmp_path / "anchor", model, "anchor/config.json", "sample_from_anchor")


# --------------------------------------------------------------------------- evaluate

@pytest.mark.slow
def test_evaluate_decodes_losslessly_with_peer_folders(tiny_target, tmp_path):
    """`eval.extra_drafters=[LABEL:FOLDER]` through the real CLI on the smoke target (the tiny target)."""
    from tests.conftest import run_cli

    write_specforge_dir(tiny_drafter(tiny_target, draft_vocab_size=1000), tmp_path / "sf")
    write_speculators_trainer_dir(tiny_drafter(tiny_target), tmp_path / "spec", ["full_attention"] * 2)
    proc = run_cli("evaluate", "+recipe=smoke_dflash", f"run_dir={tmp_path / 'run'}",
                   f"samples_dir={tmp_path / 'samples'}", "eval.methods=[plain]", "eval.max_prompts=2",
                   f"eval.extra_drafters=[sf:{tmp_path / 'sf'},spec:{tmp_path / 'spec'}]", "eval.best_k_method=sf",
                   check=True)
    assert "(specforge layout)" in proc.stderr + proc.stdout and "(speculators layout)" in proc.stderr + proc.stdout
    methods = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())["methods"]
    assert methods["sf"]["identical_to_plain"] is True and methods["spec"]["identical_to_plain"] is True
