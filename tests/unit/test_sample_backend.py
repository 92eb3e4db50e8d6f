"""The batched HF sampling backend against transformers' own generate."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from specforge_lite.data.chat import prompt_ids
from specforge_lite.stages.sample_backends import HFBackend

QUESTIONS = ["What is 2+2?", "Write a poem about the sea, the sky and the stars.", "Hi",
             "Explain recursion.", "Name three colours.", "Capital of Japan?", "Why?"]


def backend(target, max_new_tokens=24, temperature=0.0, top_p=1.0):
    model, tokenizer = target
    cfg = OmegaConf.create({"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens})
    return HFBackend(model, tokenizer, cfg)


def prompts_for(tokenizer):
    return [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def test_batched_greedy_equals_hf_generate_one_at_a_time(tiny_target):
    model, tokenizer = tiny_target
    prompts = prompts_for(tokenizer)
    got = backend(tiny_target).generate(prompts)
    for prompt, (tokens, finish) in zip(prompts, got):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
        assert tokens == want[: len(tokens)]
        assert finish == ("stop" if tokens[-1] == tokenizer.eos_token_id else "length")
        assert len(tokens) == 24 or finish == "stop"


def test_rows_leaving_the_batch_at_eos_do_not_disturb_the_others(tiny_target):
    """Treat a token that row 0 emits at step 3 as EOS: rows stop at different steps and
    leave the batch, and every row still gets what it gets when generated alone."""
    _, tokenizer = tiny_target
    prompts = prompts_for(tokenizer)
    b = backend(tiny_target, max_new_tokens=12)
    trigger = b.generate(prompts[:1])[0][0][2]
    b.eos_ids = {tokenizer.eos_token_id, trigger}
    batched = b.generate(prompts)
    assert batched == [b.generate([p])[0] for p in prompts]
    lengths = {len(tokens) for tokens, _ in batched}
    assert batched[0] == (batched[0][0][:3], "stop") and len(lengths) > 1, "rows must finish at different steps"


def test_sampling_is_reproducible_under_a_seed_and_varies_without(tiny_target):
    _, tokenizer = tiny_target
    prompts = prompts_for(tokenizer)
    b = backend(tiny_target, temperature=1.0, top_p=0.9)
    torch.manual_seed(7)
    first = b.generate(prompts)
    torch.manual_seed(7)
    assert b.generate(prompts) == first
    torch.manual_seed(8)
    assert b.generate(prompts) != first


def test_static_backends_equal_the_hf_backend(tiny_target, forbid_recompiles):
    """`sample.backend=static|compiled` (our static-cache forward, a fixed batch of left-padded
    rows): greedy outputs and finish reasons equal the hf backend's, row for row, with rows
    stopping at an EOS at different steps and a short last batch padded to the batch size."""
    from specforge_lite.stages.sample_backends import StaticBackend

    model, tokenizer = tiny_target
    prompts = prompts_for(tokenizer)
    hf = backend(tiny_target, max_new_tokens=16)
    trigger = hf.generate(prompts[:1])[0][0][2]
    hf.eos_ids = {tokenizer.eos_token_id, trigger}
    want = hf.generate(prompts)
    assert {finish for _, finish in want} == {"stop", "length"}
    cfg = OmegaConf.create({"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 16, "batch_size": 4,
                            "max_prompt_length": 96, "backend": "static"})
    sources = []
    for compiled in (False, True, True):  # the second compiled backend loads the first one's package
        static = StaticBackend(model, tokenizer, cfg, compiled=compiled)
        forbid_recompiles(compiled)  # the graph built is used
        static.eos_ids = hf.eos_ids
        assert static.generate(prompts) == want  # 7 prompts: batches of 4 and 3 (+1 spare row)
        assert (static.compile_s is not None) == compiled
        sources.append(static.graph_source)
    assert sources == [None, "compiled", "loaded"]


def test_auto_picks_vllm_where_installed_then_our_compiled_forward_then_hf(tiny_target):
    """`sample.backend=auto`: vLLM when an interpreter with it was found, else the compiled static
    forward for the targets it runs (Llama family), else transformers' forward; a named backend stays."""
    from transformers import AutoConfig

    from specforge_lite.config.schema import SampleBackend
    from specforge_lite.stages.sample import backend_name

    llama = tiny_target[0].config
    gpt2 = AutoConfig.for_model("gpt2")
    assert backend_name(SampleBackend.auto, "/opt/vllm/bin/python", llama) == "vllm"
    assert backend_name("auto", None, llama) == "compiled"
    assert backend_name("auto", None, gpt2) == "hf"
    assert backend_name(SampleBackend.hf, "/opt/vllm/bin/python", llama) == "hf"
    assert backend_name("static", None, gpt2) == "static"  # a named backend is the user's choice


def test_launch_keeps_a_vllm_sampler_in_one_process(monkeypatch):
    """auto resolves to vLLM where it is installed: one process then drives the engine, as for vllm."""
    from specforge_lite.scale import launch
    from specforge_lite.serving.vllm import interpreter as vllm_interpreter

    cfg = OmegaConf.create({"sample": {"backend": "auto", "vllm": {"python": None, "tensor_parallel_size": 2}},
                            "train": {"dry_run": False}})
    monkeypatch.setattr(vllm_interpreter, "find_python", lambda configured=None: None)
    assert launch.single_process_reason(cfg, "sample") is None
    cfg.sample.vllm.python = "/opt/vllm/bin/python"  # a configured interpreter is taken as found
    monkeypatch.undo()
    assert "one process drives the vLLM engine" in launch.single_process_reason(cfg, "sample")
    cfg.sample.backend = "hf"
    assert launch.single_process_reason(cfg, "sample") is None
