"""P-EAGLE drafter: the drop-token sampler, the parallel attention mask, training = inference,
lossless greedy decoding, the target's law when sampling, save / load and the speculators export."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.contract import DraftContext
from specforge_lite.decoding.engine import generate_plain, generate_speculative
from specforge_lite.decoding.verify import SamplingParams
from specforge_lite.drafters import eagle3, peagle
from specforge_lite.drafters.peagle.model import depth_keep, drop_token_layout, parallel_attention_mask
from tests.conftest import as_evaluate_loads, assert_same_law, drive_compiled_drafting, mostly_agree, tokens_2_3_law

AUX = [1, 3, 4]


def options(**overrides):
    base = {"draft_vocab_size": 64, "aux_layer_ids": AUX, "num_layers": 2, "num_depths": 4, "mask_token_id": None,
            "down_sample_ratio": 0.7, "down_sample_ratio_min": 0.2, "depth_weight": 1.0, "train_embeddings": True,
            "norm_before_residual": True, "norm_before_fc": False, "init_from_eagle3": None,
            "loss": "forward_kl"}
    return OmegaConf.create({"drafter": {**base, **overrides}, "train": {"seed": 0}})


def tiny_drafter(tiny_target, randomise=0.0, **overrides):
    """A P-EAGLE drafter for the tiny target; `randomise` > 0 gives its zero-initialised residual
    branches random weights, so every layer and the mask rows matter."""
    model, _ = tiny_target
    drafter = peagle.build(options(**overrides), model, torch.arange(model.config.vocab_size).flip(0))
    if randomise:
        torch.manual_seed(5)
        with torch.no_grad():
            for layer in drafter.layers:
                layer.self_attn.o_proj.weight.normal_(0, randomise)
                layer.mlp["down_proj"].weight.normal_(0, randomise)
            drafter.mask_hidden.normal_(0, 1.0)
    return drafter


# --------------------------------------------------------------------------- drop-token sampler

def test_drop_token_counts_per_depth_floor_and_nesting():
    valid = torch.zeros(2, 200, dtype=torch.bool)
    valid[0, 10:190] = True  # 178 depth-0 loss positions (anchors 8..185)
    valid[1, 50:80] = True  # a short answer: deep depths run out of candidates
    gen = torch.Generator().manual_seed(0)
    anchor, depth, loss = drop_token_layout(valid, 6, 0.7, 0.2, gen)
    n = int(valid[0, 2:].sum())
    counts = [int((depth[0] == d).sum()) for d in range(6)]
    assert counts[0] == 200  # every anchor at depth 0: the context
    assert counts[1:] == [depth_keep(n, d, 0.7, 0.2) for d in range(1, 6)]
    # r^d down to 0.2401 at d = 4, then the floor 0.2 at d = 5 (0.7^5 = 0.168)
    assert counts[1:] == [round(n * 0.7), round(n * 0.49), round(n * 0.343), round(n * 0.2401), round(n * 0.2)]
    assert depth_keep(100, 5, 0.7, 0.2) == 20 and depth_keep(100, 5, 0.7, 0.0) == 17  # 0.7^5 = 0.17 < floor 0.2
    for row in range(2):
        for d in range(1, 6):  # depth d of an anchor comes with depth d-1, and carries a loss
            deeper = set(anchor[row][depth[row] == d].tolist())
            assert deeper <= set(anchor[row][depth[row] == d - 1].tolist())
            assert all(valid[row, a + 2 + d] for a in deeper)
    assert loss[depth >= 1].all() and not loss[depth < 0].any()
    assert int(loss[0][depth[0] == 0].sum()) == n
    # the short row: 30 loss positions, depth d needs loss at t+2..t+2+d: candidates shrink with d
    short = [int((depth[1] == d).sum()) for d in range(6)]
    assert short[1] == depth_keep(30, 1, 0.7, 0.2) and all(a >= b for a, b in zip(short[1:], short[2:]))
    assert (depth[1] == -1).sum() == depth.shape[1] - sum(short)  # padded to the longest row


def test_drop_token_sampling_is_deterministic_by_seed():
    valid = torch.ones(1, 120, dtype=torch.bool)

    def layout(seed):
        return drop_token_layout(valid, 4, 0.7, 0.2, torch.Generator().manual_seed(seed))

    a, b, c = layout(1), layout(1), layout(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_layout_seed_depends_on_the_run_seed_and_the_batch_only():
    from specforge_lite.drafters.peagle.train import layout_seed

    ids = torch.arange(10)[None]
    assert layout_seed(0, ids) == layout_seed(0, ids.clone())
    assert layout_seed(0, ids) != layout_seed(1, ids) != layout_seed(1, ids + 1)


# --------------------------------------------------------------------------- attention mask

def test_attention_mask_by_hand():
    # anchors 0..3 at depth 0, anchors 1 and 2 at depth 1, anchor 1 at depth 2, one padding entry
    anchor = torch.tensor([[0, 1, 2, 3, 1, 2, 1, 0]])
    depth = torch.tensor([[0, 0, 0, 0, 1, 1, 2, -1]])
    allowed = parallel_attention_mask(anchor, depth)[0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0, 0],  # depth 0 is causal over depth 0
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],  # (1, d1): context <= 1 and itself
        [1, 1, 1, 0, 0, 1, 0, 0],  # (2, d1): context <= 2, not (1, d1)
        [1, 1, 0, 0, 1, 0, 1, 0],  # (1, d2): context <= 1, (1, d1), itself
        [0, 0, 0, 0, 0, 0, 0, 1],  # padding: itself only
    ]


def test_a_masked_position_sees_what_it_sees_at_inference(tiny_target):
    """Training entries (anchor t, depth d) compute exactly what the decoder computes for draft
    d after the context x[..t+1]: same distributions (T = 1), in one forward, every depth."""
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, randomise=0.05)
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 18))
    aux = torch.randn(1, 18, 3 * 64)
    t, k = 10, 4
    # training: all anchors at depth 0, anchor t at depths 1..3, anchor 4 at depth 1 (a distractor)
    anchor = torch.tensor([list(range(18)) + [t, t, t, 4]])
    depth = torch.tensor([[0] * 18 + [1, 2, 3, 1]])
    rows = torch.zeros_like(anchor, dtype=torch.bool)
    rows[0, [t, 18, 19, 20]] = True
    trained = torch.softmax(drafter(ids, aux, anchor, depth, rows), -1)  # [4, V_d]: depths 0..3 of anchor t
    # inference: anchors 0..t committed in two calls, then k drafts from one forward
    decode = peagle.decoder(drafter)
    tokens = ids[0].tolist()
    for lo, hi in ((0, 6), (6, t + 1)):
        hidden = {layer: aux[:, lo:hi, 64 * i: 64 * (i + 1)] for i, layer in enumerate(AUX)}
        proposal = decode.propose(DraftContext(token_ids=tokens[: hi + 1], num_prompt_tokens=6, hidden_states=hidden,
                                               sampling=SamplingParams(1.0), generator=torch.Generator()), k)
    assert len(proposal.tokens) == k
    at_inference = proposal.probs[:, drafter.draft_vocab]
    assert torch.allclose(trained, at_inference, atol=1e-5)
    # and the depths differ from each other: the mask rows are not copies of depth 0
    assert not torch.allclose(trained[0], trained[1], atol=1e-3)


def test_future_tokens_do_not_leak_into_training_entries(tiny_target):
    drafter = tiny_drafter(tiny_target, randomise=0.05)
    torch.manual_seed(2)
    ids, aux = torch.randint(0, 256, (1, 16)), torch.randn(1, 16, 192)
    anchor, depth, rows = drop_token_layout(torch.ones(1, 16), 4, 0.9, 0.5, torch.Generator().manual_seed(0))
    rows = torch.ones_like(rows) & (depth >= 0)
    base = drafter(ids, aux, anchor, depth, rows)
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[0, 12:], aux2[0, 11:] = 7, 0.0  # change what anchors >= 11 read
    changed = drafter(ids2, aux2, anchor, depth, rows)
    early = (anchor[rows] < 11)
    assert torch.equal(base[early], changed[early])
    assert not torch.allclose(base[~early], changed[~early])


# --------------------------------------------------------------------------- training

def test_build_loss_and_metrics(tiny_target):
    from specforge_lite.training.features import target_hidden

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, draft_vocab_size=320)  # full vocab: every position counts
    assert drafter.embed_tokens.weight.requires_grad and drafter.mask_hidden.shape == (1, 1, 192)
    assert drafter.config.mask_token_id == 319  # the one id the (flipped arange) counts never saw
    assert drafter.layers[1].self_attn.q_proj.weight.shape == (64, 64)
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (64, 128)
    ids = torch.randint(0, 256, (2, 40))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    aux, last = target_hidden(model, ids, batch["attention_mask"], AUX)
    peagle.batch_preparer(drafter, model)(batch, aux, last, True)
    loss, num, metrics = peagle.loss_and_metrics(drafter, batch, options(draft_vocab_size=320))
    assert num == metrics["total"][0] == int(batch["num_positions"]) == 2 * 38
    assert metrics["total"][1:] == [depth_keep(38, d, 0.7, 0.2) * 2 for d in (1, 2, 3)]
    assert metrics["chain"][0] == metrics["correct"][0] and all(c <= num for c in metrics["chain"])
    # drafter.loss reaches the loss (same entries, same counts), not the metrics
    reverse, num_r, metrics_r = peagle.loss_and_metrics(drafter, batch, options(draft_vocab_size=320,
                                                                               loss="reverse_kl"))
    assert (num_r, metrics_r) == (num, metrics) and float(reverse) > 0
    assert float(reverse) != pytest.approx(float(loss), rel=1e-3)
    loss.backward()
    assert float(loss.detach()) > 0
    assert drafter.mask_hidden.grad is not None and drafter.embed_tokens.weight.grad is not None
    # untrained, depth 0 is the target's read-out of its top aux layer (EAGLE-3's start)
    rows = torch.zeros(1, 6, dtype=torch.bool)
    rows[0, :] = True
    logits = drafter(ids[:1, :6], aux[:1, :6], torch.arange(6)[None], torch.zeros(1, 6, dtype=torch.long), rows)
    expected = model.lm_head(model.model.norm(aux[0, :6, 128:]))
    assert torch.allclose(logits, expected, atol=1e-4)


def test_options_are_checked(tiny_target):
    model, _ = tiny_target
    counts = torch.ones(model.config.vocab_size)
    with pytest.raises(SpecforgeError, match="3 aux layers"):
        peagle.build(options(aux_layer_ids=[1, 2]), model, counts)
    with pytest.raises(SpecforgeError, match="mask_token_id"):
        peagle.build(options(mask_token_id=10_000), model, counts)
    counts[300:] = 0
    assert peagle.build(options(), model, counts).config.mask_token_id == 319  # highest unseen id


def test_start_from_a_trained_eagle3_drafter(tiny_target, tmp_path):
    model, _ = tiny_target
    cfg = OmegaConf.create({"drafter": {"draft_vocab_size": 64, "aux_layer_ids": AUX, "norm_before_residual": True,
                                        "norm_before_fc": False}, "train": {"seed": 0}})
    eagle = eagle3.build(cfg, model, torch.arange(320))  # another draft vocab than the counts below give
    with torch.no_grad():
        for p in eagle.layers[0].parameters():
            p.normal_(0, 0.1)
    eagle3.save(eagle, tmp_path)
    drafter = tiny_drafter(tiny_target, init_from_eagle3=str(tmp_path))
    assert torch.equal(drafter.draft_vocab, eagle.draft_vocab)
    ids, aux = torch.randint(0, 256, (1, 9)), torch.randn(1, 9, 192)
    rows = torch.ones(1, 9, dtype=torch.bool)
    ours = drafter(ids, aux, torch.arange(9)[None], torch.zeros(1, 9, dtype=torch.long), rows)
    assert torch.allclose(ours, eagle.ttt_forward(ids, aux, 1)[0][0], atol=1e-5)  # depth 0 = EAGLE-3 step 0
    with pytest.raises(SpecforgeError, match="aux_layer_ids"):
        tiny_drafter(tiny_target, init_from_eagle3=str(tmp_path), aux_layer_ids=[1, 2, 4])


# --------------------------------------------------------------------------- decoding

def test_greedy_decoding_is_identical_to_plain(tiny_target):
    model, _ = tiny_target
    drafter = peagle.decoder(tiny_drafter(tiny_target, randomise=0.02))
    assert drafter.sequential is False
    accepted = 0
    for seed in range(4):
        prompt = torch.randint(0, 256, (5 + 7 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = generate_plain(model, prompt, 40)
        spec = generate_speculative(model, drafter, prompt, 40, 4)
        assert spec.tokens == plain.tokens
        assert max(spec.draft_lengths) <= 4
        accepted += sum(spec.accepted_lengths)
    assert accepted > 0  # depth 0 starts as the target's read-out: some drafts are accepted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_drafting_equals_eager_drafting(tiny_target, forbid_recompiles, tmp_path, dtype):
    """`compile(k)` (one frozen graph for 1..k+1 new anchors with their k - 1 mask rows and
    the read-out; on a CPU a package kept in the graph folder, which a later drafter loads)
    proposes what the eager drafter proposes, call for call, greedy and sampled; outgrowing
    the compiled cache falls back to eager drafting."""
    from specforge_lite.drafters.peagle.decode import PEagleDecodeDrafter

    drafter = tiny_drafter(tiny_target, randomise=0.3)
    for param in drafter.parameters():  # a random readout gives near-ties; sharpen it
        param.data.mul_(2)
    # saved as trained (float32) and loaded as evaluate loads it, in the target's dtype
    drafter = as_evaluate_loads("peagle", drafter, tiny_target, dtype, tmp_path / "drafter")
    eager, compiled = PEagleDecodeDrafter(drafter, capacity=64), PEagleDecodeDrafter(drafter, capacity=64)
    k = 3
    assert compiled.compile(k, cache_dir=tmp_path / "graphs") > 0 and compiled.graph_source == "compiled"
    loaded = PEagleDecodeDrafter(drafter, capacity=64)
    loaded.compile(k, cache_dir=tmp_path / "graphs")
    assert loaded.graph_source == "loaded" and [p.name.split("-")[:2] for p in (tmp_path / "graphs").iterdir()] == [["peagle", "rows"]]
    forbid_recompiles()  # the graphs built are the ones used
    greedy = drive_compiled_drafting(eager, compiled, loaded, k, AUX, 64, dtype=dtype)
    assert all(len(a) == len(b) == len(c) == k for a, b, c in greedy), greedy
    assert mostly_agree([a == b == c for a, b, c in greedy], dtype), greedy
    assert len({tuple(a) for a, _, _ in greedy}) > 3  # the proposals follow the context
    assert compiled.compiled_k is None and loaded.compiled_k is None  # 74 positions outgrew the 64-slot cache


def test_sampling_keeps_the_target_law():
    """Tokens 2 and 3 (the first speculative step, two parallel drafts) of the real engine with
    a P-EAGLE drafter on a vocab-8 target: chi-square against the target's exact law."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                         initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(config).eval()
    cfg = options(draft_vocab_size=8, aux_layer_ids=[0, 1, 2], mask_token_id=7)
    draft = peagle.build(cfg, target, torch.ones(8))
    with torch.no_grad():
        for layer in draft.layers:
            layer.self_attn.o_proj.weight.normal_(0, 0.3)
        draft.mask_hidden.normal_(0, 1.0)
    sampling, prompt, vocab = SamplingParams(0.8, 0.95), [1, 2, 3], 8
    exact = tokens_2_3_law(target, prompt, sampling, vocab)
    gen = torch.Generator().manual_seed(0)
    drafter = peagle.decoder(draft)
    n = 3000
    counts = Counter(tuple(generate_speculative(target, drafter, prompt, 3, 2, sampling, (), gen).tokens[1:])
                     for _ in range(n))
    assert_same_law(counts, exact, n)
    assert sum(counts.values()) == n and len(counts) > 10


