"""Regeneration tokens/s: the target in this process (batched transformers generate) against the same weights served
by llama-server (concurrent /v1/completions requests), on the same prompts, greedy.

    python scripts/bench_regenerate.py --gguf TARGET.gguf [--target smollm2-135m-instruct]
        [--prompts 64] [--max-new-tokens 128] [--batch-size 16] [--concurrency 8 16] [--threads N]
        [--out benchmarks/regenerate_server.json]

TARGET.gguf: the target converted by llama.cpp's convert_hf_to_gguf.py with --outtype f32, so both paths run the
same weights. llama-server: the one `draftsmith llama-cpp` finds (DRAFTSMITH_LLAMA_CPP, the cache, PATH).
The prompts are the first N of data/real/NAME/heldout_prompts.jsonl. Both paths run train/regenerate.py's own code
(`answered`): in-process B conversations per batch; through the server C requests at once, llama-server started
here on 127.0.0.1 with C slots and stopped after. tokens/s = the answers' tokens (each reply tokenized by the
target's tokenizer, one count for both paths) / the wall seconds of answering alone (model load and server start
excluded). Also how many replies are the same on both paths: greedy decoding of the same weights, though a
different summation order may part a few after many tokens. The load average before each path is recorded, since
a figure taken while other jobs share the cores understates both.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.server import Server
from draftsmith.models import llama_cpp
from draftsmith.models.zoo import resolve_target
from draftsmith.train.regenerate import answered, regenerate_batch

REPO = Path(__file__).resolve().parent.parent


def timed(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int) -> tuple[float, dict, float]:
    """Wall seconds to answer every row greedily, the rows answered (by id), the load average before."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = {r["id"]: r for r in answered(regenerate_batch, model, tokenizer, rows, 0.0, max_new_tokens, batch_size)}
    return time.perf_counter() - t0, done, load


def answer_tokens(tokenizer, rows: dict[str, dict]) -> int:
    """Tokens of the assistant turns the run wrote (every one: a multi-turn prompt's earlier answers are regenerated
    too)."""
    return sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
               for r in rows.values() for m in r["messages"] if m["role"] == "assistant")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="the target as an F32 GGUF (llama.cpp's convert_hf_to_gguf.py)")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="the in-process batch")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16], help="requests at once to the server")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "regenerate_server.json"))
    args = parser.parse_args()
    binary = str(llama_cpp.need_binary("llama-server"))
    name, target = Path(args.target).name, resolve_target(args.target)
    lines = (REPO / "data" / "real" / name / "heldout_prompts.jsonl").read_text().splitlines()[: args.prompts]
    rows = [{"id": p["id"], "messages": p["messages"]} for p in map(json.loads, lines)]
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.set_num_threads(args.threads)

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seconds, here, load = timed(model, tokenizer, rows, args.max_new_tokens, args.batch_size)
    tokens = answer_tokens(tokenizer, here)
    base = tokens / seconds
    result = {"target": args.target, "gguf": os.path.realpath(args.gguf), "gguf_bytes": os.path.getsize(args.gguf),
              "llama_server": os.path.realpath(binary),
              "llama_server_version": subprocess.run([binary, "--version"], capture_output=True, text=True).stderr.strip()
              .splitlines()[-2:], "prompts": f"the first {len(rows)} of data/real/{name}/heldout_prompts.jsonl",
              "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "threads": args.threads,
              "cores": os.cpu_count(),
              "in_process": {"batch_size": args.batch_size, "dtype": "float32", "seconds": round(seconds, 1),
                             "answer_tokens": tokens, "tokens_per_s": round(base, 1), "load_average": load},
              "server": []}
    del model
    print(json.dumps(result["in_process"]), flush=True)
    for c in args.concurrency:
        with llama_cpp.Server(Path(args.gguf), ["--no-webui"], args.threads, ctx=2048, slots=c) as server:
            seconds, served, load = timed(Server(server.url), tokenizer, rows, args.max_new_tokens, c)
            cmd = server.cmd
        tokens = answer_tokens(tokenizer, served)
        same = sum(served[i]["messages"] == here[i]["messages"] for i in here)
        result["server"].append({
            "concurrency": c, "seconds": round(seconds, 1), "answer_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1), "speedup": round(tokens / seconds / base, 2),
            "same_replies_as_in_process": f"{same}/{len(here)}", "load_average": load,
            "llama_server_command": shlex.join([Path(cmd[0]).name, *cmd[1:]])})
        print(json.dumps(result["server"][-1]), flush=True)
    result["command"] = "python scripts/bench_regenerate.py " + shlex.join(sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
