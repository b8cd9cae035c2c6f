"""Self-distilled data for real targets: the prompt builder and `draftsmith self-distill` end to end (tiny target)."""

from __future__ import annotations

import collections
import gzip
import itertools
import json
import re
import shutil

import pytest
from conftest import REPO

from draftsmith.data.dataset import DataConfig, build_dataset
from draftsmith.data.prompts import (
    build_broad_prompts,
    build_more_prompts,
    build_other_prompts,
    build_prompts,
    build_text_prompts,
    kinds_in_turn,
)
from draftsmith.data.reference import load_prompts
from draftsmith.train import self_distill


def test_prompts_are_diverse_distinct_and_split_by_first_user_turn():
    rows = build_prompts(600, seed=1)
    assert len(rows) == 600 and len({r["id"] for r in rows}) == 600
    kinds = collections.Counter(r["kind"] for r in rows)
    assert set(kinds) == {"code_write", "code_explain", "module", "rewrite", "arithmetic", "word_problem", "factual",
                          "formats", "multi_turn"} and min(kinds.values()) >= 10
    assert all(r["messages"][-1]["role"] == "user" for r in rows)
    # A follow-up never lands in the other split from its first question (no held-out leak).
    split_of = {r["messages"][0]["content"]: r["split"] for r in rows}
    assert all(split_of[r["messages"][0]["content"]] == r["split"] for r in rows)
    assert 0.03 < sum(r["split"] == "heldout" for r in rows) / len(rows) < 0.15
    assert build_prompts(600, seed=1) == rows


def test_self_distill_answers_resumes_and_finalizes(tiny_chat_target, tmp_path):
    sd = self_distill
    args = ["--target", str(tiny_chat_target), "--num-prompts", "40", "--max-new-tokens", "6", "--batch-size", "8",
            "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    sd.main(args)
    answers = [json.loads(line) for line in open(tmp_path / "work" / "answers.jsonl")]
    splits = [r["split"] for r in answers]  # held-out prompts are answered first (3-6 of these 40, by stdlib version)
    assert len(answers) == 40 and "heldout" in splits and splits == sorted(splits, key=lambda s: s != "heldout")
    assert all(m["content"] for r in answers for m in r["messages"] if m["role"] == "assistant")
    sd.main(args)  # nothing left to do: resuming adds no row
    assert sum(1 for _ in open(tmp_path / "work" / "answers.jsonl")) == 40
    sd.main(args + ["--finalize"])
    settings = json.loads((tmp_path / "out" / "settings.json").read_text())
    assert settings["answered"]["train"] + settings["answered"]["heldout"] == 40
    assert settings["sampling"]["temperature"] == 0.7 and settings["sampling"]["max_new_tokens"] == 6
    with gzip.open(tmp_path / "out" / "train.jsonl.gz", "rt") as fh:
        assert sum(1 for _ in fh) == settings["answered"]["train"]
    # The committed files feed training and the checkpoint evaluation as they are.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_target)
    rows = build_dataset(DataConfig(path=str(tmp_path / "out" / "train.jsonl.gz"), cache=False), tok)
    assert len(rows) == settings["answered"]["train"] and all(sum(r["loss_mask"]) > 0 for r in rows)
    prompts = load_prompts(tmp_path / "out" / "heldout_prompts.jsonl")
    assert len(prompts) == settings["answered"]["heldout"]
    assert all(p["messages"][-1]["role"] == "user" for p in prompts)
    # A fresh checkout (no work directory) resumes from the committed data: nothing is answered twice.
    fresh = [a if a != str(tmp_path / "work") else str(tmp_path / "work2") for a in args]
    sd.main(fresh)
    again = [json.loads(line) for line in open(tmp_path / "work2" / "answers.jsonl")]
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in answers)
    assert json.loads((tmp_path / "work2" / "timing.json").read_text())["seconds"] == settings["regeneration_seconds"]


