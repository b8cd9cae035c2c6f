"""The assistant-only loss mask, token by token, on the real chat templates of five model families.

The templates in tests/fixtures/chat_templates/ are the published Jinja templates (see the
README there); the tokenizers are tiny byte-level BPEs trained here with each family's special
tokens, so that decoding is exact and every check is about the template and the mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from draftsmith.data.chat import (
    NoAssistantTokens,
    TemplateMismatch,
    UnreadableContent,
    has_generation_markers,
    mask_from_spans,
    to_messages,
    tokenize_conversation,
    tokenize_example,
    tokenize_messages,
)
from draftsmith.data.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_bpe

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"

SYSTEM = "You are a careful Python assistant."
TURNS = [("What does add do?", "def add(a, b):\n    return a + b"),
         ("And sub? Show it.", "def sub(a, b):\n    \"\"\"a minus b\"\"\"\n    return a - b"),
         ("Thanks!", "You're welcome.")]
SENTENCES = [SYSTEM] + [t for pair in TURNS for t in pair] + ["Cutting Knowledge Date: December 2023 Today Jul"]


@dataclass
class Family:
    template: str  # fixture file
    specials: list[str]
    bos: str | None
    eos: str
    turn_prefix: str  # text the template's assistant turn puts before the content, after the generation prompt
    end_of_turn: str  # the trained token that ends an assistant turn
    system: bool = True  # conversation starts with a system message


FAMILIES = {
    "llama-3.1": Family("llama-3.1-instruct.jinja", ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                                                     "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
                        "<|begin_of_text|>", "<|eot_id|>", "", "<|eot_id|>"),
    "qwen2.5": Family("qwen2.5-instruct.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                      None, "<|im_end|>", "", "<|im_end|>"),
    # Mistral v0.3 moves the system prompt into the last user turn, so its conversations have none here
    # (test_turns_that_cannot_be_located_raise covers the system prompt).
    "mistral-v0.3": Family("mistral-7b-instruct-v0.3.jinja", ["<s>", "</s>", "[INST]", "[/INST]"],
                           "<s>", "</s>", " ", "</s>", system=False),
    # SmolLM2-135M-Instruct's template as its GGUF carries it: ChatML with a default system prompt.
    "smollm2": Family("smollm2-instruct.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                      None, "<|im_end|>", "", "<|im_end|>"),
    "gemma-3": Family("gemma-3-it.jinja", ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"],
                      "<bos>", "<eos>", "", "<end_of_turn>"),
}


def tiny_tokenizer(specials: list[str], bos: str | None, eos: str, template: str,
                   trim_offsets: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE (exact decoding) with the given special tokens and chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if trim_offsets:  # GPT-2 style: whitespace tokens get zero-width offsets
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos,
                                   additional_special_tokens=[s for s in specials if s not in (bos, eos)],
                                   chat_template=template)


def family_tokenizer(name: str, template: str | None = None, trim_offsets: bool = False):
    f = FAMILIES[name]
    return tiny_tokenizer(f.specials, f.bos, f.eos, template or (FIXTURES / f.template).read_text(), trim_offsets)


def conversation(system: bool = True, turns=TURNS) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages


def runs(ids: list[int], mask: list[int], value: int) -> list[list[int]]:
    """Maximal runs of consecutive tokens whose mask equals `value`."""
    out, current = [], []
    for i, m in zip(ids, mask, strict=True):
        if m == value:
            current.append(i)
        elif current:
            out.append(current)
            current = []
    return out + [current] if current else out


def check_mask(tokenizer, messages, expected_turns: list[str]) -> None:
    """Masked tokens decode exactly to the expected assistant turns, one run per turn; nothing else is masked."""
    out = tokenize_messages(tokenizer, messages)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(ids) == text
    assert [tokenizer.decode(r) for r in runs(ids, mask, 1)] == expected_turns
    rest = text
    for turn in expected_turns:
        assert turn in rest
        rest = rest.replace(turn, "", 1)
    assert "".join(tokenizer.decode(r) for r in runs(ids, mask, 0)) == rest


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("trim_offsets", [False, True], ids=["offsets", "trimmed-offsets"])
def test_mask_token_by_token(name, trim_offsets):
    f = FAMILIES[name]
    tokenizer = family_tokenizer(name, trim_offsets=trim_offsets)
    assert not has_generation_markers(tokenizer.chat_template)  # the fallback path: incremental rendering
    expected = [f.turn_prefix + answer + f.end_of_turn for _, answer in TURNS]
    check_mask(tokenizer, conversation(system=f.system), expected)


def as_parts(messages: list[dict[str, str]]) -> list[dict]:
    """OpenAI's other content shape: each turn's text split into two text parts at its middle."""
    return [{**m, "content": [{"type": "text", "text": m["content"][: len(m["content"]) // 2]},
                              {"type": "text", "text": m["content"][len(m["content"]) // 2:]}]} for m in messages]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_list_of_text_parts_masks_token_by_token(name):
    f = FAMILIES[name]
    tokenizer = family_tokenizer(name)
    messages = conversation(system=f.system)
    row = {"messages": as_parts(messages)}
    assert to_messages(row) == messages
    check_mask(tokenizer, to_messages(row), [f.turn_prefix + answer + f.end_of_turn for _, answer in TURNS])
    assert tokenize_example(tokenizer, row) == tokenize_messages(tokenizer, messages)


@pytest.mark.parametrize("content, said", [
    (None, "content null"), ([], "content no parts"), (7, "content a int"),
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
     r"content parts of type \['image_url', 'text'\]")])
def test_content_that_is_not_text_is_refused_naming_the_turn(content, said):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]}
    with pytest.raises(UnreadableContent, match=f"turn 1 \\(assistant\\) has {said}, not text"):
        to_messages(row)
    with pytest.raises(UnreadableContent, match="turn 0 \\(user\\) has content null"):
        to_messages({"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]})


QWEN_ASSISTANT_LINE = (
    "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}")
QWEN_WITH_MARKERS = (
    "{%- if message.role == \"assistant\" and not message.tool_calls %}\n"
    "        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}\n"
    "    {%- elif (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}")


def qwen_template_with_markers() -> str:
    template = (FIXTURES / "qwen2.5-instruct.jinja").read_text()
    assert QWEN_ASSISTANT_LINE in template
    return template.replace(QWEN_ASSISTANT_LINE, QWEN_WITH_MARKERS)


@pytest.mark.parametrize("trim_offsets", [False, True], ids=["offsets", "trimmed-offsets"])
def test_generation_markers_qwen(trim_offsets):
    tokenizer = family_tokenizer("qwen2.5", qwen_template_with_markers(), trim_offsets)
    assert has_generation_markers(tokenizer.chat_template)
    check_mask(tokenizer, conversation(), [answer + "<|im_end|>" for _, answer in TURNS])


def test_generation_markers_reference_template():
    tokenizer = tiny_tokenizer(SPECIAL_TOKENS, None, "<|endoftext|>", CHAT_TEMPLATE)
    assert has_generation_markers(tokenizer.chat_template)
    check_mask(tokenizer, conversation(), [answer + "<|end|>" for _, answer in TURNS])


@pytest.mark.parametrize("marked, unmarked", [
    (qwen_template_with_markers(), (FIXTURES / "qwen2.5-instruct.jinja").read_text()),
    (CHAT_TEMPLATE, CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")),
], ids=["qwen2.5", "reference"])
def test_markers_and_fallback_agree(marked, unmarked):
    specials = FAMILIES["qwen2.5"].specials + SPECIAL_TOKENS
    a = tokenize_messages(tiny_tokenizer(specials, None, "<|endoftext|>", marked), conversation())
    b = tokenize_messages(tiny_tokenizer(specials, None, "<|endoftext|>", unmarked), conversation())
    assert a == b


def test_a_rewriting_template_gives_one_sequence_per_assistant_turn():
    """Qwen3 strips earlier turns' <think> blocks. Each assistant turn is trained in the context the engine shows
    the model for it: messages[:i] with the generation prompt, as the template renders them, earlier turns
    untrained."""
    tokenizer = family_tokenizer("qwen2.5", (FIXTURES / "qwen3.jinja").read_text())
    messages = conversation()
    sequences = tokenize_conversation(tokenizer, messages)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(sequences) == len(assistant) == len(TURNS)
    for seq, i in zip(sequences, assistant, strict=True):
        ids, mask = seq["input_ids"], seq["loss_mask"]
        (trained,) = runs(ids, mask, 1)
        assert tokenizer.decode(trained) == "<think>\n\n</think>\n\n" + messages[i]["content"] + "<|im_end|>"
        context = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(ids[: mask.index(1)]) == context
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
    with pytest.raises(TemplateMismatch, match="3 sequences, one per run of assistant turns; use tokenize_conversation"):
        tokenize_messages(tokenizer, messages)
    assert tokenize_messages(tokenizer, messages[: assistant[0] + 1]) == sequences[0]


def test_turns_that_cannot_be_located_raise():
    # Mistral v0.3 puts the system prompt into the last user turn only while that turn is the last message.
    with pytest.raises(TemplateMismatch, match="differently once that message follows them .*generation %}"):
        tokenize_conversation(family_tokenizer("mistral-v0.3"), conversation(system=True))
    # Nothing renders before a leading assistant turn, so its start is unknown without markers.
    with pytest.raises(TemplateMismatch, match="starts with an assistant turn"):
        tokenize_conversation(family_tokenizer("llama-3.1"), conversation(system=False)[1:])


def test_no_assistant_tokens_is_an_error():
    tokenizer = family_tokenizer("llama-3.1")
    with pytest.raises(NoAssistantTokens, match="no assistant token"):
        tokenize_messages(tokenizer, [{"role": "user", "content": "hello"}])


def test_formats_normalise_to_messages():
    messages = conversation()
    sharegpt = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                   "value": m["content"]} for m in messages]}
    assert to_messages(sharegpt) == messages
    assert to_messages({"messages": messages}) == messages
    assert to_messages({"text": "plain"}) is None
    with pytest.raises(ValueError, match="unknown chat role 'narrator'"):
        to_messages({"messages": [{"role": "narrator", "content": "x"}]})
    with pytest.raises(ValueError, match="none of 'messages', 'conversations', 'text'"):
        to_messages({"prompt": "x"})
    tokenizer = family_tokenizer("gemma-3")
    assert tokenize_example(tokenizer, sharegpt) == tokenize_messages(tokenizer, messages)
    text = tokenize_example(tokenizer, {"text": "def add(a, b):"})
    assert text["input_ids"][-1] == tokenizer.eos_token_id and all(text["loss_mask"])


@pytest.mark.parametrize("template", [qwen_template_with_markers(), CHAT_TEMPLATE], ids=["qwen2.5", "reference"])
def test_marker_path_matches_transformers(template):
    """Our marker spans + overlap rule give transformers' own `return_assistant_tokens_mask`."""
    tokenizer = tiny_tokenizer(FAMILIES["qwen2.5"].specials + SPECIAL_TOKENS, None, "<|endoftext|>", template)
    ours = tokenize_messages(tokenizer, conversation())
    theirs = tokenizer.apply_chat_template(conversation(), return_dict=True, return_assistant_tokens_mask=True)
    assert ours == {"input_ids": list(theirs["input_ids"]), "loss_mask": list(theirs["assistant_masks"])}


