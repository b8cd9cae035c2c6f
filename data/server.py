"""An OpenAI-compatible server (llama-server, vLLM, SGLang) as the target that answers regeneration prompts.

    draftsmith regenerate --target DIR --server http://127.0.0.1:8080 --data PATH --out OUT.jsonl

The prompt goes to `/v1/completions` as the token ids of the text the target's own chat template renders here,
so the server continues exactly what the in-process path would: through `/v1/chat/completions` the server would
render the conversation with its own copy of the template (llama.cpp's from the GGUF, vLLM's from its tokenizer
files), and a different rendering (a default system prompt, other whitespace) would condition the answers on a
prompt the drafter never sees in training. Sampling is plain temperature sampling as in-process: the servers'
own filters are turned off (llama-server samples with top_k 40 and min_p 0.05 unless told otherwise), and each
request carries a seed derived from the run's seed and the prompt, so a rerun asks the same questions the same way.
Standard library only (urllib, one connection per request).

A request that fails for a reason that passes (HTTP 429, 500, 502, 503, 504; once the server has answered, also no
answer within the request timeout, a refused or reset connection, a body cut short or not JSON) is tried again
after an exponential backoff with jitter, waiting at least what a `Retry-After` header asks, each retry announced on
stderr in one line; after TRIES tries, or when the next one would start more than RETRY_FOR seconds after the first
failure, it gives up in one line naming the URL, the path and the last reason. Any other error (400, 404, a server
that lists no model, one that cannot be reached, times out or does not answer JSON before it ever answered) fails at
once.
"""

from __future__ import annotations

import email.utils
import hashlib
import http.client
import json
import random
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from draftsmith.data.chat import reasoning_field

# Sent with every request beside `temperature`: no top-k (-1 is "off" for vLLM, SGLang and llama.cpp alike), no
# nucleus, no min-p.
FILTERS_OFF = {"top_k": -1, "top_p": 1.0, "min_p": 0.0}

REQUEST_TIMEOUT = 600.0  # seconds without an answer before a try counts as failed (--request-timeout)
TRANSIENT = {429, 500, 502, 503, 504}  # HTTP statuses of a server busy, restarting or behind a proxy that lost it
TRIES = 8  # tries of one request at most
BACKOFF = 2.0  # seconds of backoff after the first failure, doubled after each further one, WAIT_MAX at most
WAIT_MAX = 60.0
RETRY_FOR = 300.0  # no try starts later than this many seconds after the request's first failure


class ServerError(RuntimeError):
    """A server that cannot be reached, or that does not answer as an OpenAI-compatible one."""


class Transient(Exception):
    """A failed try worth another one: why (`reason`), and the seconds the server asked to wait, if it did."""

    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