def test_text_prompts_are_distinct_split_by_hash_and_mostly_code():
    rows = build_text_prompts(300, seed=0)
    assert len(rows) == 300 and len({r["id"] for r in rows}) == 300
    kinds = collections.Counter(r["kind"] for r in rows)
    assert kinds["code"] == 210 and kinds["prose"] == 90
    assert all(r["prompt"].startswith(("def ", "async def ")) for r in rows if r["kind"] == "code")
    assert 0.03 < sum(r["split"] == "heldout" for r in rows) / len(rows) < 0.15
    assert build_text_prompts(300, seed=0) == rows


def test_text_prompts_reach_the_real_target_size_with_methods_dedented_and_code_after_the_prose():
    """3,300 openings with >= 200 held out (the self-distilled data's size) need methods and class docstrings too;
    when the prose runs out, code fills the rest."""
    rows = build_text_prompts(3300, seed=0)
    assert len({r["id"] for r in rows}) == 3300
    assert sum(r["split"] == "heldout" for r in rows) >= 200
    kinds = collections.Counter(r["kind"] for r in rows)
    assert kinds["prose"] < 990 and kinds["code"] == 3300 - kinds["prose"]
    assert any("(self" in r["prompt"].split("\n")[0] for r in rows if r["kind"] == "code")
    assert not any(r["prompt"][0].isspace() for r in rows)


