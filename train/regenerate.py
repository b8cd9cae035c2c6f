"""Rewrite every assistant turn of a chat dataset with the target itself (self-distillation).

    draftsmith regenerate --target DIR --data PATH --out OUT.jsonl [--temperature T [T ...]]
        [--batch-size B] [--max-new-tokens N] [--split S] [--limit K] [--seed S]
        [--server URL [--request-timeout SECONDS]]

A drafter learns to predict the target, so it should train on the target's own answers: the
Medusa and EAGLE authors regenerate their training data this way. For every conversation, each
assistant turn is generated from the conversation so far (earlier turns already regenerated),
rendered with the target's chat template and its generation prompt; a conversation that ends
with a user turn gets one more, generated assistant turn, so a file of prompts works too.

A reply replaces the whole assistant turn: its text as generated (a thinking model's reasoning inline, `<think>...`),
plus `reasoning_content` where a server's reasoning parser returned the reasoning apart; the input turn's own
reasoning is dropped with it. Training renders both forms as the target's template does (data/chat.py).

Conversations are generated B at a time (left padding, greedy at temperature 0, else sampled). With
`--server URL` an OpenAI-compatible server answers instead (llama-server, vLLM, SGLang serving the same
weights; data/server.py): B conversations in flight as concurrent requests, each written as soon as all its
turns are answered, the prompts rendered and tokenized here exactly as in-process. A request that fails for a
reason that passes (the server busy, restarting, cut off mid-answer, or silent for --request-timeout seconds) is
tried again with backoff; if the server stays away, the rows written so far stay and rerunning the same command
continues.
Several temperatures answer every conversation once per temperature, one temperature after the other
(`--temperature 0 1`: the states both greedy and sampled decoding visit), each row then with id
`ID-T<t>` and its `temperature`.
The output is JSONL of `{"id": ..., "messages": [...]}` (plus the input's other fields), written
and flushed per row; rerunning with the same --out skips the ids already there, so an
interrupted run resumes. `id` is the input's `id` field, or the row number. Beside it, OUT.settings.json
records the target (and its provenance), the sampling settings, what answered (in-process or the server, its
model and the request's fields; each one that wrote rows) and the command; resuming with other sampling
settings is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TextIO

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.chat import render, to_messages
from draftsmith.data.core import DiskFull, check_free, is_disk_full
from draftsmith.data.dataset import DataConfig, load_raw
from draftsmith.data.server import REQUEST_TIMEOUT, Server, ServerError
from draftsmith.models.zoo import resolve_target
from draftsmith.train.guard import cli

log = logging.getLogger("draftsmith.regenerate")
TOKENIZE = threading.Lock()  # a fast tokenizer is not to be called from several threads at once


def read_done(out: Path) -> set[str]:
    """Ids already written to `out`; a torn last line (from a killed run) is cut off the file."""
    if not out.is_file():
        return set()
    done, good = set(), 0
    with open(out, "rb") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if not line.endswith(b"\n"):
                break
            done.add(str(row["id"]))
            good += len(line)
    if good < out.stat().st_size:
        log.warning("%s: dropping a torn last line after %d complete rows", out, len(done))
        with open(out, "r+b") as fh:
            fh.truncate(good)
    return done


def append(fh: TextIO, row: dict[str, Any]) -> None:
    """Write `row` to the open JSONL `fh` as one line and make it durable (flushed and fsynced), so that every
    row answered before an error, a kill or a crash is kept and a rerun skips it."""
    fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    fh.flush()
    os.fsync(fh.fileno())


def conversations(data: str, split: str, limit: int) -> list[dict[str, Any]]:
    """Input rows as `{"id", "messages", ...other fields}`."""
    raw = load_raw(DataConfig(path=data, split=split, limit=limit))
    rows = []
    for i, example in enumerate(raw):
        messages = to_messages(example)
        if messages is None:
            raise ValueError(f"{data} row {i} is plain text; regeneration needs chat data (messages or conversations)")
        extra = {k: v for k, v in example.items() if k not in ("id", "messages", "conversations")}
        rows.append({"id": i if example.get("id") is None else example["id"], **extra, "messages": messages})
    return rows


def generate(model, tokenizer, prompts: list[list[dict[str, str]]], temperature: float,
             max_new_tokens: int) -> list[dict[str, str]]:
    """One assistant reply per conversation prefix, in one batch (the tokenizer must pad on the left), as `complete`
    gives it."""
    texts = [render(tokenizer, p, add_generation_prompt=True) for p in prompts]  # as training renders the context
    return complete(model, tokenizer, texts, temperature, max_new_tokens)


@torch.no_grad()
def complete(model, tokenizer, texts: list[str], temperature: float, max_new_tokens: int,
             add_special_tokens: bool = False) -> list[dict[str, str]]:
    """One continuation per text, in one batch (the tokenizer must pad on the left), or one request per text when
    `model` is a Server. Rendered chat needs no special tokens added; plain text for a base model takes the
    tokenizer's own (Gemma's BOS). Each continuation is {"content": text}, the text as generated (reasoning inline
    where the model writes it so), plus "reasoning_content" where a server's reasoning parser returned it apart."""
    if isinstance(model, Server):
        with TOKENIZE:
            ids = [tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"] for t in texts]
        return [model.complete(i, temperature, max_new_tokens) for i in ids]
    enc = tokenizer(texts, add_special_tokens=add_special_tokens, padding=True, return_tensors="pt").to(model.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         **sampling)  # [b, s + new]
    new = out[:, enc["input_ids"].shape[1]:]  # [b, new]
    return [{"content": text} for text in tokenizer.batch_decode(new, skip_special_tokens=True)]


def regenerate_batch(model, tokenizer, batch: list[dict[str, Any]], temperature: float,
                     max_new_tokens: int) -> list[dict[str, Any]]:
    """Replace every assistant turn of every conversation in `batch`, turn by turn across the batch; a reply
    replaces the whole turn (its reasoning too: the input's reasoning is not the target's)."""
    convs = [[dict(m) for m in row["messages"]] for row in batch]
    for conv in convs:
        if conv and conv[-1]["role"] != "assistant":
            conv.append({"role": "assistant", "content": ""})
    turns = [[i for i, m in enumerate(conv) if m["role"] == "assistant"] for conv in convs]
    for k in range(max(map(len, turns), default=0)):
        todo = [(c, t[k]) for c, t in enumerate(turns) if k < len(t)]
        replies = generate(model, tokenizer, [convs[c][:i] for c, i in todo], temperature, max_new_tokens)
        for (c, i), reply in zip(todo, replies, strict=True):
            convs[c][i] = {"role": "assistant", **reply}
    return [{**row, "messages": conv} for row, conv in zip(batch, convs, strict=True)]


Answer = Callable[[Any, Any, list[dict[str, Any]], float, int], list[dict[str, Any]]]  # regenerate_batch's shape


def answered(answer: Answer, model, tokenizer, rows: list[dict[str, Any]], temperature: float, max_new_tokens: int,
             batch_size: int) -> Iterator[dict[str, Any]]:
    """`answer(model, tokenizer, batch, temperature, max_new_tokens)` over all rows: batch_size rows per batch in
    this process, in order; through a Server, batch_size rows in flight (one request at a time each), yielded as
    each finishes. On a server's first error no further row starts; the rows in flight are yielded if they finish,
    then the error is raised."""
    if not isinstance(model, Server):
        for b in range(0, len(rows), batch_size):
            yield from answer(model, tokenizer, rows[b: b + batch_size], temperature, max_new_tokens)
        return
    todo, error = iter(rows), None
    with ThreadPoolExecutor(batch_size) as pool:
        def start() -> set:
            row = next(todo, None)
            return set() if row is None else {pool.submit(answer, model, tokenizer, [row], temperature, max_new_tokens)}
        running = set().union(*(start() for _ in range(batch_size)))
        while running:
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                if f.exception() is not None:
                    error = error or f.exception()
                else:
                    yield from f.result()
                if error is None:
                    running |= start()
    if error is not None:
        raise error


def settings_file(out: Path) -> Path:
    return out.with_suffix(".settings.json")


def record_settings(out: Path, settings: dict[str, Any], answerer: dict[str, Any]) -> None:
    """Write `settings` and the list of answerers to OUT.settings.json, adding `answerer` to the ones that wrote the
    rows already in `out`; rows sampled from another distribution than those already there (another temperature,
    filter or length; another seed is fine) are refused in one line."""
    path = settings_file(out)
    before = json.loads(path.read_text()) if path.is_file() and out.is_file() and out.stat().st_size else {}
    old, new = ({k: v for k, v in s.items() if k != "seed"} for s in (before.get("sampling", {}), settings["sampling"]))
    if before and old != new:
        raise ValueError(f"{out} holds rows sampled with {old}, not {new}; rerun with the same options or write "
                         "--out elsewhere")
    answerers = before.get("answered_by", [])
    path.write_text(json.dumps({**settings, "answered_by": answerers + [answerer] * (answerer not in answerers)},
                               indent=1) + "\n")


def in_process(model) -> dict[str, Any]:
    """The in-process answerer, for the settings file."""
    return {"in_process": "transformers generate", "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device)}


def output_bytes(rows: list[dict[str, Any]], max_new_tokens: int, bytes_per_token: int = 16) -> int:
    """An upper estimate of the JSONL the rows become: each row as read, plus max_new_tokens per assistant reply."""
    replies = [sum(m["role"] == "assistant" for m in r["messages"][:-1]) + 1 for r in rows]
    return sum(len(json.dumps(r, ensure_ascii=False).encode()) + n * max_new_tokens * bytes_per_token
               for r, n in zip(rows, replies, strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HF model directory of the target (with its tokenizer) or a named target")
    parser.add_argument("--data", required=True, help="jsonl/json/parquet/arrow file, saved dataset or hub name")
    parser.add_argument("--out", required=True, help="JSONL to write (appended to when resuming)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                        help="0: greedy; several: one answer per conversation and temperature")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--limit", type=int, default=0, help="first K conversations only; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server", default="", help="URL of an OpenAI-compatible server serving the target "
                        "(llama-server, vLLM, SGLang) to answer instead of this process; --batch-size requests at once")
    parser.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT,
                        help="with --server: seconds without an answer before a request is tried again "
                        "(default %(default)g)")
    args = parser.parse_args(argv)
    args.target = resolve_target(args.target)
    if min(args.temperature) < 0 or args.batch_size < 1 or args.max_new_tokens < 1 or args.request_timeout <= 0:
        parser.error("--temperature must be >= 0, --batch-size and --max-new-tokens >= 1, --request-timeout > 0")
    if not (Path(args.target) / "config.json").is_file():
        parser.error(f"--target {args.target} is not a model directory (no config.json)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)

    if args.server:
        model = Server(args.server, args.seed, args.request_timeout)
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(
            args.target, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    convs, several = conversations(args.data, args.split, args.limit), len(args.temperature) > 1

    def tagged(row: dict, t: float) -> dict:  # one row per conversation and temperature when there are several
        return {**row, "id": f"{row['id']}-T{t:g}", "temperature": t} if several else row
    jobs = [(t, [r for r in (tagged(c, t) for c in convs) if str(r["id"]) not in done]) for t in args.temperature]
    total = sum(len(rows) for _, rows in jobs)
    log.info("regenerate: %d conversations to do, %d already in %s", total, len(done), out)
    check_free(out.parent, output_bytes([r for _, rows in jobs for r in rows], args.max_new_tokens),
               f"{out} ({total} conversations)",
               "free space or write --out elsewhere; rows already written are kept and skipped when rerun")
    provenance = Path(args.target) / "provenance.json"
    settings = {"target": args.target,
                "target_provenance": json.loads(provenance.read_text()) if provenance.is_file() else None,
                "data": args.data, "split": args.split, "limit": args.limit,
                "sampling": {"temperatures": args.temperature, "top_k": 0, "top_p": 1.0,
                             "max_new_tokens": args.max_new_tokens, "seed": args.seed},
                "batch_size": args.batch_size, "command": "draftsmith regenerate " + shlex.join(argv or sys.argv[1:])}
    if total:
        record_settings(out, settings, model.provenance() if isinstance(model, Server) else in_process(model))
    t0, written = time.perf_counter(), 0
    with open(out, "a") as fh:
        for temperature, rows in jobs:
            try:
                for row in answered(regenerate_batch, model, tokenizer, rows, temperature, args.max_new_tokens,
                                    args.batch_size):
                    append(fh, row)
                    written += 1
                    if written % args.batch_size == 0 or written == total:
                        log.info("regenerate: %d/%d conversations (temperature %g), %.1fs", written, total,
                                 temperature, time.perf_counter() - t0)
            except OSError as e:
                if not is_disk_full(e):
                    raise
                raise DiskFull(f"the disk filled up writing {out} after {written} of {total} conversations; "
                               "free space and rerun the same command (the complete rows are kept)") from e
            except ServerError as e:
                raise ServerError(f"{e}; {written} of {total} conversations were written to {out}: rerun the same "
                                  "command once the server answers to continue") from None

if __name__ == "__main__":
    cli(main)
