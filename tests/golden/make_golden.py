"""Regenerate the chat-template golden files (then review the diff by eye):

    python tests/golden/make_golden.py
"""

from __future__ import annotations

import json
from pathlib import Path

from specforge_lite.data.chat import render_segments, tokenize_conversation

HERE = Path(__file__).resolve().parent

LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

CONVERSATIONS = {
    "single_turn": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    "multi_turn_with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "12, since 4 x 3 = 12."},
    ],
}


def llama3_tokenizer():
    from specforge_lite.targets.loading import byte_level_tokenizer

    tokenizer = byte_level_tokenizer(extra_special_tokens=LLAMA3_SPECIALS)
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


def smollm2_tokenizer():
    from omegaconf import OmegaConf

    from specforge_lite.targets.loading import load_tokenizer

    return load_tokenizer(OmegaConf.create({"path": "builtin:smollm2-135m-instruct", "chat_template": None,
                                            "trust_remote_code": False}))


def golden(tokenizer) -> dict:
    out = {}
    for name, messages in CONVERSATIONS.items():
        input_ids, loss_mask = tokenize_conversation(tokenizer, messages)
        out[name] = {
            "messages": messages,
            "segments": render_segments(tokenizer, messages),
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "assistant_text": [tokenizer.decode([t]) for t, m in zip(input_ids, loss_mask) if m],
        }
    return out


if __name__ == "__main__":
    for name, make in (("smollm2", smollm2_tokenizer), ("llama3_style", llama3_tokenizer)):
        data = golden(make())
        (HERE / f"chat_{name}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        for conv, item in data.items():
            print(name, conv, "".join(item["assistant_text"]).replace("\n", "\\n"))
