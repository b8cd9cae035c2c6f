"""A fake OpenAI-compatible server for the regeneration tests: http.server on 127.0.0.1 (a free port) in a thread,
stopped by the test (`with FakeServer(...) as server:`).

GET /v1/models lists one model; POST /v1/completions answers `answer(request body)` as a completion: its text, or the
fields of its choice (text and, as a reasoning parser adds it, reasoning_content). It records every
completion request and the most it held at once; `delay` seconds per completion make concurrency visible,
`die_after` answers it stops answering (every later connection is closed with no answer, as when the server
process is gone), `garbage` is the body it sends instead of JSON. `faults` scripts failures: each completion request
takes the next item, None to answer, else a fault (see `fail`; it may be endless: `itertools.repeat("503")`);
`tries` holds the time.monotonic() of every completion request, failed or answered.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class FakeServer:
    def __init__(self, answer: Callable[[dict], str | dict], delay: float = 0.0, die_after: int | None = None,
                 garbage: bytes | None = None, models: bytes | None = None, faults: Iterable[str | None] = (),
                 retry_after: str = "1"):
        self.requests: list[dict] = []
        self.tries: list[float] = []
        self.in_flight = self.most_in_flight = self.answered = 0
        self.stopping = threading.Event()
        lock, fake, faults = threading.Lock(), self, iter(faults)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def send(self, body: bytes, status: int = 200) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def fail(self, fault: str) -> None:
                """An HTTP status ("503"; "429" with `Retry-After: retry_after`), a 200 whose JSON is cut
                ("malformed"), a Content-Length larger than the body sent before the connection closes ("truncated"),
                or the request read and never answered until the server stops ("hang")."""
                if fault.isdigit():
                    self.send_response(int(fault))
                    if fault == "429":
                        self.send_header("Retry-After", retry_after)
                    self.send_header("Content-Length", "16")
                    self.end_headers()
                    self.wfile.write(b'{"error": "try"}')
                elif fault == "malformed":
                    self.send(b'{"choices": [{"text": ')
                elif fault == "truncated":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b'{"choices": [')
                    self.close_connection = True
                else:
                    assert fault == "hang", fault
                    fake.stopping.wait()
                    self.close_connection = True

            def do_GET(self):
                if self.path != "/v1/models":
                    return self.send(b'{"error": "not found"}', 404)
                self.send(models or json.dumps({"object": "list", "data": [{"id": "fake-target"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    return self.send(b'{"error": "not found"}', 404)
                with lock:
                    fake.tries.append(time.monotonic())
                    fault = next(faults, None)
                if fault:
                    return self.fail(fault)
                with lock:
                    if die_after is not None and fake.answered >= die_after:
                        self.close_connection = True  # no answer: the client sees the connection closed
                        return
                    fake.requests.append(body)
                    fake.in_flight += 1
                    fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
                time.sleep(delay)
                reply = None if garbage else answer(body)
                with lock:
                    fake.in_flight -= 1
                    fake.answered += 1
                choice = reply if isinstance(reply, dict) else {"text": reply}
                self.send(garbage or json.dumps({"object": "text_completion", "model": body["model"], "choices": [
                    {"index": 0, **choice, "finish_reason": "stop"}]}).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()  # hanging requests end
        self.httpd.shutdown()
        self.httpd.server_close()


def greedy(target_dir) -> Callable[[dict], str]:
    """Answers as the target at `target_dir` does greedily (temperature 0 only): the in-process path's replies."""
    model, tokenizer, lock = AutoModelForCausalLM.from_pretrained(target_dir).eval(), \
        AutoTokenizer.from_pretrained(target_dir), threading.Lock()

    def answer(body: dict) -> str:
        assert body["temperature"] == 0
        ids = torch.tensor([body["prompt"]])  # [1, s]
        with lock, torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=body["max_tokens"],
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return answer


def echo(body: dict) -> str:
    """A reply that shows what was asked: prompt length, temperature, seed."""
    return f"{len(body['prompt'])} ids at T={body['temperature']} seed {body['seed']}"
