"""DFlash drafter: the block forward against a plain loop of the same math, the anchor-block
mask and positions, anchor sampling, the position weights, training = inference, lossless
decoding (greedy and sampled), save / load, the speculators export and the bad inputs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.contract import DraftContext
from specforge_lite.decoding.engine import generate_plain, generate_speculative
from specforge_lite.decoding.verify import SamplingParams
from specforge_lite.drafters import dflash
from specforge_lite.drafters.dflash.model import anchor_block_mask, block_positions, select_anchors
from specforge_lite.drafters.dflash.train import dpace_weights, exp_decay_weights
from tests.conftest import as_evaluate_loads, assert_same_law, drive_compiled_drafting, mostly_agree, tokens_2_3_law

AUX = [1, 3, 4]
H = 64


def options(**overrides):
    base = {"draft_vocab_size": 64, "aux_layer_ids": AUX, "num_layers": 2, "block_size": 4, "num_anchors": 8,
            "causal": False, "mask_token_id": None, "position_weight": "exp_decay", "decay_gamma": 4.0,
            "dpace_alpha": 0.5, "loss": "forward_kl"}
    return OmegaConf.create({"drafter": {**base, **overrides}, "train": {"seed": 0}, "data": {"max_length": 64}})


def tiny_drafter(tiny_target, scale=1.0, **overrides):
    """A DFlash drafter for the tiny target with every trainable weight random (`scale` x the init)."""
    model, _ = tiny_target
    drafter = dflash.build(options(**overrides), model, torch.arange(model.config.vocab_size).flip(0))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if param.requires_grad and "norm" in name:
                param.uniform_(0.5, 1.5)
            elif param.requires_grad:
                param.mul_(scale)
    return drafter.eval()


# --------------------------------------------------------------------------- a plain reference

def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """x [D] at integer position pos: Llama's rotate-half rotary embedding, written out."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d // 2):
        angle = pos / theta ** (2 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + d // 2] * s
        out[i + d // 2] = x[i + d // 2] * c + x[i] * s
    return out


def reference_block(drafter, ids, aux, anchor, causal):
    """Logits [S, V_d] of the block at `anchor` of one sequence, one row, head and key at a time."""
    c = drafter.config
    s, d, eps = c.block_size, c.head_dim, c.rms_norm_eps
    groups = c.num_attention_heads // c.num_key_value_heads
    ctx = [_rms(drafter.fc.weight @ aux[p], drafter.hidden_norm.weight, eps) for p in range(anchor)]
    x = [drafter.embed_tokens.weight[ids[anchor] if j == 0 else c.mask_token_id] for j in range(s)]
    for layer in drafter.layers:
        a = layer.self_attn

        def key(h, pos, head):
            k = (a.k_proj.weight @ h)[head * d:(head + 1) * d]
            return _rope(_rms(k, a.k_norm.weight, eps), pos, c.rope_theta), (a.v_proj.weight @ h)[head * d:(head + 1) * d]

        normed = [_rms(h, layer.input_layernorm.weight, eps) for h in x]
        keys = [(p, ctx[p]) for p in range(anchor)] + [(anchor + j, normed[j]) for j in range(s)]
        new = []
        for j in range(s):
            heads = []
            for head in range(c.num_attention_heads):
                q = _rope(_rms((a.q_proj.weight @ normed[j])[head * d:(head + 1) * d], a.q_norm.weight, eps),
                          anchor + j, c.rope_theta)
                seen = [key(h, pos, head // groups) for pos, h in keys if pos < anchor or not causal or pos <= anchor + j]
                scores = torch.stack([q @ k for k, _ in seen]) / math.sqrt(d)
                weights = torch.softmax(scores, 0)
                heads.append(sum(w * v for w, (_, v) in zip(weights, seen)))
            h = x[j] + a.o_proj.weight @ torch.cat(heads)
            m = _rms(h, layer.post_attention_layernorm.weight, eps)
            mlp = layer.mlp
            new.append(h + mlp.down_proj.weight @ (torch.nn.functional.silu(mlp.gate_proj.weight @ m) * (mlp.up_proj.weight @ m)))
        x = new
    return torch.stack([drafter.lm_head.weight @ _rms(h, drafter.norm.weight, eps) for h in x])


@pytest.mark.parametrize("causal", [False, True])
def test_block_forward_equals_a_plain_loop(tiny_target, causal):
    drafter = tiny_drafter(tiny_target, causal=causal, block_size=3)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 12), generator=gen)
    aux = torch.randn(2, 12, 3 * H, generator=gen)
    anchors = torch.tensor([[1, 5, 9], [3, 4, 10]])
    with torch.no_grad():
        logits = drafter(ids, aux, anchors, torch.ones(2, 12, dtype=torch.bool))  # [2, 3, S, V_d]
        for row in range(2):
            for n, anchor in enumerate(anchors[row].tolist()):
                expected = reference_block(drafter, ids[row], aux[row], anchor, causal)
                assert torch.allclose(logits[row, n], expected, atol=1e-4), (row, anchor)


# --------------------------------------------------------------------------- masks, positions, anchors

def test_anchor_block_mask_and_positions_by_hand():
    anchors = torch.tensor([[1, 3]])
    valid = torch.tensor([[True, True, True, True, False]])  # position 4 is padding
    assert block_positions(anchors, 3).tolist() == [[1, 2, 3, 3, 4, 5]]
    mask = anchor_block_mask(anchors, 3, valid, causal=False)[0].int().tolist()
    #          context 0..4   | block rows (anchor 1: 3 rows, anchor 3: 3 rows)
    assert mask == [[1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
                    [1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
                    [1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
                    [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
                    [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
                    [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]]
    causal = anchor_block_mask(anchors, 3, valid, causal=True)[0].int()
    assert causal[:, :5].tolist() == [row[:5] for row in mask]  # the context is the same
    assert causal[:3, 5:8].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert causal[3:, 8:].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]] and not causal[:3, 8:].any()
    padded = anchor_block_mask(torch.tensor([[4]]), 2, valid, causal=False)[0]
    assert padded[:, :5].tolist() == [[True] * 4 + [False]] * 2  # padding never becomes context


def test_select_anchors():
    valid = torch.zeros(3, 10, dtype=torch.bool)
    valid[0, 5:] = True  # candidates a with valid[a+1], 1 <= a <= 8: 4..8
    valid[1, 1:3] = True  # valid[1] would need anchor 0 (no context): only a = 1
    gen = torch.Generator().manual_seed(0)
    anchors, ok = select_anchors(valid, 3, gen)
    assert anchors.shape == (3, 3)
    assert ok.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    assert set(anchors[0].tolist()) <= {4, 5, 6, 7, 8} and anchors[0].tolist() == sorted(anchors[0].tolist())
    assert anchors[1, 0] == 1 and len(set(anchors[0].tolist())) == 3
    again, _ = select_anchors(valid, 3, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    everything, ok = select_anchors(valid, 100, gen)
    assert sorted(everything[0].tolist()) == [4, 5, 6, 7, 8] and ok.sum() == 6


# --------------------------------------------------------------------------- position weights and loss

def test_position_weights_by_hand():
    assert torch.allclose(exp_decay_weights(4, 2.0), torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]))
    confidence = torch.tensor([[0.0, 0.5, 1.0, 0.2]])
    mask = torch.tensor([[False, True, True, True]])
    # alpha 0: reach = 1 * 0.5, 0.5 * 1, 0.5 * 0.2 -> weights are the suffix sums of reach
    assert torch.allclose(dpace_weights(confidence, mask, 0.0), torch.tensor([[0.0, 1.1, 0.6, 0.1]]))
    # alpha 1: every smoothed confidence is 1: row j weighs the rows from j on
    assert torch.allclose(dpace_weights(confidence, mask, 1.0), torch.tensor([[0.0, 3.0, 2.0, 1.0]]))
    hole = torch.tensor([[False, True, False, True]])  # a row without loss neither weighs nor breaks the chain
    assert torch.allclose(dpace_weights(confidence, hole, 0.0), torch.tensor([[0.0, 0.6, 0.0, 0.1]]))


@pytest.mark.parametrize("weighting", ["exp_decay", "dpace"])
def test_loss_and_metrics(tiny_target, weighting):
    from specforge_lite.training.features import target_hidden

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, draft_vocab_size=320).train()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    aux, last = target_hidden(model, ids, batch["attention_mask"], AUX)
    dflash.batch_preparer(drafter, model)(batch, aux, last, True)
    cfg = options(draft_vocab_size=320, position_weight=weighting)
    loss, num, metrics = dflash.loss_and_metrics(drafter, batch, cfg)
    # full vocab: every token from 1 on has a loss; 18 candidate anchors (1..18) a row, 8 drawn
    assert num == metrics["total"][0] == 16 and len(metrics["total"]) == 3
    assert metrics["total"] == sorted(metrics["total"], reverse=True)  # rows past the end have no loss
    assert all(ch <= co for ch, co in zip(metrics["chain"], metrics["correct"]))
    assert metrics["chain"] == sorted(metrics["chain"], reverse=True)
    loss.backward()
    assert float(loss.detach()) > 0 and drafter.fc.weight.grad is not None and drafter.layers[1].mlp.up_proj.weight.grad is not None
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None  # the target's, frozen
    reverse, num_r, metrics_r = dflash.loss_and_metrics(drafter, batch, options(draft_vocab_size=320, loss="reverse_kl",
                                                                                 position_weight=weighting))
    assert (num_r, metrics_r) == (num, metrics) and float(reverse.detach()) != pytest.approx(float(loss.detach()), rel=1e-3)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_target):
    drafter = tiny_drafter(tiny_target).train()
    gen = torch.Generator().manual_seed(4)
    ids, aux = torch.randint(0, 256, (2, 16), generator=gen), torch.randn(2, 16, 3 * H, generator=gen)
    anchors, valid = torch.tensor([[2, 7], [5, 11]]), torch.ones(2, 16, dtype=torch.bool)
    grads = []
    for flag in (False, True):
        drafter.gradient_checkpointing = flag
        drafter.zero_grad()
        drafter(ids, aux, anchors, valid).square().mean().backward()
        grads.append([p.grad.clone() for p in drafter.parameters() if p.requires_grad])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


# --------------------------------------------------------------------------- training = inference, decoding

@pytest.mark.parametrize("causal", [False, True])
def test_a_proposal_equals_the_training_block(tiny_target, causal):
    """The decoder's block after context committed in several calls (1..4 new positions each)
    computes exactly the training forward's block at that anchor: same draft distributions."""
    drafter = tiny_drafter(tiny_target, causal=causal)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (1, 30), generator=gen)
    aux = torch.randn(1, 30, 3 * H, generator=gen)
    decode = dflash.decoder(drafter)
    lo = 0
    for hi in (6, 7, 9, 12, 16, 17):  # the prompt, then what verification steps commit
        hidden = {layer: aux[:, lo:hi, H * i: H * (i + 1)] for i, layer in enumerate(AUX)}
        ctx = DraftContext(token_ids=ids[0, : hi + 1].tolist(), num_prompt_tokens=6, hidden_states=hidden,
                           sampling=SamplingParams(1.0), generator=torch.Generator())
        k = 3 if causal else 2  # fewer rows than the block: the non-causal decoder still runs all S
        proposal = decode.propose(ctx, k)
        with torch.no_grad():
            trained = torch.softmax(drafter(ids, aux, torch.tensor([[hi]]), torch.ones(1, 30, dtype=torch.bool)), -1)
        assert len(proposal.tokens) == k
        assert torch.allclose(proposal.probs[:, drafter.draft_vocab], trained[0, 0, 1:k + 1], atol=1e-5), hi
        lo = hi
    assert decode.length == 17


def fitted_drafter(tiny_target, sequences, causal, steps=20):
    """A DFlash drafter trained (a few Adam steps, the train stage's loss) on `sequences`: the
    target's own greedy answers, so that decoding them accepts some of its drafts."""
    from specforge_lite.training.features import target_hidden

    model, _ = tiny_target
    torch.manual_seed(0)
    drafter = tiny_drafter(tiny_target, causal=causal, scale=0.3, draft_vocab_size=320).train()
    optimizer = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    width = max(map(len, sequences))
    ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        aux, last = target_hidden(model, ids, torch.ones_like(ids), AUX)
    cfg = options(causal=causal, draft_vocab_size=320)
    for _ in range(steps):
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
        dflash.batch_preparer(drafter, model)(batch, aux, last, True)
        loss, num, _ = dflash.loss_and_metrics(drafter, batch, cfg)
        optimizer.zero_grad()
        (loss / num).backward()
        optimizer.step()
    return drafter.eval()


@pytest.mark.parametrize("causal", [False, True])
def test_greedy_decoding_is_identical_to_plain(tiny_target, causal):
    model, _ = tiny_target
    prompts = [torch.randint(0, 256, (5 + 7 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
               for seed in range(3)]
    plains = [generate_plain(model, prompt, 30) for prompt in prompts]
    drafter = dflash.decoder(fitted_drafter(tiny_target, [p + a.tokens for p, a in zip(prompts, plains)], causal))
    assert drafter.sequential is False and drafter.max_drafts == 3
    accepted = 0
    for prompt, plain in zip(prompts, plains):
        spec = generate_speculative(model, drafter, prompt, 30, 3)
        assert spec.tokens == plain.tokens
        assert max(spec.draft_lengths) == 3
        accepted += sum(spec.accepted_lengths)
    assert accepted > 0  # identity with drafts accepted, not only rejected


def test_sampling_keeps_the_target_law():
    """Tokens 2 and 3 (the first speculative step, two block drafts) of the real engine with a
    DFlash drafter on a vocab-8 target: chi-square against the target's exact law."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                         initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(config).eval()
    cfg = options(draft_vocab_size=8, aux_layer_ids=[0, 1, 2], mask_token_id=7, block_size=3)
    draft = dflash.build(cfg, target, torch.ones(8))
    sampling, prompt, vocab = SamplingParams(0.8, 0.95), [1, 2, 3], 8
    exact = tokens_2_3_law(target, prompt, sampling, vocab)
    gen = torch.Generator().manual_seed(0)
    drafter = dflash.decoder(draft)
    n = 1000
    counts = Counter(tuple(generate_speculative(target, drafter, prompt, 3, 2, sampling, (), gen).tokens[1:])
                     for _ in range(n))
    assert_same_law(counts, exact, n)
    assert sum(counts.values()) == n and len(counts) > 10


# --------------------------------------------------------------------------- save, load, export

def test_save_load_round_trip(tiny_target, tmp_path):
    from specforge_lite.drafters.dflash.export import max_logit_difference

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target)
    dflash.save(drafter, tmp_path, extra={"note": 1})
    assert "embed_tokens.weight" not in dflash.trained_weights(drafter)
    assert dflash.layout({"drafter": "dflash"}) == "ours"
    assert max_logit_difference(drafter, dflash.load(tmp_path, model)) == 0.0


@pytest.mark.parametrize("causal", [False, True])
def test_speculators_export_round_trip_and_strictness(tiny_target, tmp_path, causal):
    import json

    from safetensors.torch import load_file, save_file

    from specforge_lite.drafters.dflash.export import (check_speculators_dir, load_speculators_dir,
                                                       max_logit_difference, write_speculators_dir)

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, causal=causal)
    spec = tmp_path / "spec"
    config = write_speculators_dir(drafter, spec, 3, "tiny", ["LlamaForCausalLM"])
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert config["aux_hidden_state_layer_ids"] == AUX and "model_type" not in config
    assert config["sliding_window_non_causal"] is (not causal) and config["sample_from_anchor"] is False
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    _, weights = check_speculators_dir(spec)
    assert weights["fc.weight"].shape == (H, 3 * H) and weights["layers.1.self_attn.k_norm.weight"].shape == (16,)
    assert "mask_hidden" not in weights and weights["d2t"].dtype == torch.int64  # vLLM refuses mask_hidden
    assert dflash.layout(config) == "speculators"
    reloaded = dflash.load(spec, model)
    assert reloaded.config == drafter.config
    assert max_logit_difference(drafter, load_speculators_dir(spec, model)) == 0.0
    # damage: a missing weight (vLLM would not say), an extra one (vLLM fails), wrong fields
    weights.pop("layers.0.self_attn.q_norm.weight")
    save_file(weights, str(spec / "model.safetensors"))
    with pytest.raises(ValueError, match="missing \\['layers.0.self_attn.q_norm.weight'\\]"):
        check_speculators_dir(spec)
    weights = load_file(str(spec / "model.safetensors"))
    save_file({**weights, "layers.0.self_attn.q_norm.weight": torch.ones(16), "mask_hidden": torch.zeros(1, 1, 3 * H)},
              str(spec / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected \\['mask_hidden'\\]"):
        check_speculators_dir(spec)
    for damage, message in (({"mask_token_id": None}, "mask_token_id"), ({"sample_from_anchor": "yes"}, "sample_from"),
                            ({"aux_hidden_state_layer_ids": []}, "aux_hidden_state_layer_ids")):
        (spec / "config.json").write_text(json.dumps({**config, **damage}))
        with pytest.raises(ValueError, match=message):
            check_speculators_dir(spec)


# --------------------------------------------------------------------------- bad inputs

def test_bad_options_are_refused_with_one_line(tiny_target):
    model, _ = tiny_target
    counts = torch.ones(model.config.vocab_size)
    for overrides, message in (({"block_size": 1}, "block_size=1"), ({"block_size": 65}, "above the context"),
                               ({"num_anchors": 0}, "num_anchors=0"), ({"aux_layer_ids": [1, 6]}, "aux layer 6"),
                               ({"aux_layer_ids": []}, "aux_layer_ids"), ({"mask_token_id": 320}, "mask_token_id")):
        with pytest.raises(SpecforgeError, match=message) as err:
            dflash.build(options(**overrides), model, counts)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("drafter.block_size=1", "drafter.block_size=1: must be >= 2"),
    ("drafter.block_size=600", "drafter.block_size=600 is above the context of data.max_length=512"),
    ("drafter.num_anchors=0", "drafter.num_anchors=0: must be >= 1"),
    ("drafter.aux_layer_ids=[2,15,40]", "every value must be below 30"),
])
def test_bad_inputs_at_the_door(cli, tmp_path, override, message):
    """The recipe's dry run (config and the target's config only) refuses each with one line, exit 2."""
    proc = cli("train", "+recipe=dflash_smollm2", "train.dry_run=true", f"run_dir={tmp_path}", override, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr + proc.stdout
    assert len((proc.stderr + proc.stdout).strip().splitlines()) == 1


@pytest.mark.parametrize("causal,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)],
                         ids=["float32", "causal-float32", "bfloat16"])
def test_compiled_drafting_equals_eager_drafting(tiny_target, forbid_recompiles, tmp_path, causal, dtype):
    """`compile(k)` (one frozen graph for the context write of 1..k+1 new positions and the
    block read out at k drafts; on a CPU a package kept in the graph folder, which a later
    drafter loads) proposes what the eager drafter proposes, call for call, greedy and
    sampled; another k drafts eagerly; outgrowing the compiled cache falls back to eager."""
    from specforge_lite.drafters.dflash.decode import DFlashDecodeDrafter

    drafter = tiny_drafter(tiny_target, causal=causal, block_size=5)
    # saved as trained (float32) and loaded as evaluate loads it, in the target's dtype
    drafter = as_evaluate_loads("dflash", drafter, tiny_target, dtype, tmp_path / "drafter")
    if dtype == torch.bfloat16:  # a random readout gives near-ties that bf16 rounding flips; sharpen it
        for param in drafter.parameters():
            param.data.mul_(2)
    eager, compiled = DFlashDecodeDrafter(drafter, capacity=64), DFlashDecodeDrafter(drafter, capacity=64)
    k = 3
    assert compiled.compile(k, cache_dir=tmp_path / "graphs") > 0 and compiled.graph_source == "compiled"
    loaded = DFlashDecodeDrafter(drafter, capacity=64)
    loaded.compile(k, cache_dir=tmp_path / "graphs")
    assert loaded.graph_source == "loaded" and [p.name.split("-")[:2] for p in (tmp_path / "graphs").iterdir()] == [["dflash", "block"]]
    forbid_recompiles()  # the graph built is the one used
    used, graph = [], compiled.graph
    compiled.graph = lambda *args: used.append(args[0].shape[1]) or graph(*args)
    greedy = drive_compiled_drafting(eager, compiled, loaded, k, AUX, H, other_k=2, dtype=dtype)
    assert all(len(a) == len(b) == len(c) == k for a, b, c in greedy), greedy
    assert mostly_agree([a == b == c for a, b, c in greedy], dtype), greedy
    assert len({tuple(a) for a, _, _ in greedy}) > 3  # the proposals follow the context
    assert compiled.compiled_k is None and loaded.compiled_k is None  # 74 positions outgrew the 64-slot cache
    assert sorted(set(used)) == [1, 2, 3, 4]  # every verification's commit ran the graph


def test_a_k_above_the_block_is_lowered_with_a_line_naming_both(tiny_target, caplog):
    """A block of 4 drafts at most 3 tokens: evaluate asked for k = 8 measures and reports k = 3,
    and says so once; a k within the block is used as asked."""
    import logging

    from specforge_lite.measurement.choices import drafted_k

    decoder = dflash.decoder(tiny_drafter(tiny_target, block_size=4))
    ecfg = OmegaConf.create({"num_draft_tokens": 8, "method_draft_tokens": ["ngram:2"]})
    with caplog.at_level(logging.WARNING):
        assert drafted_k(ecfg, "dflash", decoder) == 3
        assert drafted_k(ecfg, "dflash", decoder) == 3
    said = [r.getMessage() for r in caplog.records if "dflash: k=8 asked" in r.getMessage()]
    assert len(said) == 1 and "at most 3" in said[0] and "block of 4" in said[0], said
    assert drafted_k(OmegaConf.create({"num_draft_tokens": 2}), "dflash", decoder) == 2
    assert drafted_k(ecfg, "ngram") == 2  # no drafter limit: as asked
