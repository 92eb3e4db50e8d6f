"""The static-cache target forward (eager and compiled) against transformers' forward on
the tiny random Llama: logits and hidden states, cropping, the shared cache, greedy
speculative decoding identical to plain decoding on the same engine, and how
`eval.engine` chooses."""

from __future__ import annotations

import pytest
import torch

from specforge_lite.decoding.drafters import NgramDrafter
from specforge_lite.decoding.engine import TargetRunner, generate_plain, generate_speculative
from specforge_lite.runtime.fast_engine import EAGER_MARGIN, FastEngine
from specforge_lite.runtime.target_choice import build_target_engine
from specforge_lite.runtime.static_llama import unsupported_reason
from specforge_lite.runtime.width_timing import clearly_faster
from tests.unit.test_engine import StubDrafter, prompts

LAYERS = (0, 2, 6)  # embeddings, a middle layer, the last (after the final norm)
SHALLOW_LAYERS = (0, 1, 2)  # the same of the two-layer target the compiled tests build (conftest)


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target[0]


def _compare(reference: TargetRunner, runner, steps: list[list[int]], crop_after: dict[int, int]):
    reference.reset()
    runner.reset()
    for i, ids in enumerate(steps):
        want_logits, want_hidden = reference.forward(ids)
        got_logits, got_hidden = runner.forward(ids)
        assert got_logits.shape == want_logits.shape
        torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=1e-4)
        assert set(got_hidden) == set(want_hidden)
        for layer in want_hidden:
            torch.testing.assert_close(got_hidden[layer], want_hidden[layer], atol=2e-5, rtol=1e-4)
        if i in crop_after:
            reference.crop(crop_after[i])
            runner.crop(crop_after[i])
        assert runner.length == reference.length


STEPS = [list(range(10, 47)), [5], [6, 7, 8], [9, 10, 11, 12], [13]]
CROPS = {2: 39, 3: 40}  # drop two of three drafts, then all four


def test_static_forward_equals_transformers(target):
    engine = FastEngine(target, capacity=64, hidden_layers=LAYERS, max_width=4)
    _compare(TargetRunner(target, LAYERS), engine.runner(LAYERS), STEPS, CROPS)


def test_compiled_forward_equals_transformers(two_layer_target, forbid_recompiles):
    # widths 1..3 compiled (width 4 and the prefill run the same module eagerly); capacity 128 and
    # two layers, as test_engine_choice's, the window test's and test_tree_compiled's: one package
    # for them all (session cache)
    target = two_layer_target
    engine = FastEngine(target, capacity=128, hidden_layers=SHALLOW_LAYERS, max_width=3, compiled=True)
    assert engine.compile() > 0
    forbid_recompiles()  # the graphs built are the ones used
    _compare(TargetRunner(target, SHALLOW_LAYERS), engine.runner(SHALLOW_LAYERS), STEPS, CROPS)
    # each width the package covers goes to the forward timed faster at it (the eager module only
    # beyond the margin), and a width routed to the eager module computes what the graph does
    routed = engine.route_widths(range(1, 20), context_len=32, rounds=2)
    assert sorted(routed["serves"]) == list(range(1, 17)) and engine.length == 0  # the package's widths
    ms = routed["ms"]
    for width, forward in routed["serves"].items():
        eager_wins = ms["eager"][width] * (1 + EAGER_MARGIN) < ms["compiled"][width]
        assert forward == ("eager" if eager_wins else "compiled") == engine.serves(width), (width, ms)
    engine.eager_widths = {2, 3}
    assert [engine.serves(w) for w in (1, 2, 3, 4, 17)] == ["compiled", "eager", "eager", "compiled", "eager"]
    _compare(TargetRunner(target, SHALLOW_LAYERS), engine.runner(SHALLOW_LAYERS), STEPS, CROPS)
    # greedy speculative decoding on the compiled engine equals plain decoding on it
    runner = engine.runner(SHALLOW_LAYERS)
    plain_runner = engine.runner()
    for ids in prompts(3, seed=4):
        plain = generate_plain(target, ids, 24, runner=plain_runner)
        for drafter in (StubDrafter(plain.tokens, right=2, vocab=256, hidden_state_layers=SHALLOW_LAYERS),
                        NgramDrafter()):
            spec = generate_speculative(target, drafter, ids, 24, 2, runner=runner)
            assert spec.tokens == plain.tokens
            if isinstance(drafter, StubDrafter):  # two of two drafts right: compiled widths used
                assert spec.tau > 1.5


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_equals_plain_on_static_engine(target, k):
    engine = FastEngine(target, capacity=128, hidden_layers=LAYERS, max_width=k + 1)
    hf_runner = TargetRunner(target)
    for ids in prompts(4, seed=k):
        want = generate_plain(target, ids, 40, runner=hf_runner).tokens
        plain = generate_plain(target, ids, 40, runner=engine.runner())
        assert plain.tokens == want  # tiny fp32 model: no argmax near a tie
        for right in (0, 1, k):
            drafter = StubDrafter(want, right=right, vocab=256, hidden_state_layers=LAYERS)
            spec = generate_speculative(target, drafter, ids, 40, k, runner=engine.runner(LAYERS))
            assert spec.tokens == want
            if right == k:
                assert spec.tau > 1.5


