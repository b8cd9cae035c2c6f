"""`draftsmith regenerate` on a tiny random Llama: batched turn-by-turn regeneration, and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from draftsmith.data.tokenizer import END, train_bpe
from draftsmith.train import regenerate

ROWS = [
    {"id": "one-turn", "source": "a.py", "messages": [{"role": "user", "content": "def add(a, b):"},
                                                     {"role": "assistant", "content": "return a + b"}]},
    {"id": "two-turns", "source": "b.py", "messages": [
        {"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "def neg(a):"},
        {"role": "assistant", "content": "return -a"}, {"role": "user", "content": "def twice(a):"},
        {"role": "assistant", "content": "return 2 * a"}]},
    {"id": "prompt-only", "source": "c.py", "messages": [{"role": "user", "content": "def zero(a):"}]},
    {"id": "long-prompt", "source": "d.py", "messages": [
        {"role": "user", "content": "def is_positive(number):\n    \"\"\"True when number > 0.\"\"\""},
        {"role": "assistant", "content": "return number > 0"}]},
]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny random Llama with the reference tokenizer and chat template, saved as an HF directory."""
    path = tmp_path_factory.mktemp("target")
    tokenizer = train_bpe([m["content"] for r in ROWS for m in r["messages"]] * 4, vocab_size=300)
    torch.manual_seed(0)
    eos = [tokenizer.convert_tokens_to_ids(END), tokenizer.eos_token_id]
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=eos)  # replies depend on the prompt
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=eos)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(target: Path, data: Path, out: Path, *extra: str) -> list[dict]:
    regenerate.main(["--target", str(target), "--data", str(data), "--out", str(out), "--batch-size", "3",
                     "--max-new-tokens", "6", *extra])
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_regenerates_every_assistant_turn(target, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    rows = run(target, data, tmp_path / "out.jsonl")
    assert [r["id"] for r in rows] == [r["id"] for r in ROWS]
    assert [r["source"] for r in rows] == [r["source"] for r in ROWS]

    model = LlamaForCausalLM.from_pretrained(target).eval()
    tokenizer = regenerate.AutoTokenizer.from_pretrained(target)
    for old, new in zip(ROWS, rows, strict=True):
        expected = old["messages"] + ([{"role": "assistant"}] if old["messages"][-1]["role"] == "user" else [])
        assert [m["role"] for m in new["messages"]] == [m["role"] for m in expected]
        for i, (m_old, m_new) in enumerate(zip(expected, new["messages"], strict=True)):
            if m_old["role"] != "assistant":
                assert m_new == m_old
                continue
            # The batched, left-padded reply equals the reply to this prefix alone (no padding),
            # given the conversation so far with earlier turns already regenerated.
            (alone,) = regenerate.generate(model, tokenizer, [new["messages"][:i]], 0.0, 6)
            assert m_new["content"] == alone
            assert m_new["content"] != m_old.get("content")
    first_replies = [next(m["content"] for m in r["messages"] if m["role"] == "assistant") for r in rows]
    assert len(set(first_replies)) == len(rows)  # the model reads the prompt, so the check above has teeth

    # Control: with right padding the same batch gives other replies, so padding mistakes would show.
    prompts = [r["messages"][: next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")]
               for r in rows]
    tokenizer.padding_side = "right"
    assert regenerate.generate(model, tokenizer, prompts, 0.0, 6) != first_replies


def test_resume_after_a_partial_file(target, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    full = run(target, data, tmp_path / "full.jsonl")

    out = tmp_path / "partial.jsonl"
    lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[2] + lines[1][: len(lines[1]) // 2])  # two rows, then a torn line
    resumed = run(target, data, out)
    assert sorted(r["id"] for r in resumed) == sorted(r["id"] for r in ROWS)  # every id exactly once
    by_id = {r["id"]: r for r in full}
    assert all(r == by_id[r["id"]] for r in resumed)
    assert [r["id"] for r in resumed[:2]] == [full[0]["id"], full[2]["id"]]  # kept, not rewritten

    before = out.read_text()
    run(target, data, out)  # nothing left to do
    assert out.read_text() == before


def test_several_temperatures_answer_each_conversation_once_per_temperature(target, tmp_path):
    """--temperature 0 1: the greedy answers of every conversation, then the sampled ones (the same samples as a run
    at temperature 1 alone with the same seed), ids ID-T0 / ID-T1; a rerun resumes where the file ends."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    greedy = run(target, data, tmp_path / "greedy.jsonl")
    sampled = run(target, data, tmp_path / "sampled.jsonl", "--temperature", "1", "--seed", "3")
    out = tmp_path / "both.jsonl"
    both = run(target, data, out, "--temperature", "0", "1", "--seed", "3")
    assert [r["id"] for r in both] == [f"{r['id']}-T0" for r in ROWS] + [f"{r['id']}-T1" for r in ROWS]
    assert [r["temperature"] for r in both] == [0.0] * len(ROWS) + [1.0] * len(ROWS)
    assert [r["messages"] for r in both] == [r["messages"] for r in greedy + sampled]
    assert greedy != sampled
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[: len(ROWS) + 1]))  # cut after the first sampled row
    assert [r["id"] for r in run(target, data, out, "--temperature", "0", "1")] == [r["id"] for r in both]


def test_sampling_and_bad_input(target, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    rows = run(target, data, tmp_path / "sampled.jsonl", "--temperature", "1.5", "--seed", "1")
    assert len(rows) == 2 and all(m["content"] is not None for r in rows for m in r["messages"])

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "plain"}) + "\n")
    with pytest.raises(ValueError, match="regeneration needs chat data"):
        run(target, text, tmp_path / "never.jsonl")
    with pytest.raises(SystemExit):
        run(target, data, tmp_path / "never.jsonl", "--temperature", "-1")


def test_too_little_disk_for_the_output_is_refused_before_generating(target, tmp_path, monkeypatch):
    from draftsmith.data import core

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    need = regenerate.output_bytes(regenerate.conversations(str(data), "train", 0), 6)
    assert need > sum(len(json.dumps(r)) for r in ROWS) + 5 * 6 * 16 - 1  # five replies of up to 6 tokens each
    real = core.shutil.disk_usage
    monkeypatch.setattr(core.shutil, "disk_usage", lambda p: real(p)._replace(free=need))
    with pytest.raises(core.DiskFull, match=rf"not enough disk space for {tmp_path / 'out.jsonl'} \(4 conversations\)"
                                             r": needs about .* free space or write --out elsewhere"):
        run(target, data, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()
