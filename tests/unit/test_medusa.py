"""Medusa heads: shapes and initialisation, loss alignment, lossless decoding, the vLLM
export and its strict reload."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from specforge_lite import SpecforgeError
from specforge_lite.decoding.engine import generate_plain, generate_speculative
from specforge_lite.decoding.verify import SamplingParams
from specforge_lite.drafters import medusa
from specforge_lite.drafters.medusa.decode import MedusaDecodeDrafter
from specforge_lite.drafters.medusa.export import export_weights, load_vllm_dir, max_logit_difference, write_vllm_dir


def cfg(heads=3, layers=2, vocab=64, loss="forward_kl"):
    return OmegaConf.create({"drafter": {"num_heads": heads, "num_layers": layers, "draft_vocab_size": vocab,
                                         "loss": loss},
                             "train": {"seed": 0, "step_weight": 0.8}})


def build(tiny_target, heads=3, layers=2, vocab=64):
    model, _ = tiny_target
    counts = torch.arange(model.config.vocab_size).flip(0)
    return medusa.build(cfg(heads, layers, vocab), model, counts)


def test_shapes_names_and_initialisation(tiny_target):
    model, _ = tiny_target
    heads = build(tiny_target)
    h = model.config.hidden_size
    names = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    assert names == {**{f"blocks.{i}.layers.{j}.weight": (h, h) for i in range(3) for j in range(2)},
                     **{f"lm_heads.{i}.weight": (64, h) for i in range(3)}, "token_map": (64,)}
    vocab = heads.draft_vocab
    assert model.generation_config.eos_token_id in vocab.tolist() and vocab.tolist() == sorted(vocab.tolist())
    # zero blocks + the target's rows: an untrained head gives the target's own next-token logits
    hidden = torch.randn(2, 5, h)
    expected = model.lm_head(hidden)[..., vocab]
    for out in heads(hidden):
        assert torch.allclose(out, expected, atol=1e-6)


def test_full_vocab_heads_have_identity_map(tiny_target):
    model, _ = tiny_target
    heads = build(tiny_target, vocab=10_000)
    assert heads.config.draft_vocab_size == model.config.vocab_size
    assert torch.equal(heads.token_map, torch.arange(model.config.vocab_size))
    assert "token_map" not in export_weights(heads)


def test_loss_targets_head_i_at_token_two_plus_i(tiny_target):
    """Head i at anchor t is scored against the target's logits at t+1+i; a head whose
    output equals exactly those logits has the minimum (the target's entropy) everywhere."""
    model, _ = tiny_target
    heads = build(tiny_target, heads=2, layers=1)
    ids = torch.randint(0, 256, (1, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    last = model.model(input_ids=ids).last_hidden_state.detach()
    prepare = medusa.batch_preparer(heads, model)
    prepare(batch, None, last, True)
    loss, num, metrics = medusa.loss_and_metrics(heads, batch, cfg(2, 1))
    assert num == metrics["total"][0] == int(batch["valid"][:, 2:].sum())
    assert metrics["total"][1] == int(batch["valid"][:, 3:].sum())
    assert loss.requires_grad and float(loss) > 0
    assert metrics["chain"][1] <= metrics["chain"][0] <= metrics["correct"][0]


def test_greedy_decoding_is_identical_to_plain_and_sampling_runs(tiny_target):
    model, _ = tiny_target
    torch.manual_seed(3)
    heads = build(tiny_target, heads=4, layers=1)
    with torch.no_grad():  # random blocks: proposals are partly wrong, partly right
        for block in heads.blocks:
            block.layers[0].weight.normal_(0, 0.05)
    drafter = MedusaDecodeDrafter(heads)
    accepted = 0
    for seed in range(4):
        prompt = torch.randint(0, 256, (int(5 + 7 * seed),), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = generate_plain(model, prompt, 40)
        spec = generate_speculative(model, drafter, prompt, 40, 4)
        assert spec.tokens == plain.tokens
        assert max(spec.draft_lengths) <= 4
        accepted += sum(spec.accepted_lengths)
    assert accepted > 0  # head 0 starts as the target's head: some drafts are accepted
    sampled = generate_speculative(model, drafter, [1, 2, 3], 20, 3, SamplingParams(0.8),
                                   (), torch.Generator().manual_seed(0))
    assert len(sampled.tokens) == 20


def test_decoding_reads_the_final_norm_hidden_state(tiny_target):
    """HF hidden-state index -1 is what the heads were trained on: the final-norm output."""
    from specforge_lite.runtime.hf_runner import TargetRunner

    model, _ = tiny_target
    runner = TargetRunner(model, MedusaDecodeDrafter.hidden_state_layers)
    runner.reset()
    ids = [5, 6, 7, 8]
    _, hidden = runner.forward(ids)
    expected = model.model(input_ids=torch.tensor([ids])).last_hidden_state
    assert torch.allclose(hidden[-1], expected, atol=1e-5)


def test_export_reloads_strictly_and_rejects_damage(tiny_target, tmp_path):
    model, _ = tiny_target
    heads = build(tiny_target)
    out = tmp_path / "medusa"
    config = write_vllm_dir(heads, out)
    assert config["model_type"] == "medusa" and config["truncated_vocab_size"] == 64
    assert config["num_heads"] == 3 and config["num_hidden_layers"] == 2 and config["medusa_fc_bias"] is False
    # vLLM's config reader maps any key holding "num" + "heads"/"layers": only ours may
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    reloaded = load_vllm_dir(out, model)
    assert max_logit_difference(heads, reloaded) == 0.0

    weights = load_file(str(out / "model.safetensors"))
    for damage, message in ((lambda w: w.pop("lm_heads.1.weight"), "missing"),
                            (lambda w: w.update({"extra.weight": torch.zeros(1)}), "unexpected"),
                            (lambda w: w.update({"token_map": torch.zeros(3, dtype=torch.long)}), "wrong shapes")):
        broken = dict(weights)
        damage(broken)
        save_file(broken, str(out / "model.safetensors"))
        with pytest.raises(SpecforgeError, match=message):
            load_vllm_dir(out, model)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "num_heads": "3"}))
    with pytest.raises(SpecforgeError, match="num_heads should be a int"):
        load_vllm_dir(out, model)


def test_save_load_round_trip(tiny_target, tmp_path):
    model, _ = tiny_target
    heads = build(tiny_target)
    medusa.save(heads, tmp_path, extra={"trained_steps": 3})
    assert json.loads((tmp_path / "config.json").read_text())["drafter"] == "medusa"
    assert max_logit_difference(heads, medusa.load(tmp_path, model)) == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_heads_draft_like_the_eager_ones(tiny_target, forbid_recompiles, tmp_path, dtype):
    """`compile(k)` makes the greedy read-out of k heads one graph (on a CPU a package a later
    drafter loads): the same drafts as eager heads (same accepted lengths, step for step),
    output identical to plain decoding (in float32; in bf16 a wider verify forward may round a
    near-tie the other way, so there the drafts alone are compared)."""
    from specforge_lite.targets.loading import load_target
    from tests.conftest import mostly_agree, target_cfg

    if dtype == "bfloat16":
        tiny_target = load_target(target_cfg("builtin:tiny-llama", dtype="bfloat16"))
    model, _ = tiny_target
    torch.manual_seed(3)
    heads = build(tiny_target, heads=4, layers=1)
    with torch.no_grad():
        for block in heads.blocks:
            block.layers[0].weight.normal_(0, 0.05)
    eager, first = MedusaDecodeDrafter(heads), MedusaDecodeDrafter(heads)
    assert first.compile(3, cache_dir=tmp_path) > 0 and first.compiled_k == 3 and first.graph_source == "compiled"
    compiled = MedusaDecodeDrafter(heads)
    compiled.compile(3, cache_dir=tmp_path)
    assert compiled.graph_source == "loaded" and compiled.compiled_k == 3  # the drafts below come from the loaded one
    forbid_recompiles()  # the graph built is the one used
    accepted, same = 0, []
    for seed in range(4):
        prompt = torch.randint(0, 256, (5 + 7 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = generate_plain(model, prompt, 40)
        a = generate_speculative(model, eager, prompt, 40, 3)
        b = generate_speculative(model, compiled, prompt, 40, 3)
        assert a.tokens == plain.tokens or dtype == "bfloat16"
        same.append(a.tokens == b.tokens and a.accepted_lengths == b.accepted_lengths)
        accepted += sum(b.accepted_lengths)
    assert mostly_agree(same, dtype) and accepted > 0
    # another k is another graph (the head count is baked in, not an input shape): compiled
    # anew, not the k = 3 package loaded
    two = MedusaDecodeDrafter(heads)
    two.compile(2, cache_dir=tmp_path)
    assert two.graph_source == "compiled" and len(list(tmp_path.iterdir())) == 2
    spec = generate_speculative(model, two, prompt, 40, 2)
    assert (spec.tokens == plain.tokens or dtype == "bfloat16") and max(spec.draft_lengths) == 2