def test_negative_layers_count_from_the_end(target):
    """Drafters may ask for hidden states as -1 (the final-norm output), as transformers' tuple."""
    engine = FastEngine(target, capacity=64, hidden_layers=(-1, 2))
    reference, runner = TargetRunner(target, (-1, 2)), engine.runner((-1, 2))
    reference.reset()
    runner.reset()
    _, want = reference.forward(list(range(9)))
    _, got = runner.forward(list(range(9)))
    assert set(got) == {-1, 2}
    for layer in (-1, 2):
        torch.testing.assert_close(got[layer], want[layer], atol=2e-5, rtol=1e-4)


def test_shared_cache_and_capacity_errors(target):
    engine = FastEngine(target, capacity=16, hidden_layers=(2,))
    first, second = engine.runner((2,)), engine.runner()
    first.reset()
    first.forward([1, 2, 3])
    second.reset()
    with pytest.raises(RuntimeError, match="another runner"):
        first.forward([4])
    with pytest.raises(RuntimeError, match="holds 16 positions"):
        second.forward(list(range(17)))
    with pytest.raises(ValueError, match=r"without hidden layers \[3\]"):
        engine.runner((3,))


def test_engine_choice(target, two_layer_target):
    static = build_target_engine(target, "static", 64, LAYERS, 3)
    assert static.info["used"] == "static" and static.engine is not None
    hf = build_target_engine(target, "hf", 64, LAYERS, 3)
    assert hf.engine is None and isinstance(hf.runner(LAYERS), TargetRunner)
    auto = build_target_engine(two_layer_target, "auto", 128, SHALLOW_LAYERS, 2, repeats=1)
    assert auto.info["used"] in ("hf", "static", "compiled")
    assert set(auto.info["measured_ms"]) >= {"hf", "static"}
    assert all(set(ms) == {1, 2} and min(ms.values()) > 0 for ms in auto.info["measured_ms"].values())
    chosen, noise, default = auto.info["measured_ms"], auto.info["noise"], auto.info["default"]
    assert default == ("compiled" if "compiled" in chosen else "static")
    if auto.info["used"] != default:  # left the default only by more than the noise could make
        used = auto.info["used"]
        assert clearly_faster(chosen[used].values(), chosen[default].values(), max(noise[used], noise[default]))


