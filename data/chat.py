"""Conversations -> token ids + loss mask, with the target tokenizer's own chat template.

The loss mask covers assistant tokens only: what the model itself generates in an assistant
turn, i.e. the turn's content plus the template's end-of-turn token (`<|eot_id|>`,
`<|im_end|>`, `</s>`, `<end_of_turn>`, ...). The end-of-turn token is trained because a drafter
that cannot predict it drafts past the end of every answer; the role header before the content
(the generation prompt) and the whitespace a template puts between turns after the end-of-turn
token are not, because the target never generates them.

Assistant text is located in the rendered conversation in one of two ways, never with a
hard-coded separator:
  * the template marks assistant turns with `{% generation %}...{% endgeneration %}`: the
    marked character spans, as the template's author placed them;
  * otherwise, incremental rendering: turn i is the text that rendering `messages[:i+1]` adds
    to rendering `messages[:i]` with the generation prompt, minus whitespace after a trailing
    special token. That requires each partial rendering to be a prefix of the full one; a
    template that rewrites earlier turns once later turns follow (Qwen3 drops earlier turns'
    `<think>` blocks, Mistral v0.3 moves the system prompt to the last user turn) raises
    `TemplateMismatch` instead of producing a wrong mask.
The full conversation is tokenized once; a token is trained when its characters overlap an
assistant span (as in transformers' `return_assistant_tokens_mask`). So a token that crosses
the boundary, e.g. '\n    ' when the generation prompt ends in '\n' and the answer starts with
indentation, is trained: the answer's first token is never lost.
"""

from __future__ import annotations

import re
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "model": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                "system": "system", "tool": "tool"}


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class NoAssistantTokens(ValueError):
    """An example whose loss mask would be all zeros."""


class TemplateMismatch(ValueError):
    """A chat template whose partial renderings are not prefixes of the full rendering."""


class UnreadableContent(ValueError):
    """A turn whose content is not text: null, missing, or parts other than text (images, audio, ...)."""


def content_text(content: Any, where: str) -> str:
    """A turn's content as the text a template renders: a string as it is, a list of OpenAI text parts
    ([{"type": "text", "text": ...}, ...]) joined as they stand; anything else raises `UnreadableContent`."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if isinstance(content, list):
        kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content})
        got = f"parts of type {kinds}" if content else "no parts"
    else:
        got = "null" if content is None else f"a {type(content).__name__}"
    raise UnreadableContent(f"{where} has content {got}, not text; give a string or a list of text parts")


def to_messages(example: dict[str, Any]) -> list[dict[str, str]] | None:
    """Normalise one example to OpenAI `messages`; None for plain `text` examples.

    Accepts OpenAI (`messages`: role/content, content a string or a list of text parts), ShareGPT
    (`conversations`: from/value) and plain `text`; a turn without text raises `UnreadableContent`.
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
    for i, turn in enumerate(turns):
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise ValueError(f"unknown chat role {turn[role_key]!r}; use one of {sorted(set(ROLE_ALIASES))}")
        messages.append({"role": role, "content": content_text(turn.get(content_key), f"turn {i} ({role})")})
    return messages


def has_generation_markers(template: str) -> bool:
    """Whether a chat template marks assistant turns with `{% generation %}`."""
    return GENERATION_TAG.search(template) is not None


def _special_tokens(tokenizer) -> list[str]:
    """Strings of all special tokens, including added ones outside the special-tokens map."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return sorted(set(added) | set(tokenizer.all_special_tokens), key=len, reverse=True)


def _render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _marked_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and the character spans the template wraps in {% generation %}."""
    rendered, spans = render_jinja_template(conversations=[messages], chat_template=tokenizer.get_chat_template(),
                                            return_assistant_tokens_mask=True, **tokenizer.special_tokens_map)
    return rendered[0], [tuple(s) for s in spans[0]]


def _incremental_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and assistant spans found by rendering the conversation turn by turn."""
    text = _render(tokenizer, messages)
    specials = _special_tokens(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise TemplateMismatch("the conversation starts with an assistant turn, whose start cannot be located "
                                   "without {% generation %} markers; drop the leading turn or add the markers")
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(upto) and upto.startswith(before)):
            raise TemplateMismatch(
                f"the chat template renders the conversation up to message {i} (assistant) differently once later "
                "turns follow (e.g. it strips earlier <think> blocks or moves the system prompt), so assistant tokens "
                "cannot be located; add {% generation %}...{% endgeneration %} around assistant content in the "
                "template, or train on single-turn examples")
        start, end = len(before), len(upto)
        turn = text[start:end].rstrip()
        if any(turn.endswith(s) for s in specials):  # whitespace after the end-of-turn token is formatting
            end = start + len(turn)
        spans.append((start, end))
    return text, spans


def mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a span (zero-width tokens: that start inside one).

    `offsets` and `spans` are sorted, spans disjoint, so one pass over both suffices.
    """
    mask, j = [], 0
    for s, e in offsets:
        while j < len(spans) and spans[j][1] <= s:  # spans that end before this token
            j += 1
        a = spans[j][0] if j < len(spans) else None
        mask.append(int(a is not None and (e > a if e > s else a <= s)))
    return mask


def tokenize_messages(tokenizer, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    """Render `messages` with the tokenizer's chat template and mark the assistant tokens.

    Returns:
        {"input_ids": [s], "loss_mask": [s]} with loss_mask 1 exactly on assistant tokens.
    Raises:
        NoAssistantTokens: when no token would be trained on.
        TemplateMismatch: when the template has no generation markers and rewrites earlier turns.
    """
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template; set tokenizer.chat_template or use plain `text` data")
    if has_generation_markers(tokenizer.get_chat_template()):
        text, spans = _marked_spans(tokenizer, messages)
    else:
        text, spans = _incremental_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    loss_mask = mask_from_spans(enc["offset_mapping"], spans)
    if not any(loss_mask):
        raise NoAssistantTokens("example has no assistant token to train on")
    return {"input_ids": list(enc["input_ids"]), "loss_mask": loss_mask}


def tokenize_example(tokenizer, example: dict[str, Any]) -> dict[str, list[int]]:
    """One dataset example (messages, conversations or text) -> input_ids + loss_mask.

    Plain text is trained on every token, with BOS/EOS as the tokenizer adds them and an EOS
    appended when it does not.
    """
    messages = to_messages(example)
    if messages is None:
        ids = tokenizer(example["text"], add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = ids + [tokenizer.eos_token_id]
        return {"input_ids": ids, "loss_mask": [1] * len(ids)}
    return tokenize_messages(tokenizer, messages)
