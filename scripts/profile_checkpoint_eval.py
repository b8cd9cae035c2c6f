"""Where an EAGLE run's checkpoint evaluation spends its time: the recipe's own evaluator (train/eagle.py's
`checkpoint_evaluator`, as the loop calls it) run twice on one drafter, the first call and a later one, each split into
the target's held-out forwards, the drafter's held-out pass, decoding (drafting, verification) and the baseline.

    python scripts/profile_checkpoint_eval.py --recipe recipes/eagle3/smollm2-135m.yaml \
        --drafter runs/eagle3-smollm2-long/checkpoint-150/model --out benchmarks/eval_profile_smollm2.json \
        eagle.fc_norm=false

Without --drafter the recipe's drafter is freshly initialised (tau near 1: decoding then costs less than a trained
drafter's). Times are wall seconds of this process (2 torch threads where the cores are shared: compare the shares).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from draftsmith.data.dataset import build_dataset, heldout_rows
from draftsmith.decoding import evaluate as decode_eval
from draftsmith.decoding.lean import LeanForward
from draftsmith.models.eagle import Eagle, draft_vocab, load_eagle
from draftsmith.models.eagle_proposer import EagleProposer
from draftsmith.models.target import load_target
from draftsmith.train import config as C
from draftsmith.train import eagle as entry

SECTIONS = {  # label -> what is timed (inclusive; a label timing two functions adds them)
    "heldout_target": [(entry, "heldout_batches")],  # the target's forwards and whole-vocabulary head, held-out rows
    "heldout": [(entry, "heldout_metrics")],  # the drafter's held-out pass, its teacher's head over the draft rows too
    "heldout_teacher": [(Eagle, "teacher")],  # that head alone (inside heldout)
    "decode": [(decode_eval, "generate_batch")],  # the whole decodes, drafting included (the baseline's too)
    "decode_draft": [(EagleProposer, "propose"), (EagleProposer, "accept")],  # the drafter's part of them
    "decode_forward": [(LeanForward, "ragged")],  # the target's forwards in them (prefills, baseline included)
    "baseline": [(decode_eval, "baseline")],  # plain decoding, timed once for speedup
}


def timed(totals: dict, label: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t
    return wrapper


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--drafter", help="a drafter dir (a checkpoint's model/ or best/); default: a fresh one")
    parser.add_argument("--calls", type=int, default=2, help="evaluations of the same drafter (the first pays once)")
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = C.load(entry.Recipe, args.recipe, args.overrides)
    target = load_target(cfg.target.path, cfg.target.dtype)
    heldout = heldout_rows(cfg.data, target.tokenizer, limit=cfg.eval.heldout_examples, path=cfg.eval.heldout_path)
    if args.drafter:
        method = load_eagle(args.drafter, target)
    else:
        torch.manual_seed(cfg.loop.seed)
        train = build_dataset(cfg.data, target.tokenizer)
        method = Eagle(target, cfg.eagle, draft_vocab(train, target.config.vocab_size, cfg.eagle.draft_vocab_size))
    evaluate = entry.checkpoint_evaluator(cfg, target, heldout)
    totals: dict[str, float] = defaultdict(float)
    for label, where in SECTIONS.items():
        for owner, name in where:
            setattr(owner, name, timed(totals, label, getattr(owner, name)))
    calls = []
    method.eval()
    for i in range(args.calls):
        totals.clear()
        t = time.perf_counter()
        with torch.no_grad():
            metrics = evaluate(method, i)
        total = time.perf_counter() - t
        s = {k: round(totals.get(k, 0.0), 3) for k in SECTIONS}
        s["decode"] = round(s["decode"] - s["baseline"], 3)  # the speculative decodes alone
        s["decode_verify"] = round(s["decode"] - s["decode_draft"], 3)  # target forwards and the loop's own work
        calls.append({"call": i + 1, "seconds": round(total, 3), "sections": s,
                      "share": {k: round(v / total, 3) for k, v in s.items()},
                      "tau": metrics.get("tau"), "expected_tau": metrics["expected_tau"]})
        print(json.dumps(calls[-1]), flush=True)
    result = {"command": "python scripts/profile_checkpoint_eval.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "recipe": args.recipe, "drafter": args.drafter or "fresh", "overrides": args.overrides,
              "eval": C.to_dict(cfg)["eval"], "threads": torch.get_num_threads(),
              "host": f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end", "calls": calls}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
