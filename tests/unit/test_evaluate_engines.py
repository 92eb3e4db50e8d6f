"""The evaluate stage drives every serving engine through one interface (serving/engines.py)
and resolves target.path once: on the tiny target, with vLLM's child process replaced by a
stand-in that answers as vllm_runner.py does (no vLLM here); everything else is real."""

import json
import sys

import pytest

import specforge_lite.stages.evaluate as evaluate  # imported before any test replaces what it imports
import specforge_lite.targets.loading as targets
from specforge_lite.serving.engines import ENGINES, Engine
from specforge_lite.serving.vllm import methods as vllm_methods
from tests.conftest import compose

SMOKE = ["+recipe=smoke", "eval.max_prompts=2", "eval.bootstrap.resamples=50", "eval.max_new_tokens=8",
         "eval.warmup=1", "eval.plots=false", "eval.best_k_method=null"]


class FakeVllm:
    """vLLM's child process as `VllmEngine` talks to it: each request answered with 8 tokens in
    8 iterations (plain decoding), the engine arguments recorded."""

    started: list[dict] = []

    def __init__(self, kwargs, vcfg, log_path=None):
        self.started.append(kwargs)
        self.load_s, self.version, self.draft = 0.1, "stand-in", None

    def generate(self, prompts, params, one_at_a_time=False):
        outputs = [{"token_ids": list(range(3, 3 + params["max_tokens"])), "finish_reason": "length",
                    "seconds": 0.01, "counters": {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                                                  "accepted_per_position": [], "iterations": params["max_tokens"]}}
                   for _ in prompts]
        return {"outputs": outputs, "seconds": 0.01 * len(prompts)}

    def held_weights(self):
        return []

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def resolutions(monkeypatch):
    """Count calls of `resolve_target_path`, wherever a module imported it by name."""
    original, calls = targets.resolve_target_path, []

    def counting(path, *args, **kwargs):
        calls.append(path)
        return original(path, *args, **kwargs)

    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "__name__", "").startswith("specforge_lite") \
                and getattr(module, "resolve_target_path", None) is original:
            monkeypatch.setattr(module, "resolve_target_path", counting)
    FakeVllm.started = []
    monkeypatch.setattr(vllm_methods, "VllmEngine", FakeVllm)  # where the vllm_* methods start it
    return calls


def test_every_engine_implements_the_interface():
    names = [engine.name for engine in ENGINES]
    assert len(set(names)) == len(names) == 2
    for engine in ENGINES:
        assert isinstance(engine, Engine)  # every name of the protocol
        assert engine.plain in engine.methods(["plain", "vllm_plain", "llamacpp_plain", "eagle3"])
        assert engine.methods(["plain", "eagle3", "hf_generate"]) == []


@pytest.mark.parametrize("methods", ["[plain,vllm_plain,vllm_ngram]", "[vllm_ngram]"])
def test_a_vllm_evaluate_resolves_the_target_once(tmp_path, resolutions, methods):
    """Beside our engine and alone, the stage resolves target.path once and every load and
    engine reads that one path (vLLM gets it as its `model`)."""
    cfg = compose(SMOKE + ["stage=evaluate", f"eval.methods={methods}", f"run_dir={tmp_path}"])
    evaluate.run(cfg)
    assert resolutions == [cfg.target.path]
    resolved = targets.resolve_target_path(cfg.target.path)
    assert [kwargs["model"] for kwargs in FakeVllm.started] == [resolved, resolved]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert set(report["vllm"]["methods"]) == {"vllm_plain", "vllm_ngram"}
    alone = methods == "[vllm_ngram]"
    assert report.get("baseline", "plain") == ("vllm_plain" if alone else "plain")
    assert report["vllm"]["baseline"] == ("vllm_plain" if alone else "our plain")
    assert "## vLLM stand-in" in (tmp_path / "eval" / "report.md").read_text()


def test_which_engine_serves_which_drafter_comes_from_the_contract():
    """The method catalogue, llama.cpp's tables and the door's refusals are views of each
    drafter's VLLM_SERVING / LLAMACPP_SERVING: adding a drafter touches its own folder only."""
    from specforge_lite.drafters.methods import LLAMACPP_METHODS, VLLM_METHODS
    from specforge_lite.drafters.registry import DRAFTERS
    from specforge_lite.serving.llamacpp.checks import DRAFT_OF, GGUF_DRAFTERS, gguf_refusal
    from specforge_lite.serving.llamacpp.runner import METHODS, NEEDS_DRAFT, SPEC_TYPE_FLAGS

    assert set(METHODS) == set(LLAMACPP_METHODS)
    for name, module in DRAFTERS.items():
        served = module.LLAMACPP_SERVING
        assert isinstance(served, (tuple, str)) and served, name
        runs = isinstance(served, tuple)
        assert (f"llamacpp_{name}" in LLAMACPP_METHODS) == runs == (f"llamacpp_{name}" in NEEDS_DRAFT)
        assert (f"vllm_{name}" in VLLM_METHODS) == bool(module.VLLM_SERVING)
        if runs:
            spec_type, file = served
            assert METHODS[f"llamacpp_{name}"] == spec_type and spec_type in SPEC_TYPE_FLAGS
            assert GGUF_DRAFTERS[name] == (SPEC_TYPE_FLAGS[spec_type], file) and DRAFT_OF[f"llamacpp_{name}"] == name
            assert gguf_refusal(name, {}) is None
        else:
            assert gguf_refusal(name, {}) == served
