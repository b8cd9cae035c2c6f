"""The data pipeline: loading every supported format, length handling, counts, caching and packing."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.data import core
from draftsmith.data import dataset as D
from draftsmith.data.chat import NoAssistantTokens, tokenize_conversation, tokenize_example
from draftsmith.data.packing import pack
from draftsmith.data.tokenizer import train_bpe
from draftsmith.train import config as C

CONVERSATIONS = [
    [{"role": "user", "content": "Add two numbers."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Negate."},
     {"role": "assistant", "content": "def neg(a):\n    return -a"}, {"role": "user", "content": "Twice?"},
     {"role": "assistant", "content": "def twice(a):\n    return 2 * a"}],
    [{"role": "user", "content": "Is it zero?"}, {"role": "assistant", "content": "def zero(a):\n    return a == 0"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [m["content"] for conv in CONVERSATIONS for m in conv] * 4
    return train_bpe(texts, vocab_size=300)


def sharegpt(conv):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in conv]}


def write_all_formats(tmp: Path) -> dict[str, Path]:
    """The same conversations as jsonl (OpenAI), json (ShareGPT), parquet, arrow and a save_to_disk dir."""
    rows = [{"id": i, "messages": conv} for i, conv in enumerate(CONVERSATIONS)]
    paths = {"jsonl": tmp / "data.jsonl", "json": tmp / "data.json", "parquet": tmp / "data.parquet",
             "saved": tmp / "saved"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["json"].write_text(json.dumps([{"id": i, **sharegpt(c)} for i, c in enumerate(CONVERSATIONS)]))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["saved"]))
    paths["arrow"] = next(paths["saved"].glob("*.arrow"))
    return paths


def test_config_is_range_checked():
    for bad in ({"max_length": 1}, {"num_proc": 0}, {"limit": -1}, {"split": "validation"}):
        with pytest.raises(C.ConfigError, match="data."):
            D.DataConfig(**bad)
    with pytest.raises(C.ConfigError, match="did you mean 'truncate'"):
        C.load(D.DataConfig, overrides=["overlong=truncat"])
    assert C.load(D.DataConfig, overrides=["max_length=64", "pack=true"]).pack


def test_every_format_gives_the_same_rows(tokenizer, tmp_path):
    expected = [tokenize_example(tokenizer, {"messages": c}) for c in CONVERSATIONS]
    paths = write_all_formats(tmp_path)
    for name, path in paths.items():
        ds = D.build_dataset(D.DataConfig(path=str(path), max_length=512, cache=False), tokenizer)
        assert ds.column_names == ["input_ids", "loss_mask"], name
        assert ds.to_list() == expected, name
    data_dir = tmp_path / "files"  # a directory of data files, as a hub dataset repository looks
    data_dir.mkdir()
    (data_dir / "part-0.jsonl").write_text(paths["jsonl"].read_text())
    ds = D.build_dataset(D.DataConfig(path=str(data_dir), max_length=512, cache=False), tokenizer)
    assert ds.to_list() == expected
    gz = tmp_path / "data.jsonl.gz"  # the committed self-distilled data is gzipped JSONL
    gz.write_bytes(gzip.compress(paths["jsonl"].read_bytes()))
    ds = D.build_dataset(D.DataConfig(path=str(gz), max_length=512, cache=False), tokenizer)
    assert ds.to_list() == expected
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match="does not exist"):
        D.build_dataset(D.DataConfig(path=str(missing), cache=False), tokenizer)
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        D.build_dataset(D.DataConfig(path=str(tmp_path / "data.csv"), cache=False), tokenizer)


def test_plain_text_is_trained_everywhere(tokenizer, tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": "def add(a, b):\n    return a + b"}) + "\n")
    (row,) = D.build_dataset(D.DataConfig(path=str(path), cache=False), tokenizer).to_list()
    assert all(row["loss_mask"]) and row["input_ids"][-1] == tokenizer.eos_token_id


def lengths(tokenizer):
    return [len(tokenize_example(tokenizer, {"messages": c})["input_ids"]) for c in CONVERSATIONS]


def test_overlong_truncate_and_drop(tokenizer, tmp_path, caplog):
    path = write_all_formats(tmp_path)["jsonl"]
    n = lengths(tokenizer)
    max_length = sorted(n)[1]  # the longest example is over-long, its first assistant turn still fits
    assert n[1] > max_length
    cfg = D.DataConfig(path=str(path), max_length=max_length, cache=False)
    with caplog.at_level(logging.INFO, logger="draftsmith.data"):
        ds, stats = D.prepare(cfg, tokenizer)
    assert (stats.read, stats.truncated, stats.dropped_overlong, stats.kept) == (3, 1, 0, 3)
    assert "truncated 1" in caplog.text
    full = tokenize_example(tokenizer, {"messages": CONVERSATIONS[1]})
    assert ds[1] == {k: v[:max_length] for k, v in full.items()}

    ds, stats = D.prepare(D.DataConfig(path=str(path), max_length=max_length, overlong="drop", cache=False),
                          tokenizer)
    assert (stats.truncated, stats.dropped_overlong, stats.kept, len(ds)) == (0, 1, 2, 2)
    assert max(map(len, ds["input_ids"])) <= max_length


def test_a_line_separator_inside_a_json_string_is_text_not_a_line_break(tokenizer, tmp_path):
    """JSON Lines end at "\\n" only; U+2028 / U+2029 / U+0085 may stand raw in a JSON string (json.dumps with
    ensure_ascii=False writes them so), and a model's answer can hold them."""
    conv = [{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c\u2029d\x85e"}]
    line = json.dumps({"messages": conv}, ensure_ascii=False) + "\n"
    (tmp_path / "odd.jsonl").write_text(line * 2)
    with gzip.open(tmp_path / "odd.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(line * 2)
    for name in ("odd.jsonl", "odd.jsonl.gz"):
        assert D.check_json_rows(tmp_path / name) == 2
        rows = D.build_dataset(D.DataConfig(path=str(tmp_path / name), max_length=1024, cache=False), tokenizer)
        assert len(rows) == 2
    assert [r["messages"] for r in core.read_file(tmp_path / "odd.jsonl", "-")] == [conv, conv]


def test_no_assistant_is_an_error_by_default(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"messages": CONVERSATIONS[0]}, {"messages": [{"role": "user", "content": "only a question"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(NoAssistantTokens, match=r"1 of 2 examples have no assistant token .*row 1.*on_no_assistant=drop"):
        D.build_dataset(D.DataConfig(path=str(path), cache=False), tokenizer)
    ds, stats = D.prepare(D.DataConfig(path=str(path), on_no_assistant="drop", cache=False), tokenizer)
    assert (stats.no_assistant, stats.kept) == (1, 1) and any(ds[0]["loss_mask"])

    # Truncation that cuts away every assistant token counts as no-assistant, never an all-zero mask.
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    first_trained = tokenize_example(tokenizer, {"messages": CONVERSATIONS[0]})["loss_mask"].index(1)
    cfg = D.DataConfig(path=str(path), max_length=first_trained, on_no_assistant="drop", cache=False)
    with pytest.raises(ValueError, match="no example left to train on .*dropped 1 without assistant tokens"):
        D.prepare(cfg, tokenizer)


def test_content_as_text_parts_reads_and_null_content_is_refused_or_counted(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATIONS[1]]
    null = [CONVERSATIONS[0][0], {"role": "assistant", "content": None}]
    rows = [{"messages": CONVERSATIONS[0]}, {"messages": parts}, {"messages": null}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"{path} row 2: turn 1 \(assistant\) has content null, not text \(1 of 3 "
                                         r"examples have such a turn\); .*data.on_unreadable=drop"):
        D.build_dataset(D.DataConfig(path=str(path), cache=False), tokenizer)
    ds, stats = D.prepare(D.DataConfig(path=str(path), on_unreadable="drop", cache=False), tokenizer)
    assert (stats.read, stats.unreadable, stats.kept) == (3, 1, 2)
    assert ds.to_list() == [tokenize_example(tokenizer, {"messages": c}) for c in CONVERSATIONS[:2]]
    assert "1 with unreadable content" in stats.summary()


def test_cache_hit_and_invalidation(tokenizer, tmp_path, monkeypatch):
    path = write_all_formats(tmp_path)["jsonl"]
    cfg = D.DataConfig(path=str(path), max_length=512, cache_dir=str(tmp_path / "cache"))
    first = D.build_dataset(cfg, tokenizer)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one complete entry, no temporary directory left

    def fail(*args, **kwargs):
        raise AssertionError("cache miss")
    monkeypatch.setattr(D, "tokenize_dataset", fail)
    assert D.build_dataset(cfg, tokenizer).to_list() == first.to_list()
    monkeypatch.undo()

    key = D.cache_key(cfg, tokenizer)
    other_template = train_bpe(["def add(a, b):"] * 4, vocab_size=300)
    other_template.chat_template = tokenizer.chat_template.replace("<|assistant|>\n", "<|assistant|>")
    assert D.cache_key(cfg, other_template) != key
    assert D.cache_key(D.DataConfig(path=str(path), max_length=256, cache_dir=cfg.cache_dir), tokenizer) != key
    with open(path, "a") as fh:
        fh.write(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    assert D.cache_key(cfg, tokenizer) != key
    assert len(D.build_dataset(cfg, tokenizer)) == 4


def test_reference_examples_are_the_default(tokenizer, tmp_path):
    cfg = D.DataConfig(limit=6, max_length=1024, on_no_assistant="drop", cache=False)
    ds, stats = D.prepare(cfg, tokenizer)
    assert stats.read == 6 and len(ds) == stats.kept > 0
    assert all(any(m) for m in ds["loss_mask"])


def test_extra_sources_are_built_alone_and_appended(tokenizer, tmp_path):
    """data.extra: each source is built as data.path would be (limit per source; "" the reference examples) and its
    rows follow path's; held-out rows read one source, and the reference split is checked wherever "" appears."""
    paths = write_all_formats(tmp_path)
    cfg = dict(max_length=1024, on_no_assistant="drop", limit=2, cache=False)
    parts = [D.build_dataset(D.DataConfig(path=p, **cfg), tokenizer).to_list()
             for p in (str(paths["jsonl"]), str(paths["parquet"]), "")]
    mixed = C.load(D.DataConfig, None, [f"path={paths['jsonl']}", f"extra=[{paths['parquet']}, '']",
                                        *(f"{k}={v}" for k, v in cfg.items())])
    assert mixed.extra == [str(paths["parquet"]), ""]
    assert D.build_dataset(mixed, tokenizer).to_list() == parts[0] + parts[1] + parts[2]
    keys = {D.cache_key(c, tokenizer) for c in (mixed, D.DataConfig(path=mixed.path, **cfg),
                                                 D.DataConfig(path=mixed.path, extra=[""], **cfg))}
    assert len(keys) == 3  # what a hidden-state cache checks its data by
    assert len(parts[2]) > 0 and parts[2] != parts[0]
    held = D.heldout_rows(mixed, tokenizer, 8, str(paths["jsonl"]), split="train")
    assert [r["input_ids"] for r in held] == [r["input_ids"] for r in D.build_dataset(
        D.DataConfig(path=str(paths["jsonl"]), max_length=1024, cache=False), tokenizer)]
    with pytest.raises(C.ConfigError, match="data.split"):
        D.DataConfig(path=str(paths["jsonl"]), extra=[""], split="validation")


def test_packed_dataset_rows(tokenizer, tmp_path):
    path = write_all_formats(tmp_path)["jsonl"]
    L = max(lengths(tokenizer)) + 8
    ds, stats = D.prepare(D.DataConfig(path=str(path), max_length=L, pack=True, cache=False), tokenizer)
    assert ds.column_names == ["input_ids", "loss_mask", "position_ids"] and stats.rows == len(ds) < 3
    examples = [tokenize_example(tokenizer, {"messages": c}) for c in CONVERSATIONS]
    found = 0
    for row in ds:
        assert len(row["input_ids"]) == L
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [L]
        for a, b in zip(starts, starts[1:], strict=False):
            assert row["position_ids"][a:b] == list(range(b - a))  # restart at every example
            segment = {"input_ids": row["input_ids"][a:b], "loss_mask": row["loss_mask"][a:b]}
            if segment in examples:
                found += 1
            else:  # the padding tail
                assert b == L and set(segment["input_ids"]) == {tokenizer.pad_token_id}
                assert not any(segment["loss_mask"])
    assert found == len(examples)


def tiny_llama(vocab_size: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_packing_equals_separate_forwards():
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist(), "loss_mask": [1] * n}
                for n in (5, 7, 3, 9, 4, 2)]
    rows = pack(examples, seq_len=16, pad_id=0)
    assert len(rows) < len(examples)
    model = tiny_llama()
    ids = torch.tensor([r["input_ids"] for r in rows])  # [r, 16]
    pos = torch.tensor([r["position_ids"] for r in rows])  # [r, 16]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits  # [r, 16, V]
        unpacked = model(input_ids=ids, use_cache=False).logits  # [r, 16, V], plain causal across the row
    matched, crossed = 0, 0
    for r, row in enumerate(rows):
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [16]
        for a, b in zip(starts, starts[1:], strict=False):
            ex = row["input_ids"][a:b]
            if not any(row["loss_mask"][a:b]):
                assert b == 16 and set(ex) == {0}  # padding, never trained
                continue
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([ex]), use_cache=False).logits[0]  # [n, V]
            torch.testing.assert_close(packed[r, a:b], alone, atol=1e-5, rtol=1e-5)
            matched += 1
            crossed += a > 0 and not torch.allclose(unpacked[r, a:b], alone, atol=1e-5)
    assert matched == len(examples)
    assert crossed > 0  # the check can fail: without restarting position ids, examples see each other


def test_pack_rejects_overlong():
    with pytest.raises(ValueError, match="truncate or drop it first"):
        pack([{"input_ids": [1] * 5, "loss_mask": [1] * 5}], seq_len=4, pad_id=0)


def first_fit_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Plain first-fit decreasing, scanning every open row: the reference for `pack`."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows, free = [], []
    for i in order:
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def test_pack_is_first_fit_decreasing():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 65, (500,), generator=g).tolist()
    examples = [{"input_ids": [i] * n, "loss_mask": [1] * n} for i, n in enumerate(lengths)]
    rows = pack(examples, seq_len=64, pad_id=-1)
    members = [[ids[a] for a, p in enumerate(r["position_ids"]) if p == 0 and ids[a] != -1]
               for r in rows for ids in [r["input_ids"]]]
    assert members == first_fit_rows(lengths, 64)
    assert sum(map(len, members)) == len(examples)


def test_hub_names_go_to_load_dataset(tokenizer, monkeypatch):
    calls = []

    def fake_load_dataset(name, split, revision):
        calls.append((name, split, revision))
        return datasets.Dataset.from_list([sharegpt(c) for c in CONVERSATIONS])
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = D.DataConfig(path="someone/chat-data", split="train_sft", revision="abc123", max_length=512, cache=False)
    assert len(D.build_dataset(cfg, tokenizer)) == 3
    assert calls == [("someone/chat-data", "train_sft", "abc123")]
    assert D._data_key(cfg) == {"hub": "someone/chat-data", "revision": "abc123", "split": "train_sft"}


def test_a_rewriting_template_gives_one_example_per_assistant_turn(tokenizer, tmp_path):
    """Qwen3 strips earlier turns' <think> blocks: the two-answer conversation becomes two examples."""
    path = write_all_formats(tmp_path)["jsonl"]
    qwen3 = train_bpe(["def add(a, b):"] * 4, vocab_size=300)
    qwen3.chat_template = (Path(__file__).parent / "fixtures/chat_templates/qwen3.jinja").read_text()
    ds, stats = D.prepare(D.DataConfig(path=str(path), cache=False), qwen3)
    assert (stats.read, stats.examples, stats.kept) == (3, 4, 4)
    assert ds.to_list() == [seq for c in CONVERSATIONS for seq in tokenize_conversation(qwen3, c)]
