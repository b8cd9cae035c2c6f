"""Self-distilled data for a real target: build diverse prompts, let the target answer them, commit the result.

    draftsmith self-distill --target smollm2-135m-instruct            # resumable; rerun to continue
    draftsmith self-distill --target smollm2-135m-instruct --server http://127.0.0.1:8080  # answered by a server
    draftsmith self-distill --target smollm2-135m-instruct --more-prompts 1000  # 1,000 training prompts more
    draftsmith self-distill --target smollm2-135m-instruct --broad --num-prompts 2000  # data/real/NAME/broad
    draftsmith self-distill --target smollm2-135m-instruct --finalize # write data/real/NAME from what is done
    draftsmith self-distill --target smollm2-135m-instruct --other-prompts  # data/real/NAME/other_prompts.jsonl

Prompts come from data/prompts.py (code from the stdlib, arithmetic and word problems, factual questions,
rewriting, lists and formats, multi-turn follow-ups), split train / held-out by a hash of the first user
turn; `--more-prompts M` adds M training prompts to the --num-prompts ones, the held-out split unchanged.
`--broad` answers prompts of nine everyday kinds instead (advice, how-to, comparisons, ideas, stories, letters, ...:
build_broad_prompts) into data/real/NAME/broad, a second source for a recipe's `data.extra`.
A target whose tokenizer has no chat template (a base model such as Gemma-3-270M) gets plain-text
openings instead (stdlib function headers with docstrings, prose) and continues them: rows of `text`. The target answers each one through train/regenerate.py's batched generation (held-out prompts
first), or through an OpenAI-compatible server serving the same weights (`--server URL`, --batch-size
requests at once; see `draftsmith regenerate`), appending to `runs/self_distill/NAME/answers.jsonl`, so an
interrupted run resumes where it stopped (a fresh checkout resumes from the data already finalized into
data/real/NAME). `--finalize` writes `data/real/NAME/{train,heldout}.jsonl.gz` and `settings.json` (sampling
settings, counts, the target's provenance, what answered, time spent, the command) from the answers written so far.
`--other-prompts` writes `data/real/NAME/other_prompts.jsonl` instead: 64 prompts of kinds the training prompts never
are (build_other_prompts), to measure a drafter's tau on another domain (`scripts/learning_curve.py --prompts`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.core import read_file
from draftsmith.data.prompts import (
    build_broad_prompts,
    build_more_prompts,
    build_other_prompts,
    build_prompts,
    build_text_prompts,
)
from draftsmith.data.server import REQUEST_TIMEOUT, Server, ServerError
from draftsmith.models.zoo import resolve_target
from draftsmith.train.guard import cli
from draftsmith.train.regenerate import (
    answered,
    append,
    complete,
    in_process,
    read_done,
    record_settings,
    regenerate_batch,
    settings_file,
)

log = logging.getLogger("draftsmith.self_distill")


def finalize(work: Path, out: Path, target_dir: Path, settings: dict) -> dict:
    """answers.jsonl -> out/{train,heldout}.jsonl.gz + settings.json; returns the settings written."""
    rows = [json.loads(line) for line in open(work / "answers.jsonl")]
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in ("train", "heldout"):
        part = [r for r in rows if r["split"] == split]
        counts[split] = len(part)
        with gzip.open(out / f"{split}.jsonl.gz", "wt", encoding="utf-8", compresslevel=9) as fh:
            for r in part:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    # Decoding prompts for tau: each held-out conversation up to its last user turn (earlier answers kept), or the
    # held-out text opening.
    with open(out / "heldout_prompts.jsonl", "w") as fh:
        for r in rows:
            if r["split"] == "heldout":
                prompt = {"prompt": r["prompt"]} if "prompt" in r else {"messages": r["messages"][:-1]}
                fh.write(json.dumps({"id": r["id"], "kind": r["kind"], **prompt}, ensure_ascii=False) + "\n")
    prompts = [r for name in ("prompts.jsonl", "more_prompts.jsonl") if (work / name).is_file()
               for r in read_file(work / name, f"delete {work} and run again")]
    timing = read_file(work / "timing.json", f"delete {work} and run again") if (work / "timing.json").is_file() else {}
    answerers = settings_file(work / "answers.jsonl")
    settings = {**settings, "answered": counts, "prompts": {
        "train": sum(p["split"] == "train" for p in prompts), "heldout": sum(p["split"] == "heldout" for p in prompts)},
        "regeneration_seconds": round(timing.get("seconds", 0.0)),
        "target_provenance": read_file(target_dir / "provenance.json", "build the target again")
        if (target_dir / "provenance.json").is_file() else None,
        "answered_by": json.loads(answerers.read_text())["answered_by"] if answerers.is_file() else None}
    (out / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    return settings


def continue_batch(model, tokenizer, batch: list[dict], temperature: float, max_new_tokens: int) -> list[dict]:
    """Plain-text rows `{"prompt", ...}` -> the same rows with `text`: the opening and the target's continuation."""
    tails = complete(model, tokenizer, [r["prompt"] for r in batch], temperature, max_new_tokens, add_special_tokens=True)
    return [{**r, "text": r["prompt"] + tail["content"]} for r, tail in zip(batch, tails, strict=True)]


