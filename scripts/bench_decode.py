"""Benchmark the bundled decoder against plain decoding and Hugging Face's assisted generation.

    python scripts/bench_decode.py [--target models/reference-target] [--draft DIR | --draft-layers 2]
        [--num-prompts 20] [--max-new-tokens 128] [--gamma 5] [--lookahead 2 3 2] [--threads 1] [--compile]
        [--out benchmarks/decode.json]

On the target's held-out prompts, greedy, batch size 1, one process: for a draft model (a trained
sibling with --draft, else the target's first --draft-layers layers with its final norm and LM
head), prompt lookup and lookahead, it measures tau, the wall-clock speedup over the target's own
decoding (timed on each prompt right before ours), and `hf_time_ratio` = time of `generate(assistant_model=draft)` or
`generate(prompt_lookup_num_tokens=10)` / time of our decoder with the same drafter (> 1: ours is
faster; Hugging Face has no lookahead). Lookahead's window, n-gram size and guesses default to 2 3 2:
on a CPU verification cost grows with the number of tree nodes, and the reference's GPU sizes (7 5 7)
are slower than plain decoding there. Each prompt runs plain decoding, every variant of ours, then
Hugging Face's back to back, so all see the same machine load. Our variants: `ours` (the same drafter
settings as Hugging Face's: gamma / num_assistant_tokens constant, 10 lookup tokens), `adaptive` (the
same drafter with its length chosen per step by decoding/adaptive.py, at most the same gamma), and with
--compile `compiled` (ours with the verify forward under torch.compile, compiled before timing; Hugging
Face's assisted generation has no compiled path). Both sides run greedy, the same max tokens, after a
warm-up, with the same torch thread count; the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import load_prompts
from draftsmith.decoding.adaptive import AdaptiveGamma
from draftsmith.decoding.cost import relative, verify_cost_curve
from draftsmith.decoding.evaluate import render_prompts
from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.decoding.proposers import DraftModel, Lookahead, PromptLookup, truncated_copy
from draftsmith.models.target import REFERENCE_TARGET

REPO = Path(__file__).resolve().parent.parent


def clock(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


@torch.no_grad()
def run(target, prompts, max_new: int, ours: dict, hf_kwargs: dict | None) -> dict:
    """Per prompt, back to back: the target's own decoding, each of ours, Hugging Face's (assisted when hf_kwargs)."""
    stats = {name: DecodeStats() for name in ours}
    secs = {name: 0.0 for name in ["plain", *ours, "hf"]}
    matches = {name: True for name in ours}
    for x in prompts:
        x = x.to(target.device)
        t = clock(target.device)
        plain_generate(target, x, max_new)
        secs["plain"] += clock(target.device) - t
        outs = {}
        for name, decode in ours.items():
            t = clock(target.device)
            outs[name], _ = decode(x, stats[name])
            secs[name] += clock(target.device) - t
        t = clock(target.device)
        ref = target.generate(x, max_new_tokens=max_new, do_sample=False, **(hf_kwargs or {}))
        secs["hf"] += clock(target.device) - t
        for name, out in outs.items():  # greedy: ours must equal the target's own generate token for token
            matches[name] &= torch.equal(out, ref)
    return {"stats": stats, "seconds": secs, "matches": matches}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REFERENCE_TARGET))
    parser.add_argument("--draft", help="a trained draft model directory (default: truncated copy of the target)")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--lookahead", type=int, nargs=3, default=[2, 3, 2], metavar=("W", "N", "G"),
                        help="lookahead window, n-gram size, guesses per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for ours and Hugging Face's alike")
    parser.add_argument("--compile", action="store_true", help="also time ours with the verify forward compiled")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "decode.json"))
    args = parser.parse_args(argv)
    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"--target {args.target}: no model there; build the reference target with train/target.py")

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target).to(args.device).eval()
    prompts = render_prompts(tokenizer, load_prompts(limit=args.num_prompts))
    draft = (AutoModelForCausalLM.from_pretrained(args.draft).to(args.device).eval() if args.draft
             else truncated_copy(target, args.draft_layers))
    draft.generation_config.update(num_assistant_tokens=args.gamma, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)
    V, new = target.config.vocab_size, args.max_new_tokens
    load_start = os.getloadavg()
    curve = verify_cost_curve(target)  # prices adaptive gamma
    rel = relative(curve)
    run(target, prompts[:1], 8, {"plain": lambda x, s: plain_generate(target, x, 8, stats=s)}, None)  # warm-up
    cases = {
        "draft_model": (lambda: DraftModel(draft, V, args.gamma), "gamma", {"assistant_model": draft}),
        "prompt_lookup": (lambda: PromptLookup(10, 2), "num_pred_tokens",
                          {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}),
        "lookahead": (lambda: Lookahead(*args.lookahead), None, None),
    }
    results = {}
    for name, (make, knob, hf_kwargs) in cases.items():
        variants = {"ours": make()}
        if knob:
            variants["adaptive"] = AdaptiveGamma(make(), rel, curve[1], knob=knob)
        if args.compile:
            speculative_generate(target, make(), prompts[0].to(target.device), 16, compile=True)  # compiles
            variants["compiled"] = make()
        ours = {v: (lambda x, s, p=p, c=(v == "compiled"): speculative_generate(target, p, x, new, stats=s, compile=c))
                for v, p in variants.items()}
        r = run(target, prompts, new, ours, hf_kwargs)
        sec = r["seconds"]
        row = {"plain_s": round(sec["plain"], 2), "hf_s": round(sec["hf"], 2) if hf_kwargs else None}
        for v, st in r["stats"].items():
            row[v] = {"tau": round(st.tau, 3),
                      "speedup": round(sec["plain"] / sec[v], 3),  # same prompts, same tokens (greedy)
                      "hf_time_ratio": round(sec["hf"] / sec[v], 3) if hf_kwargs else None,
                      "greedy_matches_target": r["matches"][v],
                      "acceptance_by_position": [round(a, 3) for a in st.acceptance_by_position()],
                      "seconds": round(sec[v], 2), "drafter_s": round(st.drafter_s, 2),
                      "target_s": round(st.target_s, 2), "target_forwards": st.steps, "new_tokens": st.new_tokens}
            if v == "adaptive":
                row[v]["mean_gamma"] = round(sum(variants[v].gammas) / max(1, len(variants[v].gammas)), 2)
            print(f"{name:14s} {v:9s} tau {st.tau:5.2f}  speedup {row[v]['speedup']:5.2f}x  "
                  f"hf_time_ratio {row[v]['hf_time_ratio']}  greedy==target {r['matches'][v]}", flush=True)
        results[name] = row
    out = {"settings": {"command": " ".join(["python scripts/bench_decode.py", *(argv if argv is not None else sys.argv[1:])]),
                        "target": args.target, "draft": args.draft or f"first {args.draft_layers} layers of the target",
                        "num_prompts": len(prompts), "max_new_tokens": new, "gamma": args.gamma, "device": args.device,
                        "lookahead_window_ngram_guesses": args.lookahead, "compile": args.compile,
                        "greedy": True, "batch_size": 1, "torch_threads": torch.get_num_threads(),
                        "verify_cost_relative": {str(k): round(v, 3) for k, v in rel.items()},
                        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg()},
           **results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