def test_a_base_model_without_a_chat_template_continues_text(tiny_chat_target, tmp_path):
    """A target with no chat template (a base model) gets plain-text openings and continues them: rows of `text`
    that train as plain text, and held-out `prompt` rows the checkpoint evaluation decodes."""
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_chat_target, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tok = AutoTokenizer.from_pretrained(base)
    assert tok.chat_template is None
    args = ["--target", str(base), "--num-prompts", "60", "--max-new-tokens", "5", "--batch-size", "32",
            "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    self_distill.main(args)
    self_distill.main(args + ["--finalize"])
    answers = [json.loads(line) for line in open(tmp_path / "work" / "answers.jsonl")]
    assert len(answers) == 60 and all(r["text"].startswith(r["prompt"]) and len(r["text"]) > len(r["prompt"])
                                      for r in answers)
    settings = json.loads((tmp_path / "out" / "settings.json").read_text())
    split = collections.Counter(r["split"] for r in build_text_prompts(60, 0))  # hashed, from this Python's stdlib
    assert settings["format"] == "text" and settings["answered"] == split and split["heldout"] > 0
    rows = build_dataset(DataConfig(path=str(tmp_path / "out" / "train.jsonl.gz"), cache=False), tok)
    assert len(rows) == settings["answered"]["train"] and all(sum(r["loss_mask"]) > 0 for r in rows)
    prompts = load_prompts(tmp_path / "out" / "heldout_prompts.jsonl")
    assert len(prompts) == settings["answered"]["heldout"] and all("prompt" in p for p in prompts)


def test_self_distill_through_a_server_answers_as_in_process_and_records_it(tiny_chat_target, tmp_path):
    """`--server URL` (tests/openai_server.py, serving the same weights greedily): the same answers as the in-process
    path, and settings.json names the server that answered; --finalize needs no server."""
    from openai_server import FakeServer, greedy

    args = ["--target", str(tiny_chat_target), "--num-prompts", "24", "--max-new-tokens", "5", "--batch-size", "4",
            "--temperature", "0", "--out", str(tmp_path / "out")]
    self_distill.main(args + ["--work", str(tmp_path / "here")])
    with FakeServer(greedy(tiny_chat_target)) as server:
        self_distill.main(args + ["--work", str(tmp_path / "served"), "--server", server.url])
    assert server.most_in_flight == 4
    self_distill.main(args + ["--work", str(tmp_path / "served"), "--server", server.url, "--finalize"])

    def answers(work: str) -> dict:
        return {r["id"]: r for r in map(json.loads, open(tmp_path / work / "answers.jsonl"))}
    served = answers("served")
    assert len(served) == 24 and served == answers("here")
    assert any(r["kind"] == "multi_turn" for r in served.values())
    settings = json.loads((tmp_path / "out" / "settings.json").read_text())
    assert [a.get("server") for a in settings["answered_by"]] == [server.url]
    assert settings["sampling"]["temperature"] == 0 and settings["command"].endswith(f"--server {server.url}")


def test_more_prompts_are_new_training_prompts_and_leave_the_held_out_split_alone(tiny_chat_target, tmp_path):
    base = build_prompts(300, seed=1)
    more = build_more_prompts(300, 60, seed=1)
    assert len(more) == 60 and len({r["id"] for r in more}) == 60 and build_more_prompts(300, 60, seed=1) == more
    assert not {r["id"] for r in more} & {r["id"] for r in base}
    assert all(r["split"] == "train" for r in more)  # the held-out split stays build_prompts(300)'s
    heldout_firsts = {r["messages"][0]["content"] for r in base if r["split"] == "heldout"}
    assert not any(r["messages"][0]["content"] in heldout_firsts for r in more)  # no held-out question trained on

    args = ["--target", str(tiny_chat_target), "--num-prompts", "30", "--max-new-tokens", "4", "--batch-size", "8",
            "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    self_distill.main(args)
    self_distill.main(args + ["--finalize"])
    heldout = (tmp_path / "out" / "heldout_prompts.jsonl").read_text()
    before = json.loads((tmp_path / "out" / "settings.json").read_text())
    self_distill.main(args + ["--more-prompts", "12"])  # resumes: only the 12 new prompts are answered
    self_distill.main(args + ["--more-prompts", "12", "--finalize"])
    after = json.loads((tmp_path / "out" / "settings.json").read_text())
    assert after["answered"] == {"train": before["answered"]["train"] + 12, "heldout": before["answered"]["heldout"]}
    assert after["prompts"]["train"] == before["prompts"]["train"] + 12 and after["more_prompts"] == 12
    assert (tmp_path / "out" / "heldout_prompts.jsonl").read_text() == heldout
    answers = [json.loads(line) for line in open(tmp_path / "work" / "answers.jsonl")]
    assert len(answers) == 42 and {r["id"] for r in answers[30:]} == {r["id"] for r in build_more_prompts(30, 12)}


def test_other_prompts_are_another_domain_and_the_committed_file_is_what_the_command_writes(tiny_chat_target, tmp_path):
    committed = REPO / "data" / "real" / "smollm2-135m-instruct"
    self_distill.main(["--target", str(tiny_chat_target), "--other-prompts", "--out", str(tmp_path)])
    written = (tmp_path / "other_prompts.jsonl").read_text()
    assert written == (committed / "other_prompts.jsonl").read_text()  # seeded: the same file on every run
    rows = load_prompts(tmp_path / "other_prompts.jsonl")
    kinds = collections.Counter(r["kind"] for r in rows)
    assert len(rows) == 64 and len({r["id"] for r in rows}) == 64 and set(kinds.values()) == {8}
    assert len({r["kind"] for r in rows[:8]}) == 8 and kinds_in_turn(rows) == rows  # the kinds take turns
    with gzip.open(committed / "train.jsonl.gz", "rt") as fh:
        train = [json.loads(line) for line in fh]
    train_kinds = {r["kind"] for r in train} | {r["kind"] for r in build_prompts(600)}
    assert not set(kinds) & train_kinds  # no kind the drafter was trained on
    train_texts = {m["content"] for r in train for m in r["messages"] if m["role"] == "user"}
    assert not {r["messages"][0]["content"] for r in rows} & train_texts
    assert build_other_prompts(seed=1) != build_other_prompts() == build_other_prompts()
    # The held-out split is sorted by kind; taking turns, its first 64 prompts hold 7 or 8 of each of its 9 kinds.
    heldout = load_prompts(committed / "heldout_prompts.jsonl")
    mixed = collections.Counter(r["kind"] for r in kinds_in_turn(heldout)[:64])
    assert len(mixed) == 9 and set(mixed.values()) == {7, 8}
    assert sorted(r["id"] for r in kinds_in_turn(heldout)) == sorted(r["id"] for r in heldout)


def test_broad_prompts_are_new_kinds_in_turn_and_answered_into_a_source_of_their_own(tiny_chat_target, tmp_path):
    rows = build_broad_prompts(900)
    kinds = collections.Counter(r["kind"] for r in rows)
    assert len({r["id"] for r in rows}) == 900 and len(kinds) == 9 and set(kinds.values()) == {100}
    assert kinds_in_turn(rows) == rows and build_broad_prompts(900) == rows != build_broad_prompts(900, seed=1)
    # Kinds of their own: neither the default set's (trained on) nor the other domain's (never trained on).
    assert not set(kinds) & ({r["kind"] for r in build_prompts(600)} | {r["kind"] for r in build_other_prompts()})
    assert 0.03 < sum(r["split"] == "heldout" for r in rows) / len(rows) < 0.15
    args = ["--target", str(tiny_chat_target), "--broad", "--num-prompts", "20", "--max-new-tokens", "4",
            "--batch-size", "8", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    self_distill.main(args)
    self_distill.main(args + ["--finalize"])
    settings = json.loads((tmp_path / "out" / "broad" / "settings.json").read_text())
    assert settings["prompt_set"] == "broad" and sum(settings["answered"].values()) == 20
    with gzip.open(tmp_path / "out" / "broad" / "train.jsonl.gz", "rt") as fh:
        train = [json.loads(line) for line in fh]
    assert {r["id"] for r in train} == {r["id"] for r in build_broad_prompts(20) if r["split"] == "train"}
    assert not (tmp_path / "out" / "train.jsonl.gz").exists()  # the default set's source is left alone


def test_self_distill_gives_up_on_a_failing_server_in_one_line_and_a_rerun_asks_only_what_is_left(
        tiny_chat_target, tmp_path, monkeypatch):
    """A server that answers four requests, then 503s: one line with the prompts answered so far, each of them in
    answers.jsonl; rerun against a healthy server, only the prompts left are asked and the rows before are kept."""
    from openai_server import FakeServer, echo

    from draftsmith.data import server as server_module
    from draftsmith.train.guard import cli

    monkeypatch.setattr(server_module, "TRIES", 2)
    monkeypatch.setattr(server_module, "BACKOFF", 0.01)
    work = tmp_path / "work"
    args = ["--target", str(tiny_chat_target), "--num-prompts", "8", "--max-new-tokens", "5", "--batch-size", "1",
            "--work", str(work), "--out", str(tmp_path / "out")]
    with FakeServer(echo, faults=itertools.chain([None] * 4, itertools.repeat("503"))) as server:
        with pytest.raises(SystemExit) as stop:
            cli(self_distill.main, [*args, "--server", server.url, "--request-timeout", "5"])
    kept = (work / "answers.jsonl").read_text()
    done = [json.loads(line) for line in kept.splitlines()]
    assert 1 <= len(done) < 8 and str(stop.value.code).count("\n") == 0
    assert re.search(rf"gave up on {re.escape(server.url)}/v1/completions after 2 of 2 tries in \d+ s, the last: "
                     rf"HTTP 503: .*; {len(done)} of 8 prompts are answered in {re.escape(str(work))}/answers.jsonl: "
                     r"rerun the same command once the server answers to continue", str(stop.value.code))

    def turns(rows: list[dict]) -> int:
        return sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    assert turns(done) == 4
    with FakeServer(echo) as healthy:
        self_distill.main([*args, "--server", healthy.url])
    rows = [json.loads(line) for line in (work / "answers.jsonl").read_text().splitlines()]
    assert (work / "answers.jsonl").read_text().startswith(kept) and len({r["id"] for r in rows}) == len(rows) == 8
    assert len(healthy.requests) == turns(rows) - turns(done)  # nothing answered twice
