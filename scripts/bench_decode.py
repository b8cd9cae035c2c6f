"""Benchmark the bundled decoder against plain decoding and Hugging Face's assisted generation.

    python scripts/bench_decode.py [--target models/reference-target] [--draft DIR | --draft-layers 2]
        [--num-prompts 20] [--max-new-tokens 128] [--gamma 5] [--lookahead 2 3 2] [--out benchmarks/decode.json]

On the target's held-out prompts, greedy, batch size 1, one process: for a draft model (a trained
sibling with --draft, else the target's first --draft-layers layers with its final norm and LM
head), prompt lookup and lookahead, it measures tau, the wall-clock speedup over the target's own
decoding (timed on each prompt right before ours), and `hf_time_ratio` = time of `generate(assistant_model=draft)` or
`generate(prompt_lookup_num_tokens=10)` / time of our decoder with the same drafter (> 1: ours is
faster; Hugging Face has no lookahead). Lookahead's window, n-gram size and guesses default to 2 3 2:
on a CPU verification cost grows with the number of tree nodes, and the reference's GPU sizes (7 5 7)
are slower than plain decoding there. Each prompt runs ours then Hugging Face's back to back, so
both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import load_prompts
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
def run(target, prompts, max_new: int, ours, hf_kwargs: dict | None) -> dict:
    """Per prompt, back to back: the target's own decoding, ours, Hugging Face's (assisted when hf_kwargs)."""
    stats, plain_s, ours_s, hf_s, matches = DecodeStats(), 0.0, 0.0, 0.0, True
    for x in prompts:
        x = x.to(target.device)
        t0 = clock(target.device)
        plain_generate(target, x, max_new)
        t1 = clock(target.device)
        out, _ = ours(x, stats)
        t2 = clock(target.device)
        ref = target.generate(x, max_new_tokens=max_new, do_sample=False, **(hf_kwargs or {}))
        t3 = clock(target.device)
        plain_s, ours_s, hf_s = plain_s + t1 - t0, ours_s + t2 - t1, hf_s + t3 - t2
        matches &= torch.equal(out, ref)  # greedy: ours must equal the target's own generate token for token
    return {"stats": stats, "plain_s": plain_s, "ours_s": ours_s, "hf_s": hf_s, "matches": matches}


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
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "decode.json"))
    args = parser.parse_args(argv)
    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"--target {args.target}: no model there; build the reference target with train/target.py")

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target).to(args.device).eval()
    prompts = render_prompts(tokenizer, load_prompts(limit=args.num_prompts))
    draft = (AutoModelForCausalLM.from_pretrained(args.draft).to(args.device).eval() if args.draft
             else truncated_copy(target, args.draft_layers))
    draft.generation_config.update(num_assistant_tokens=args.gamma, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)
    V, new = target.config.vocab_size, args.max_new_tokens
    run(target, prompts[:1], 8, lambda x, s: plain_generate(target, x, 8, stats=s), None)  # warm-up
    cases = {
        "draft_model": (DraftModel(draft, V, args.gamma), {"assistant_model": draft}),
        "prompt_lookup": (PromptLookup(10, 2), {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}),
        "lookahead": (Lookahead(*args.lookahead), None),
    }
    results = {}
    for name, (proposer, hf_kwargs) in cases.items():
        r = run(target, prompts, new, lambda x, s, p=proposer: speculative_generate(target, p, x, new, stats=s),
                hf_kwargs)
        st = r["stats"]
        results[name] = {"tau": round(st.tau, 3),
                         "speedup": round(r["plain_s"] / r["ours_s"], 3),  # same prompts, same tokens (greedy)
                         "hf_time_ratio": round(r["hf_s"] / r["ours_s"], 3) if hf_kwargs else None,
                         "greedy_matches_target": r["matches"],
                         "acceptance_by_position": [round(a, 3) for a in st.acceptance_by_position()],
                         "ours_s": round(r["ours_s"], 2), "hf_s": round(r["hf_s"], 2) if hf_kwargs else None,
                         "plain_s": round(r["plain_s"], 2),
                         "drafter_s": round(st.drafter_s, 2), "target_s": round(st.target_s, 2),
                         "target_forwards": st.steps, "new_tokens": st.new_tokens}
        print(f"{name:14s} tau {st.tau:5.2f}  speedup {results[name]['speedup']:5.2f}x  "
              f"hf_time_ratio {results[name]['hf_time_ratio']}  greedy==target {r['matches']}")
    out = {"settings": {"target": args.target, "draft": args.draft or f"first {args.draft_layers} layers of the target",
                        "num_prompts": len(prompts), "max_new_tokens": new, "gamma": args.gamma, "device": args.device,
                        "lookahead_window_ngram_guesses": args.lookahead,
                        "greedy": True, "batch_size": 1, "torch_threads": torch.get_num_threads()},
           **results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
