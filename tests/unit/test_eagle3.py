"""EAGLE-3 drafter: vocab maps, shapes, TTT alignment, checkpoint round trip."""

from __future__ import annotations


import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.drafters import eagle3
from specforge_lite.drafters.vocab import build_draft_vocab, count_tokens, vocab_maps
from tests.conftest import as_evaluate_loads, mostly_agree


def test_draft_vocab_takes_most_frequent_masked_tokens():
    counts = count_tokens([([5, 6, 6, 7, 7, 7], [0, 1, 1, 1, 1, 1]), ([5, 5, 5], [0, 0, 0])], vocab_size=10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 2, 3, 0, 0]  # unmasked 5s do not count
    vocab = build_draft_vocab(counts, 3, always=[9])
    assert vocab.tolist() == [6, 7, 9]
    d2t, t2d = vocab_maps(vocab, 10)
    assert (torch.arange(3) + d2t).tolist() == [6, 7, 9] and d2t.dtype == torch.long
    assert t2d.nonzero().flatten().tolist() == [6, 7, 9]


def test_unseen_tokens_fill_by_lowest_id():
    assert build_draft_vocab(torch.tensor([0, 0, 5, 0]), 3).tolist() == [0, 1, 2]


def tiny_drafter(tiny_target, vocab=64, norm_before_residual=False, norm_before_fc=False, fc_norm=False,
                 norm_output=False):
    model, _ = tiny_target
    cfg = OmegaConf.create({"drafter": {"draft_vocab_size": vocab, "aux_layer_ids": [1, 3, 4],
                                        "norm_before_residual": norm_before_residual,
                                        "norm_before_fc": norm_before_fc, "fc_norm": fc_norm,
                                        "norm_output": norm_output}, "train": {"seed": 0}})
    counts = torch.arange(model.config.vocab_size).flip(0)
    return eagle3.build(cfg, model, counts)


# (norm_before_residual, norm_before_fc, fc_norm, norm_output): the plain layer, speculators'
# switches, and the EAGLE-3.1 variants (speculators 0.9 trains norm_before_fc + norm_output)
VARIANTS = [(False, False, False, False), (True, False, False, False), (True, True, False, False),
            (True, True, False, True), (True, False, True, True), (False, False, True, False)]


def test_build_shapes_and_initialisation(tiny_target):
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target)
    h = model.config.hidden_size
    assert drafter.fc.weight.shape == (h, 3 * h)
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (4 * 16, 2 * h)
    assert drafter.lm_head.weight.shape == (64, h)
    vocab = drafter.draft_vocab
    assert model.generation_config.eos_token_id in vocab.tolist()
    assert torch.equal(drafter.lm_head.weight, model.lm_head.weight[vocab])
    assert torch.equal(drafter.embed_tokens.weight, model.model.embed_tokens.weight)
    assert not drafter.embed_tokens.weight.requires_grad
    # untrained, step 0 is the target's read-out (final norm, lm_head rows) of the top aux layer
    torch.manual_seed(3)
    ids, aux = torch.randint(0, 256, (1, 6)), torch.randn(1, 6, 3 * h)
    top = aux[..., 2 * h:]
    expected = model.lm_head(model.model.norm(top))[..., vocab]
    assert torch.allclose(drafter.ttt_forward(ids, aux, 1)[0], expected, atol=1e-5)


def test_aux_layers_must_be_three_and_in_range(tiny_target):
    model, _ = tiny_target
    for ids in ([1, 2], [1, 2, 99]):
        cfg = OmegaConf.create({"drafter": {"draft_vocab_size": 32, "aux_layer_ids": ids, "norm_before_residual": False,
                                            "norm_before_fc": False}, "train": {"seed": 0}})
        with pytest.raises(SpecforgeError, match="drafter.aux_layer_ids"):
            eagle3.build(cfg, model, torch.ones(model.config.vocab_size))


def test_ttt_step_outputs_do_not_see_the_future(tiny_target):
    """Changing tokens / features after anchor t leaves every step's prediction at anchors
    < t - steps unchanged (causality of the TTT attention)."""
    drafter = tiny_drafter(tiny_target)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 20))
    aux = torch.randn(1, 20, 3 * 64)
    outs = drafter.ttt_forward(ids, aux, steps=3)
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[0, 15:] = 7
    aux2[0, 15:] = 0.0
    outs2 = drafter.ttt_forward(ids2, aux2, steps=3)
    for a, b in zip(outs, outs2):
        assert torch.allclose(a[0, :11], b[0, :11], atol=1e-5)
        assert not torch.allclose(a[0, 14:], b[0, 14:])


