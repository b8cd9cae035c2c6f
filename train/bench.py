"""The leaderboard: every drafter on the same target, the same held-out prompts, the same training budget.

    draftsmith bench [--budget-minutes 5] [--methods ngram medusa1 ...] [--reuse] [--merge]
        [--run METHOD=DIR ...] [--num-prompts 20] [--max-new-tokens 128] [--threads 1] [--train-threads N]
        [--runs-dir runs/bench]
        [--override [METHOD:]KEY=VALUE ...] [--out benchmarks/leaderboard.json]

For each method of METHODS (the untrained baselines, then every recipe of models/registry.py): train it on the target with its default recipe for
`--budget-minutes` of training time (`loop.max_minutes`; evaluations excluded) into
`--runs-dir/<method>`, resuming a run there if one was cut short. The time budget binds for every
method (the recipe's max_steps is lifted), and the loop's schedules (LR warm-up and decay, Medusa-2's
head warm-up, LayerSkip's gradual curriculum) run over that budget, so each method gets the same
time and a complete schedule within it; the steps it made are reported. With
`--reuse`, a run that already holds a drafter (in `--runs-dir/<method>`, else the recipe's own
`loop.output_dir`; `--run METHOD=DIR` names one) is evaluated as it is, with the training time its
checkpoint recorded.
Methods whose entry script or recipe is missing are reported as not available; `--merge` adds the
methods of this command to the leaderboard already at `--out` (same evaluation settings required),
so a recipe can join without re-measuring the others.

Every decoding variant (chain; tree where the method has one) is then evaluated on the same
held-out prompts at temperature 0 (greedy, output checked token by token against the verifying
model's plain greedy decoding) and temperature 1 (exact rejection sampling, so lossless), with one
seed per prompt. Per prompt, plain decoding by the verifying model and speculative decoding run back
to back, so both see the same load on a shared machine; speedup is plain time per token over
speculative time per token. Medusa-2 and LayerSkip change the target's own weights: they verify
with (and are timed against) their trained model, as the `verifier` field says.

The speedup model (Leviathan et al. 2023) for every fixed-length chain: alpha = accepted / offered
draft positions at temperature 0 (the i.i.d. acceptance that fits the measured per-position
rates), c = drafter seconds per drafted token / target seconds per verification forward, both
from that evaluation's timing; speedup(gamma) = (1 - alpha^(gamma+1)) / ((1 - alpha)(1 + gamma c))
for gamma = 1..8 (Medusa: up to its number of heads), gamma* its argmax, which is then measured.

Writes the JSON, a Markdown table (`.md`) and a plot (`.png`) beside it, three panels: tau by method, acceptance
by draft position, tau against training step (the runs' checkpoint evaluations in metrics.jsonl).

Time at the defaults: 44 min 15 s measured on 2 CPU cores shared with lower-priority jobs (6 methods
trained 5 min each, plus start-up, checkpoint evaluations and the final evaluation of 15 variants on
20 prompts x 128 tokens at both temperatures). The evaluation's share scales with prompts x tokens,
training with `--budget-minutes`. Decoding runs on `--threads 1` by default: a 10M-parameter target at batch 1
is latency-bound, and on cores shared with other jobs two OpenMP threads once decoded 10x slower
than one (450-760 ms against 46 ms per token at load average 8). Training keeps torch's default
threads: at one thread, Medusa-1 trained at ~85 tokens/s against ~940 with the default, side by side; but
when other jobs oversubscribe the cores (load average ~12 on 2 cores), EAGLE-3 made 9 steps in 5 minutes with
the default against 23 in 1.5 minutes with one thread (`--train-threads 1`). The load average at the start and
end of the command is recorded in the settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.core import (
    best_record,
    checkpoints,
    find_drafter,
    has_drafter,
    read_drafter_meta,
    read_file,
)
from draftsmith.data.reference import PROMPTS_PATH, load_prompts
from draftsmith.decoding.bench import BASELINES, TEMPERATURES, Drafting, evaluate_variants
from draftsmith.decoding.cost import drafting_cost, relative, verify_cost_curve
from draftsmith.decoding.evaluate import render_prompts
from draftsmith.models.registry import METHODS as REGISTRY
from draftsmith.models.target import REFERENCE_TARGET
from draftsmith.models.zoo import resolve_target
from draftsmith.train.config import shipped
from draftsmith.train.entries import TRAIN
from draftsmith.train.guard import cli

# ---- the methods ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Method:
    """A leaderboard entry: a method (or one of its recipes) and how it decodes (decoding/bench.py)."""

    key: str
    name: str
    build: Callable[[Path | None, nn.Module], dict[str, Drafting]]  # (drafter dir, target) -> variants
    script: str = ""  # train/METHOD.py, run as `python -m draftsmith.train.METHOD`; empty: nothing to train
    recipe: str = ""  # recipes/METHOD/NAME.yaml, shipped with the package
    curve: str = "eval/tau"  # the checkpoint metric plotted against step; {fields} from drafter.json


METHODS = [
    Method("ngram", "prompt lookup (n-gram)", BASELINES["ngram"]),
    Method("suffix", "suffix decoding", BASELINES["suffix"]),
    Method("lookahead", "lookahead", BASELINES["lookahead"]),
    Method("draft", "draft model (untrained, 2 layers)", BASELINES["draft"]),
    *(Method(r.key, r.name, plugin.variants, f"train/{r.entry}.py", f"recipes/{r.recipe}", r.curve)
      for plugin in REGISTRY.values() for r in plugin.recipes),
]
BY_KEY = {m.key: m for m in METHODS}
TARGET_RECIPES = {"smollm2-135m-instruct": "smollm2-135m", "gemma3-270m": "gemma3-270m"}  # named target -> its recipes' name (recipes/<method>/*NAME.yaml)


def for_target(method: Method, target: str) -> Method:
    """The method with the recipe written for a named target (the reference target's otherwise)."""
    name = TARGET_RECIPES.get(target)
    return dataclasses.replace(method, recipe=method.recipe.replace("tiny-code", name)) if name and method.recipe \
        else method


def unavailable(method: Method) -> str | None:
    """Why a method cannot run with this installation, or None."""
    if method.script and Path(method.script).stem not in TRAIN:
        return f"not available: {method.script} does not exist"
    if method.recipe and not Path(shipped(method.recipe)).is_file():
        return f"not available: {method.recipe} does not exist"
    return None


# ---- training ------------------------------------------------------------------------------------------

def recipe_output_dir(method: Method) -> Path:
    return Path(yaml.safe_load(Path(shipped(method.recipe)).read_text())["loop"]["output_dir"])


def overrides_for(method: Method, overrides: list[str]) -> list[str]:
    """`key=value` applies to every method, `METHOD:key=value` to that one only."""
    out = []
    for o in overrides:
        head, _, value = o.partition("=")
        only, _, key = head.rpartition(":")
        if not only or only == method.key:
            out.append(f"{key}={value}")
    return out


UNBOUNDED_STEPS = 10**6  # lifts every recipe's step limit, so that the time budget alone ends training


def train(method: Method, run: Path, budget_minutes: float, target: str, overrides: list[str],
          threads: int | None = None) -> float:
    """Train (or resume) `method` into `run` under the budget (with `threads` OpenMP threads, else torch's default);
    returns the wall seconds, evaluations included."""
    run.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", f"draftsmith.train.{Path(method.script).stem}", "--config", shipped(method.recipe),
           f"target.path={target}",
           f"loop.output_dir={run}", f"loop.max_minutes={budget_minutes:g}", f"loop.max_steps={UNBOUNDED_STEPS}",
           *overrides_for(method, overrides)]
    print(f"[{method.key}] training: {' '.join(cmd[1:])} (log: {run / 'train.log'})", flush=True)
    start = time.perf_counter()
    with open(run / "train.log", "a") as log:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        tail = (run / "train.log").read_text().strip().splitlines()[-1:]
        raise RuntimeError(f"training failed (exit {done.returncode}): {tail[0] if tail else ''} (see {run}/train.log)")
    return time.perf_counter() - start


