"""`draftsmith regenerate` on a tiny random Llama: batched turn-by-turn regeneration, and resume."""

from __future__ import annotations

import itertools
import json
import re
import time
from email.utils import formatdate
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from draftsmith.data import server as server_module
from draftsmith.data.chat import tokenize_sequences
from draftsmith.data.tokenizer import END, train_bpe
from draftsmith.train import regenerate
from draftsmith.train.guard import cli

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
            assert m_new == {"role": "assistant", **alone}
            assert m_new["content"] != m_old.get("content")
    first_replies = [next(m["content"] for m in r["messages"] if m["role"] == "assistant") for r in rows]
    assert len(set(first_replies)) == len(rows)  # the model reads the prompt, so the check above has teeth

    # Control: with right padding the same batch gives other replies, so padding mistakes would show.
    prompts = [r["messages"][: next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")]
               for r in rows]
    tokenizer.padding_side = "right"
    assert [r["content"] for r in regenerate.generate(model, tokenizer, prompts, 0.0, 6)] != first_replies


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


# ---- through an OpenAI-compatible server (tests/openai_server.py) ---------------------------------------------

TRIES = 3


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    """Three tries a request, backoffs of hundredths of a second: a failing server takes the tests moments."""
    monkeypatch.setattr(server_module, "TRIES", TRIES)
    monkeypatch.setattr(server_module, "BACKOFF", 0.01)


def by_id(rows: list[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in rows}


def test_a_server_answers_as_the_in_process_path_does(target, tmp_path):
    """A server serving the same weights greedily gives the very rows the in-process path writes (the prompt goes as the
    token ids of the target's own chat template rendering), with what answered in OUT.settings.json."""
    from openai_server import FakeServer, greedy

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    here = run(target, data, tmp_path / "here.jsonl")
    with FakeServer(greedy(target)) as server:
        served = run(target, data, tmp_path / "served.jsonl", "--server", server.url + "/v1/")
    assert len(served) == len(ROWS) and by_id(served) == by_id(here)
    assert len(server.requests) == 5  # one per assistant turn: 1 + 2 + 1 + 1
    assert all(b["model"] == "fake-target" and b["max_tokens"] == 6 and b["temperature"] == 0 and b["top_k"] == -1
               and b["top_p"] == 1.0 and b["min_p"] == 0.0 and all(isinstance(i, int) for i in b["prompt"])
               for b in server.requests)
    settings = json.loads((tmp_path / "served.settings.json").read_text())
    (answerer,) = settings["answered_by"]
    assert answerer["server"] == server.url and answerer["model"] == {"id": "fake-target"}
    assert answerer["endpoint"] == "/v1/completions" and answerer["request"]["min_p"] == 0.0
    here_settings = json.loads((tmp_path / "here.settings.json").read_text())
    assert here_settings["answered_by"] == [{"in_process": "transformers generate", "dtype": "float32",
                                             "device": "cpu"}]
    assert {k: v for k, v in settings.items() if k not in ("answered_by", "command")} == \
        {k: v for k, v in here_settings.items() if k not in ("answered_by", "command")}
    assert settings["sampling"] == {"temperatures": [0.0], "top_k": 0, "top_p": 1.0, "max_new_tokens": 6, "seed": 0}


def test_a_servers_reasoning_replaces_the_inputs_and_is_trained(target, tmp_path):
    """A reply's reasoning that the server returns apart from its text (choices[0].reasoning_content, or `reasoning`)
    is written as the turn's reasoning_content; the input's own reasoning never outlives its turn. A template that
    renders reasoning (Qwen3's) then trains each turn's reasoning with its answer."""
    from openai_server import FakeServer, echo

    data = tmp_path / "data.jsonl"
    old = [{**m, "reasoning_content": "old thoughts"} if m["role"] == "assistant" else m for m in ROWS[1]["messages"]]
    data.write_text(json.dumps({**ROWS[1], "messages": old}) + "\n")

    def reasoned(body: dict) -> dict:
        field = "reasoning_content" if len(body["prompt"]) % 2 else "reasoning"
        return {"text": echo(body), field: f"thinking over {len(body['prompt'])} ids"}
    with FakeServer(echo) as plain, FakeServer(reasoned) as parser:
        (without,) = run(target, data, tmp_path / "plain.jsonl", "--server", plain.url)
        (row,) = run(target, data, tmp_path / "reasoned.jsonl", "--server", parser.url)
    assert "old thoughts" not in json.dumps(without) + json.dumps(row)
    assert [m for m in without["messages"] if m["role"] == "assistant"] == \
        [{"role": "assistant", "content": echo(b)} for b in plain.requests]
    assert [m for m in row["messages"] if m["role"] == "assistant"] == \
        [{"role": "assistant", "content": echo(b), "reasoning_content": f"thinking over {len(b['prompt'])} ids"}
         for b in parser.requests]
    assert {len(b["prompt"]) % 2 for b in parser.requests} == {0, 1}  # both field names were answered

    tokenizer = regenerate.AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = (Path(__file__).parent / "fixtures/chat_templates/qwen3.jinja").read_text()
    sequences = tokenize_sequences(tokenizer, row)
    assert len(sequences) == 2  # Qwen3 strips the first answer's reasoning once the next question follows
    for seq, b in zip(sequences, parser.requests, strict=True):
        trained = tokenizer.decode([t for t, m in zip(seq["input_ids"], seq["loss_mask"], strict=True) if m])
        assert trained.startswith(f"<think>\nthinking over {len(b['prompt'])} ids\n</think>\n\n{echo(b)}")


def test_a_server_gets_batch_size_requests_at_once(target, tmp_path):
    from openai_server import FakeServer, echo

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({**r, "id": f"{r['id']}-{k}"}) + "\n" for k in range(3) for r in ROWS))
    with FakeServer(echo, delay=0.2) as server:
        rows = run(target, data, tmp_path / "out.jsonl", "--server", server.url, "--batch-size", "4")
    assert sorted(r["id"] for r in rows) == sorted(f"{r['id']}-{k}" for k in range(3) for r in ROWS)
    assert len(server.requests) == 15 and server.most_in_flight == 4


