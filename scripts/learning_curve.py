"""The learning curve of an EAGLE run: tau by real speculative decoding (chain and tree, T=0 and T=1) of every
checkpoint against the training tokens it had seen, beside the held-out step-0 acceptance its checkpoint evaluation
logged (metrics.jsonl); a table (JSON) and one plot. All prompts of a checkpoint are decoded together
(`evaluate(batch=...)`: at T=0 the batch-1 tau).

    python scripts/learning_curve.py --run runs/eagle3-smollm2-offline --kinds-in-turn --num-prompts 16 \
        --max-new-tokens 64 --out benchmarks/learning_curve_smollm2.json --plot benchmarks/learning_curve_smollm2.png
    python scripts/learning_curve.py --run runs/eagle3-smollm2-offline --steps 4695 --num-prompts 16 \
        --prompts data/real/smollm2-135m-instruct/other_prompts.jsonl --out benchmarks/other_domain_smollm2.json

Each checkpoint's figures are written as soon as they are measured and kept on a rerun (delete the JSON to measure
afresh); the prompts are the recipe's held-out ones (eval.prompts) unless `--prompts FILE` names others (such as
another domain's, `draftsmith self-distill --other-prompts`), decoded as `draftsmith evaluate` does: the first
--num-prompts of the file, or with `--kinds-in-turn` the first after the prompts' kinds are made to take turns (a
held-out split is sorted by kind, so its first prompts are all code); the JSON records which.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import yaml

from draftsmith.data.core import checkpoints
from draftsmith.data.prompts import kinds_in_turn
from draftsmith.data.reference import load_prompts
from draftsmith.decoding.evaluate import evaluate, render_prompts
from draftsmith.models.eagle_proposer import sibling
from draftsmith.models.registry import load_proposer
from draftsmith.models.target import load_target
from draftsmith.train.config import shipped

MODES = ("chain", "tree")
TEMPERATURES = (0.0, 1.0)


def logged(run: Path, row: dict, evals: dict[int, dict]) -> dict:
    """The row with what the run logged at its step (`evals`: step -> the checkpoint evaluation's last row of
    metrics.jsonl): the held-out step-0 acceptance (greedy: top-1 agreement; T=1: expected acceptance), its seconds
    and the run's eval_share, and the training seconds spent (the checkpoint's state.json); None where the
    checkpoint was not evaluated (a stop)."""
    e = evals.get(row["step"], {})
    state = run / f"checkpoint-{row['step']}" / "state.json"
    return {**row, **{k: round(e[key], 4) if e else None for k, key in (
        ("heldout_acc_0", "eval/heldout_acc_0"), ("heldout_accept_0", "eval/heldout_accept_0"),
        ("checkpoint_eval_seconds", "eval/eval_seconds"), ("eval_share", "eval_share"))},
        "train_seconds": round(json.loads(state.read_text())["train_seconds"], 1) if state.is_file() else
        row.get("train_seconds")}


def plot(table: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["train_tokens"] / 1e3 for r in table]
    for mode in MODES:
        for t, style in zip(TEMPERATURES, ("-", "--"), strict=True):
            ax.plot(x, [r[f"tau_{mode}_t{t:g}"] for r in table], style, marker="o", label=f"tau {mode} T={t:g}")
    ax.set(xlabel="training tokens (thousands)", ylabel="tau (tokens per target forward)", title=title)
    ax.set_xscale("log")
    acc = [(xi, r["heldout_acc_0"]) for xi, r in zip(x, table, strict=True) if r.get("heldout_acc_0") is not None]
    if acc:
        right = ax.twinx()
        right.plot(*zip(*acc, strict=True), ":", color="grey", marker="s", label="held-out step-0 acceptance")
        right.set(ylabel="held-out step-0 acceptance", ylim=(0, 1))
        right.legend(loc="lower right")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a training run directory with checkpoint-*/model")
    parser.add_argument("--prompts", help="JSONL of prompts to decode (default: the recipe's eval.prompts)")
    parser.add_argument("--kinds-in-turn", action="store_true",
                        help="take --num-prompts prompts with the file's kinds taking turns, not the first ones")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, nargs="*", help="only these checkpoints' steps (default: all)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    run = Path(args.run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    positions = cfg["loop"]["batch_size"] * cfg["loop"]["grad_accum"] * cfg["data"]["max_length"]
    prompts_file = args.prompts or cfg["eval"]["prompts"]
    pick = "kinds in turn" if args.kinds_in_turn else "first"
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {
        "run": str(run), "recipe": {k: cfg[k] for k in ("target", "data", "eagle", "loop")},
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "prompts": prompts_file, "pick": pick,
        "train_tokens": f"steps x {positions} (batch_size x grad_accum x data.max_length: packed rows, padding "
                        "included)", "table": []}
    given = (result["num_prompts"], result["max_new_tokens"], result["prompts"], result.get("pick", "first"))
    if given != (args.num_prompts, args.max_new_tokens, prompts_file, pick):
        raise SystemExit(f"{out} was measured with {given[0]} prompts of {given[2]} ({given[3]}) x {given[1]} tokens; "
                         "pass the same, or another --out to measure afresh")
    result["command"] = (f"python scripts/learning_curve.py --run {run} --num-prompts {result['num_prompts']} "
                         f"--max-new-tokens {result['max_new_tokens']} --out {out}"
                         + (f" --prompts {args.prompts}" if args.prompts else "")
                         + (" --kinds-in-turn" if args.kinds_in_turn else "")
                         + (f" --plot {args.plot}" if args.plot else ""))  # --steps: only which ones this call adds
    done = {r["step"] for r in result["table"]}
    todo = [c for c in checkpoints(run) if int(c.name.split("-")[1]) not in done and (c / "model").is_dir()
            and (not args.steps or int(c.name.split("-")[1]) in args.steps)]
    if todo:
        target = load_target(cfg["target"]["path"])
        rows = load_prompts(Path(shipped(prompts_file)))
        rows = (kinds_in_turn(rows) if args.kinds_in_turn else rows)[: args.num_prompts]
        prompts = render_prompts(target.tokenizer, rows)
        baselines: dict = {}
    for ckpt in todo:
        step, t0 = int(ckpt.name.split("-")[1]), time.perf_counter()
        row = {"step": step, "train_tokens": step * positions}
        first = load_proposer(str(ckpt / "model"), target.model)
        for mode in MODES:
            r = evaluate(target.model, functools.partial(sibling, first, mode=mode), prompts, args.max_new_tokens,
                         TEMPERATURES, check_greedy=False, baselines=baselines, batch=len(prompts))
            for t, fig in r["by_temperature"].items():
                row[f"tau_{mode}_t{t}"] = round(fig["tau"], 4)
        row["seconds"] = round(time.perf_counter() - t0, 1)  # this curve's decoding of the checkpoint
        kept = json.loads(out.read_text())["table"] if out.is_file() else []  # another call's rows too
        result["table"] = sorted([*[r for r in kept if r["step"] != step], row], key=lambda r: r["step"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(row), flush=True)
    if out.is_file():  # every row written so far, by this call or another, with what the run logged since
        metrics = run / "metrics.jsonl"
        evals = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines() if metrics.is_file() else [])
                 if "eval/heldout_acc_0" in r}
        result["table"] = [logged(run, r, evals) for r in json.loads(out.read_text())["table"]]
        out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot and result["table"]:
        plot(result["table"], args.plot, f"{Path(cfg['target']['path']).name} EAGLE-3: tau against training tokens\n"
                                          f"{result['num_prompts']} prompts of {Path(prompts_file).name} x "
                                          f"{result['max_new_tokens']} tokens")
    return result


if __name__ == "__main__":
    main()
