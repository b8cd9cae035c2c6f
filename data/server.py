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
"""

from __future__ import annotations

import hashlib
import http.client
import json
import urllib.error
import urllib.request
from typing import Any

# Sent with every request beside `temperature`: no top-k (-1 is "off" for vLLM, SGLang and llama.cpp alike), no
# nucleus, no min-p.
FILTERS_OFF = {"top_k": -1, "top_p": 1.0, "min_p": 0.0}


class ServerError(RuntimeError):
    """A server that cannot be reached, or that does not answer as an OpenAI-compatible one."""


class Server:
    """The completions endpoint of the server at `url` (with or without a trailing /v1); `model` is its first entry
    in /v1/models, asked once here, so a wrong URL fails before any work starts."""

    def __init__(self, url: str, seed: int = 0, timeout: float = 600.0):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.seed, self.timeout = seed, timeout
        listed = self.call("/v1/models")
        models = listed.get("data") if isinstance(listed, dict) else None
        if not models or not isinstance(models, list) or not isinstance(models[0], dict) or "id" not in models[0]:
            raise ServerError(f"{self.url}/v1/models lists no model ({str(listed)[:80]}); is --server an "
                              "OpenAI-compatible server (llama-server, vLLM, SGLang) with a model loaded?")
        self.model: dict[str, Any] = models[0]

    def call(self, path: str, body: dict | None = None) -> Any:
        """GET `path` (POST `body` as JSON when given) -> the decoded JSON answer."""
        request = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = " ".join(e.read().decode(errors="replace").split())[:200]
            raise ServerError(f"{self.url}{path} answered HTTP {e.code}: {detail or e.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, cut, timed out
            reason = e.reason if isinstance(e, urllib.error.URLError) else repr(e)
            raise ServerError(f"no answer from {self.url}{path} ({reason}); start the server or fix --server") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{self.url}{path} did not answer JSON ({raw[:60]!r}); is --server an "
                              "OpenAI-compatible server (llama-server, vLLM, SGLang)?") from None

    def complete(self, ids: list[int], temperature: float, max_tokens: int) -> str:
        """The continuation of the prompt `ids` (token ids of the target's vocabulary), at most `max_tokens` long."""
        seed = int(hashlib.sha256(f"{self.seed}:{ids}".encode()).hexdigest()[:7], 16)
        answer = self.call("/v1/completions", {
            "model": self.model["id"], "prompt": ids, "max_tokens": max_tokens, "temperature": temperature,
            **FILTERS_OFF, "seed": seed, "stream": False})
        try:
            text = answer["choices"][0]["text"]
        except (KeyError, IndexError, TypeError):
            text = None
        if not isinstance(text, str):
            raise ServerError(f"{self.url}/v1/completions answered without choices[0].text ({str(answer)[:80]}); "
                              "is --server an OpenAI-compatible server (llama-server, vLLM, SGLang)?")
        return text

    def provenance(self) -> dict[str, Any]:
        """What answered, for the settings file: the URL, the model entry the server lists, how it was asked."""
        return {"server": self.url, "model": self.model, "endpoint": "/v1/completions",
                "prompt": "token ids of the target's chat template rendering (as in-process)",
                "request": {**FILTERS_OFF, "seed": f"the first 7 hex digits of sha256('{self.seed}:' + ids)"}}
