"""Conversations -> token ids + loss mask, with the target tokenizer's own chat template.

The loss mask covers assistant tokens only. Templates that mark assistant turns with
`{% generation %}` are used through transformers' `return_assistant_tokens_mask`; for the
others the conversation is rendered incrementally and each assistant turn is the text that
its message adds after the generation prompt. No separator is ever hard-coded.
"""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "model": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                "system": "system", "tool": "tool"}


class NoAssistantTokens(ValueError):
    """An example whose loss mask would be all zeros."""


def to_messages(example: dict[str, Any]) -> list[dict[str, str]] | None:
    """Normalise one example to OpenAI `messages`; None for plain `text` examples.

    Accepts OpenAI (`messages`: role/content), ShareGPT (`conversations`: from/value) and
    plain `text`.
    """
    if example.get("messages") is not None:
        turns, role_key, content_key = example["messages"], "role", "content"
    elif example.get("conversations") is not None:
        turns, role_key, content_key = example["conversations"], "from", "value"
    elif example.get("text") is not None:
        return None
    else:
        raise ValueError(f"example has none of 'messages', 'conversations', 'text' (keys: {sorted(example)}); "
                         "convert it to OpenAI messages, ShareGPT conversations or plain text")
    messages = []
    for turn in turns:
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise ValueError(f"unknown chat role {turn[role_key]!r}; use one of {sorted(set(ROLE_ALIASES))}")
        messages.append({"role": role, "content": turn[content_key]})
    return messages


def _has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "{% generation %}" in template or "{%- generation %}" in template


def _assistant_char_spans(tokenizer, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
    """Character spans of assistant turns in `text`, found by incremental rendering."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ValueError("the chat template renders earlier turns differently once later turns follow, so "
                             "assistant tokens cannot be located; add {% generation %} markers to the template")
        spans.append((len(before), len(upto)))
    return spans


def tokenize_messages(tokenizer, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    """Render `messages` with the tokenizer's chat template.

    Returns:
        {"input_ids": [s], "loss_mask": [s]} with loss_mask 1 exactly on assistant tokens.
    Raises:
        NoAssistantTokens: when no token would be trained on.
    """
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template; set tokenizer.chat_template or use plain `text` data")
    if _has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        input_ids, loss_mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        spans = _assistant_char_spans(tokenizer, messages, text)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = list(enc["input_ids"])
        loss_mask = [int(any(a <= s and e <= b and e > s for a, b in spans)) for s, e in enc["offset_mapping"]]
    if not any(loss_mask):
        raise NoAssistantTokens("example has no assistant token to train on")
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def tokenize_example(tokenizer, example: dict[str, Any]) -> dict[str, list[int]]:
    """One dataset example (messages, conversations or text) -> input_ids + loss_mask."""
    messages = to_messages(example)
    if messages is None:
        ids = tokenizer(example["text"], add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = ids + [tokenizer.eos_token_id]
        return {"input_ids": ids, "loss_mask": [1] * len(ids)}
    return tokenize_messages(tokenizer, messages)
