"""Medusa figures: tau and speedup by real decoding, and the training cost, into benchmarks/medusa.json.

    python scripts/bench_medusa.py --medusa1 runs/medusa1-tiny-code --medusa2 runs/medusa2-tiny-code

For each trained drafter (a run dir, its best/ or a drafter dir): decode held-out prompts with the
chain (top-1 of every head) and with the greedy tree (built from per-head rank accuracy measured on
held-out rows), greedy and temperature 1 with exact verification (lossless), and temperature 1 with
typical acceptance (lossy, labelled so); tau, per-head acceptance and wall-clock speedup over the
target's own decoding at the same temperature. Medusa-2 decodes with its merged backbone. Then the
training cost: one optimizer step of the method on a training batch over the frozen target's
forward-only time on the same batch (median of repeats), and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from draftsmith.data.core import collate, find_drafter, read_drafter_meta
from draftsmith.data.dataset import DataConfig, build_dataset, heldout_rows
from draftsmith.data.reference import PROMPTS_PATH, load_prompts
from draftsmith.decoding.bench import write_figures
from draftsmith.decoding.evaluate import evaluate, render_prompts
from draftsmith.models.medusa import (
    Medusa,
    MedusaConfig,
    MedusaProposer,
    chain_choices,
    greedy_tree,
    heldout_accuracy,
    load_medusa,
    target_passes,
)
from draftsmith.models.target import Target, load_target

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"greedy": (0.0, "auto"), "t1": (1.0, "exact"), "typical": (1.0, "typical")}


def decode_figures(name: str, run: Path, args) -> dict:
    """tau / acceptance / speedup of one drafter for chain and tree, at every setting."""
    drafter = load_medusa(find_drafter(run))
    target, heads = drafter.target, drafter.heads
    passes = target_passes(target, heldout_rows(DataConfig(max_length=256), target.tokenizer, args.heldout))
    _, acc = heldout_accuracy(heads, passes, ranks=args.tree_ranks)  # [K, R]
    tree, expected = greedy_tree(acc, args.tree_budget)
    prompts = render_prompts(target.tokenizer, load_prompts(Path(args.prompts), args.num_prompts))
    out = {f"{name}.tree.nodes": len(tree), f"{name}.tree.expected_tau": expected,
           f"{name}.rank_accuracy": [[round(a, 4) for a in row] for row in acc.tolist()]}
    baselines: dict = {}
    for mode, choices in (("chain", chain_choices(heads.num_heads)), ("tree", tree)):
        for setting, (temperature, rule) in SETTINGS.items():
            r = evaluate(target.model, MedusaProposer(heads, choices), prompts, args.max_new_tokens, (temperature,),
                         rule, check_greedy=setting == "greedy", baselines=baselines)
            key = f"{name}.{mode}.{setting}"
            out.update({f"{key}.tau": r["tau"], f"{key}.speedup": r["speedup"],
                        f"{key}.acceptance_by_head": [round(a, 4) for a in r["acceptance_by_position"]],
                        f"{key}.lossy": rule == "typical"})
            if setting == "greedy":
                out[f"{key}.matches_target_generate"] = r["greedy_matches_target"]
            print(f"{key}: tau={r['tau']:.3f} speedup={r['speedup']:.2f}x"
                  f"{' (typical acceptance: LOSSY)' if rule == 'typical' else ''}", flush=True)
    return out


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def train_cost(name: str, run: Path, args) -> dict:
    """Step time of the method (forward, backward, AdamW) over the frozen target's forward-only time."""
    meta = read_drafter_meta(find_drafter(run))
    target = load_target(meta["target"])
    cfg = MedusaConfig(**meta["medusa"])
    rows = build_dataset(DataConfig(max_length=args.seq_len, overlong="drop", on_no_assistant="drop", pack=True,
                                    limit=400), target.tokenizer)
    batch = collate([rows[i] for i in range(args.batch_size)])
    frozen = Target(load_target(meta["target"]).model, None, meta["target"])

    def forward_only():
        with torch.no_grad():
            frozen.tap(batch["input_ids"], None, batch.get("position_ids"))
    method = Medusa(target, cfg).train()
    optimizer = torch.optim.AdamW(method.param_groups(1e-3))

    def step():
        loss, _ = method(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    t_fwd, t_step = _median_time(forward_only, args.repeats), _median_time(step, args.repeats)
    print(f"{name}: step {t_step * 1e3:.0f} ms / frozen forward {t_fwd * 1e3:.0f} ms = {t_step / t_fwd:.2f}",
          flush=True)
    return {f"{name}.train_step_ms": t_step * 1e3, f"{name}.target_forward_ms": t_fwd * 1e3,
            f"{name}.train_cost_ratio": t_step / t_fwd,
            f"{name}.trainable_params": sum(p.numel() for p in method.parameters() if p.requires_grad)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--medusa1", type=Path)
    parser.add_argument("--medusa2", type=Path)
    parser.add_argument("--prompts", default=str(PROMPTS_PATH))
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--heldout", type=int, default=64, help="held-out examples for the rank accuracy")
    parser.add_argument("--tree-budget", type=int, default=31)
    parser.add_argument("--tree-ranks", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "medusa.json")
    args = parser.parse_args(argv)
    runs = {name: run for name, run in (("medusa1", args.medusa1), ("medusa2", args.medusa2)) if run}
    if not runs:
        sys.exit("bench_medusa: pass --medusa1 RUN and/or --medusa2 RUN")
    torch.manual_seed(0)
    figures: dict = {}
    for name, run in runs.items():
        figures.update(decode_figures(name, run, args))
        figures.update(train_cost(name, run, args))
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return write_figures(args.out, figures, {
        "runs": {k: str(v) for k, v in runs.items()}, "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens, "tree_budget": args.tree_budget, "batch": [args.batch_size, args.seq_len],
        "typical": "lossy (epsilon 0.09, delta 0.3)", "exact": "multi-round rejection sampling, lossless"})


if __name__ == "__main__":
    main()
