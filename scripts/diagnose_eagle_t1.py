"""Where a trained EAGLE drafter loses acceptance at temperature 1: per-step held-out acceptance with the draft logits
divided by t (is q calibrated?), and for EAGLE-3 how well its fused input predicts the target's final feature f
(R^2 of norm(fc(g)) against least squares on the same input and on the last fused layer alone).

    python scripts/diagnose_eagle_t1.py --runs runs/lb47_5s0/eagle1 runs/lb47_5s0/eagle3 \
        --out benchmarks/eagle3_stop47_diagnosis.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftsmith.data.core import collate, find_drafter
from draftsmith.data.dataset import DataConfig, heldout_rows
from draftsmith.models.eagle import Eagle, load_eagle
from draftsmith.models.target import REFERENCE_TARGET, load_target
from draftsmith.train.eagle import heldout_batches, heldout_metrics

HELDOUT = "data/regenerated/reference-target/heldout_t1.jsonl.gz"
TEMPERATURES = (0.7, 0.8, 0.9, 1.0, 1.1, 1.25)
STEPS = 5


def calibration(m: Eagle, rows: list[dict]) -> dict:
    """Expected tau at T=1 and accept_k with the draft logits divided by t."""
    logits = m.drafter.logits
    out, batches = {}, heldout_batches(m, rows)
    try:
        for t in TEMPERATURES:
            m.drafter.logits = lambda o, head, t=t: logits(o, head) / t
            r = heldout_metrics(m, batches, STEPS)
            out[str(t)] = {"expected_tau_t1": round(r["expected_tau_t1"], 4),
                           "accept": [round(r[f"heldout_accept_{k}"], 4) for k in range(STEPS)]}
            print(f"  t={t}: expected tau T=1 {r['expected_tau_t1']:.3f}", flush=True)
    finally:
        m.drafter.logits = logits
    return out


def input_fit(m: Eagle, rows: list[dict]) -> dict:
    """R^2 on the second half of the held-out positions of f from EAGLE-3's fused input: the trained norm(fc(g)),
    least squares fitted on the first half over fc_norm(g) (with an intercept), and over the last fused layer alone."""
    d, fs, xs = m.drafter, [], []
    for i in range(0, len(rows), 8):
        batch = collate(rows[i: i + 8])
        f, g = m.features(batch)  # [b, s, H], [b, s, n*H]
        real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones(f.shape[:2], dtype=torch.bool)
        fs.append(f[real])
        xs.append(d.fc_input(g[real]))  # [N, n*H]
    f, x = torch.cat(fs), torch.cat(xs)  # [N, H], [N, n*H]
    half, H = len(f) // 2, f.shape[1]

    def r2(pred: torch.Tensor) -> float:
        y = f[half:]
        return round(float(1 - (pred - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum()), 4)

    def least_squares(a: torch.Tensor) -> float:
        a = torch.cat([a, torch.ones(len(a), 1)], 1).double()
        w = torch.linalg.lstsq(a[:half], f[:half].double()).solution
        return r2((a[half:] @ w).float())
    return {"positions": len(f), "trained": r2(d.norm(d.fc(x))[half:]), "least_squares": least_squares(x),
            "least_squares_last_layer": least_squares(x[:, -H:])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", type=Path, required=True, help="EAGLE-1 / EAGLE-3 run directories")
    parser.add_argument("--heldout-data", default=HELDOUT)
    parser.add_argument("--heldout-rows", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    target = load_target(REFERENCE_TARGET)
    rows = heldout_rows(DataConfig(max_length=256), target.tokenizer, args.heldout_rows, args.heldout_data)
    report = {"command": " ".join(["python scripts/diagnose_eagle_t1.py", *(argv if argv is not None else sys.argv[1:])]),
              "heldout_data": args.heldout_data, "heldout_rows": len(rows), "runs": {}}
    with torch.no_grad():
        for run in args.runs:
            print(f"[{run}]", flush=True)
            m = load_eagle(find_drafter(run), target).eval()
            entry = {"version": m.cfg.version, "calibration": calibration(m, rows)}
            if m.cfg.version == 3:
                entry["input_fit"] = input_fit(m, rows)
                print(f"  input R^2: {entry['input_fit']}", flush=True)
            report["runs"][str(run)] = entry
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
