"""The learning curve of an EAGLE run: tau by real speculative decoding (chain and tree, T=0 and T=1) of every
checkpoint against the training tokens it had seen, beside the held-out step-0 acceptance its checkpoint evaluation
logged (metrics.jsonl); a table, written as a named entry of a JSON file that holds a target's curves (or its
prompt sets), and one plot of all the file's entries. All prompts of a checkpoint are decoded together
(`evaluate(batch=...)`: at T=0 the batch-1 tau).

    python scripts/learning_curve.py --run runs/eagle3-smollm2-offline --kinds-in-turn --num-prompts 16 \
        --max-new-tokens 64 --out benchmarks/learning_curve_smollm2.json --entry shipped \
        --plot benchmarks/learning_curve_smollm2.png
    python scripts/learning_curve.py --run runs/eagle3-smollm2-offline --steps 4695 --num-prompts 16 \
        --prompts data/real/smollm2-135m-instruct/other_prompts.jsonl --out benchmarks/domains_smollm2.json \
        --entry other/shipped

Each checkpoint's figures are written as soon as they are measured and kept on a rerun (delete the entry to measure
afresh), the file's other entries untouched; the prompts are the recipe's held-out ones (eval.prompts) unless
`--prompts FILE` names others (such as another domain's, `draftsmith self-distill --other-prompts`), decoded as
`draftsmith evaluate` does: the first --num-prompts of the file, or with `--kinds-in-turn` the first after the
prompts' kinds are made to take turns (a held-out split is sorted by kind, so its first prompts are all code); the
JSON records which.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import yaml

from draftsmith.data.core import checkpoints, write_atomically
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


def read_entries(out: Path) -> dict[str, dict]:
    """The JSON at `out`: entry name -> one run's curve on one prompt set; {} before the first is written."""
    return json.loads(out.read_text()) if out.is_file() else {}


def write_entry(out: Path, entry: str, result: dict) -> None:
    """`result` as entry `entry` of the JSON at `out`, its other entries kept as the file holds them now (another
    call may have written one since); the file is replaced whole."""
    entries = {**read_entries(out), entry: result}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, lambda tmp: tmp.write_text(json.dumps(entries, indent=1) + "\n"))


def plot(entries: dict[str, dict], path: str) -> None:
    """One panel per entry: tau (chain and tree, T=0 and T=1) against training tokens, and the held-out step-0
    acceptance its checkpoint evaluations logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {name: e for name, e in entries.items() if e["table"]}
    cols = min(2, len(shown))
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(shown):]:
        ax.remove()
    for ax, (name, e) in zip(axes.flat[: len(shown)], shown.items(), strict=True):
        table = e["table"]
        x = [r["train_tokens"] / 1e3 for r in table]
        for mode in MODES:
            for t, style in zip(TEMPERATURES, ("-", "--"), strict=True):
                ax.plot(x, [r[f"tau_{mode}_t{t:g}"] for r in table], style, marker="o", label=f"tau {mode} T={t:g}")
        ax.set(xlabel="training tokens (thousands)", ylabel="tau (tokens per target forward)",
               title=f"{name}: {Path(e['recipe']['target']['path']).name} EAGLE-3\n{e['num_prompts']} prompts of "
                     f"{Path(e['prompts']).name} x {e['max_new_tokens']} tokens")
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
    parser.add_argument("--out", required=True, help="the JSON of a target's curves (or prompt sets), by entry")
    parser.add_argument("--entry", required=True,
                        help="this run's name in --out on these prompts (e.g. shipped, other/shipped)")
    parser.add_argument("--plot", help="a PNG of every entry of --out, one panel each")
    args = parser.parse_args(argv)
    run = Path(args.run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    positions = cfg["loop"]["batch_size"] * cfg["loop"]["grad_accum"] * cfg["data"]["max_length"]
    prompts_file = args.prompts or cfg["eval"]["prompts"]
    pick = "kinds in turn" if args.kinds_in_turn else "first"
    out = Path(args.out)
    result = read_entries(out).get(args.entry) or {
        "run": str(run), "recipe": {k: cfg[k] for k in ("target", "data", "eagle", "loop")},
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "prompts": prompts_file, "pick": pick,
        "train_tokens": f"steps x {positions} (batch_size x grad_accum x data.max_length: packed rows, padding "
                        "included)", "table": []}
    given = (result["num_prompts"], result["max_new_tokens"], result["prompts"], result.get("pick", "first"))
    if given != (args.num_prompts, args.max_new_tokens, prompts_file, pick):
        raise SystemExit(f"{out} entry {args.entry!r} was measured with {given[0]} prompts of {given[2]} ({given[3]}) "
                         f"x {given[1]} tokens; pass the same, or another --entry to measure afresh")
    result["command"] = (f"python scripts/learning_curve.py --run {run} --num-prompts {result['num_prompts']} "
                         f"--max-new-tokens {result['max_new_tokens']} --out {out} --entry {args.entry}"
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
        kept = (read_entries(out).get(args.entry) or {"table": []})["table"]  # another call's rows too
        result["table"] = sorted([*[r for r in kept if r["step"] != step], row], key=lambda r: r["step"])
        write_entry(out, args.entry, result)
        print(json.dumps(row), flush=True)
    if args.entry in read_entries(out):  # every row written so far, by this call or another, with what the run
        metrics = run / "metrics.jsonl"  # logged since
        evals = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines() if metrics.is_file() else [])
                 if "eval/heldout_acc_0" in r}
        result["table"] = [logged(run, r, evals) for r in read_entries(out)[args.entry]["table"]]
        write_entry(out, args.entry, result)
    if args.plot and result["table"]:
        plot(read_entries(out), args.plot)
    return result


if __name__ == "__main__":
    main()
