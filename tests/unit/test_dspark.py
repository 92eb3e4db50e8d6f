"""DSpark drafter: speculators' own folders and forward (tests/golden/dspark, made by
tests/golden/make_dspark_golden.py with speculators 0.9.0) reproduced from the folders, a planted
change in the Markov head caught; the decoder's Markov readout equal to the training forward;
the loss with its confidence term; lossless chains and trees; the export's strict reload and
the calibration the report prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from specforge_lite.contract import DraftContext
from specforge_lite.decoding.engine import generate_plain, generate_speculative, generate_tree
from specforge_lite.measurement.metrics import calibration
from specforge_lite.decoding.tree import TreeShape
from specforge_lite.decoding.verify import SamplingParams
from specforge_lite.drafters import dspark
from specforge_lite.drafters.dspark.model import MarkovHead
from specforge_lite.drafters.registry import detect_drafter

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "dspark"
AUX = [1, 3, 4]
H = 64


@pytest.fixture(scope="module")
def golden_target():
    return AutoModelForCausalLM.from_pretrained(GOLDEN.parent / "dflash" / "target", dtype=torch.float32).eval()


def golden_outputs(drafter, ref):
    anchor = ref["anchor"][None]
    with torch.no_grad():
        logits, confidence = drafter(ref["input_ids"], ref["aux"], anchor, torch.ones_like(ref["input_ids"]).bool())
    return logits[0, 0], confidence[0, 0]


def test_the_golden_folders_were_written_by_speculators():
    assert json.loads((GOLDEN / "versions.json").read_text())["speculators"] == "0.9.0"


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_a_speculators_folder_reproduces_its_forward(golden_target, kind):
    """Logits with the Markov bias and confidence logits of speculators' training forward on one block."""
    folder = GOLDEN / kind
    assert detect_drafter(folder) == ("dspark", "speculators")
    drafter = dspark.load(folder, golden_target)
    assert drafter.config.markov_head_type == kind and drafter.config.sample_from_anchor is True
    assert drafter.config.confidence_with_markov is (kind != "rnn")
    ref = load_file(str(GOLDEN / "reference" / f"{kind}.safetensors"))
    logits, confidence = golden_outputs(drafter, ref)
    torch.testing.assert_close(logits, ref["logits"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(confidence, ref["confidence"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("plant", ["weights", "previous_token", "rnn_state"])
def test_a_planted_change_in_the_markov_head_fails_the_golden_comparison(golden_target, monkeypatch, plant):
    kind = "rnn" if plant == "rnn_state" else "gated"
    drafter = dspark.load(GOLDEN / kind, golden_target)
    ref = load_file(str(GOLDEN / "reference" / f"{kind}.safetensors"))
    if plant == "weights":
        with torch.no_grad():
            drafter.markov_head.markov_w2.weight[0, 0] += 0.01
    elif plant == "previous_token":  # each row biased by its own position's token, one too far
        embed = MarkovHead.embed
        monkeypatch.setattr(MarkovHead, "embed", lambda self, previous: embed(self, torch.roll(previous, -1, -1)))
    else:  # the recurrent state never carried down the block
        step = MarkovHead.step
        monkeypatch.setattr(MarkovHead, "step", lambda self, emb, hidden, state: step(self, emb, hidden, None))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(golden_outputs(drafter, ref)[0], ref["logits"][0], rtol=1e-5, atol=1e-5)


def options(**overrides):
    base = {"name": "dspark", "draft_vocab_size": 64, "aux_layer_ids": AUX, "num_layers": 1, "block_size": 4,
            "num_anchors": 8, "causal": False, "mask_token_id": None, "position_weight": "exp_decay",
            "decay_gamma": 4.0, "dpace_alpha": 0.5, "loss": "forward_kl", "sample_from_anchor": True,
            "markov_rank": 16, "markov_head_type": "vanilla", "confidence_head": True, "confidence_with_markov": True,
            "confidence_alpha": 1.0, "confidence_target": "overlap"}
    return OmegaConf.create({"drafter": {**base, **overrides}, "train": {"seed": 0}, "data": {"max_length": 64}})


def tiny_drafter(tiny_target, **overrides):
    model, _ = tiny_target
    drafter = dspark.build(options(**overrides), model, torch.arange(model.config.vocab_size).flip(0))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if param.requires_grad and "norm" in name:
                param.uniform_(0.5, 1.5)
            elif param.requires_grad:
                param.normal_(0.0, 0.3)
    return drafter.eval()


@pytest.mark.parametrize("anchor_drafts,kind", [(True, "vanilla"), (False, "rnn"), (True, "gated")])
def test_the_decoder_reads_the_block_out_as_the_training_forward_scores_it(tiny_target, anchor_drafts, kind):
    """Greedy drafts after context committed in several calls, then the training forward teacher-
    forced on those drafts at the same anchor: each row's argmax is the draft the decoder made
    (the Markov bias read the token drafted before it), and the decoder's confidences are the
    confidence head's on that block."""
    drafter = tiny_drafter(tiny_target, sample_from_anchor=anchor_drafts, markov_head_type=kind)
    decode = dspark.decoder(drafter)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (1, 40), generator=gen)
    aux = torch.randn(1, 40, 3 * H, generator=gen)
    lo, k = 0, 4 if anchor_drafts else 3
    for hi in (6, 9, 13):
        hidden = {layer: aux[:, lo:hi, H * i: H * (i + 1)] for i, layer in enumerate(AUX)}
        ctx = DraftContext(token_ids=ids[0, :hi + 1].tolist(), num_prompt_tokens=6, hidden_states=hidden)
        proposal = decode.propose(ctx, k)
        assert len(proposal.tokens) == k
        forced = ids.clone()
        forced[0, hi + 1:hi + 1 + k] = torch.tensor(proposal.tokens)
        with torch.no_grad():
            logits, confidence = drafter(forced, aux, torch.tensor([[hi]]), torch.ones(1, 40, dtype=torch.bool))
        rows = slice(0, k) if anchor_drafts else slice(1, k + 1)
        assert drafter.draft_vocab[logits[0, 0, rows].argmax(-1)].tolist() == proposal.tokens, hi
        assert proposal.confidence == pytest.approx(torch.sigmoid(confidence[0, 0, rows]).tolist(), abs=1e-5)
        lo = hi


def test_loss_adds_the_confidence_term_and_trains_the_heads(tiny_target):
    from specforge_lite.training.features import target_hidden

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, draft_vocab_size=320).train()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    aux, last = target_hidden(model, ids, batch["attention_mask"], AUX)
    dspark.batch_preparer(drafter, model)(batch, aux, last, True)
    losses = {}
    for alpha, goal in ((0.0, "overlap"), (1.0, "overlap"), (1.0, "greedy")):
        drafter.zero_grad()
        loss, num, metrics = dspark.loss_and_metrics(drafter, batch, options(draft_vocab_size=320,
                                                                            confidence_alpha=alpha,
                                                                            confidence_target=goal))
        loss.backward()
        losses[alpha, goal] = float(loss.detach())
        # the anchor row drafts too: 4 drafting rows; anchors 1..17 (row 0 predicts x[a + 1]), 8 drawn a row
        assert len(metrics["total"]) == 4 and num == metrics["total"][0] == 16
        assert drafter.markov_head.markov_w2.weight.grad.abs().sum() > 0
        assert drafter.markov_head.markov_w1.weight.grad.abs().sum() > 0
        proj = drafter.confidence_head.proj.weight.grad
        assert (proj is not None and proj.abs().sum() > 0) == (alpha > 0)
    assert losses[1.0, "overlap"] > losses[0.0, "overlap"] and losses[1.0, "greedy"] != losses[1.0, "overlap"]


@pytest.mark.parametrize("anchor_drafts", [True, False])
def test_greedy_chains_and_trees_are_identical_to_plain(golden_target, anchor_drafts, tmp_path):
    """speculators' rnn folder (its anchor row drafts) and the same drafter read DFlash's way."""
    folder = GOLDEN / "rnn"
    if not anchor_drafts:
        config = json.loads((folder / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "sample_from_anchor": False}))
        (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
        folder = tmp_path
    decoder = dspark.decoder(dspark.load(folder, golden_target))
    assert decoder.max_drafts == (4 if anchor_drafts else 3)
    for seed in range(2):
        prompt = torch.randint(0, 95, (5 + 4 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = generate_plain(golden_target, prompt, 16).tokens
        chain = generate_speculative(golden_target, decoder, prompt, 16, decoder.max_drafts)
        tree = generate_tree(golden_target, decoder, prompt, 16, TreeShape(depth=decoder.max_drafts, branch=2,
                                                                            nodes=6))
        assert chain.tokens == plain == tree.tokens
        assert max(chain.draft_lengths) == decoder.max_drafts and max(tree.draft_lengths) == 6


def test_the_tree_starts_with_the_chain_and_follows_the_path(golden_target):
    """The tree's first root path is the greedy chain, and a node's children come from the law after
    the node's own token (the Markov bias), so siblings' subtrees differ."""
    decoder = dspark.decoder(dspark.load(GOLDEN / "vanilla", golden_target))
    prompt = [3, 17, 40, 8, 9, 60]
    with torch.no_grad():
        hidden = golden_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    ctx = DraftContext(token_ids=prompt + [11], num_prompt_tokens=6,
                       hidden_states={i: hidden[i] for i in decoder.hidden_state_layers})
    chain = decoder.propose(ctx, 4).tokens
    decoder.reset()
    tree = decoder.propose_tree(ctx, 4, 3, 12)
    first_path = [0]
    while (children := tree.children(first_path[-1])):
        first_path.append(children[0])
    assert [tree.tokens[i] for i in first_path] == chain
    by_parent = {}
    for node, parent in enumerate(tree.parents):
        if parent >= 0 and tree.depths()[node] == 2:
            by_parent.setdefault(parent, []).append(tree.tokens[node])
    assert len(by_parent) >= 2 and len({tuple(v) for v in by_parent.values()}) >= 2


def test_sampled_decoding_runs_on_the_markov_laws(golden_target):
    decoder = dspark.decoder(dspark.load(GOLDEN / "gated", golden_target))
    out = generate_speculative(golden_target, decoder, [4, 5, 6, 7], 12, 4, SamplingParams(0.8),
                               generator=torch.Generator().manual_seed(0))
    assert len(out.tokens) == 12 and sum(out.draft_lengths) > 0


def test_export_round_trip_and_readme(tiny_target, tmp_path):
    from specforge_lite.drafters.dflash.export import check_speculators_dir, max_logit_difference
    from specforge_lite.drafters.dspark.export import DSPARK, export

    model, tokenizer = tiny_target
    drafter = tiny_drafter(tiny_target, markov_head_type="gated", draft_vocab_size=320)
    dspark.save(drafter, tmp_path / "trained")
    cfg = OmegaConf.create({"recipe_name": "test"})
    info = export(cfg, tmp_path / "trained", tmp_path / "out", model, tokenizer, 3, "eval", "tiny")
    assert info["speculative_tokens"] == 4  # a non-causal block serves its whole block: 4 with the anchor row
    folder = tmp_path / "out" / "speculators"
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["markov_head_type"] == "gated"
    assert config["sample_from_anchor"] is True and config["enable_confidence_head"] is True
    assert "gated or rnn head is for speculators" in (folder / "README.md").read_text()
    reloaded = dspark.load(folder, model)
    assert max_logit_difference(drafter, reloaded) == 0.0
    weights = load_file(str(folder / "model.safetensors"))
    weights.pop("markov_head.gate_proj.bias")
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="gate_proj.bias"):
        check_speculators_dir(folder, DSPARK)


@pytest.mark.parametrize("kind,layout", [("vanilla", "export"), ("gated", "ready_to_serve"), ("rnn", "older_names")])
def test_a_specforge_dspark_folder_reads_back(tiny_target, tmp_path, kind, layout):
    """SpecForge's DSpark export (`DSparkDraftModel`: DFlash's SpecForge folder with
    dflash_config.projector_type "dspark", the heads' settings in dflash_config, their weights under
    our names, no drafting from the anchor), the same made ready to serve (`Qwen3DSparkModel`, the
    settings at the top level) and older checkpoints' `logit_head.` names: read by drafter=dspark
    with the same forward; read as DFlash it is refused, naming the way."""
    from specforge_lite.drafters.dflash.export import max_logit_difference
    from tests.unit.test_dflash_interop import write_specforge_dir

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, markov_head_type=kind, draft_vocab_size=model.config.vocab_size,
                           mask_token_id=300, sample_from_anchor=False, confidence_with_markov=kind != "rnn")
    heads = {"markov_rank": 16, "markov_head_type": kind, "enable_confidence_head": True,
             "confidence_head_with_markov": kind != "rnn", "confidence_head_alpha": 1.0}
    folder = tmp_path / "sf"
    config = write_specforge_dir(drafter, folder, projector_type="dspark", **heads)
    config["architectures"], config["auto_map"] = ["DSparkDraftModel"], {"AutoModel": "dspark.DSparkDraftModel"}
    if layout == "ready_to_serve":  # SpecForge's serving script: the settings copied up, its SGLang name
        config.update(heads, architectures=["Qwen3DSparkModel"])
        config.pop("auto_map")
        config["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if k not in heads}
    if layout == "older_names":
        weights = load_file(str(folder / "model.safetensors"))
        save_file({("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
                   for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    assert detect_drafter(folder) == ("dspark", "specforge")
    loaded = dspark.load(folder, model)
    assert (loaded.config.markov_head_type, loaded.config.sample_from_anchor, loaded.config.aux_layer_ids) == \
        (kind, False, AUX)
    assert max_logit_difference(drafter, loaded) == 0.0
    from specforge_lite import SpecforgeError
    from specforge_lite.drafters.dflash.interop import load_specforge

    with pytest.raises(SpecforgeError, match="projector_type 'dspark'.*read it as drafter=dspark"):
        load_specforge(folder, model)


def test_calibration_counts_reached_positions_only():
    from specforge_lite.decoding.engine import Generation

    gen = Generation(tokens=[1], finish="length", num_prompt_tokens=1)
    gen.accepted_lengths, gen.confidences = [2, 0, 3], [[0.9, 0.8, 0.5], [0.6, 0.4, 0.3], [0.7, 0.7, 0.7]]
    rows = calibration([gen], 3)
    assert [r["steps"] for r in rows] == [3, 2, 2]
    assert rows[0]["predicted"] == pytest.approx((0.9 + 0.6 + 0.7) / 3) and rows[0]["measured"] == pytest.approx(2 / 3)
    assert rows[2]["measured"] == pytest.approx(0.5)  # step 1 rejected position 3, step 3 kept it
    assert calibration([Generation(tokens=[1], finish="length", num_prompt_tokens=1)], 3) is None


def test_vllm_dspark_is_refused_at_the_door_without_a_gpu(cli, tmp_path):
    """vLLM 0.32's CPU runner has no DSpark proposer: on a machine without CUDA the door says so in one
    line before any stage runs, and points at our engine."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine serves vllm_dspark")
    proc = cli("evaluate", "+recipe=smoke_dspark", f"run_dir={tmp_path}", "eval.methods=[plain,dspark,vllm_dspark]")
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2 and "vLLM 0.32 runs DSpark on its GPU model runner only" in out, out
    assert "measure dspark with our engine here" in out and "Traceback" not in out


def test_compiled_drafting_equals_eager_drafting(tiny_target, forbid_recompiles, tmp_path):
    """DSpark's block graph (the context write and the block forward, its heads read outside it)
    proposes what the eager module proposes, call for call, greedy and sampled, as DFlash's does."""
    from specforge_lite.drafters.dspark.decode import DSparkDecodeDrafter
    from tests.conftest import as_evaluate_loads, drive_compiled_drafting

    drafter = as_evaluate_loads("dspark", tiny_drafter(tiny_target, block_size=5), tiny_target, torch.float32,
                                tmp_path / "drafter")
    eager, compiled, loaded = (DSparkDecodeDrafter(drafter, capacity=64) for _ in range(3))
    k = 4
    assert compiled.compile(k, cache_dir=tmp_path / "graphs") > 0 and compiled.graph_source == "compiled"
    loaded.compile(k, cache_dir=tmp_path / "graphs")
    assert loaded.graph_source == "loaded"
    assert [p.name.split("-")[:2] for p in (tmp_path / "graphs").iterdir()] == [["dspark", "block"]]
    forbid_recompiles()
    greedy = drive_compiled_drafting(eager, compiled, loaded, k, AUX, H, other_k=2)
    assert all(a == b == c and len(a) == k for a, b, c in greedy), greedy
    assert len({tuple(a) for a, _, _ in greedy}) > 3


def test_the_confidence_source_is_the_head_or_the_softmax(tiny_target):
    """eval.draft_confidence: a DSpark draft's confidence is its head's sigmoid, or with `softmax` the
    probability its (Markov-biased) law gives the drafted token, as other drafters report it."""
    drafter = tiny_drafter(tiny_target)
    decode = dspark.decoder(drafter)
    gen = torch.Generator().manual_seed(11)
    aux = torch.randn(1, 8, 3 * H, generator=gen)
    ctx = DraftContext(token_ids=torch.randint(0, 256, (9,), generator=gen).tolist(), num_prompt_tokens=8,
                       hidden_states={layer: aux[:, :, H * i: H * (i + 1)] for i, layer in enumerate(AUX)})
    assert decode.confidence_source == "head"
    head = decode.propose(ctx, 4)
    decode.confidence_source = "softmax"
    softmax = decode.propose(ctx, 4)
    assert head.tokens == softmax.tokens and head.confidence != softmax.confidence
    base, normed = decode._draft(ctx, 4)
    state, previous, expected = decode._start(normed, ctx.token_ids[-1]), ctx.token_ids[-1], []
    for row, token in enumerate(softmax.tokens):
        logits, state, _ = decode._law(base, normed, row, previous, state)
        expected.append(float(torch.softmax(logits, -1).max()))
        previous = token
    assert softmax.confidence == pytest.approx(expected, abs=1e-6)