def test_shifted_targets_alignment():
    from specforge_lite.drafters.common import shifted_targets

    logits = torch.arange(6.0).view(1, 6, 1).expand(1, 6, 2)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    (l0, m0), (l1, m1) = shifted_targets(logits, mask, 2)
    assert l0[0, :, 0].tolist() == [1, 2, 3, 4, 5, 0] and m0[0].tolist() == [1, 1, 1, 0, 0, 0]
    assert l1[0, :, 0].tolist() == [2, 3, 4, 5, 0, 0] and m1[0].tolist() == [1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_load_round_trip(tiny_target, tmp_path, variant):
    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, 64, *variant)
    eagle3.save(drafter, tmp_path, extra={"note": 1})
    loaded = eagle3.load(tmp_path, model)
    ids, aux = torch.randint(0, 256, (2, 9)), torch.randn(2, 9, 192)
    for a, b in zip(drafter.ttt_forward(ids, aux, 2), loaded.ttt_forward(ids, aux, 2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_drafter_matches_the_training_unroll(tiny_target, variant):
    """Drafting at inference computes what the TTT unroll computes: feed anchors 0..t, draft
    k tokens greedily, then unroll training on a sequence continuing with those drafts;
    step j's argmax at anchor t must be draft j+1, with the same logits."""
    from specforge_lite.contract import DraftContext
    from specforge_lite.drafters.eagle3.decode import Eagle3DecodeDrafter

    drafter = tiny_drafter(tiny_target, 64, *variant)
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 16)).tolist()[0]
    aux = torch.randn(1, 16, 3 * 64)
    layers = (1, 3, 4)
    decode = Eagle3DecodeDrafter(drafter)
    t, k = 9, 4
    # two calls, as in decoding: prompt anchors first, then two more committed positions
    for lo, hi in ((0, 7), (7, t + 1)):
        hidden = {layer: aux[:, lo:hi, 64 * i: 64 * (i + 1)] for i, layer in enumerate(layers)}
        proposal = decode.propose(DraftContext(token_ids=ids[: hi + 1], num_prompt_tokens=7,
                                               hidden_states=hidden), k)
    drafts = proposal.tokens
    assert len(drafts) == k
    continued = torch.tensor([ids[: t + 2] + drafts[:-1] + [0] * 3])
    feats = torch.cat([aux[:, : t + 1], torch.zeros(1, continued.shape[1] - t - 1, 192)], dim=1)
    outs = drafter.ttt_forward(continued, feats, steps=k)
    for j in range(k):
        token_id = int(drafter.draft_vocab[outs[j][0, t].argmax()])
        assert token_id == drafts[j], f"step {j}"


def test_norm_switches_change_the_function_and_add_input_norm(tiny_target):
    """norm_before_residual feeds hidden_norm(g) to the residual; norm_before_fc adds a 3H
    RMSNorm before fc. Same seed, same weights otherwise: different outputs."""
    torch.manual_seed(2)
    ids, aux = torch.randint(0, 256, (1, 8)), 50 * torch.randn(1, 8, 192)
    outs = {}
    for variant in VARIANTS:
        drafter = tiny_drafter(tiny_target, 64, *variant)
        assert hasattr(drafter, "input_norm") == variant[1]
        if variant[1]:
            assert drafter.input_norm.weight.shape == (192,) and "input_norm.weight" in eagle3.trained_weights(drafter)
            with torch.no_grad():  # a non-trivial norm weight, so the variant is visible
                drafter.input_norm.weight.uniform_(0.5, 1.5)
        if variant[2]:
            assert [f"fc_norm.{i}.weight" in eagle3.trained_weights(drafter) for i in range(3)] == [True] * 3
            with torch.no_grad():
                for norm in drafter.fc_norm:
                    norm.weight.uniform_(0.5, 1.5)
        outs[variant] = drafter.ttt_forward(ids, aux, 2)[1]  # step 1: norm_output changes what it reads
    for a, b in zip(VARIANTS, VARIANTS[1:]):
        assert not torch.allclose(outs[a], outs[b]), (a, b)


