"""LayerSkip benchmark: self-speculation against the exit layer, before and after LayerSkip training.

    python scripts/bench_layerskip.py [--run runs/layerskip-tiny-code] [--prompts 10] [--max-new-tokens 128]

Trains the default LayerSkip recipe on the reference target unless `--run` already holds a
finished run, then for the target before and after training: held-out loss over every held-out
row, and tau / wall-clock speedup of greedy self-speculative decoding for every exit layer E
(plus temperature 1, exact, at the best E), and a check against transformers' own
`generate(assistant_early_exit=E)`: same greedy tokens, and its time over ours. Writes
`benchmarks/layerskip.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import load_prompts
from draftsmith.decoding import speculative_generate
from draftsmith.decoding.evaluate import evaluate, render_prompts
from draftsmith.models.layerskip import EarlyExit
from draftsmith.models.target import REFERENCE_TARGET
from draftsmith.train import layerskip as recipe
from draftsmith.train.target import measure

REPO = Path(__file__).resolve().parent.parent


def hf_early_exit_time(model, prompts, max_new_tokens: int, exit_layer: int, ours: list[torch.Tensor]):
    """transformers' own self-speculation: (seconds, whether its greedy tokens equal ours)."""
    same, start = True, time.perf_counter()
    for x, mine in zip(prompts, ours, strict=True):
        out = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, assistant_early_exit=exit_layer,
                             num_assistant_tokens=4, num_assistant_tokens_schedule="constant")
        same &= torch.equal(out, mine)
    return time.perf_counter() - start, same


def sweep(model_dir: Path, prompts_rows: list[dict], max_new_tokens: int, gamma: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = render_prompts(tokenizer, prompts_rows)
    L = model.config.num_hidden_layers
    baselines: dict = {}
    by_exit = {}
    for E in range(1, L):
        r = evaluate(model, EarlyExit(model, E, gamma), prompts, max_new_tokens, baselines=baselines)
        by_exit[E] = {"tau": round(r["tau"], 3), "speedup": round(r["speedup"], 3),
                      "acceptance_by_position": [round(a, 3) for a in r["acceptance_by_position"]],
                      "greedy_matches_target": r["greedy_matches_target"]}
        print(f"{model_dir.name}: E={E} tau={r['tau']:.3f} speedup={r['speedup']:.2f}", flush=True)
    best = max(by_exit, key=lambda E: by_exit[E]["speedup"])
    sampled = evaluate(model, EarlyExit(model, best, gamma), prompts, max_new_tokens, temperatures=(1.0,),
                       baselines=baselines)
    ours, start = [], time.perf_counter()
    for x in prompts:
        ours.append(speculative_generate(model, EarlyExit(model, best, gamma), x, max_new_tokens)[0])
    our_s = time.perf_counter() - start
    hf_s, hf_same = hf_early_exit_time(model, prompts, max_new_tokens, best, ours)
    return {"heldout": measure(model_dir), "by_exit": by_exit, "best_exit": best,
            "best_exit_t1": {"tau": round(sampled["tau"], 3), "speedup": round(sampled["speedup"], 3)},
            "hf_assistant_early_exit": {"hf_time_ratio": round(hf_s / our_s, 3), "same_greedy_tokens": hf_same}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=str(REPO / "runs/layerskip-tiny-code"))
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "benchmarks/layerskip.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    run = Path(args.run)
    train_s = None
    if not (run / "best" / "drafter.json").is_file():
        start = time.perf_counter()
        with torch.enable_grad():
            recipe.main(["--config", str(REPO / "recipes/layerskip/tiny-code.yaml"), f"loop.output_dir={run}"])
        train_s = round(time.perf_counter() - start, 1)
    rows = load_prompts(limit=args.prompts)
    before = sweep(REFERENCE_TARGET, rows, args.max_new_tokens, args.gamma)
    after = sweep(run / "best", rows, args.max_new_tokens, args.gamma)
    result = {"before": before, "after": after, "train_seconds": train_s,
              "heldout_loss_change": round(after["heldout"]["heldout_loss"] - before["heldout"]["heldout_loss"], 4),
              "settings": {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
                           "run": str(run), "recipe": "recipes/layerskip/tiny-code.yaml"}}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {"best_exit": v["best_exit"], **v["by_exit"][v["best_exit"]],
                          "heldout_loss": v["heldout"]["heldout_loss"]} for k, v in
                      (("before", before), ("after", after))}, indent=2))


if __name__ == "__main__":
    main()
