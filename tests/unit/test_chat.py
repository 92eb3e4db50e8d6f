"""Chat templating and assistant-only loss masks, against golden files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specforge_lite import SpecforgeError
from specforge_lite.data.chat import prompt_ids, render_segments, tokenize_conversation
from tests.golden.make_golden import CONVERSATIONS, llama3_tokenizer

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def check_against_golden(tokenizer, golden_file):
    golden = json.loads((GOLDEN / golden_file).read_text())
    assert set(golden) == set(CONVERSATIONS)
    for name, expected in golden.items():
        messages = expected["messages"]
        input_ids, loss_mask = tokenize_conversation(tokenizer, messages)
        assert [list(s) for s in render_segments(tokenizer, messages)] == expected["segments"], name
        assert input_ids == expected["input_ids"], name
        assert loss_mask == expected["loss_mask"], name
        # the pieces are exactly the template's own rendering
        assert "".join(t for t, _ in expected["segments"]) == tokenizer.apply_chat_template(messages, tokenize=False)


@pytest.mark.slow
def test_smollm2_template_golden(smollm2_tokenizer):
    check_against_golden(smollm2_tokenizer, "chat_smollm2.json")


def test_llama3_style_template_golden():
    check_against_golden(llama3_tokenizer(), "chat_llama3_style.json")


def test_mask_marks_exactly_the_replies_and_end_of_turn():
    tokenizer = llama3_tokenizer()
    messages = CONVERSATIONS["multi_turn_with_system"]
    input_ids, loss_mask = tokenize_conversation(tokenizer, messages)
    masked = tokenizer.decode([t for t, m in zip(input_ids, loss_mask) if m])
    assert masked == "4<|eot_id|>12, since 4 x 3 = 12.<|eot_id|>"
    assert sum(loss_mask) < len(loss_mask)


def test_prompt_then_reply_matches_full_tokenisation():
    """What the target generates after prompt_ids is what the mask covers."""
    tokenizer = llama3_tokenizer()
    messages = CONVERSATIONS["single_turn"]
    prompt = prompt_ids(tokenizer, messages[:1])
    input_ids, loss_mask = tokenize_conversation(tokenizer, messages)
    assert input_ids[: len(prompt)] == prompt
    assert loss_mask[: len(prompt)] == [0] * len(prompt) and all(loss_mask[len(prompt):])


def test_truncation_to_max_length():
    tokenizer = llama3_tokenizer()
    ids, mask = tokenize_conversation(tokenizer, CONVERSATIONS["multi_turn_with_system"], max_length=50)
    assert len(ids) == len(mask) == 50


def test_missing_chat_template_is_a_clear_error():
    tokenizer = llama3_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(SpecforgeError, match="no chat template; set target.chat_template"):
        tokenize_conversation(tokenizer, CONVERSATIONS["single_turn"])


def test_template_that_rewrites_history_is_refused():
    tokenizer = llama3_tokenizer()
    # renders only the last message: earlier turns vanish once later ones exist
    tokenizer.chat_template = ("{{ messages[-1]['role'] + ': ' + messages[-1]['content'] + '\n' }}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(SpecforgeError, match="not prefix-stable"):
        tokenize_conversation(tokenizer, CONVERSATIONS["multi_turn_with_system"])