@pytest.mark.parametrize("variant", VARIANTS)
def test_speculators_export_round_trip(tiny_target, tmp_path, variant):
    """The speculators directory states the switches, holds input_norm iff norm_before_fc,
    passes the strict reload and reproduces the drafter's logits; SGLang's layout is refused
    for a drafter trained with a switch it cannot express."""
    from specforge_lite.drafters.eagle3.export import (load_speculators_dir, write_speculators_dir,
                                                       write_sglang_dir)

    model, _ = tiny_target
    drafter = tiny_drafter(tiny_target, 64, *variant)
    config = write_speculators_dir(drafter, tmp_path / "spec", 3, "tiny", ["LlamaForCausalLM"])
    assert (config["norm_before_residual"], config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == variant
    reloaded = load_speculators_dir(tmp_path / "spec", model)
    ids, aux = torch.randint(0, 256, (1, 9)), torch.randn(1, 9, 192)
    for a, b in zip(drafter.ttt_forward(ids, aux, 2), reloaded.ttt_forward(ids, aux, 2)):
        assert torch.equal(a, b)
    if any(variant):
        with pytest.raises((ValueError, SpecforgeError), match="SGLang"):
            write_sglang_dir(drafter, tmp_path / "sglang")
    else:
        write_sglang_dir(drafter, tmp_path / "sglang")


@pytest.mark.parametrize("dtype,cast", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["float32", "bfloat16", "bfloat16-target-float32-drafter"])
def test_compiled_drafting_equals_eager_drafting(tiny_target, forbid_recompiles, tmp_path, dtype, cast):
    """`compile(k)` (frozen graphs for the greedy chain and 1..k+1 new anchors; on a CPU two
    packages kept in the graph folder, which a later drafter loads) proposes what the eager
    drafter proposes, call for call, fed the target's features in the target's dtype; outgrowing
    the compiled cache falls back to eager drafting with the same proposals. The drafter is saved
    as trained (float32) and loaded as evaluate loads it, in the target's dtype; not `cast`, it
    stays float32 beside a bf16 target (its graphs then read bf16 features: they once read their
    bytes as float32 and drafted garbage, which the eager module never did)."""
    from specforge_lite.contract import DraftContext
    from specforge_lite.drafters.eagle3.decode import Eagle3DecodeDrafter

    drafter = tiny_drafter(tiny_target, 64, *VARIANTS[3])
    for param in drafter.parameters():  # a random readout gives near-ties; sharpen it
        param.data.mul_(3)
    drafter = as_evaluate_loads("eagle3", drafter, tiny_target, dtype, tmp_path / "drafter", cast)
    graphs = tmp_path / "graphs"
    eager, compiled = Eagle3DecodeDrafter(drafter, capacity=64), Eagle3DecodeDrafter(drafter, capacity=64)
    k = 3
    assert compiled.compile(k, cache_dir=graphs) > 0 and compiled.graph_source == "compiled"
    assert sorted(p.name.split("-")[:2] for p in graphs.iterdir()) == [["eagle3", "anchors"], ["eagle3", "chain"]]
    if not cast:  # a graph refuses features of another dtype instead of reading their bytes as its own
        with pytest.raises(TypeError, match="argument 0 is torch.bfloat16, the graph was built for torch.float32"):
            compiled._anchor_graph(torch.zeros(1, 2, 3 * 64, dtype=dtype), torch.zeros(1, 2, dtype=torch.long),
                                   torch.arange(2))
    loaded = Eagle3DecodeDrafter(drafter, capacity=64)
    loaded.compile(k, cache_dir=graphs)
    assert loaded.graph_source == "loaded" and len(list(graphs.iterdir())) == 2
    tree_calls = []
    if cast:  # EAGLE-2's tree of depth 3, branch 2, as one graph (the drafter in the target's dtype)
        assert compiled.compile_tree(3, 2, cache_dir=graphs) > 0
        tree_graph = compiled._tree_graph
        compiled._tree_graph = lambda *args: tree_calls.append(1) or tree_graph(*args)
    forbid_recompiles()  # the graphs built are the ones used
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (100,), generator=gen).tolist()
    aux = torch.randn(1, 100, 3 * 64, generator=gen).to(dtype)
    layers = (1, 3, 4)
    calls, trees, lo = [], [], 0
    for hi in [7, 8, 10, 13, 17, 18, 21, 40, 44, 70, 73]:  # prompt, then 1..4 new positions per step
        hidden = {layer: aux[:, lo:hi, 64 * i: 64 * (i + 1)] for i, layer in enumerate(layers)}
        ctx = DraftContext(token_ids=ids[: hi + 1], num_prompt_tokens=7, hidden_states=hidden)
        calls.append((eager.propose(ctx, k).tokens, compiled.propose(ctx, k).tokens, loaded.propose(ctx, k).tokens))
        trees.append((eager.propose_tree(ctx, 3, 2, 6), compiled.propose_tree(ctx, 3, 2, 6)))
        lo = hi
    assert all(len(a) == len(b) == len(c) == k for a, b, c in calls), calls
    assert mostly_agree([a == b == c for a, b, c in calls], dtype), calls
    assert len(tree_calls) >= 8 * cast and all(len(a) == len(b) == 6 for a, b in trees)  # the graph drafted them
    # the same scores, best first, and the same best root token: this random drafter gives every node
    # nearly one law, so paths tie exactly in one forward and by an ulp in the other, and which of two
    # tied nodes a tree keeps may differ (a broken graph changes the scores themselves)
    # (bf16: the best node's score alone, each law's rounding moving every deeper path's)
    depth = len(trees[0][0]) if dtype == torch.float32 else 1
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert mostly_agree([a.tokens[0] == b.tokens[0] and all(abs(x - y) <= tol for x, y in
                                                             zip(a.scores[:depth], b.scores[:depth]))
                         for a, b in trees], dtype), trees
    assert len({tuple(a) for a, _, _ in calls}) > 3  # the proposals follow the context
    assert compiled.compiled_k is None and loaded.compiled_k is None  # 74 positions outgrew the 64-slot cache