def test_unsupported_models_fall_back_to_transformers(target):
    config = type(target.config).from_dict({**target.config.to_dict(), "hidden_act": "gelu"})
    assert "hidden_act" in unsupported_reason(config)
    original = target.config
    try:
        target.config = config
        assert build_target_engine(target, "auto", 64, (), 2).info["used"] == "hf"
        with pytest.raises(ValueError, match="eval.engine=static.*hidden_act"):
            build_target_engine(target, "static", 64, (), 2)
    finally:
        target.config = original


def test_cache_capacity_covers_every_turn(tiny_target):
    from omegaconf import OmegaConf

    from specforge_lite.data.chat import prompt_ids
    from specforge_lite.data.eval_prompts import conversation as _messages
    from specforge_lite.data.eval_prompts import cache_capacity

    model, tokenizer = tiny_target
    prompts = [{"id": "a", "category": "x", "system": None, "turns": ["hello there", "and again " * 20]},
               {"id": "b", "category": "x", "system": None, "turns": ["short"]}]
    ecfg = OmegaConf.create({"max_new_tokens": 50, "num_draft_tokens": 4})
    capacity = cache_capacity(tokenizer, prompts, ecfg, model.config)
    two_turns = prompt_ids(tokenizer, _messages(prompts[0], ["x" * 50], 1))  # a 50-byte first answer
    assert capacity % 64 == 0
    assert capacity >= len(two_turns) + 50 + 4 + 1
    assert capacity <= model.config.max_position_embeddings


def test_compiled_draft_model_drafts_like_the_eager_one(target, forbid_recompiles):
    """A draft model's `compile` moves it onto the static forward with compiled widths 1-2:
    every draft equals the eager draft model's (same accepted lengths, step for step), and
    greedy output stays plain decoding's."""
    from specforge_lite.decoding.drafters import DraftModelDrafter
    from specforge_lite.targets.surgery import truncated_copy

    draft = truncated_copy(target, 2)
    eager, compiled = DraftModelDrafter(draft), DraftModelDrafter(draft)
    assert compiled.compile(3, capacity=128) > 0 and compiled.runner is not None
    forbid_recompiles()
    for ids in prompts(3, seed=7):
        plain = generate_plain(target, ids, 40)
        a = generate_speculative(target, eager, ids, 40, 3)
        b = generate_speculative(target, compiled, ids, 40, 3)
        assert a.tokens == b.tokens == plain.tokens
        assert a.accepted_lengths == b.accepted_lengths and sum(b.accepted_lengths) > 0


def test_autotune_setting(monkeypatch):
    from specforge_lite.runtime.compile import AUTOTUNE_ENV, autotune
    from specforge_lite.runtime.graph_cache import graph_key

    monkeypatch.delenv(AUTOTUNE_ENV, raising=False)
    assert autotune() is True  # users' default
    key_autotuned = graph_key({}, [], [])
    for off in ("0", "off", "False"):
        monkeypatch.setenv(AUTOTUNE_ENV, off)
        assert autotune() is False
    assert graph_key({}, [], []) != key_autotuned  # a package of the other kernels is another package
    monkeypatch.setenv(AUTOTUNE_ENV, "sometimes")
    with pytest.raises(ValueError, match=AUTOTUNE_ENV):
        autotune()


def test_gemm_rows_setting_and_restore(monkeypatch):
    from torch._inductor.codegen import cpp_micro_gemm as micro

    from specforge_lite.runtime.compile import GEMM_ROWS_ENV, _GemmRows, gemm_rows

    monkeypatch.delenv(GEMM_ROWS_ENV, raising=False)
    assert gemm_rows() == 4
    monkeypatch.setenv(GEMM_ROWS_ENV, "0")
    assert gemm_rows() == 0
    for bad in ("-1", "x", "17"):
        monkeypatch.setenv(GEMM_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=GEMM_ROWS_ENV):
            gemm_rows()

    def fp32_avx512_blocks():
        return [tuple(c.register_blocking) for c in micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec]
                if c.vec_isa_cls is micro.VecAVX512 and c.input_dtype == torch.float32
                and c.input2_dtype == torch.float32 and c.extra_check is None]

    before = list(micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec])
    assert fp32_avx512_blocks() and (4, 48, 1) not in fp32_avx512_blocks()
    with _GemmRows(4):
        assert fp32_avx512_blocks() == [(4, 48, 1)]
        others = [c for c in micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec] if c.vec_isa_cls is not micro.VecAVX512]
        assert others == [c for c in before if c.vec_isa_cls is not micro.VecAVX512]
    assert micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec] == before
    with _GemmRows(0):
        assert micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec] == before


