"""Measure a drafter by real speculative decoding with its target.

    python scripts/evaluate.py --target DIR --drafter SPEC [--prompts FILE] [--num-prompts 20]
        [--max-new-tokens 128] [--temperatures 0 1] [--rule auto|greedy|exact|typical] [--plot acc.png]
        --out results.json

SPEC: a drafter checkpoint directory, `ngram` (prompt lookup), `suffix` (suffix decoding), `lookahead`, or
`draft:DIR` (a draft model with the target's tokenizer). Prompts come from the reference target's held-out set unless
`--prompts FILE` (JSONL; each line `{"messages": [...]}` rendered with the target's chat template, or
`{"prompt": "raw text"}`) is given. Prints a table and writes tau, acceptance by position, the
accepted-length histogram, speedup over the target's own decoding, and greedy equality checked
token by token against `target.generate(do_sample=False)`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import PROMPTS_PATH, load_prompts
from draftsmith.decoding.evaluate import evaluate, render_prompts
from draftsmith.decoding.proposers import load_proposer
from draftsmith.models.target import REFERENCE_TARGET


def table(results: dict) -> str:
    lines = [f"{'T':>5} {'tau':>6} {'speedup':>8} {'greedy==target':>15}  acceptance by position"]
    for t, r in results["by_temperature"].items():
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        lines.append(f"{t:>5} {r['tau']:6.3f} {r['speedup']:8.2f}x {str(r['greedy_matches_target']):>15}  {acc}")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for t, r in results["by_temperature"].items():
        acc = r["acceptance_by_position"]
        a.plot(range(1, len(acc) + 1), acc, marker="o", label=f"T={t} (tau {r['tau']:.2f})")
        hist = r["accept_length_histogram"]
        b.bar([int(k) for k in hist], list(hist.values()), alpha=0.5, label=f"T={t}")
    a.set(xlabel="draft position", ylabel="conditional acceptance", ylim=(0, 1.05), title="acceptance by position")
    b.set(xlabel="tokens committed per target forward", ylabel="steps", title="accepted length (tau) histogram")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REFERENCE_TARGET), help="Hugging Face causal LM directory")
    parser.add_argument("--drafter", required=True, help="checkpoint dir, ngram, suffix, lookahead or draft:DIR")
    parser.add_argument("--prompts", default=str(PROMPTS_PATH), help="JSONL of messages or prompt rows")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--rule", default="auto", choices=["auto", "greedy", "exact", "typical"])
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--gamma", type=int, default=5, help="draft tokens per step of a draft model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write a PNG of acceptance by position and the tau histogram")
    parser.add_argument("--out", required=True, help="results JSON")
    args = parser.parse_args(argv)
    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"--target {args.target}: no config.json there; pass a Hugging Face model directory")

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).to(args.device)
    extra = {"gamma": args.gamma} if args.drafter.startswith("draft:") else {}
    proposer = load_proposer(args.drafter, target, tokenizer, **extra)
    prompts = render_prompts(tokenizer, load_prompts(Path(args.prompts), limit=args.num_prompts))
    results = evaluate(target, proposer, prompts, args.max_new_tokens, tuple(args.temperatures), args.rule,
                       seed=args.seed, top_k=args.top_k, top_p=args.top_p)
    results["settings"].update(target=args.target, drafter=args.drafter, prompts=args.prompts, dtype=args.dtype,
                               device=args.device, **extra)
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