def retry_after(value: str | None) -> float | None:
    """The seconds a `Retry-After` header asks for (delay-seconds or an HTTP-date), None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def backoff(failures: int) -> float:
    """Seconds to wait after the `failures`-th failure of a request: BACKOFF doubled per failure, WAIT_MAX at most,
    its upper half drawn at random (jitter) so that requests that failed together do not all come back together."""
    step = min(WAIT_MAX, BACKOFF * 2 ** (failures - 1))
    return step / 2 + random.uniform(0, step / 2)


class Server:
    """The completions endpoint of the server at `url` (with or without a trailing /v1); `model` is its first entry
    in /v1/models, asked once here, so a wrong URL fails before any work starts."""

    def __init__(self, url: str, seed: int = 0, timeout: float = REQUEST_TIMEOUT):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.seed, self.timeout = seed, timeout
        self.answered = False  # until it has answered once, only its HTTP 429 and 5xx answers are tried again
        listed = self.call("/v1/models")
        models = listed.get("data") if isinstance(listed, dict) else None
        if not models or not isinstance(models, list) or not isinstance(models[0], dict) or "id" not in models[0]:
            raise ServerError(f"{self.url}/v1/models lists no model ({str(listed)[:80]}); is --server an "
                              "OpenAI-compatible server (llama-server, vLLM, SGLang) with a model loaded?")
        self.model: dict[str, Any] = models[0]

    def call(self, path: str, body: dict | None = None) -> Any:
        """GET `path` (POST `body` as JSON when given) -> the decoded JSON answer, tried again as the module says."""
        start, first_failure, tries = time.monotonic(), None, 0
        while True:
            tries += 1
            try:
                answer = self.once(path, body)
            except Transient as e:
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                wait = max(backoff(tries), e.retry_after or 0.0)
                if tries >= TRIES or now + wait > first_failure + RETRY_FOR:
                    raise ServerError(f"gave up on {self.url}{path} after {tries} of {TRIES} tries in "
                                      f"{now - start:.0f} s, the last: {e.reason}"
                                      + ("" if self.answered else "; rerun once the server is ready")) from None
                print(f"warning: {self.url}{path}: {e.reason}; trying again in {wait:.1f} s (try {tries + 1} of "
                      f"{TRIES})", file=sys.stderr, flush=True)
                time.sleep(wait)
                continue
            self.answered = True
            return answer

    def once(self, path: str, body: dict | None) -> Any:
        """One try of `call`: the decoded JSON answer; Transient when another try may succeed, else ServerError."""
        request = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = " ".join(e.read().decode(errors="replace").split())[:200]
            reason = f"HTTP {e.code}: {detail or e.reason}"
            if e.code in TRANSIENT:
                wait = retry_after(e.headers.get("Retry-After"))
                raise Transient(reason + (f" (Retry-After {wait:.0f} s)" if wait is not None else ""), wait) from None
            raise ServerError(f"{self.url}{path} answered {reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, cut, timed out
            cause = e.reason if isinstance(e, urllib.error.URLError) else e
            why = f"in {self.timeout:g} s" if isinstance(cause, TimeoutError) else \
                f"({cause if isinstance(e, urllib.error.URLError) else repr(e)})"
            if self.answered:
                raise Transient(f"no answer {why}") from None
            raise ServerError(f"no answer from {self.url}{path} {why}; start the server or fix --server") from None
        try:
            return json.loads(raw)
        except ValueError:
            if self.answered:
                raise Transient(f"did not answer JSON ({raw[:60]!r})") from None
            raise ServerError(f"{self.url}{path} did not answer JSON ({raw[:60]!r}); is --server an "
                              "OpenAI-compatible server (llama-server, vLLM, SGLang)?") from None

    def complete(self, ids: list[int], temperature: float, max_tokens: int) -> dict[str, str]:
        """The continuation of the prompt `ids` (token ids of the target's vocabulary), at most `max_tokens` long, as
        an assistant message: {"content": text}, with "reasoning_content" where the server's reasoning parser
        returned the reasoning apart (choices[0] carries one of chat.REASONING_FIELDS beside `text`)."""
        seed = int(hashlib.sha256(f"{self.seed}:{ids}".encode()).hexdigest()[:7], 16)
        answer = self.call("/v1/completions", {
            "model": self.model["id"], "prompt": ids, "max_tokens": max_tokens, "temperature": temperature,
            **FILTERS_OFF, "seed": seed, "stream": False})
        try:
            choice = answer["choices"][0]
            text = choice["text"]
        except (KeyError, IndexError, TypeError):
            text = None
        if not isinstance(text, str):
            raise ServerError(f"{self.url}/v1/completions answered without choices[0].text ({str(answer)[:80]}); "
                              "is --server an OpenAI-compatible server (llama-server, vLLM, SGLang)?")
        # a server's reasoning parser puts the reasoning apart from the text under the names chat.REASONING_FIELDS
        # lists (vLLM, llama-server); without one the text holds it as the model wrote it (`<think>...`)
        field = reasoning_field(choice)
        return {"content": text} if field is None else {"content": text, "reasoning_content": choice[field]}

    def provenance(self) -> dict[str, Any]:
        """What answered, for the settings file: the URL, the model entry the server lists, how it was asked."""
        return {"server": self.url, "model": self.model, "endpoint": "/v1/completions",
                "prompt": "token ids of the target's chat template rendering (as in-process)",
                "request": {**FILTERS_OFF, "seed": f"the first 7 hex digits of sha256('{self.seed}:' + ids)"}}