def test_compiled_forward_wider_than_one_register_block(forbid_recompiles, autotuned):
    # a width of 6 rows spans a full 4-row register block and a 2-row tail (autotuned: the C++
    # GEMM micro-kernel, whose blocks these are, is one of the autotuned choices); a stand-in whose
    # products all share one shape, so that the choices of one shape are built, not of every shape
    from transformers import LlamaConfig, LlamaForCausalLM

    from specforge_lite.runtime.static_llama import StaticLlama
    from specforge_lite.runtime.compile import compile_frozen

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                          tie_word_embeddings=False)).eval()
    eager = StaticLlama(target, 64, LAYERS).eval()
    compiled_module = StaticLlama(target, 64, LAYERS).eval()
    ids, positions = torch.arange(3, 9), torch.arange(6)
    graph, _ = compile_frozen(compiled_module, [(ids, positions)])
    forbid_recompiles()
    with torch.inference_mode():
        want_logits, want_hidden = eager(ids, positions)
        got_logits, got_hidden = graph(ids.clone(), positions.clone())
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=1e-4)
    for got, want in zip(got_hidden, want_hidden):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_compiled_window_grows_without_recompiling(two_layer_target, forbid_recompiles):
    # attention spans only the slots written so far, rounded up to WINDOW_STEP: one graph per
    # width serves every window (here 16 .. 128 slots, the last one the whole cache), and the
    # tokens are transformers' own
    from specforge_lite.runtime.static_llama import WINDOW_STEP

    target = two_layer_target
    engine = FastEngine(target, capacity=128, hidden_layers=SHALLOW_LAYERS, max_width=2, compiled=True)
    engine.compile()
    forbid_recompiles()
    ids = prompts(1, seed=11)[0][:9]
    want = generate_plain(target, ids, 119, runner=TargetRunner(target))
    got = generate_plain(target, ids, 119, runner=engine.runner())
    assert got.tokens == want.tokens and len(got.tokens) == 119  # the cache filled to its last slot
    assert engine.module.window(9).shape[0] == WINDOW_STEP
    assert engine.module.window(WINDOW_STEP + 1).shape[0] == 2 * WINDOW_STEP
    assert engine.module.window(10_000).shape[0] == 128  # never past the cache


def test_packed_prefill_equals_the_padded_forward(target):
    # rows of different lengths prefilled as one packed sequence: each row's last logits and
    # its cache slots equal the left-padded forward's, and a windowed decoding step after it
    # equals a whole-cache step after the padded prefill
    from specforge_lite.runtime.static_llama import StaticLlama
    from specforge_lite.stages.sample_backends import left_padded

    rows = [list(range(3, 3 + n)) for n in (5, 12, 1)]
    padded = StaticLlama(target, 32, (), batch=3).eval()
    packed = StaticLlama(target, 32, (), batch=3).eval()
    ids, start = left_padded(rows, 0)
    width = ids.shape[1]
    with torch.inference_mode():
        want = padded(ids, torch.arange(width), start, last_only=True)[0][:, -1]
        got = packed.prefill_rows(rows)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        for a, b in zip(padded.layers, packed.layers):
            for row, first in enumerate(start.tolist()):
                torch.testing.assert_close(b.k_cache[row, :, first:width], a.k_cache[row, :, first:width])
                torch.testing.assert_close(b.v_cache[row, :, first:width], a.v_cache[row, :, first:width])
        step = want.argmax(-1)[:, None]
        want_next = padded(step, torch.tensor([width]), start)[0]
        got_next = packed(step, torch.tensor([width]), start, window=packed.window(width + 1))[0]
        torch.testing.assert_close(got_next, want_next, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="non-empty rows"):
        packed.prefill_rows(rows[:2])


