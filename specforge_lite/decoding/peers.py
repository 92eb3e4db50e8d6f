"""Hugging Face's own decoders, measured as peers in the same table: plain
`generate`, prompt-lookup decoding and assisted generation with a draft model.

They return the same `Generation` record as our loops. Target forwards are counted
with a forward pre-hook on the target module (the assistant is another module, so
its calls are not counted). HF's assisted loop has no separate prefill: its first
forward runs the prompt and the first drafts together; we still leave one forward
and one token out of tau, as for our loops, so plain `generate` scores 1.00.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from specforge_lite.decoding.engine import Generation
from specforge_lite.decoding.verify import GREEDY, SamplingParams


def generate_hf(model, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
                eos_ids: Iterable[int] = (), pad_id: int | None = None, **generate_kwargs) -> Generation:
    """`model.generate` on one prompt; `generate_kwargs` select the HF decoder
    (`prompt_lookup_num_tokens=k`, `assistant_model=...`)."""
    eos = list(eos_ids)
    calls = [0]

    def count(module, args, kwargs):
        calls[0] += 1

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    sample_kwargs = ({"do_sample": False, "temperature": None, "top_p": None, "top_k": None} if sampling.greedy
                     else {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                           "top_k": 0})
    input_ids = torch.tensor([prompt_ids], device=model.device)
    try:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                                 pad_token_id=pad_id if pad_id is not None else (eos[0] if eos else None),
                                 **sample_kwargs, **generate_kwargs)
        total_s = time.perf_counter() - start
    finally:
        handle.remove()
    tokens = out[0, len(prompt_ids):].tolist()
    finish = "length"
    for i, token in enumerate(tokens):
        if token in eos:
            tokens, finish = tokens[:i + 1], "eos"
            break
    return Generation(tokens=tokens, finish=finish, num_prompt_tokens=len(prompt_ids),
                      num_forwards=max(calls[0] - 1, 0), total_s=total_s)


def prepare_assistant(assistant, num_draft_tokens: int) -> None:
    """Make HF's assisted generation draft exactly k tokens per step, as our chain does
    (HF's defaults draft 20 and stop early below 0.4 confidence)."""
    config = assistant.generation_config
    config.num_assistant_tokens = num_draft_tokens
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