def seed_from_committed(out: Path, answers: Path, timing: Path) -> None:
    """Start a fresh work directory from data already finalized into `out` (a later run resumes there)."""
    parts = [out / f"{split}.jsonl.gz" for split in ("heldout", "train")]
    if not all(p.is_file() for p in parts):
        return
    with open(answers, "w") as fh:
        for p in parts:
            with gzip.open(p, "rt", encoding="utf-8") as src:
                fh.writelines(src)
    settings = read_file(out / "settings.json", f"delete {out} and regenerate the data")
    timing.write_text(json.dumps({"seconds": settings.get("regeneration_seconds", 0.0)}))
    # Data finalized before answerers were recorded came from this script's in-process path (float32 on the CPU).
    answerers = settings.get("answered_by") or [{"in_process": "transformers generate", "dtype": "float32",
                                                 "device": "cpu"}]
    settings_file(answers).write_text(json.dumps({"sampling": settings["sampling"], "answered_by": answerers}))
    log.info("self_distill: resuming from the %s answers committed in %s", sum(settings["answered"].values()), out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a named target (models/zoo.py) or an HF model directory")
    parser.add_argument("--num-prompts", type=int, default=3300)
    parser.add_argument("--more-prompts", type=int, default=0,
                        help="training prompts beyond --num-prompts' (data/prompts.py build_more_prompts); chat only")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--broad", action="store_true", help="prompts of everyday kinds the default set lacks "
                        "(data/prompts.py build_broad_prompts), into <work>/broad and <out>/broad; chat only")
    parser.add_argument("--work", default="", help="default runs/self_distill/<target name>")
    parser.add_argument("--out", default="", help="default data/real/<target name>")
    parser.add_argument("--finalize", action="store_true", help="write the compressed data from what is done")
    parser.add_argument("--other-prompts", action="store_true", help="write OUT/other_prompts.jsonl (prompts of "
                        "another domain, data/prompts.py build_other_prompts, seeded by --seed) and stop; chat only")
    parser.add_argument("--server", default="", help="URL of an OpenAI-compatible server serving the target "
                        "(llama-server, vLLM, SGLang) to answer instead of this process; --batch-size requests at once")
    parser.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT,
                        help="with --server: seconds without an answer before a request is tried again "
                        "(default %(default)g)")
    args = parser.parse_args(argv)
    if args.request_timeout <= 0:
        parser.error("--request-timeout must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    name = Path(args.target).name
    work = Path(args.work or Path("runs") / "self_distill" / name) / ("broad" if args.broad else "")
    out = Path(args.out or Path("data") / "real" / name) / ("broad" if args.broad else "")
    target_dir = Path(resolve_target(args.target))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    text = tokenizer.chat_template is None  # a base model: plain-text openings to continue
    if text and args.more_prompts:
        parser.error(f"--more-prompts: {args.target} has no chat template; there are more plain-text openings only "
                     "through a larger --num-prompts (a new held-out split)")
    if args.broad and (text or args.more_prompts or args.other_prompts):
        parser.error("--broad: chat prompts of their own set, for a target with a chat template, without "
                     "--more-prompts or --other-prompts")
    if text and args.other_prompts:
        parser.error(f"--other-prompts: {args.target} has no chat template; the other domain's prompts are chat "
                     "conversations")
    if args.other_prompts:
        out.mkdir(parents=True, exist_ok=True)
        rows = build_other_prompts(seed=args.seed)
        (out / "other_prompts.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        log.info("self_distill: %d prompts of %d other kinds written to %s", len(rows), len({r["kind"] for r in rows}),
                 out / "other_prompts.jsonl")
        return
    settings = {"target": args.target, "format": "text" if text else "chat", "num_prompts": args.num_prompts,
                **({"prompt_set": "broad"} if args.broad else {}),
                **({"more_prompts": args.more_prompts} if args.more_prompts else {}),
                "prompt_seed": args.seed,
                "sampling": {"temperature": args.temperature, "top_k": 0, "top_p": 1.0,
                             "max_new_tokens": args.max_new_tokens, "seed": args.seed},
                "batch_size": args.batch_size,
                "command": "draftsmith self-distill " + shlex.join(a for a in (sys.argv[1:] if argv is None else argv)
                                                                          if a != "--finalize")}
    if args.finalize:
        print(json.dumps(finalize(work, out, target_dir, settings), indent=1))
        return

    work.mkdir(parents=True, exist_ok=True)
    prompts_file = work / "prompts.jsonl"
    if not prompts_file.is_file():
        build = build_text_prompts if text else build_broad_prompts if args.broad else build_prompts
        rows = build(args.num_prompts, args.seed)
        prompts_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    rows = read_file(prompts_file, f"delete {prompts_file} and run again")
    if args.more_prompts:
        more = build_more_prompts(args.num_prompts, args.more_prompts, args.seed)
        (work / "more_prompts.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in more))
        rows += more
    answers = work / "answers.jsonl"
    if not answers.is_file():
        seed_from_committed(out, answers, work / "timing.json")
    done = read_done(answers)
    # Held-out first; then conversations with as many turns together, so a batch runs no extra rounds for a few.
    todo = sorted((r for r in rows if r["id"] not in done),
                  key=lambda r: (r["split"] != "heldout", len(r.get("messages", ()))))
    log.info("self_distill: %d of %d prompts to answer (%s)", len(todo), len(rows), answers)

    torch.manual_seed(args.seed + len(done))
    if args.server:
        model = Server(args.server, args.seed, args.request_timeout)
    else:
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if todo:
        record_settings(answers, settings, model.provenance() if args.server else in_process(model))
    timing_file = work / "timing.json"
    spent = read_file(timing_file, f"delete {timing_file} and run again")["seconds"] if timing_file.is_file() else 0.0
    t0, written = time.perf_counter(), 0
    with open(answers, "a") as fh:
        try:
            for row in answered(continue_batch if text else regenerate_batch, model, tokenizer, todo, args.temperature,
                                args.max_new_tokens, args.batch_size):
                append(fh, row)
                written += 1
                timing_file.write_text(json.dumps({"seconds": spent + time.perf_counter() - t0}))
                if written % args.batch_size == 0 or written == len(todo):
                    log.info("self_distill: %d/%d answered, %.0f s spent", len(done) + written, len(rows),
                             spent + time.perf_counter() - t0)
        except ServerError as e:
            raise ServerError(f"{e}; {len(done) + written} of {len(rows)} prompts are answered in {answers}: rerun "
                              "the same command once the server answers to continue") from None


if __name__ == "__main__":
    cli(main)