def training_record(run: Path, drafter_dir: Path, curve: str) -> dict:
    """What the run recorded: steps and training seconds of its last checkpoint, the best step, tau by step."""
    state, config = last_state(run), run_config(run)
    best = best_record(drafter_dir)
    key = curve.format(**read_drafter_meta(drafter_dir))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").is_file() else []
    return {"run": str(run), "drafter": str(drafter_dir), "steps": state.get("step"),
            "train_seconds": state.get("train_seconds"),  # absent in runs older than loop.max_minutes
            "tokens_seen": tokens_seen(config, state),
            "best_step": best.get("step"),
            "max_minutes": config["loop"].get("max_minutes") if config else None,
            "curve_metric": key, "curve": [[r["step"], r[key]] for r in rows if key in r]}


def last_state(run: Path) -> dict:
    """The loop state of the run's last checkpoint ({} without one)."""
    ckpts = [c / "state.json" for c in checkpoints(run) if (c / "state.json").is_file()]
    return read_file(ckpts[-1], f"delete {ckpts[-1].parent} (a damaged checkpoint) and run again") if ckpts else {}


def run_config(run: Path) -> dict | None:
    return read_file(run / "config.yaml", f"delete {run} and run again") if (run / "config.yaml").is_file() else None


def tokens_seen(config: dict | None, state: dict) -> int | None:
    """Token positions trained on: steps x batch x grad_accum x processes x max_length (packed rows are
    max_length long, their padding included); None where the run does not say."""
    if not config or "step" not in state or not config.get("data", {}).get("pack"):
        return None
    loop = config["loop"]
    return state["step"] * loop["batch_size"] * loop.get("grad_accum", 1) * state.get("world_size", 1) \
        * config["data"]["max_length"]


