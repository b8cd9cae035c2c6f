"""Where an EAGLE drafter's acceptance at temperature 1 goes: the held-out acceptance of one drafter on answers its
target samples at several temperatures.

    python scripts/bench_context_temperature.py --drafter RUN/best [--prompts FILE] [--num-prompts 48]
        [--max-new-tokens 96] [--temperatures 0 0.7 1] [--out benchmarks/context_temperature_smollm2.json]

Decoding at T=1 differs from greedy decoding in two ways at once: the text the drafter continues is sampled at T=1
(the context), and a draft token is kept with probability sum_v min(p_v, q_v) instead of when it is the target's
argmax (the rule). For each temperature the target answers the same held-out prompts (kinds in turn, seeded) and the
drafter's checkpoint evaluation runs on those answers (train/eagle.py `heldout_metrics`, 5 unrolled steps):
`expected_tau` predicts the greedy chain's tau from the greedy acceptance along the answer, `expected_tau_t1` the
T=1 chain's from the T=1 acceptance. Greedy decoding's tau is read on the T=0 answers, T=1 decoding's on the T=1
answers: the difference between the T=1 answers' two columns is the rule's share of the gap, the difference between
the rows in one column the context's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from draftsmith.data.prompts import kinds_in_turn
from draftsmith.data.reference import load_prompts
from draftsmith.decoding.evaluate import render_prompts
from draftsmith.models.eagle import load_eagle
from draftsmith.train.eagle import heldout_batches, heldout_metrics

REPO = Path(__file__).resolve().parent.parent
KEYS = ("expected_tau", "expected_tau_t1", "heldout_acc_0", "heldout_accept_0", "heldout_cond_acc_1",
        "heldout_accept_1")


@torch.no_grad()
def answers(model, prompts: list[list[int]], eos: int, temperature: float, max_new: int, batch: int = 16
            ) -> list[list[int]]:
    """The target's answer ids to each prompt (sampled at `temperature`, greedy at 0), cut after its first EOS."""
    torch.manual_seed(0)
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        n = max(map(len, chunk))
        ids = torch.tensor([[eos] * (n - len(p)) + p for p in chunk])  # [b, n] padded on the left
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in chunk])
        sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0} if temperature > 0 \
            else {"do_sample": False}
        y = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=eos,
                           **sampling)[:, n:]  # [b, new]
        out += [a[:a.index(eos) + 1] if eos in a else a for a in y.tolist()]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="an EAGLE drafter directory (a run's best/)")
    parser.add_argument("--prompts", type=Path, default=REPO / "data/real/smollm2-135m-instruct/heldout_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/context_temperature_smollm2.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    method = load_eagle(args.drafter).eval()
    target = method.target
    rows = kinds_in_turn(load_prompts(args.prompts))[:args.num_prompts]
    prompts = [x[0].tolist() for x in render_prompts(target.tokenizer, rows)]
    result = {"command": shlex.join(["python", "scripts/bench_context_temperature.py", *sys.argv[1:]]),
              "drafter": args.drafter, "target": target.path, "prompts": str(args.prompts), "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "by_temperature": {}}
    for t in args.temperatures:
        ys = answers(target.model, prompts, target.tokenizer.eos_token_id, t, args.max_new_tokens)
        data = [{"input_ids": p + y, "loss_mask": [0] * len(p) + [1] * len(y)} for p, y in zip(prompts, ys, strict=True)]
        with torch.no_grad():
            m = heldout_metrics(method, heldout_batches(method, data), 5)
        result["by_temperature"][f"{t:g}"] = {**{k: m[k] for k in KEYS}, "answer_tokens": sum(map(len, ys))}
        print(f"answers at T={t:g}: " + ", ".join(f"{k} {m[k]:.3f}" for k in KEYS), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
