"""Draft-model distillation benchmark: each loss and each data mode at the same draft size and budget.

    python scripts/bench_distill.py [--steps 30] [--batch-size 4] [--examples 256] [--prompts 8]
        [--max-new-tokens 64] [--gamma 4] [--gammas 1 2 3 4 6] [--out benchmarks/distill.json]

On the reference target, every variant starts from the same draft (the target's first --layers
layers, embeddings, final norm and LM head, copied) and trains for the same number of steps on
the same first --examples training prompts (recipes/distill/tiny-code.yaml otherwise; --max-minutes
caps each variant's training time, and the steps each reached are reported):
  losses on the fixed data: ce, fkl, rkl, jsd (beta 0.5), tvd;
  data modes with forward KL: fixed, regenerated (the target's greedy answers to the same prompts,
  written by `draftsmith regenerate`; its cost is reported), on-policy (GKD, lambda 0.5: every other
  step trains on the draft's own samples for the batch's prompts, scored by the target).
Each draft (and the untrained copy) is measured on held-out prompts by real speculative decoding,
gamma tokens per step: tau and speedup over the target's own decoding (timed right before, per
variant), greedy (checked token by token against the target's generate) and at temperature 1
(exact). For the best variant: the cost ratio c = draft forward / target forward (one cached token
each), alpha from its tau (tau = (1 - alpha^(gamma+1)) / (1 - alpha)), the gamma that maximises the
predicted speedup (1 - alpha^(gamma+1)) / ((1 - alpha)(1 + gamma c)), and the measured best over a
gamma sweep (each prompt decoded plainly and at every gamma back to back). The JSON is rewritten
after every variant, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftsmith.data.reference import load_prompts
from draftsmith.decoding import cache as kv
from draftsmith.decoding.bench import measure
from draftsmith.decoding.cost import alpha_from_tau, predicted_speedup
from draftsmith.decoding.evaluate import baseline, evaluate, render_prompts
from draftsmith.decoding.proposers import DraftModel
from draftsmith.models.distill import DistillConfig, build_draft
from draftsmith.models.target import REFERENCE_TARGET, load_target
from draftsmith.train import distill as recipe

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {  # name: overrides of the distill section
    "ce": ["distill.loss=ce"],
    "fkl": ["distill.loss=fkl"],
    "rkl": ["distill.loss=rkl"],
    "jsd": ["distill.loss=jsd", "distill.beta=0.5"],
    "tvd": ["distill.loss=tvd"],
    "fkl_regenerated": ["distill.loss=fkl", "distill.sequences=regenerated"],
    "fkl_on_policy": ["distill.loss=fkl", "distill.lmbda=0.5"],
}


def regenerate(out: Path, examples: int, max_new_tokens: int) -> dict:
    """The target's greedy answers to the first `examples` training prompts (skipped when already written)."""
    done = out.is_file() and sum(1 for _ in out.open()) >= examples
    start = time.perf_counter()
    if not done:
        subprocess.run([sys.executable, "-m", "draftsmith.train.cli", "regenerate", "--target", str(REFERENCE_TARGET),
                        "--data", "", "--split", "train", "--limit", str(examples), "--out", str(out),
                        "--max-new-tokens", str(max_new_tokens), "--batch-size", "32"], check=True)
    return {"examples": examples, "max_new_tokens": max_new_tokens, "file": str(out),
            "seconds": None if done else round(time.perf_counter() - start, 1),
            "note": "reused an existing file" if done else "greedy, batch 32, this process's CPU threads"}


def decode(target, draft, prompts, max_new: int, gamma: int) -> dict:
    """tau and speedup, greedy (checked against the target's generate) and at temperature 1 (exact).

    The target's own decoding is timed right before (greedy; its cost per token does not depend on the
    temperature), so both sides of each speedup see the same machine load.
    """
    plain = baseline(target, prompts, max_new)
    r = evaluate(target, DraftModel(draft, target.config.vocab_size, gamma), prompts, max_new,
                 temperatures=(0.0, 1.0), baselines={0.0: plain, 1.0: plain})
    g, s = r["by_temperature"]["0"], r["by_temperature"]["1"]
    return {"tau_greedy": round(g["tau"], 3), "tau_t1": round(s["tau"], 3),
            "speedup_greedy": round(g["speedup"], 3), "speedup_t1": round(s["speedup"], 3),
            "acceptance_by_position_greedy": [round(a, 3) for a in g["acceptance_by_position"]],
            "greedy_matches_target": g["greedy_matches_target"]}


def gamma_sweep(target, draft, prompts, max_new: int, gammas: list[int]) -> dict:
    """Greedy tau and speedup at every gamma, each timed back to back with plain decoding (decoding/bench.py)."""
    out = {}
    for g in gammas:
        r, _ = measure(target, functools.partial(DraftModel, draft, target.config.vocab_size, g), prompts, max_new)
        out[g] = {"tau": round(r["tau"], 3), "speedup": round(r["speedup"], 3)}
    return out