def test_graph_allowance_adds_up_over_modules(monkeypatch):
    # dynamo's recompile limit counts every graph of one code object: two engines of 9 widths
    # each (a bench's two builds, a target and a draft model) need room for all 18
    import torch._dynamo.config as dynamo_config

    from specforge_lite.runtime import compile as fast_target

    monkeypatch.setattr(fast_target, "_GRAPHS_ALLOWED", [0])
    with dynamo_config.patch(recompile_limit=8):  # torch's own patcher restores it
        fast_target.allow_graphs(9)
        fast_target.allow_graphs(9)
        assert dynamo_config.recompile_limit >= 18


def test_compiled_graph_is_kept_and_loaded_by_a_later_engine(two_layer_target, tmp_path, caplog):
    # a CPU engine's graphs are one AOTInductor package in the cache folder; a second engine
    # built from the same weights and shapes loads it instead of compiling, and its forwards
    # are transformers' own; a damaged package is compiled again, not trusted (on the two-layer
    # target: the rule does not depend on depth, and a shallower package builds sooner)
    target, layers = two_layer_target, SHALLOW_LAYERS
    first = FastEngine(target, capacity=64, hidden_layers=layers, max_width=3, compiled=True, cache_dir=tmp_path)
    first.compile()
    assert first.graph_source == "compiled"
    packages = sorted(tmp_path.iterdir())
    assert len(packages) == 1 and packages[0].name.startswith("target-") and packages[0].suffix == ".pt2"
    second = FastEngine(target, capacity=64, hidden_layers=layers, max_width=3, compiled=True, cache_dir=tmp_path)
    second.compile()
    assert second.graph_source == "loaded"
    _compare(TargetRunner(target, layers), second.runner(layers), STEPS, CROPS)
    packages[0].write_bytes(b"not a package")
    third = FastEngine(target, capacity=64, hidden_layers=layers, max_width=3, compiled=True, cache_dir=tmp_path)
    with caplog.at_level("WARNING"):
        third.compile()
    assert third.graph_source == "compiled" and "did not load" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [packages[0].name]  # replaced, no partial file left
    _compare(TargetRunner(target, layers), third.runner(layers), STEPS, CROPS)


def test_graph_key_follows_weights_and_shapes(target):
    from specforge_lite.runtime.static_llama import StaticLlama
    from specforge_lite.runtime.target_package import graph_key

    base = graph_key(StaticLlama(target, 64, LAYERS), 3)
    assert graph_key(StaticLlama(target, 64, LAYERS), 3) == base
    assert graph_key(StaticLlama(target, 128, LAYERS), 3) != base
    assert graph_key(StaticLlama(target, 64, (2,)), 3) != base
    changed = StaticLlama(target, 64, LAYERS)
    with torch.no_grad():
        changed.layers[1].down[0, 0] += 1e-3  # one weight of one layer
    assert graph_key(changed, 3) != base


def test_graph_cache_folder_setting(monkeypatch, tmp_path):
    from specforge_lite.runtime.graph_cache import GRAPH_CACHE_ENV, graph_cache_dir

    monkeypatch.setenv(GRAPH_CACHE_ENV, str(tmp_path))
    assert graph_cache_dir() == tmp_path
    for off in ("0", "off"):
        monkeypatch.setenv(GRAPH_CACHE_ENV, off)
        assert graph_cache_dir() is None
    monkeypatch.delenv(GRAPH_CACHE_ENV)
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", str(tmp_path / "models"))
    assert graph_cache_dir() == tmp_path / "models" / "compiled"
