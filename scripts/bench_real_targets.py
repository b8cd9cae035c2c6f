"""What a real target costs to decode and verify: provenance, plain decoding speed, the verify-cost curve.

    python scripts/bench_real_targets.py --target smollm2-135m-instruct [--prompts FILE] [--threads 2]
    python scripts/bench_real_targets.py --leaderboard benchmarks/leaderboard_smollm2.json   # per-method rows

For a named target (models/zoo.py) or any HF directory: its conversion provenance; plain greedy decoding
(tokens/s through the bundled decoder, the speedup baseline) on held-out prompts; and the verify-cost
curve (decoding/cost.py: one forward over k = 1, 2, 4, 8, 16, 32 new tokens on a 200-token KV cache,
medians of shuffled rounds), absolute and relative to a 1-token forward. Writes them under
`targets.<name>` of `benchmarks/real_targets.json`, keeping everything else in the file.

With `--leaderboard`, measures nothing: it writes what a leaderboard on a real target (`draftsmith bench
--target NAME`) found per method (train/bench.py `real_target_rows`: budget, steps, tokens seen, tau at T=0 / T=1
per decoding, acceptance by position, greedy equality, measured and predicted speedup) under
`targets.<name>.methods`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import load_prompts
from draftsmith.decoding.cost import relative, verify_cost_curve
from draftsmith.decoding.evaluate import render_prompts
from draftsmith.decoding.generate import plain_generate
from draftsmith.models.zoo import resolve_target
from draftsmith.train.bench import real_target_rows

REPO = Path(__file__).resolve().parent.parent


def shown(path: str) -> str:
    """A path inside the checkout as relative to it (the JSON is committed), any other as given."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="a named real target or an HF directory (measures it)")
    parser.add_argument("--leaderboard", type=Path, help="a leaderboard JSON on a real target (records its rows)")
    parser.add_argument("--prompts", default="", help="default data/real/<name>/heldout_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "real_targets.json"))
    args = parser.parse_args(argv)
    if bool(args.target) == bool(args.leaderboard):
        parser.error("give --target (to measure a target) or --leaderboard (to record its per-method rows)")
    if args.leaderboard:
        board = json.loads(args.leaderboard.read_text())
        rows = {"leaderboard": shown(str(args.leaderboard)), **real_target_rows(board)}
        update(Path(args.out), Path(board["settings"]["target"]).name, lambda row: {**row, "methods": rows})
        return rows
    torch.set_num_threads(args.threads)
    name = Path(args.target).name
    path = Path(resolve_target(args.target))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    args.prompts = args.prompts or str(REPO / "data" / "real" / name / "heldout_prompts.jsonl")
    prompts = render_prompts(tokenizer, load_prompts(Path(args.prompts), args.num_prompts))

    t0 = time.perf_counter()
    new = 0
    for ids in prompts:
        _, stats = plain_generate(model, ids, args.max_new_tokens)
        new += stats.new_tokens
    plain_s = time.perf_counter() - t0
    curve = verify_cost_curve(model, context=args.context)
    row = {
        "provenance": json.loads((path / "provenance.json").read_text()) if (path / "provenance.json").is_file()
        else None,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "plain_greedy": {"tokens": new, "seconds": round(plain_s, 2), "tokens_per_s": round(new / plain_s, 2),
                         "prompts": len(prompts), "prompts_file": shown(args.prompts),
                         "max_new_tokens": args.max_new_tokens},
        "verify_cost": {"context": args.context, "seconds": {str(k): round(s, 5) for k, s in curve.items()},
                        "relative": {str(k): round(v, 3) for k, v in relative(curve).items()}},
        "threads": args.threads, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    update(Path(args.out), name, lambda old: {**row, **({"methods": old["methods"]} if "methods" in old else {})})
    print(json.dumps({k: row[k] for k in ("plain_greedy", "verify_cost")}, indent=1))
    return row


def update(out: Path, name: str, change) -> None:
    """Replace `targets.<name>` of the JSON at `out` by `change(its current value)`, keeping everything else."""
    doc = json.loads(out.read_text()) if out.is_file() else {}
    targets = doc.setdefault("targets", {})
    targets[name] = change(targets.get(name, {}))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
