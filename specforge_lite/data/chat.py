"""Chat templating with an assistant-only loss mask.

The target tokenizer's own chat template renders the conversation; we render it
prefix by prefix so each piece of text is known to be prompt or assistant reply,
then tokenise piece by piece. The reply piece is exactly what the target produces
after the generation prompt (its content and end-of-turn token), so the mask marks
the tokens a drafter must learn to predict. Whitespace the template adds after the
end-of-turn token is template glue and stays unmasked.
"""

from __future__ import annotations

from typing import Sequence

from specforge_lite import SpecforgeError

Message = dict  # {"role": str, "content": str}


def _render(tokenizer, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def require_chat_template(tokenizer, name: str = "the target tokenizer") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise SpecforgeError(
            f"{name} has no chat template; set target.chat_template to a Jinja template "
            "(for instance the ChatML one: <|im_start|>role\\ncontent<|im_end|>)")


def render_segments(tokenizer, messages: Sequence[Message]) -> list[tuple[str, bool]]:
    """Split the template's rendering of `messages` into `(text, is_assistant)` pieces.

    The pieces concatenate to the template's full rendering. Raises if the template
    is not prefix-stable (renders earlier turns differently once later ones exist).
    """
    require_chat_template(tokenizer)
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise SpecforgeError(
                "the chat template is not prefix-stable (it renders earlier turns differently "
                f"once turn {i} is added), so assistant tokens cannot be located; "
                "set target.chat_template to a template without that behaviour")
        reply = full[len(prompt):]
        core = reply.rstrip()
        segments += [(prompt[len(done):], False), (core, True), (reply[len(core):], False)]
        done = full
    rest = _render(tokenizer, messages, add_generation_prompt=False)[len(done):]
    segments.append((rest, False))
    return [(text, is_assistant) for text, is_assistant in segments if text]


def tokenize_conversation(tokenizer, messages: Sequence[Message], max_length: int | None = None
                          ) -> tuple[list[int], list[int]]:
    """`(input_ids, loss_mask)` of a conversation; mask 1 on assistant reply tokens.

    Truncated to `max_length` tokens from the right.
    """
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for text, is_assistant in render_segments(tokenizer, messages):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids += ids
        loss_mask += [int(is_assistant)] * len(ids)
    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return input_ids, loss_mask


def prompt_ids(tokenizer, messages: Sequence[Message]) -> list[int]:
    """Token ids of `messages` followed by the generation prompt (what the target continues)."""
    require_chat_template(tokenizer)
    text = _render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