def test_sampling_is_sent_seeded_and_recorded_and_a_change_of_it_is_refused_on_resume(target, tmp_path):
    from openai_server import FakeServer, echo

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = ("--temperature", "0.7", "--seed", "5")
    with FakeServer(echo) as server:
        first = run(target, data, tmp_path / "a.jsonl", "--server", server.url, *args)
        again = run(target, data, tmp_path / "b.jsonl", "--server", server.url, *args)
        other = run(target, data, tmp_path / "c.jsonl", "--server", server.url, "--temperature", "0.7")
        assert by_id(first) == by_id(again) != by_id(other)  # the seed of a request: the run's seed and the prompt
        assert {b["temperature"] for b in server.requests} == {0.7}
        assert len({b["seed"] for b in server.requests}) == 10  # five prompts, two run seeds
        settings = json.loads((tmp_path / "a.settings.json").read_text())
        assert settings["sampling"]["temperatures"] == [0.7] and settings["sampling"]["seed"] == 5
        assert settings["command"].endswith("--temperature 0.7 --seed 5")
        lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
        (tmp_path / "a.jsonl").write_text(lines[0])
        with pytest.raises(ValueError, match=r"a.jsonl holds rows sampled with .*'temperatures': \[0.7\].* not .*"
                                             r"\[1.0\].*; rerun with the same options or write --out elsewhere"):
            run(target, data, tmp_path / "a.jsonl", "--server", server.url, "--temperature", "1", "--seed", "5")


def test_a_server_that_dies_mid_run_loses_nothing_and_a_rerun_continues(target, tmp_path):
    from openai_server import FakeServer, greedy

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({**r, "id": f"{r['id']}-{k}"}) + "\n" for k in range(2) for r in ROWS))
    out = tmp_path / "out.jsonl"
    answer = greedy(target)
    with FakeServer(answer, die_after=4) as server:
        with pytest.raises(regenerate.ServerError, match=rf"gave up on {server.url}/v1/completions after {TRIES} "
                                                         rf"of {TRIES} tries in \d+ s, the last: no answer \(.*\); \d of 8 "
                                                         rf"conversations were written to {out}: rerun the same"):
            run(target, data, out, "--server", server.url, "--batch-size", "2")
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert out.read_text().endswith("\n") and 1 <= len(kept) < 8
    with FakeServer(answer) as second:  # restarted, here on another port
        rows = run(target, data, out, "--server", second.url, "--batch-size", "2")
    assert rows[: len(kept)] == kept and sorted(r["id"] for r in rows) == sorted(by_id(rows))  # no duplicates
    assert len(rows) == 8 and by_id(rows) == by_id(run(target, data, tmp_path / "here.jsonl"))  # nothing lost
    answered_by = json.loads((tmp_path / "out.settings.json").read_text())["answered_by"]
    assert [a["server"] for a in answered_by] == [server.url, second.url]


