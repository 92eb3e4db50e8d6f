"""Drafters users already have: folders in the layouts speculators, SGLang / SpecForge and vLLM
write, made from our own drafters by the documented renames and config rules, are detected,
loaded back with identical logits, and refused with a message naming the file when one thing
is wrong."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_lite import SpecforgeError
from specforge_lite.drafters.eagle3.export import load_sglang_dir, write_speculators_dir, write_sglang_dir
from specforge_lite.drafters.registry import DRAFTERS, detect_drafter
from tests.unit.test_eagle3 import tiny_drafter

eagle3 = DRAFTERS["eagle3"]


def same_logits(a, b, hidden=64):
    torch.manual_seed(5)
    ids, aux = torch.randint(0, 256, (2, 9)), torch.randn(2, 9, 3 * hidden)
    return all(torch.equal(x, y) for x, y in zip(a.ttt_forward(ids, aux, 3), b.ttt_forward(ids, aux, 3)))


def as_speculators_09(directory):
    """Rewrite one of our speculators exports the way speculators 0.9 writes under transformers 5:
    `rope_parameters` instead of `rope_theta`, sliding-window layer fields, no
    norm_before_residual (vLLM then assumes true), the embedding included, bf16 tensors."""
    config = json.loads((directory / "config.json").read_text())
    layer = config["transformer_layer_config"]
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": layer.pop("rope_theta")}
    layer.update(layer_types=["sliding_attention"], sliding_window=2048, use_sliding_window=True)
    assert config.pop("norm_before_residual") is True
    config["architectures"] = ["Eagle3Speculator"]
    (directory / "config.json").write_text(json.dumps(config))
    return config


def test_a_speculators_09_folder_loads_with_identical_logits(tiny_target, tmp_path):
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, 64, True, True, False, True)  # speculators' training defaults
    with torch.no_grad():  # bf16 on disk: compare with the drafter rounded the same way
        for p in drafter.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    folder = tmp_path / "spec09"
    write_speculators_dir(drafter, folder, 3, "tiny", ["LlamaForCausalLM"])
    as_speculators_09(folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}
    weights["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    save_file(weights, str(folder / "model.safetensors"))
    assert detect_drafter(folder) == ("eagle3", "speculators")
    loaded = eagle3.load(folder, model)
    assert loaded.config.norm_before_residual and loaded.config.norm_output and loaded.config.norm_before_fc
    assert loaded.config.aux_layer_ids == [1, 3, 4]
    assert same_logits(drafter, loaded)


def test_an_sglang_folder_counts_aux_layers_one_lower_and_loads_with_identical_logits(tiny_target, tmp_path):
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, 64)  # SGLang cannot express the norm switches
    folder = tmp_path / "sglang"
    write_sglang_dir(drafter, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # ours: [1, 3, 4]
    assert all(k.startswith(("midlayer.", "fc.", "norm.", "lm_head.", "d2t", "t2d"))
               for k in load_file(str(folder / "model.safetensors")))
    assert detect_drafter(folder) == ("eagle3", "sglang")
    loaded = eagle3.load(folder, model)
    assert loaded.config.aux_layer_ids == [1, 3, 4] and not loaded.config.norm_before_residual
    assert same_logits(drafter, loaded)


def test_vllm_medusa_and_hf_folders_are_detected(tiny_target, tmp_path):
    from specforge_lite.drafters.medusa.export import write_vllm_dir
    from tests.unit.test_medusa import build as build_heads

    model, _ = tiny_target
    heads = build_heads(tiny_target)
    write_vllm_dir(heads, tmp_path / "medusa")
    assert detect_drafter(tmp_path / "medusa") == ("medusa", "vllm")
    loaded = DRAFTERS["medusa"].load(tmp_path / "medusa", model)
    hidden = torch.randn(1, 5, model.config.hidden_size)
    assert all(torch.equal(a, b) for a, b in zip(heads(hidden), loaded(hidden)))
    model.save_pretrained(tmp_path / "hf")
    assert detect_drafter(tmp_path / "hf") == ("distilled", "hf")


def break_speculators(folder, what):
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    if what == "missing weight":
        weights.pop("layers.0.hidden_norm.weight")
    elif what == "misshapen weight":
        weights["fc.weight"] = weights["fc.weight"][:, :10].contiguous()
    elif what == "qwen3 layer":
        config["transformer_layer_config"]["model_type"] = "qwen3"
    elif what == "two aux layers":
        config["eagle_aux_hidden_state_layer_ids"] = [1, 3]
    elif what == "truncated config":
        (folder / "config.json").write_text(json.dumps(config)[:40])
        return
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))


@pytest.mark.parametrize("what,message", [
    ("missing weight", "spec/model.safetensors: does not fit: missing layers.0.hidden_norm.weight"),
    ("misshapen weight", "misshapen tensors: fc.weight (64, 10) (expected (64, 192))"),
    ("qwen3 layer", "1-layer llama config"),
    ("two aux layers", "exactly 3 aux layers"),
    ("truncated config", "spec/config.json: invalid JSON"),
])
def test_a_broken_speculators_folder_is_refused_naming_the_file(tiny_target, tmp_path, what, message):
    model, _ = tiny_target
    folder = tmp_path / "spec"
    write_speculators_dir(tiny_drafter(tiny_target, 64), folder, 3, "tiny", ["LlamaForCausalLM"])
    break_speculators(folder, what)
    with pytest.raises(SpecforgeError, match=re.escape(message)):
        eagle3.load(folder, model)


def test_broken_sglang_medusa_and_unknown_folders_are_refused(tiny_target, tmp_path):
    from specforge_lite.drafters.medusa.export import write_vllm_dir
    from tests.unit.test_medusa import build as build_heads

    model, _ = tiny_target
    write_sglang_dir(tiny_drafter(tiny_target, 64), tmp_path / "sglang")
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    del config["draft_vocab_size"]
    (tmp_path / "sglang" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecforgeError, match="sglang/config.json: missing field 'draft_vocab_size'"):
        load_sglang_dir(tmp_path / "sglang", model)
    write_vllm_dir(build_heads(tiny_target), tmp_path / "medusa")
    config = json.loads((tmp_path / "medusa" / "config.json").read_text())
    config["num_heads"] = "three"
    (tmp_path / "medusa" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecforgeError, match="num_heads should be a int"):
        DRAFTERS["medusa"].load(tmp_path / "medusa", model)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(SpecforgeError, match="no drafter layout we read"):
        detect_drafter(tmp_path / "other")
    with pytest.raises(SpecforgeError, match="does not exist"):
        detect_drafter(tmp_path / "nowhere")