@torch.no_grad()
def seconds_per_token(model, x: torch.Tensor, n: int) -> float:
    """Median time of one cached single-token forward after a prefill of x [1, L]."""
    cache = kv.new_cache()
    tok = model(input_ids=x, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)  # [1, 1]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cost_ratio(target, draft, prompts, n: int = 32, rounds: int = 3) -> dict:
    """c = draft forward / target forward, alternating the two models so both see the same load."""
    t_draft, t_target = [], []
    for _ in range(rounds):
        for x in prompts[:2]:
            t_target.append(seconds_per_token(target, x, n))
            t_draft.append(seconds_per_token(draft, x, n))
    d, t = statistics.median(t_draft), statistics.median(t_target)
    return {"c": round(d / t, 3), "draft_ms": round(1e3 * d, 3), "target_ms": round(1e3 * t, 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per variant (the training budget)")
    parser.add_argument("--max-minutes", type=float, default=4.0, help="cap on each variant's training time")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--examples", type=int, default=256, help="training prompts (fixed and regenerated)")
    parser.add_argument("--regen-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    parser.add_argument("--runs", default=str(REPO / "runs/bench-distill"))
    parser.add_argument("--out", default=str(REPO / "benchmarks/distill.json"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    runs, out_path = Path(args.runs), Path(args.out)
    runs.mkdir(parents=True, exist_ok=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out = {"settings": {
        "target": "models/reference-target", "draft": f"first {args.layers} target layers + embeddings, final norm, "
        "LM head (copied, then trained)", "steps": args.steps, "max_minutes_per_variant": args.max_minutes,
        "batch_size": args.batch_size, "data": f"first {args.examples} reference training chat examples, packed to 256",
        "recipe": "recipes/distill/tiny-code.yaml (lr 5e-4 cosine, temperature 1)",
        "budget": "the same optimizer steps for every variant (a small CPU budget, far from convergence); "
                  "train_seconds differ: CE needs no target forward, on-policy steps sample first",
        "held_out_prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
        "temperature_1": "exact speculative sampling, seeded", "on_policy": f"lambda 0.5, {args.batch_size} prompts "
        f"per on-policy step, up to {args.max_new_tokens} sampled tokens each", "jsd_beta": 0.5,
        "device": "cpu", "torch_threads": torch.get_num_threads(),
        "note": "2 CPU cores shared with other engineers' jobs: tau is exact, wall-clock figures are noisy"}}

    def write() -> None:
        out["wall_seconds"] = round(time.perf_counter() - start, 1)
        out_path.write_text(json.dumps(out, indent=2) + "\n")

    out["regeneration"] = regenerate(runs / "regenerated.jsonl", args.examples, args.regen_tokens)
    print(f"regenerated: {out['regeneration']}", flush=True)
    target = load_target()
    prompts = render_prompts(target.tokenizer, load_prompts(limit=args.prompts))
    untrained = build_draft(target, DistillConfig(layers=args.layers)).eval()
    results = out["variants"] = {"untrained": {**decode(target.model, untrained, prompts, args.max_new_tokens,
                                                        args.gamma), "train_seconds": 0.0, "steps": 0}}
    print(f"untrained: {results['untrained']}", flush=True)
    write()
    drafts = {}
    for name, overrides in VARIANTS.items():
        loop = recipe.main(["--config", str(REPO / "recipes/distill/tiny-code.yaml"),
                            f"loop.output_dir={runs / name}", "loop.resume=never", f"loop.max_steps={args.steps}",
                            f"loop.max_minutes={args.max_minutes}", f"loop.save_every={args.steps}",
                            f"loop.batch_size={args.batch_size}", "loop.log_every=5", "loop.best_metric=",
                            "eval.num_prompts=0", f"data.limit={args.examples}", f"distill.layers={args.layers}",
                            f"distill.gamma={args.gamma}", f"distill.regenerated={out['regeneration']['file']}",
                            f"distill.on_policy_prompts={args.batch_size}",
                            f"distill.on_policy_tokens={args.max_new_tokens}", *overrides])
        draft = drafts[name] = loop.unwrapped.draft.eval()
        rows = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in rows if "loss" in r][-1]
        results[name] = {**decode(target.model, draft, prompts, args.max_new_tokens, args.gamma),
                         "train_seconds": round(loop.state.train_seconds, 1), "steps": loop.state.step,
                         "train_rows": len(loop.dataset), "overrides": overrides,
                         "last_logged_train": {k: last[k] for k in ("loss", "alpha_t0", "alpha_t1") if k in last}}
        print(f"{name}: {results[name]}", flush=True)
        write()

    ranked = sorted(VARIANTS, key=lambda n: -results[n]["tau_greedy"])
    best = ranked[0]
    out["winner"] = {
        "greedy": best, "t1": max(VARIANTS, key=lambda n: results[n]["tau_t1"]),
        "ranking_greedy": {n: results[n]["tau_greedy"] for n in ranked},
        "greedy_margin_over_runner_up": round(results[best]["tau_greedy"] - results[ranked[1]]["tau_greedy"], 3),
        "greedy_gain_over_untrained": round(results[best]["tau_greedy"] - results["untrained"]["tau_greedy"], 3)}
    cost = cost_ratio(target.model, drafts[best], prompts)
    sweep = gamma_sweep(target.model, drafts[best], prompts, args.max_new_tokens, args.gammas)
    alpha = alpha_from_tau(results[best]["tau_greedy"], args.gamma)
    predicted = {g: round(predicted_speedup(alpha, cost["c"], g), 3) for g in range(1, max(args.gammas) + 1)}
    out["gamma"] = {"draft": best, "cost_ratio": cost, "alpha": round(alpha, 4),
                    "alpha_from": f"tau greedy at gamma {args.gamma}, assuming i.i.d. acceptance",
                    "predicted_speedup": predicted, "predicted_best_gamma": max(predicted, key=predicted.get),
                    "measured": sweep, "measured_best_gamma": max(sweep, key=lambda g: sweep[g]["speedup"])}
    write()
    print(json.dumps({k: out[k] for k in ("winner", "gamma")}, indent=2))
    return out


if __name__ == "__main__":
    main()