def test_mask_from_spans_matches_the_overlap_rule():
    offsets = [(0, 3), (3, 3), (3, 5), (5, 9), (9, 9), (9, 10), (10, 14), (14, 14), (14, 20)]
    spans = [(4, 9), (14, 16)]
    # (3, 5) straddles the start, (9, 9) sits on an end (outside), (14, 14) on a start (inside).
    assert mask_from_spans(offsets, spans) == [0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert mask_from_spans(offsets, []) == [0] * len(offsets)


def test_a_token_across_the_turn_boundary_is_trained():
    """An answer that starts with indentation after a header ending in '\\n' (outside the generation
    block) tokenizes as one '\\n    ' token; it overlaps the answer, so it is trained, like
    transformers' `return_assistant_tokens_mask` does, and the answer's first token is never lost."""
    tokenizer = train_bpe(["def f(a):\n    return a\n    pass\n"] * 20, vocab_size=300)
    tokenizer.chat_template = CHAT_TEMPLATE.replace("'<|assistant|>' }}{% generation %}",
                                                    "'<|assistant|>\\n' }}{% generation %}")
    answer = "    return a + b"
    out = tokenize_messages(tokenizer, [{"role": "user", "content": "def add(a, b):"},
                                        {"role": "assistant", "content": answer}])
    (trained,) = runs(out["input_ids"], out["loss_mask"], 1)
    assert tokenizer.convert_ids_to_tokens(trained[0]) == "ĊĠĠĠ"
    assert tokenizer.decode(trained) == "\n" + answer + "<|end|>"