# ---- output --------------------------------------------------------------------------------------------

def _rounded(x, digits: int = 4):
    """Floats to `digits` decimals; seconds (keys ending in _s) to microseconds, so that figures derived from short
    timings (c, from drafter_s and target_s) read the same from the JSON as when measured."""
    if isinstance(x, float):
        return round(x, digits)
    if isinstance(x, dict):
        return {k: _rounded(v, 6 if k.endswith("_s") else digits) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v, digits) for v in x]
    return x


def _training_cell(entry: dict) -> str:
    t = entry.get("training")
    if not t:
        return "none"
    s = t.get("train_seconds")
    seconds = "time not recorded" if s is None else f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"
    tokens = f" ({t['tokens_seen'] / 1e3:.0f}k tokens)" if t.get("tokens_seen") else ""
    return f"{t['steps']} steps{tokens}, {seconds} ({'reused' if t['reused'] else 'trained here'})"


def _params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n else "0"


def _cost(stats: dict) -> str:
    c = drafting_cost(stats)
    return "" if c is None else f"{c:.3f}"


def _lossless(row: dict) -> bool:
    """Every greedy check of a variant passed (at its gamma, and at gamma* where that was measured)."""
    return row["by_temperature"]["0"]["greedy_matches_target"] and \
        row.get("speedup_model", {}).get("greedy_matches_target_at_gamma_star", True)


def real_target_rows(board: dict) -> dict:
    """Per method, what benchmarks/real_targets.json keeps of a leaderboard on a real target: the training
    budget, steps and tokens, and per decoding variant and temperature tau, acceptance by position, greedy
    equality and speedup, with the speedup model's prediction beside the measurement (chains)."""
    methods = {}
    for key, entry in board["methods"].items():
        if entry["status"] != "ok":
            methods[key] = {"name": entry["name"], "status": entry["status"]}
            continue
        t = entry.get("training") or {}
        tokens = t.get("tokens_seen")
        if t and "tokens_seen" not in t:  # a leaderboard older than tokens_seen: from the run, if still on disk
            tokens = tokens_seen(run_config(Path(t["run"])), last_state(Path(t["run"])))
        row = {"name": entry["name"], "recipe": entry["recipe"], "verifier": entry["verifier"],
               "budget_minutes": t.get("max_minutes"), "steps": t.get("steps"),
               "train_seconds": t.get("train_seconds"), "tokens_seen": tokens, "variants": {}}
        for variant, r in entry["variants"].items():
            out = {"gamma": r["gamma"], "drafter_params": r["drafter_params"], "new_params": r["new_params"]}
            for temp, stats in r["by_temperature"].items():
                out[f"T={temp}"] = {k: stats[k] for k in ("tau", "acceptance_by_position", "speedup",
                                                          "greedy_matches_target")}
            m = r.get("speedup_model")
            if m:
                out["speedup_model"] = {k: m[k] for k in ("alpha", "c", "predicted_tau", "predicted_speedup",
                                                          "measured_speedup", "gamma_star", "predicted_at_gamma_star",
                                                          "measured_at_gamma_star") if k in m}
            row["variants"][variant] = out
        methods[key] = row
    s = board["settings"]
    return {"command": s["command"], "num_prompts": s["num_prompts"], "max_new_tokens": s["max_new_tokens"],
            "budget_minutes": s["budget_minutes"], "total_seconds": s.get("total_seconds"), "methods": methods}