@pytest.mark.parametrize("case", ["unreachable", "models", "completions", "no choices", "http error"])
def test_an_unreachable_or_garbage_server_is_one_line_and_no_file(target, tmp_path, case):
    import socket

    from openai_server import FakeServer, echo

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out.jsonl"
    fake = FakeServer(echo, models=b"<html>It works!</html>" if case == "models" else None,
                      garbage={"completions": b"<html>It works!</html>", "no choices": b'{"id": 1}'}.get(case))
    expected = {"unreachable": r"no answer from .*/v1/models \(.*refused\); start the server or fix --server",
                "models": r"/v1/models did not answer JSON \(b'<html>It works!</html>'\); is --server an "
                          r"OpenAI-compatible server \(llama-server, vLLM, SGLang\)\?",
                "completions": rf"gave up on .*/v1/completions after {TRIES} of {TRIES} tries in \d+ s, the last: did not "
                               r"answer JSON \(b'<html>It works!</html>'\); 0 of 4 conversations were written",
                "no choices": r"/v1/completions answered without choices\[0\].text \(\{'id': 1\}\); is --server",
                "http error": r"/nowhere/v1/models answered HTTP 404: \{\"error\": \"not found\"\}"}[case]
    argv = ["--target", str(target), "--data", str(data), "--out", str(out), "--max-new-tokens", "6",
            "--server", fake.url + ("/nowhere" if case == "http error" else "")]
    if case == "unreachable":
        fake.httpd.server_close()  # never started: nothing listens on its port
        with socket.socket() as probe:
            assert probe.connect_ex(fake.httpd.server_address) != 0
        with pytest.raises(SystemExit) as stop:
            cli(regenerate.main, argv)
    else:
        with fake, pytest.raises(SystemExit) as stop:
            cli(regenerate.main, argv)
    message = str(stop.value.code)
    assert "\n" not in message and re.search(expected, message), message
    assert not out.is_file() or out.read_text() == ""


def test_retry_after_and_backoff():
    assert server_module.retry_after("120") == 120 and server_module.retry_after("0") == 0
    assert 28 < server_module.retry_after(formatdate(time.time() + 30, usegmt=True)) <= 30  # the HTTP-date form
    assert server_module.retry_after(formatdate(time.time() - 30, usegmt=True)) == 0
    assert server_module.retry_after("soon") is None and server_module.retry_after(None) is None
    waits = [server_module.backoff(k) for k in range(1, 40)]
    assert 0.005 <= waits[0] <= 0.01 and 0.01 <= waits[1] <= 0.02 and max(waits) <= server_module.WAIT_MAX
    assert len({round(server_module.backoff(3), 6) for _ in range(20)}) > 1  # jitter


def test_a_server_that_errs_for_a_while_is_tried_again_and_every_row_is_written_once(target, tmp_path, capsys):
    """429 (waiting its Retry-After), 500, 502, 503, 504, malformed JSON, a body cut short and a request left
    unanswered past --request-timeout are each tried again, at most TRIES tries a request; the rows are those of a
    healthy server, each once, and each retry is announced on stderr in one line."""
    from openai_server import FakeServer, echo

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with FakeServer(echo) as healthy:
        expected = run(target, data, tmp_path / "healthy.jsonl", "--server", healthy.url)
    faults = ["429", None, "500", "503", None, "malformed", "truncated", None, "502", "hang", None, "504", None]
    with FakeServer(echo, faults=faults) as server:
        rows = run(target, data, tmp_path / "out.jsonl", "--server", server.url, "--batch-size", "1",
                   "--request-timeout", "0.5")
    assert [r["id"] for r in rows] == [r["id"] for r in ROWS] and by_id(rows) == by_id(expected)
    assert len(server.tries) == len(faults) and len(server.requests) == 5
    assert server.tries[1] - server.tries[0] >= 1.0  # Retry-After: 1
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    url = re.escape(f"{server.url}/v1/completions")
    assert len(warnings) == 8 and all(re.fullmatch(rf"warning: {url}: .*; trying again in [\d.]+ s \(try [23] of "
                                                   rf"{TRIES}\)", w) for w in warnings), warnings
    reasons = [w.split(": ", 2)[2].split("; trying")[0] for w in warnings]
    assert reasons == ['HTTP 429: {"error": "try"} (Retry-After 1 s)', 'HTTP 500: {"error": "try"}',
                       'HTTP 503: {"error": "try"}', "did not answer JSON (b\'{\"choices\": [{\"text\": \')",
                       "no answer (IncompleteRead(13 bytes read, 987 more expected))", 'HTTP 502: {"error": "try"}',
                       "no answer in 0.5 s", 'HTTP 504: {"error": "try"}']


