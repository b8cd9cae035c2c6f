"""EAGLE figures: tau and speedup of EAGLE-1 / EAGLE-3 (chain and EAGLE-2 tree) beside Medusa-1, into benchmarks/eagle.json.

    python scripts/bench_eagle.py --eagle1 runs/eagle-tiny-code --eagle3 runs/eagle3-tiny-code \
        --medusa1 runs/medusa1-budget25

Each run's best drafter decodes the same held-out prompts, greedy and at temperature 1 with exact
verification (lossless), as a chain and as trees (EAGLE-2 dynamic trees for EAGLE, by default EAGLE-2's
own top_k 10 / depth 6 / 60 nodes and a CPU-sized 4 / 6 / 24; Medusa's tree measured at its best checkpoint); tau, acceptance by draft position and wall-clock speedup over the
target's own decoding at the same temperature, timed in this process. Beside them, each run's
training record (steps, training seconds with evaluations excluded, tokens/s, trainable parameters)
and the held-out per-step conditional acceptance at its best checkpoint; the offline hidden-state
cache figures from benchmarks/eagle_cache.json are copied in when that file exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftsmith.data.core import best_record, checkpoints, find_drafter
from draftsmith.data.dataset import DataConfig, heldout_rows
from draftsmith.data.reference import PROMPTS_PATH, load_prompts
from draftsmith.decoding.bench import write_figures
from draftsmith.decoding.evaluate import evaluate, render_prompts
from draftsmith.models.medusa import chain_choices
from draftsmith.models.registry import load_proposer
from draftsmith.models.target import load_target

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"greedy": 0.0, "t1": 1.0}


def training_record(run: Path) -> dict:
    """Steps, training time and throughput of a run, and its best checkpoint's evaluation."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = checkpoints(run)[-1]
    state = json.loads((last / "state.json").read_text())
    best = best_record(run)
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return {"steps": state["step"], "train_seconds": round(state["train_seconds"], 1),
            "tokens_per_s": round(sum(speeds) / len(speeds), 1) if speeds else None,
            "best_step": best["step"], "best_tau_during_training": best.get("tau"),
            "heldout_cond_acc": [round(best[k], 4) for k in sorted(b for b in best if b.startswith("heldout_cond_acc"))],
            "expected_tau": best.get("expected_tau"),
            "tau_by_step": [(r["step"], round(r["eval/tau"], 3)) for r in rows if "eval/tau" in r]}


def vocab_coverage(drafter: Path, target) -> float:
    """Share of the target's greedy next tokens on held-out rows that the draft vocabulary contains (EAGLE-3 can
    never draft the others)."""
    from safetensors import safe_open

    with safe_open(str(drafter / "eagle.safetensors"), framework="pt") as f:
        t2d = f.get_tensor("t2d")  # [V] bool
    hits = total = 0
    for row in heldout_rows(DataConfig(max_length=256), target.tokenizer, 64):
        ids = torch.tensor(row["input_ids"])[None]
        with torch.no_grad():
            greedy = target.logits(target.tap(ids).hidden)[0].argmax(-1)  # [s]
        mask = torch.tensor(row["loss_mask"][1:]).bool()  # positions predicting an assistant token
        hits += int(t2d[greedy[:-1][mask]].sum())
        total += int(mask.sum())
    return hits / max(1, total)


def decode(name: str, target, proposer, prompts, args, baselines: dict) -> dict:
    out = {}
    for setting, temperature in SETTINGS.items():
        r = evaluate(target.model, proposer, prompts, args.max_new_tokens, (temperature,), "auto",
                     check_greedy=setting == "greedy", baselines=baselines)
        out[setting] = {"tau": round(r["tau"], 4), "speedup": round(r["speedup"], 3),
                        "acceptance_by_position": [round(a, 4) for a in r["acceptance_by_position"]],
                        "drafter_seconds": round(r["drafter_s"], 2), "target_seconds": round(r["target_s"], 2)}
        if setting == "greedy":
            out[setting]["matches_target_generate"] = r["greedy_matches_target"]
        print(f"{name} {setting}: tau={r['tau']:.3f} speedup={r['speedup']:.2f}x", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eagle1", type=Path)
    parser.add_argument("--eagle3", type=Path)
    parser.add_argument("--medusa1", type=Path, help="Medusa-1 trained on the same data for the same wall time")
    parser.add_argument("--prompts", default=str(PROMPTS_PATH))
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--trees", nargs="+", default=["10,6,60", "4,6,24"],
                        help="EAGLE-2 trees as top_k,depth,total_tokens (default: EAGLE-2's defaults, and a CPU-sized one)")
    parser.add_argument("--cache-figures", type=Path, default=REPO / "benchmarks" / "eagle_cache.json")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "eagle.json")
    args = parser.parse_args(argv)
    runs = {k: v for k, v in (("eagle1", args.eagle1), ("eagle3", args.eagle3), ("medusa1", args.medusa1)) if v}
    if not runs:
        sys.exit("bench_eagle: pass --eagle1, --eagle3 and/or --medusa1 run directories")
    torch.manual_seed(0)
    target = load_target()
    prompts = render_prompts(target.tokenizer, load_prompts(Path(args.prompts), args.num_prompts))
    baselines: dict = {}
    figures: dict = {}
    for name, run in runs.items():
        drafter = find_drafter(run)
        if name == "medusa1":
            modes = {"chain": dict(chain=True), "tree": {}}
        else:
            modes = {"chain": dict(mode="chain", gamma=args.gamma)}
            for spec in args.trees:
                top_k, depth, total = map(int, spec.split(","))
                modes[f"tree{total}"] = dict(mode="tree", top_k=top_k, depth=depth, total_tokens=total)
        figures[name] = {"run": str(run), "training": training_record(run),
                         "drafter_params": sum(t.numel() for t in _weights(drafter).values())}
        if name == "eagle3":
            figures[name]["draft_vocab_coverage_of_target_greedy"] = round(vocab_coverage(drafter, target), 4)
        for mode, kwargs in modes.items():
            proposer = load_proposer(str(drafter), target.model, **kwargs)
            if name == "medusa1" and mode == "tree" and proposer.choices == chain_choices(len(proposer.choices[-1])):
                continue
            figures[name][mode] = decode(f"{name} {mode}", target, proposer, prompts, args, baselines)
    cache = json.loads(args.cache_figures.read_text()) if args.cache_figures.is_file() else None
    figures["offline_cache"] = cache
    return write_figures(args.out, figures, {
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
        "eagle2_trees": {f"tree{t.split(',')[2]}": dict(zip(("top_k", "depth", "total_tokens"), map(int, t.split(",")),
                                                            strict=True)) for t in args.trees},
        "t1": "temperature 1, exact verification (multi-round rejection sampling for trees), lossless"})


def _weights(drafter: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in drafter.glob("*.safetensors") for k, v in load_file(f).items() if v.is_floating_point()}


if __name__ == "__main__":
    main()