def markdown(board: dict) -> str:
    s = board["settings"]
    commands = sorted({e["measured_by"] for e in board["methods"].values()}, key=len, reverse=True)
    lines = [f"Measured by {' and '.join(f'`{c}`' for c in commands)}: target `{Path(s['target']).name}`, "
             f"{s['num_prompts']} held-out prompts x {s['max_new_tokens']} new tokens, batch 1, {s['device']}, "
             f"{s['torch_threads']} torch thread(s), training budget {s['budget_minutes']:g} min per method "
             "(reused runs: their own recorded time).",
             "tau counts the bonus token; T=1 is exact (lossless) sampling; speedup is wall-clock against the "
             "verifying model's plain decoding, timed back to back per prompt (noisy on shared cores); "
             "drafter params: run per draft (in brackets: not shared with the target).", "",
             "c = drafting cost per proposed token: drafter seconds per drafted node / target seconds per "
             "verification forward, at T=0.", "",
             "| method | decoding | drafter params (new) | training | tau T=0 | tau T=1 | c | speedup T=0 | speedup T=1 "
             "| acceptance by position, T=0 | greedy = target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for entry in board["methods"].values():
        if entry["status"] != "ok":
            lines.append(f"| {entry['name']} | | | | | | | | {entry['status']} | |")
            continue
        for variant, row in entry["variants"].items():
            t0, t1 = row["by_temperature"]["0"], row["by_temperature"]["1"]
            acc = " ".join(f"{a:.2f}" for a in t0["acceptance_by_position"][:5])
            name = entry["name"] + ("" if entry["verifier"] == "target" else f" ({entry['verifier']})")
            decoding = variant + (f" gamma={row['gamma']}" if row["gamma"] else "")
            lines.append(f"| {name} | {decoding} | {_params(row['drafter_params'])} ({_params(row['new_params'])}) "
                         f"| {_training_cell(entry)} | {t0['tau']:.2f} | {t1['tau']:.2f} | {_cost(t0)} | {t0['speedup']:.2f}x "
                         f"| {t1['speedup']:.2f}x | {acc} | {'yes' if _lossless(row) else 'NO'} |")
    lines += ["", "Speedup model (chains, T=0): alpha = accepted / offered positions, c = drafter time per drafted "
              "token / target time per verification; predicted = E[tokens] / (v(gamma+1) + gamma c_plain), with "
              "E[tokens] = (1 - alpha^(gamma+1)) / (1 - alpha), v the target's verify-cost curve measured at start "
              "(decoding/cost.py) and c_plain the drafter's time per token against a plain decoding step.",
              "`verify / plain` is what one verification cost against one plain step here, which the measured "
              "speedup also pays.",
              "", "| method | gamma | alpha | c | verify / plain | tau predicted / measured | speedup predicted / "
              "measured | gamma* | speedup at gamma*: predicted / measured |", "|---|---|---|---|---|---|---|---|---|"]
    for entry in board["methods"].values():
        for variant, row in entry.get("variants", {}).items():
            m = row.get("speedup_model")
            if not m:
                continue
            star = (f"{m['predicted_at_gamma_star']:.2f}x / {m['measured_at_gamma_star']:.2f}x"
                    if "measured_at_gamma_star" in m else "(same gamma)")
            t0 = row["by_temperature"]["0"]
            verify = (t0["target_s"] / t0["target_forwards"]) / (t0["plain_wall_s"] / t0["plain_new_tokens"])
            lines.append(f"| {entry['name']} {variant} | {m['gamma']} | {m['alpha']:.3f} | {m['c']:.3f} | {verify:.2f} "
                         f"| {m['predicted_tau']:.2f} / {t0['tau']:.2f} "
                         f"| {m['predicted_speedup']:.2f}x / {m['measured_speedup']:.2f}x | {m['gamma_star']} | {star} |")
    return "\n".join(lines) + "\n"


def plots(board: dict, out: Path) -> Path:
    """tau by method, acceptance by draft position, tau against training step: one PNG of three panels beside
    `out`."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        sys.exit("draftsmith bench draws its plots with matplotlib: pip install -e '.[plot]' (the JSON and table "
                 "are written)")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{e['name']} {v}", r) for e in board["methods"].values() for v, r in e.get("variants", {}).items()]
    fig, (taus, acceptance, curves) = plt.subplots(3, 1, figsize=(10, 14))
    width = 0.4
    for j, t in enumerate(("0", "1")):
        taus.bar([i + (j - 0.5) * width for i in range(len(rows))], [r["by_temperature"][t]["tau"] for _, r in rows],
                 width, label=f"T={t}")
    taus.set_xticks(range(len(rows)), [n for n, _ in rows], rotation=30, ha="right")
    taus.set(ylabel="tau (tokens per target forward)", title="tau by method")
    taus.legend()
    acceptance.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for name, r in rows:
        acc = r["by_temperature"]["0"]["acceptance_by_position"][:8]
        acceptance.plot(range(1, len(acc) + 1), acc, "--" if name.endswith("tree") else "-", marker="o", label=name)
    acceptance.set(xlabel="draft position", ylabel="conditional acceptance (T=0)", ylim=(0, 1.05),
                   title="acceptance by draft position")
    acceptance.legend(fontsize=7)
    for e in board["methods"].values():
        curve = (e.get("training") or {}).get("curve")
        if curve:
            curves.plot([s for s, _ in curve], [t for _, t in curve], marker="o",
                        label=f"{e['name']} ({e['training']['curve_metric']})")
    curves.set(xlabel="training step", ylabel="tau at checkpoint evaluation", title="tau against training step")
    if curves.lines:
        curves.legend(fontsize=7)
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the command ---------------------------------------------------------------------------------------

def run_method(method: Method, args, target, prompts) -> dict:
    entry: dict = {"name": method.name, "script": method.script or None, "recipe": method.recipe or None}
    why = unavailable(method)
    if why:
        return {**entry, "status": why}
    drafter_dir = None
    if method.script:
        run = args.runs_dir / method.key
        given = args.run.get(method.key)
        if given and not has_drafter(given):
            raise ValueError(f"--run {method.key}={given}: no drafter there (no drafter.json, best/ or checkpoint)")
        candidates = [run, recipe_output_dir(method)] if args.reuse else []
        found = given or next((c for c in candidates if has_drafter(c)), None)
        wall = None
        if found is None:
            wall = train(method, run, args.budget_minutes, args.target_as_given, args.override, args.train_threads)
            found = run
        drafter_dir = find_drafter(found)
        entry["training"] = {**training_record(found, drafter_dir, method.curve), "reused": wall is None,
                             "wall_seconds_with_evaluations": wall}
    start = time.perf_counter()
    variants = method.build(drafter_dir, target)
    entry["verifier"] = "target" if all(v.verifier is target for v in variants.values()) else "own trained backbone"
    entry["variants"] = evaluate_variants(variants, prompts, args.max_new_tokens, args.seed, args.verify_cost)
    entry["eval_seconds"] = time.perf_counter() - start
    return {**entry, "status": "ok"}


SAME = ("target", "prompts", "num_prompts", "max_new_tokens", "temperatures", "seed", "budget_minutes", "torch_threads")


SHIPPED_INPUTS = (Path("models/reference-target"), Path("data/reference_prompts.jsonl"))


def _portable(value):
    """The reference target and prompts as paths inside the package, so that installs elsewhere compare equal."""
    for rel in SHIPPED_INPUTS:
        if isinstance(value, str) and Path(value).parts[-len(rel.parts):] == rel.parts:
            return str(rel)
    return value


def merged(board: dict, out: Path) -> dict:
    """`board`'s methods over those of the leaderboard already at `out`, which must share its settings."""
    if not out.is_file():
        return board
    old = read_file(out, "run without --merge")
    differ = [k for k in SAME if _portable(old["settings"].get(k)) != _portable(board["settings"][k])]
    if differ:
        raise SystemExit(f"--merge: {out} was measured with other {', '.join(differ)}; run without --merge")
    for entry in old["methods"].values():
        entry.setdefault("measured_by", old["settings"]["command"])
    methods = {**old["methods"], **board["methods"]}
    return {"settings": {**board["settings"], "earlier": old["settings"].get("earlier", []) + [old["settings"]]},
            "methods": {k: methods[k] for k in BY_KEY if k in methods}}


def _git(*args: str) -> str:
    """git's answer about the checkout this code runs from ('' when installed from a wheel)."""
    return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=list(BY_KEY), default=list(BY_KEY))
    parser.add_argument("--budget-minutes", type=float, default=5.0, help="training time per method (loop.max_minutes)")
    parser.add_argument("--reuse", action="store_true", help="evaluate existing runs instead of training")
    parser.add_argument("--target", default=str(REFERENCE_TARGET),
                        help=f"an HF model directory or a named target ({', '.join(TARGET_RECIPES)})")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="default: the reference held-out prompts; data/real/NAME/heldout_prompts.jsonl for a named target")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for decoding (training: torch's default)")
    parser.add_argument("--train-threads", type=int, default=None,
                        help="OpenMP threads per training run (default: torch's); 1 on cores other jobs oversubscribe")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs") / "bench")
    parser.add_argument("--run", nargs="*", default=[], metavar="METHOD=DIR",
                        help="evaluate this existing run of a method instead of training it")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides for every training run (data.limit=200), or for one (layerskip:loop.lr=1e-4)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other methods of an existing --out measured with the same settings")
    parser.add_argument("--out", type=Path, default=Path("benchmarks") / "leaderboard.json")
    args = parser.parse_args(argv)
    args.run = dict(r.split("=", 1) for r in args.run)
    bad = [k for k in args.run if k not in BY_KEY or not BY_KEY[k].script]
    if bad:
        raise SystemExit(f"--run {bad[0]}=...: not a trained method; choose from "
                         f"{', '.join(m.key for m in METHODS if m.script)}")
    args.run = {k: Path(v) for k, v in args.run.items()}
    if args.budget_minutes <= 0:
        raise SystemExit("--budget-minutes must be > 0")
    args.target_as_given, args.target = args.target, Path(resolve_target(args.target))
    if not (args.target / "config.json").is_file():
        raise SystemExit(f"--target {args.target}: no config.json there; pass a Hugging Face model directory")
    named = args.target_as_given in TARGET_RECIPES
    args.prompts = args.prompts or (Path(shipped(f"data/real/{args.target_as_given}/heldout_prompts.jsonl")) if named
                                    else PROMPTS_PATH)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target).eval()
    prompts = render_prompts(tokenizer, load_prompts(args.prompts, limit=args.num_prompts))
    curve = verify_cost_curve(target)
    args.verify_cost = relative(curve)
    board = {"settings": {
        "command": " ".join(["draftsmith bench", *(argv if argv is not None else sys.argv[1:])]),
        "target": args.target_as_given, "target_dir": str(args.target), "prompts": str(args.prompts),
        "num_prompts": len(prompts), "recipes": TARGET_RECIPES.get(args.target_as_given, "tiny-code"),
        "verify_cost": {"seconds": {str(k): v for k, v in curve.items()},
                        "relative": {str(k): v for k, v in args.verify_cost.items()}},
        "max_new_tokens": args.max_new_tokens, "temperatures": list(TEMPERATURES), "seed": args.seed,
        "budget_minutes": args.budget_minutes, "reuse": args.reuse, "overrides": args.override,
        "device": "CPU", "torch_threads": torch.get_num_threads(), "train_threads": args.train_threads or "torch default",
        "load_average_at_start": os.getloadavg(), "batch_size": 1,
        "git_commit": _git("rev-parse", "HEAD"), "git_modified": _git("diff", "--name-only", "HEAD").split()},
        "methods": {}}
    for key in args.methods:
        method = for_target(BY_KEY[key], args.target_as_given)
        print(f"[{key}] {method.name}", flush=True)
        try:
            board["methods"][key] = run_method(method, args, target, prompts)
        except (RuntimeError, ValueError, OSError, KeyError) as e:
            board["methods"][key] = {"name": method.name, "status": f"failed: {e}"}
        board["methods"][key]["measured_by"] = board["settings"]["command"]
        if board["methods"][key]["status"] != "ok":
            print(f"[{key}] {board['methods'][key]['status']}", flush=True)
    board["settings"]["total_seconds"] = time.perf_counter() - start
    board["settings"]["load_average_at_end"] = os.getloadavg()
    board = _rounded(merged(board, args.out) if args.merge else board)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(board, indent=2) + "\n")
    table = markdown(board)
    args.out.with_suffix(".md").write_text(table)
    plots(board, args.out)
    print(table)
    return board


if __name__ == "__main__":
    cli(main)
