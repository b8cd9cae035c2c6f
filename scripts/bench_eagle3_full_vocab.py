"""How much of EAGLE-3's T=1 gap is its draft vocabulary (issue #15): one drafter decoded twice.

    python scripts/bench_eagle3_full_vocab.py runs/e3_vs_e1/eagle3/best [--num-prompts 20] [--max-new-tokens 128]

An EAGLE-3 drafter with a frozen head (`eagle.head_init=frozen`: the target's LM-head rows of its draft
vocabulary) is decoded as trained, over its draft vocabulary, and with the target's whole head in place of
those rows (draft vocabulary = the target's, the same logits on the draft tokens), on the leaderboard's
held-out prompts at T=0 and T=1, chain (gamma 5) and tree (top 8, 5 rounds, 24 nodes).
Exact sampling accepts at most the target's mass on the draft tokens per position; the full head lifts that cap.
Writes benchmarks/eagle3_full_vocab.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from draftsmith.data.reference import PROMPTS_PATH, load_prompts
from draftsmith.decoding.evaluate import evaluate, render_prompts
from draftsmith.models.eagle_drafter import EagleDrafter
from draftsmith.models.eagle_proposer import EagleProposer, load_proposer
from draftsmith.models.target import load_target

REPO = Path(__file__).resolve().parent.parent
MODES = {"chain": dict(mode="chain", gamma=5), "tree": dict(mode="tree", top_k=8, depth=5, total_tokens=24)}


def with_full_head(drafter: EagleDrafter, head: torch.Tensor) -> EagleDrafter:
    """The same drafter over the target's whole vocabulary: its head rows replaced by the target's head [V, H]."""
    if not torch.equal(drafter.lm_head.weight, head[drafter.draft_ids]):
        raise SystemExit("the drafter's head is not the target's rows (train it with eagle.head_init=frozen)")
    full = EagleDrafter(drafter.config, drafter.version, torch.arange(head.shape[0]), drafter.fc.in_features
                        // drafter.config.hidden_size)
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}
    state["lm_head.weight"] = head
    missing = full.load_state_dict(state, strict=False).missing_keys
    assert sorted(missing) == ["d2t", "t2d"], missing  # the full vocabulary's, from the constructor
    return full.to(head).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", help="an EAGLE-3 run's best/ (frozen target head)")
    parser.add_argument("--target", default=str(REPO / "models/reference-target"))
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/eagle3_full_vocab.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_target(args.target)
    prompts = render_prompts(target.tokenizer, load_prompts(PROMPTS_PATH, limit=args.num_prompts))
    base = load_proposer(args.drafter, target)
    drafters = {"draft_vocabulary": base.drafter, "full_vocabulary": with_full_head(base.drafter, target.lm_head.weight)}
    out = {"settings": {"command": "python scripts/bench_eagle3_full_vocab.py " + args.drafter, "target": args.target,
                        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "torch_threads": 1,
                        "draft_vocab_size": base.drafter.d2t.numel()}, "results": {}}
    baselines: dict = {}
    for name, drafter in drafters.items():
        for mode, kwargs in MODES.items():
            proposer = EagleProposer(drafter, base.embed, base.head, base.hidden_layers, **kwargs)
            r = evaluate(target.model, proposer, prompts, args.max_new_tokens, temperatures=(0.0, 1.0),
                         baselines=baselines)
            row = {f"T={t}": {"tau": v["tau"], "speedup": v["speedup"], "acceptance_by_position":
                              v["acceptance_by_position"]} for t, v in r["by_temperature"].items()}
            row["greedy_matches_target"] = r["greedy_matches_target"]
            out["results"][f"{name}/{mode}"] = row
            print(name, mode, {t: (round(v["tau"], 2), round(v["speedup"], 2)) for t, v in row.items()
                               if t.startswith("T=")}, flush=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