GIVE_UPS = {  # the fault a server answers every request with from the 4th on -> (tries of that request, last reason)
    "429": (1, r'HTTP 429: \{"error": "try"\} \(Retry-After 3600 s\)'),  # past RETRY_FOR: no try waits that long
    "500": (TRIES, r'HTTP 500: \{"error": "try"\}'),
    "503": (TRIES, r'HTTP 503: \{"error": "try"\}'),
    "malformed": (TRIES, r"did not answer JSON \(b'\{\"choices\": \[\{\"text\": '\)"),
    "truncated": (TRIES, r"no answer \(IncompleteRead\(13 bytes read, 987 more expected\)\)"),
    "hang": (TRIES, r"no answer in 0.3 s"),
}


@pytest.mark.parametrize("fault", GIVE_UPS)
def test_a_server_that_keeps_failing_is_given_up_in_one_line_and_a_rerun_continues(target, tmp_path, capsys, fault):
    """A server that answers three requests (two conversations), then fails every one: the run gives up within its
    bound in one line naming the URL, the path, the last reason and how to go on, with the two rows written; rerun
    against a healthy server, it asks only the two conversations left and keeps the rows written before."""
    from openai_server import FakeServer, echo

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out.jsonl"
    argv = ["--target", str(target), "--data", str(data), "--out", str(out), "--max-new-tokens", "6", "--batch-size",
            "1", "--request-timeout", "0.3"]
    tries, reason = GIVE_UPS[fault]
    with FakeServer(echo, faults=itertools.chain([None] * 3, itertools.repeat(fault)), retry_after="3600") as server:
        start = time.monotonic()
        with pytest.raises(SystemExit) as stop:
            cli(regenerate.main, [*argv, "--server", server.url])
        seconds = time.monotonic() - start
    message = str(stop.value.code)
    assert "\n" not in message and re.fullmatch(
        rf"\S+: error: gave up on {re.escape(server.url)}/v1/completions after {tries} of {TRIES} tries in \d+ s, the "
        rf"last: {reason}; 2 of 4 conversations were written to {re.escape(str(out))}: rerun the same command once "
        r"the server answers to continue \(DRAFTSMITH_DEBUG=1 shows the traceback\)", message), message
    assert len(server.tries) == 3 + tries and seconds < 3 + tries * 0.3 + TRIES * 0.04  # bounded in count and time
    stalls = [line for line in capsys.readouterr().err.splitlines() if "no answer in 0.3 s; trying again" in line]
    assert len(stalls) == (TRIES - 1 if fault == "hang" else 0)
    kept = out.read_text()
    assert [json.loads(line)["id"] for line in kept.splitlines()] == ["one-turn", "two-turns"]

    with FakeServer(echo) as healthy:
        rows = run(target, data, out, "--server", healthy.url)
    assert out.read_text().startswith(kept) and sorted(r["id"] for r in rows) == sorted(r["id"] for r in ROWS)
    assert len(healthy.requests) == 2  # one turn each of the two conversations left; none answered twice
    with FakeServer(echo) as again:
        assert by_id(rows) == by_id(run(target, data, tmp_path / "healthy.jsonl", "--server", again.url))


def test_a_permanent_error_mid_run_is_not_tried_again(target, tmp_path):
    from openai_server import FakeServer, echo

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out.jsonl"
    with FakeServer(echo, faults=[None, "400"]) as server, pytest.raises(
            regenerate.ServerError, match=rf"^{re.escape(server.url)}/v1/completions answered HTTP 400: "
                                          r'\{"error": "try"\}; 1 of 4 conversations were written'):
        run(target, data, out, "--server", server.url, "--batch-size", "1")
    assert len(server.tries) == 2
