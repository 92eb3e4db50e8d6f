"""The static and compiled forward on the families it covers beyond Llama (tests/families.py):
Qwen3's per-head q/k norms. Logits and hidden states against transformers' forward over a
prefill, chain steps and rejected drafts (the cache after each crop), a draft tree's verify
row by row against the chain forward of each branch, and greedy speculative decoding equal to
plain decoding on each engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specforge_lite.decoding.drafters import NgramDrafter
from specforge_lite.decoding.engine import TargetRunner, generate_plain, generate_speculative
from specforge_lite.runtime.fast_engine import FastEngine
from specforge_lite.runtime.static_llama import StaticLlama, unsupported_reason
from tests.families import STATIC_FAMILIES, family_target  # noqa: F401  (a fixture)
from tests.unit.test_engine import StubDrafter, prompts
from tests.unit.test_fast_target import CROPS, STEPS, _compare

# the family's first two layers: each of its parts (q/k norms, experts and router, the window) is
# in every layer, and a compiled graph's code grows with the layers (docs/TESTING.md "Compiled forwards")
LAYERS = (0, 1, 2)


@pytest.fixture(scope="module", params=STATIC_FAMILIES)
def family_model(request, family_target):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(family_target(request.param), dtype=torch.float32,
                                                 num_hidden_layers=2).eval()
    assert model.config.num_hidden_layers == len(model.model.layers) == 2
    assert unsupported_reason(model.config) is None
    return model


@pytest.fixture(scope="module")
def compiled_engine(family_model):
    """One compiled engine (widths 1..3) for the tests that use it: compiling is the slow part."""
    engine = FastEngine(family_model, capacity=128, hidden_layers=LAYERS, max_width=3, compiled=True)
    assert engine.compile() > 0
    return engine


def test_static_forward_equals_transformers_over_steps_and_crops(family_model):
    engine = FastEngine(family_model, capacity=64, hidden_layers=LAYERS, max_width=4)
    _compare(TargetRunner(family_model, LAYERS), engine.runner(LAYERS), STEPS, CROPS)


def test_compiled_forward_equals_transformers(family_model, compiled_engine, forbid_recompiles):
    forbid_recompiles()  # the graphs built are the ones used
    _compare(TargetRunner(family_model, LAYERS), compiled_engine.runner(LAYERS), STEPS, CROPS)


def test_a_tree_verify_gives_each_branch_its_chain_logits(family_model):
    """Two branches after a shared prefix, verified in one forward under a tree mask, give the
    logits each branch gets when it is forwarded alone as a chain (so the cache and the norms
    see the tree's layout right)."""
    prompt, left, right = list(range(20, 40)), [7, 8], [9]
    with torch.no_grad():
        static = StaticLlama(family_model, capacity=64)
        static(torch.tensor(prompt), torch.arange(len(prompt)))
        n = len(prompt)
        # rows: left[0] (parent: prompt end), left[1] (parent: left[0]), right[0] (parent: prompt end)
        ids = torch.tensor(left + right)
        positions = torch.tensor([n, n + 1, n])
        write_at = torch.tensor([n, n + 1, n + 2])
        window = static.slots[:n + 3]
        mask = window[None, :] < n
        mask = mask.repeat(3, 1)
        mask[0, n] = mask[1, n] = mask[1, n + 1] = mask[2, n + 2] = True
        tree_logits, _ = static(ids, positions, window=window, write_at=write_at, tree_mask=mask)
        for rows, branch in (([0, 1], left), ([2], right)):
            chain = StaticLlama(family_model, capacity=64)
            chain(torch.tensor(prompt), torch.arange(n))
            want, _ = chain(torch.tensor(branch), torch.arange(n, n + len(branch)))
            torch.testing.assert_close(tree_logits[rows], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("compiled", [False, True], ids=["static", "compiled"])
def test_greedy_speculative_decoding_is_plain_decoding(family_model, compiled, request):
    engine = (request.getfixturevalue("compiled_engine") if compiled
              else FastEngine(family_model, capacity=128, hidden_layers=LAYERS, max_width=3))
    runner, plain_runner = engine.runner(LAYERS), engine.runner()
    accepted = 0
    for ids in prompts(3, seed=4):
        plain = generate_plain(family_model, ids, 24, runner=plain_runner)
        for drafter in (StubDrafter(plain.tokens, right=2, vocab=256, hidden_state_layers=LAYERS), NgramDrafter()):
            spec = generate_speculative(family_model, drafter, ids, 24, 2, runner=runner)
            assert spec.tokens == plain.tokens
            accepted += sum(spec.accepted_lengths)
    assert accepted > 0  # drafts were accepted: the wide verify forwards ran


def test_a_batched_prefill_gives_each_row_its_own_last_logits(family_model):
    """`prefill_rows` (the batched sampler's prefill: rows packed, attention per row) against
    transformers' forward of each row alone; one row longer than Mistral's window."""
    rows = [list(range(20, 45)), list(range(50, 60))]
    static = StaticLlama(family_model, capacity=64, batch=2)
    with torch.no_grad():
        got = static.prefill_rows(rows)
        for b, row in enumerate(rows):
            torch.testing.assert_close(got[b], family_model(torch.tensor([row])).logits[0, -1], atol=2e-4, rtol=1e-4)


def test_qwen2_attention_biases_against_transformers():
    """Qwen2's q/k/v biases through the static forward's fused q/k/v product, against transformers'
    forward: the biases random (transformers starts them at zero, which no bias path could get wrong)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.families import SHAPE

    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, "num_hidden_layers": 2})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert proj.bias is not None
                proj.bias.normal_(0, 0.5)
    assert unsupported_reason(model.config) is None
    engine = FastEngine(model, capacity=64, hidden_layers=LAYERS, max_width=4)
    _compare(TargetRunner(model, LAYERS), engine.runner(LAYERS), STEPS, CROPS)
