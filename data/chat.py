"""Conversations -> token ids + loss mask, with the target tokenizer's own chat template.

The loss mask covers assistant tokens only: what the model itself generates in an assistant
turn, i.e. the turn's reasoning and content plus the template's end-of-turn token (`<|eot_id|>`,
`<|im_end|>`, `<|return|>`, `</s>`, `<end_of_turn>`, ...). The end-of-turn token is trained because a drafter
that cannot predict it drafts past the end of every answer; the role header before the content
(the generation prompt) and the whitespace a template puts between turns after the end-of-turn
token are not, because the target never generates them.

Assistant text is located in the rendered conversation in one of two ways, never with a
hard-coded separator:
  * the template marks assistant turns with `{% generation %}...{% endgeneration %}`: the
    marked character spans, as the template's author placed them;
  * otherwise, incremental rendering: turn i is the text that rendering `messages[:i+1]` adds
    to rendering `messages[:i]` with the generation prompt (the context the engine shows the
    model when it generates turn i), minus whitespace after a trailing special token.
A template that rewrites earlier turns once later turns follow (Qwen3 and GLM-4.6 keep `<think>`
blocks only after the last user turn; gpt-oss drops the analysis channel and ends earlier answers with
`<|end|>` instead of `<|return|>`) cannot show every turn as generated in one rendering of the whole
conversation. Such a conversation becomes several sequences (`tokenize_conversation`): a sequence is
`render(messages[:i+1])` for an assistant turn i, trained on every assistant turn it still shows as
generated (turn i and the turns before it back to the previous split; earlier ones are context,
untrained). A template that rewrites nothing gives one sequence, the rendering of the whole
conversation. A template that renders the context differently once the turn follows it (Mistral v0.3
puts the system prompt into the last user turn only while that turn is last) raises `TemplateMismatch`
rather than produce a wrong mask.

Reasoning: `to_messages` reads an assistant turn's reasoning from `reasoning_content` (OpenAI-compatible
servers: vLLM, llama-server), `reasoning` or `thinking` (gpt-oss) and keeps it as `reasoning_content`; the
template gets it under both names it is read by (`reasoning_content`: Qwen3, GLM-4.6, Kimi-K2, DeepSeek-V3.2;
`thinking`: gpt-oss). Reasoning inline in the content (`<think>...</think>answer`) stays there: the templates
that read reasoning split it off themselves (Qwen3, GLM-4.6), the others render the content as given. What is
trained is what the template renders: one that never renders a final answer's reasoning (DeepSeek-V3.1, whose
generation prompt closes the think block; Kimi-K2-Thinking for its first answer) trains the answer without it.

The sequence is tokenized once; a token is trained when its characters overlap an
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
# Where an assistant turn's reasoning may come, the first non-empty one wins: OpenAI-compatible servers (vLLM,
# llama-server), other servers and datasets, gpt-oss's template and datasets.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


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
    An assistant turn's reasoning (the first non-empty of REASONING_FIELDS) is kept as `reasoning_content`.
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
        message = {"role": role, "content": content_text(turn.get(content_key), f"turn {i} ({role})")}
        field = reasoning_field(turn) if role == "assistant" else None
        if field is not None:
            message["reasoning_content"] = content_text(turn[field], f"turn {i} ({role}) {field}")
        messages.append(message)
    return messages


def reasoning_field(turn: dict[str, Any]) -> str | None:
    """The first of REASONING_FIELDS that `turn` (a message, or a server's choice) carries non-empty, if any."""
    return next((k for k in REASONING_FIELDS if turn.get(k)), None)


def has_generation_markers(template: str) -> bool:
    """Whether a chat template marks assistant turns with `{% generation %}`."""
    return GENERATION_TAG.search(template) is not None


def _special_tokens(tokenizer) -> list[str]:
    """Strings of all special tokens, including added ones outside the special-tokens map."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return sorted(set(added) | set(tokenizer.all_special_tokens), key=len, reverse=True)


def _as_templates_read(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """`messages` with each turn's reasoning under both names templates read it by: `reasoning_content` (Qwen3,
    GLM-4.6, Kimi-K2, DeepSeek-V3.2, ...) and `thinking` (gpt-oss)."""
    return [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in messages]


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """`messages` (as `to_messages` gives them) in the tokenizer's chat template, as training renders them."""
    return tokenizer.apply_chat_template(_as_templates_read(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _marked_spans(tokenizer, messages: list[dict[str, str]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """The rendered text and the character spans the template wraps in {% generation %}, as one sequence."""
    rendered, spans = render_jinja_template(conversations=[_as_templates_read(messages)],
                                            chat_template=tokenizer.get_chat_template(),
                                            return_assistant_tokens_mask=True, **tokenizer.special_tokens_map)
    return [(rendered[0], [tuple(s) for s in spans[0]])]


def _incremental_spans(tokenizer, messages: list[dict[str, str]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """(text, assistant spans) of each sequence, found by rendering the conversation turn by turn.

    Turn i is what `render(messages[:i+1])` adds to `render(messages[:i], add_generation_prompt=True)`. Consecutive
    turns share a sequence while each rendering starts with the one before (the template did not rewrite the earlier
    turns); the last sequence is the whole conversation's rendering when that starts with it.
    """
    specials = _special_tokens(tokenizer)
    sequences: list[tuple[str, list[tuple[int, int]]]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise TemplateMismatch("the conversation starts with an assistant turn, whose start cannot be located "
                                   "without {% generation %} markers; drop the leading turn or add the markers")
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if not upto.startswith(before):
            raise TemplateMismatch(
                f"the chat template renders the turns before assistant message {i} differently once that message "
                "follows them (e.g. it moves the system prompt to the last user turn), so the message's tokens cannot "
                "be located; add {% generation %}...{% endgeneration %} around assistant content in the template")
        start, end = len(before), len(upto)
        turn = upto[start:].rstrip()
        if any(turn.endswith(s) for s in specials):  # whitespace after the end-of-turn token is formatting
            end = start + len(turn)
        if sequences and upto.startswith(sequences[-1][0]):
            sequences[-1] = (upto, sequences[-1][1] + [(start, end)])
        else:
            sequences.append((upto, [(start, end)]))
    text = render(tokenizer, messages)
    if sequences and text.startswith(sequences[-1][0]):  # turns after the last assistant one stay as context
        sequences[-1] = (text, sequences[-1][1])
    return sequences


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


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    """Render `messages` with the tokenizer's chat template and mark the assistant tokens.

    Returns:
        one {"input_ids": [s], "loss_mask": [s]} when one rendering shows every assistant turn as the model
        generates it, else one per run of such turns (see the module docstring); loss_mask is 1 exactly on
        assistant tokens.
    Raises:
        NoAssistantTokens: when no token would be trained on.
        TemplateMismatch: when an assistant turn cannot be located without generation markers (a leading assistant
            turn, or a template that renders the turns before it differently once it follows them).
    """
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template; set tokenizer.chat_template or use plain `text` data")
    if has_generation_markers(tokenizer.get_chat_template()):
        sequences = _marked_spans(tokenizer, messages)
    else:
        sequences = _incremental_spans(tokenizer, messages)
    out = []
    for text, spans in sequences:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        out.append({"input_ids": list(enc["input_ids"]), "loss_mask": mask_from_spans(enc["offset_mapping"], spans)})
    if not any(any(seq["loss_mask"]) for seq in out):
        raise NoAssistantTokens("example has no assistant token to train on")
    return out


def tokenize_messages(tokenizer, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    """`tokenize_conversation` for a conversation that is one sequence (`tokenize_example`)."""
    return tokenize_example(tokenizer, {"messages": messages})


def _plain_text(tokenizer, text: str) -> dict[str, list[int]]:
    """Plain text, trained on every token, with BOS/EOS as the tokenizer adds them and an EOS appended when it does
    not."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = ids + [tokenizer.eos_token_id]
    return {"input_ids": ids, "loss_mask": [1] * len(ids)}


def tokenize_sequences(tokenizer, example: dict[str, Any]) -> list[dict[str, list[int]]]:
    """One dataset example (messages, conversations or text) -> its sequences of input_ids + loss_mask: one, or one
    per run of assistant turns where the chat template rewrites earlier turns (`tokenize_conversation`)."""
    messages = to_messages(example)
    return [_plain_text(tokenizer, example["text"])] if messages is None else tokenize_conversation(tokenizer, messages)


def tokenize_example(tokenizer, example: dict[str, Any]) -> dict[str, list[int]]:
    """One dataset example that is one sequence -> input_ids + loss_mask (`tokenize_sequences`); a template that
    rewrites earlier turns of this conversation raises `TemplateMismatch`."""
    sequences = tokenize_sequences(tokenizer, example)
    if len(sequences) > 1:
        raise TemplateMismatch("the chat template renders earlier turns differently once later turns follow (e.g. it "
                               f"strips earlier <think> blocks), so the conversation is {len(sequences)} sequences, "
                               "one per run of assistant turns; use tokenize_conversation")
    return sequences[0]