# --------------------------------------------------------------------------- save, load, export

@pytest.mark.parametrize("train_embeddings", [True, False])
def test_save_load_round_trip(tiny_target, tmp_path, train_embeddings):
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, randomise=0.05, train_embeddings=train_embeddings)
    peagle.save(drafter, tmp_path, extra={"note": 1})
    assert ("embed_tokens.weight" in peagle.trained_weights(drafter)) == train_embeddings
    loaded = peagle.load(tmp_path, model)
    ids, aux = torch.randint(0, 256, (2, 12)), torch.randn(2, 12, 192)
    layout = drop_token_layout(torch.ones(2, 12), 4, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert torch.equal(drafter(ids, aux, *layout), loaded(ids, aux, *layout))


@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_speculators_export_round_trip_and_strictness(tiny_target, tmp_path, norm_before_fc):
    import json

    from safetensors.torch import load_file, save_file

    from specforge_lite.drafters.peagle.export import (check_speculators_dir, load_speculators_dir,
                                                       max_logit_difference, write_speculators_dir)

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, randomise=0.05, norm_before_fc=norm_before_fc)
    config = write_speculators_dir(drafter, tmp_path / "spec", 3, "tiny", ["LlamaForCausalLM"])
    assert config["speculators_model_type"] == "peagle" and config["speculators_config"]["algorithm"] == "peagle"
    assert config["mask_token_id"] == drafter.config.mask_token_id and "model_type" not in config
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2 and config["norm_before_residual"] is True
    _, weights = check_speculators_dir(tmp_path / "spec")
    assert weights["mask_hidden"].shape == (1, 1, 192) and "embed_tokens.weight" in weights
    assert "layers.1.hidden_norm.weight" not in weights and ("input_norm.weight" in weights) == norm_before_fc
    assert max_logit_difference(drafter, load_speculators_dir(tmp_path / "spec", model)) == 0.0
    # damage: a missing mask_hidden (vLLM refuses it), an extra weight, a wrong field
    weights.pop("mask_hidden")
    save_file(weights, str(tmp_path / "spec" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing \\['mask_hidden'\\]"):
        check_speculators_dir(tmp_path / "spec")
    weights = load_file(str(tmp_path / "spec" / "model.safetensors"))
    save_file({**weights, "mask_hidden": torch.zeros(1, 1, 192), "layers.1.hidden_norm.weight": torch.ones(64)},
              str(tmp_path / "spec" / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected \\['layers.1.hidden_norm.weight'\\]"):
        check_speculators_dir(tmp_path / "spec")
    (tmp_path / "spec" / "config.json").write_text(json.dumps({**config, "mask_token_id": None}))
    with pytest.raises(ValueError, match="mask_token_id"):
        check_speculators_dir(tmp_path / "spec")
