"""Three EAGLE-3 trainers side by side on SmolLM2-135M-Instruct: draftsmith, speculators 0.9.0 and SpecForge 0.2.0.

    python scripts/bench_peers.py [--work runs/bench-peers] [--budget-minutes 30] [--lr 1e-3] [--conversations N]
        [--num-prompts 16] [--plan]

Needs PyPI (the peers' venvs, ~1.3 GiB each; llama.cpp and the target on first use), disk for the inputs (6.4 GiB
for draftsmith's cache, each input's size recorded), and a quiet machine for some 7 h with the defaults on 2 cores:
~2.5 h of inputs (the offline cache, then the peers' single target pass over all conversations), five trainings of
--budget-minutes (plus each peer's probe and export, ~3 h) and ~1.5 h of serving. Resumable: every step's outcome
goes to WORK/state.json and a finished step is never redone, so running it again continues where it stopped.

Phases, one step after another (`--plan` prints them without running anything):
  setup   both peers' venvs (train/peers.py), llama.cpp built, the target converted (models/zoo.py);
  inputs  draftsmith's offline cache of the shipped recipe, and both peers' input from one target pass over the same
          conversations and maximum length, each timed, with the disk it takes;
  train   each trainer for --budget-minutes of training: draftsmith with loop.max_minutes = budget (its cosine
          anneals inside it), each peer at its own lr with its schedule planned to the budget, then each peer once
          more at our lr (--lr); each records steps, tokens seen, epochs and training tokens/s; the report names the
          better of a peer's two rows;
  judge   every drafter converted with llama.cpp's converter and served by llama-server (F32 target) on the held-out
          and the other-domain prompts at T=0 and T=1: acceptance length and by position, tokens/s against plain
          decoding, greedy equality; beside it our decoder's tau with the same drafter (a peer's export read as its
          engine reads it); every intermediate checkpoint, with its training minutes and tokens seen, at T=0 on the
          held-out prompts;
  report  benchmarks/peers.json (every figure, the command, the machine, each step's load average before and after;
          per trainer its steps, tokens seen, epochs and tokens/s, and at equal tokens: the largest token count
          every trainer's checkpoints reach and each trainer's checkpoint nearest to it) and benchmarks/peers.png
          (acceptance length against training minutes and against tokens seen).
Tokens seen are the non-padding positions of the batches each trainer's optimizer steps trained on, loss-masked or
not: the peers count them per step (train/peer_cpu.py; speculators shifts each conversation by one, so counts one
token less of each); draftsmith's loop counts the positions of its packed rows (train/bench.py `tokens_seen`),
padding included, which are scaled here by the share of them that hold a token.
A step with a 1-minute load average above 1.5 before it or after it (taken --cool-seconds after it ends, once its own
load has decayed) is recorded as loaded and run again on the next invocation. A step that fails prints one line
naming it and its log; the steps that do not need it still run (each trainer is judged on its own), and the report
holds what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = "smollm2-135m-instruct"
RECIPE = REPO / "recipes/eagle3/smollm2-135m.yaml"
DATA = REPO / "data/real" / TARGET
# the drafter all three train: draft vocabulary 4096, features of layers 2 / 15 / 27, no EAGLE 3.1 per-layer norms
DRAFTER = ["eagle.draft_vocab_size=4096", "eagle.aux_layers=[2,15,27]", "eagle.fc_norm=false"]
PEERS = ("speculators", "specforge")
LOADED = 1.5  # 1-minute load average on these 2 cores above which a step's timing is not trusted
COOL_S = 60  # wait after a step before its "after" load: its own 2-core load decays to ~0.7 in a minute
CHECKPOINTS = 6  # draftsmith checkpoints per budget, for the acceptance-against-minutes plot
STEPS_PER_MINUTE = 150  # draftsmith's recipe late in its run (its save_every comment): spaces those checkpoints
TRAINED = ("steps", "tokens", "epochs", "train_seconds", "tokens_per_s")  # of each trainer, in the report


@dataclass
class Step:
    """One step of a phase: a command run in a child process (its output in WORK/logs/NAME.log), or `run` called in
    this process (`what` it does, for --plan). `out` is what it writes: removed before a step recorded as loaded
    runs again; `result` reads what a finished child's output says (a trainer's steps and tokens). It is skipped
    when a step it `needs` failed."""

    name: str
    phase: str
    argv: list[str] = field(default_factory=list)
    run: Callable[[], dict] | None = None
    what: str = ""
    out: Path | None = None
    needs: tuple[str, ...] = ()
    result: Callable[[], dict] | None = None


def plan(args: argparse.Namespace) -> list[Step]:
    w = args.work
    py = [sys.executable]
    limit = [f"data.limit={args.conversations}"] if args.conversations else []
    cache, inputs = w / "inputs/cache", w / "inputs/peers"
    steps = [*(Step(f"setup-{p}", "setup", [*py, "-m", "draftsmith.train.peers", "setup", p]) for p in PEERS),
             Step("setup-llama-cpp", "setup", [*py, "-m", "draftsmith.train.cli", "llama-cpp", "--build"]),
             Step("setup-target", "setup", [*py, "-m", "draftsmith.models.zoo", TARGET]),
             Step("inputs-draftsmith", "inputs", [*py, "-m", "draftsmith.train.cli", "cache", "--config", str(RECIPE),
                                                  "--out", str(cache), *DRAFTER, *limit], out=cache,
                  needs=("setup-target",)),
             Step("inputs-peers", "inputs", [*py, "-m", "draftsmith.train.peers", "write", "--config", str(RECIPE),
                                             "--out", str(inputs), *DRAFTER, *limit], out=inputs,
                  needs=("setup-target",)),
             # the same data.limit as its cache: the cache is refused for data other than the recipe's
             Step("train-draftsmith", "train", [
                 *py, "-m", "draftsmith.train.cli", "train", "eagle3", str(RECIPE), *DRAFTER, *limit,
                 f"offline.path={cache}", f"loop.max_minutes={args.budget_minutes:g}", f"loop.lr={args.lr:g}",
                 f"loop.output_dir={w / 'train/draftsmith'}", f"loop.keep_last={CHECKPOINTS + 2}",
                 f"loop.save_every={max(1, int(STEPS_PER_MINUTE * args.budget_minutes / CHECKPOINTS))}"],
                 out=w / "train/draftsmith", needs=("inputs-draftsmith",),
                 result=lambda: draftsmith_result(w / "train/draftsmith", cache, inputs))]
    for suffix, lr in (("", None), ("-our-lr", args.lr)):
        steps += [Step(f"train-{p}{suffix}", "train", [
            *py, "-m", "draftsmith.train.peers", "train", p, "--inputs", str(inputs), "--out",
            str(w / f"train/{p}{suffix}"), "--budget-minutes", f"{args.budget_minutes:g}",
            *(["--lr", f"{lr:g}"] if lr else [])], out=w / f"train/{p}{suffix}", needs=(f"setup-{p}", "inputs-peers"),
            result=lambda run=w / f"train/{p}{suffix}": json.loads((run / "result.json").read_text()))
            for p in PEERS]
    trainers = ["draftsmith", *(f"{p}{s}" for s in ("", "-our-lr") for p in PEERS)]
    steps += [Step(f"judge-{n}", "judge", run=lambda n=n: judge(args, n), out=w / f"judge/{n}",
                   what=f"{n} served by llama-server on both prompt sets" + (", our tau beside it, its checkpoints"
                                                                             if n != "plain" else ""),
                   needs=("setup-llama-cpp", "setup-target") + ((f"train-{n}", "judge-plain") if n != "plain"
                                                                 else ()))
              for n in ("plain", *trainers)]
    steps.append(Step("report", "report", run=lambda: report(args), what=f"{args.out} and {args.plot}"))
    return steps


def load_state(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"steps": {}}


def save_state(path: Path, state: dict) -> None:
    """Written aside, then renamed: a state file is whole or the previous one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(path)


def done(state: dict, name: str) -> bool:
    s = state["steps"].get(name, {})
    return s.get("status") == "done" and not s.get("loaded")


def execute(step: Step, log: Path) -> dict:
    """Run one step -> its figures: wall seconds, peak resident memory of the child and the processes it waited for
    (its trainer), and what its `run` returned."""
    t0 = time.time()
    if step.run is not None:
        return {**step.run(), "started": t0, "wall_seconds": round(time.time() - t0, 1)}
    with open(log, "w") as out:
        proc = subprocess.Popen(step.argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"exited with {os.waitstatus_to_exitcode(status)}")
    figures = {"started": t0, "wall_seconds": round(time.time() - t0, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024)}
    if step.out is not None and step.out.exists():
        figures["disk_bytes"] = sum(p.stat().st_size for p in step.out.rglob("*") if p.is_file())
    if step.result is not None:
        figures["result"] = step.result()
    return figures


def run_all(steps: list[Step], work: Path, cool_s: float = COOL_S, say=print) -> dict:
    """Every step not done yet, in order: a step whose `needs` failed is skipped, one that fails is recorded with
    its log and the rest go on. Returns the state (WORK/state.json), saved after each step."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    path = work / "state.json"
    state = load_state(path)
    failed = set()
    for step in steps:
        if done(state, step.name):
            say(f"{step.name}: done earlier")
            continue
        if missing := [n for n in step.needs if n in failed]:
            failed.add(step.name)
            say(f"{step.name}: skipped, {missing[0]} failed")
            continue
        if state["steps"].get(step.name, {}).get("loaded") and step.out is not None:
            shutil.rmtree(step.out, ignore_errors=True)  # timed again from scratch on a quiet machine
        log = work / "logs" / f"{step.name}.log"
        say(f"{step.name}: running, log {log}" if step.argv else f"{step.name}: running")
        before = os.getloadavg()[0]
        try:
            figures = execute(step, log)
        except Exception as e:
            if step.run is not None:  # a step run in this process: its traceback is its log
                log.write_text(traceback.format_exc())
            failed.add(step.name)
            line = " ".join(str(e).split())
            state["steps"][step.name] = {"status": "failed", "error": line, "log": str(log)}
            save_state(path, state)
            say(f"{step.name} ({step.phase}) failed: {line}; see {log}")
            continue
        time.sleep(cool_s)
        after = os.getloadavg()[0]
        state["steps"][step.name] = {"status": "done", "phase": step.phase, "log": str(log),
                                     "load_before": before, "load_after": after,
                                     "loaded": max(before, after) > LOADED, **figures}
        save_state(path, state)
        if state["steps"][step.name]["loaded"]:
            say(f"{step.name}: loaded (load {before:.2f} before, {after:.2f} after): runs again next time")
    return state


# ---- tokens seen: the peers' from their step events (train/peers.py), draftsmith's from its checkpoints ----------

def token_share(cache: Path, inputs: Path) -> float | None:
    """The share of draftsmith's packed positions that hold a token: its cache holds the packed rows (positions),
    the peers' input the same conversations unpacked (tokens). None without both."""
    try:
        return json.loads((inputs / "manifest.json").read_text())["tokens"] / \
            json.loads((cache / "manifest.json").read_text())["tokens"]
    except (OSError, ValueError, KeyError):
        return None


def draftsmith_trained(ckpt: Path, share: float | None) -> dict:
    """What a draftsmith checkpoint was trained on: steps, positions as its loop counts them (train/bench.py
    `tokens_seen`: steps x batch x grad_accum x processes x max_length, packed rows with their padding), tokens (the
    positions x `share`, `token_share`: exact over whole epochs) and training seconds (its steps only: evaluations
    and saves excluded, which a peer's include)."""
    from draftsmith.data.core import read_file
    from draftsmith.train.bench import run_config, tokens_seen

    state = read_file(ckpt / "state.json", f"delete {ckpt} (a damaged checkpoint)")
    positions = tokens_seen(run_config(ckpt), state)
    return {"steps": state["step"], "positions": positions,
            "tokens": round(positions * share) if positions is not None and share is not None else None,
            "train_seconds": state["train_seconds"]}


def draftsmith_result(run: Path, cache: Path, inputs: Path) -> dict:
    """draftsmith's run in the terms of a peer's result.json, from its last checkpoint (`draftsmith_trained`), with
    the epochs and tokens/s."""
    from draftsmith.data.core import checkpoints

    found = checkpoints(run)
    if not found:
        raise FileNotFoundError(f"draftsmith left no checkpoint in {run}")
    share = token_share(cache, inputs)
    r = draftsmith_trained(found[-1], share)
    epoch = json.loads((cache / "manifest.json").read_text())["tokens"]  # the positions of all its packed rows
    return {**r, "token_share": share, "train_seconds": round(r["train_seconds"], 1),
            "epochs": round(r["positions"] / epoch, 3) if r["positions"] is not None else None,
            "tokens_per_s": round(r["tokens"] / r["train_seconds"], 1) if r["tokens"] and r["train_seconds"] else None}


def checkpoints_of(name: str, run: Path, started: float, work: Path) -> list[dict]:
    """Each checkpoint a run kept, oldest first: its name, training minutes, tokens seen and path: draftsmith's
    checkpoint's model/ (its training seconds and tokens, `draftsmith_trained`), a peer's checkpoint directory
    (minutes from its first optimizer step, or from `started` before one; tokens those of the steps made by the time
    it was saved)."""
    from draftsmith.data.core import checkpoints
    from draftsmith.train import peers

    if name == "draftsmith":
        share = token_share(work / "inputs/cache", work / "inputs/peers")
        trained = [(c, draftsmith_trained(c, share)) for c in checkpoints(run)]
        return [{"checkpoint": c.name, "minutes": round(t["train_seconds"] / 60, 1), "tokens": t["tokens"],
                 "path": c / "model"} for c, t in trained]
    events = peers.read_events(run / "main" / "events.txt")
    t0 = events.steps[0] if events.steps else started
    # speculators: a directory per epoch (and `interrupted`) beside links to them; SpecForge: <run_id>-step<N>
    found = [d for d in (run / "main" / "checkpoints").glob("*") if not d.is_symlink() and (
        (d / "model.safetensors").is_file() if name.startswith("speculators") else d.name.startswith(
            f"{peers.RUN_ID}-step"))]
    return [{"checkpoint": d.name, "minutes": round((d.stat().st_mtime - t0) / 60, 1),
             "tokens": peers.tokens_until(events, d.stat().st_mtime), "path": d}
            for d in sorted(found, key=lambda d: d.stat().st_mtime)]


# ---- judge and report -----------------------------------------------------------------------------------------

def proposer_of_export(name: str, export: Path, target, gamma: int):
    """Our decoder's proposer of a peer's export, its weights read as the engine its layout is for reads them
    (models/eagle_export.py: speculators' by vLLM's speculators reader, SpecForge's LlamaForCausalLMEagle3 by
    SGLang's). Both peers ship the target's embedding as embed_tokens.weight, where our proposer drafts with the
    target's own: it must equal it."""
    import torch
    from safetensors import safe_open

    from draftsmith.models import registry as R
    from draftsmith.models.eagle_proposer import EagleProposer

    with safe_open(export / "model.safetensors", "pt") as f:
        embed = f.get_tensor("embed_tokens.weight") if "embed_tokens.weight" in f.keys() else None
    if embed is not None and not torch.equal(embed, target.embed.weight.detach().to(embed.dtype)):
        raise ValueError(f"{export}: its embed_tokens.weight is not the target's embedding, which our decoder drafts "
                         "with")
    drafter, meta = R.load("eagle", "speculators" if name.startswith("speculators") else "sglang", export)
    return EagleProposer(drafter.to(target.lm_head.weight.dtype), target.embed, target.lm_head, meta["aux_layers"],
                         gamma=gamma)


def judge(args: argparse.Namespace, name: str) -> dict:
    """Trainer `name`'s drafter served by llama-server on both prompt sets at T=0 and T=1, greedy outputs compared
    with plain decoding's (the step judge-plain), our decoder's tau beside it; each of its intermediate checkpoints at
    T=0 on the held-out prompts, with its minutes and tokens seen (one that fails is recorded with its error). Written
    to WORK/judge/NAME.json."""
    import torch

    from draftsmith.data.core import find_drafter, one_line
    from draftsmith.data.reference import load_prompts
    from draftsmith.decoding.evaluate import render_prompts
    from draftsmith.models import llama_cpp
    from draftsmith.models import registry as R
    from draftsmith.models.serve_bench import ours, serve, target_ggufs
    from draftsmith.models.target import load_target
    from draftsmith.train import peers

    w, state = args.work, load_state(args.work / "state.json")["steps"]
    torch.set_num_threads(args.threads)
    target = load_target(TARGET)
    gguf = target_ggufs(TARGET, Path(target.path), ["f32"])["f32"]
    prompts = {k: render_prompts(target.tokenizer, load_prompts(DATA / f, limit=args.num_prompts))
               for k, f in (("heldout", "heldout_prompts.jsonl"), ("other", "other_prompts.jsonl"))}
    temps, n = [0.0, 1.0], ["--spec-draft-n-max", str(args.draft_n)]

    def gguf_of(drafter: Path, out: Path) -> Path:
        if (drafter / "drafter.json").is_file():  # draftsmith's own
            return R.export(drafter, "gguf", out, overwrite=True) / llama_cpp.GGUF_FILE
        return llama_cpp.convert(drafter, out.with_suffix(".gguf"), "f32", target_dir=target.path)

    ids = {k: [x[0].tolist() for x in p] for k, p in prompts.items()}
    judged, here = w / "judge" / f"{name}.json", w / "judge" / name
    here.mkdir(parents=True, exist_ok=True)
    if name == "plain":
        r = {k: serve(gguf, [], ids[k], args.max_new_tokens, temps, args.threads) for k in prompts}
    else:
        plain = json.loads((w / "judge" / "plain.json").read_text())
        step, run = state[f"train-{name}"], w / "train" / name
        final = find_drafter(run) if name == "draftsmith" else Path(step["result"]["export"])
        spec = ["--spec-type", "draft-eagle3", "-md", str(gguf_of(final, here / "final"))]
        r = {"drafter": str(final), "llama_cpp": {}, "checkpoints": []}
        for k in prompts:
            r["llama_cpp"][k] = serve(gguf, spec + n, ids[k], args.max_new_tokens, temps, args.threads)
            r["llama_cpp"][k]["greedy_equals_plain"] = r["llama_cpp"][k]["0"]["outputs"] == plain[k]["0"]["outputs"]
        try:
            proposer = R.load_proposer(str(final), target.model, gamma=args.draft_n) if name == "draftsmith" else \
                proposer_of_export(name, final, target, args.draft_n)
            r["ours"] = {k: ours(target.model, proposer, p, args.max_new_tokens, args.draft_n, temps)
                         for k, p in prompts.items()}
        except Exception as e:  # a layout our loaders refuse: said, and the rest of the judgement kept
            r["ours"] = {"not_loadable": one_line(e)}
        for c in checkpoints_of(name, run, step["started"], w):
            path = c.pop("path")
            try:  # a peer's checkpoint exported as llama.cpp's converter reads it
                drafter = path if name == "draftsmith" else \
                    peers.export(name.split("-")[0], w / "inputs/peers", path, here / "checkpoints" / path.name)
                model = ["--spec-type", "draft-eagle3", "-md", str(gguf_of(drafter, here / f"c-{c['checkpoint']}"))]
                c["acceptance_length"] = serve(gguf, model + n, ids["heldout"], args.max_new_tokens, [0.0],
                                               args.threads)["0"]["acceptance_length"]
            except Exception as e:
                c["error"] = one_line(e)
            r["checkpoints"].append(c)
    judged.write_text(json.dumps(r, indent=1) + "\n")
    return {"judgement": str(judged)}


def at_equal_tokens(drafters: dict[str, dict]) -> dict:
    """The largest token count that every trainer's judged checkpoints reach, and each trainer's checkpoint nearest
    to it (its name, minutes, tokens and acceptance length); {} when no trainer has one."""
    judged = {n: [c for c in r.get("checkpoints", []) if c.get("tokens") and "acceptance_length" in c]
              for n, r in drafters.items()}
    judged = {n: cs for n, cs in judged.items() if cs}
    if not judged:
        return {}
    tokens = min(max(c["tokens"] for c in cs) for cs in judged.values())
    return {"tokens": tokens, "nearest": {n: min(cs, key=lambda c: abs(c["tokens"] - tokens))
                                          for n, cs in judged.items()}}


def report(args: argparse.Namespace) -> dict:
    """benchmarks/peers.json from the state and the judgement; benchmarks/peers.png from the checkpoints."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judge = args.work / "judge"
    judged = {"plain": json.loads((judge / "plain.json").read_text()) if (judge / "plain.json").is_file() else None,
              "drafters": {f.stem: json.loads(f.read_text()) for f in sorted(judge.glob("*.json"))
                           if f.stem != "plain"}}
    for p in PEERS:  # the better of a peer's own lr and ours, by T=0 held-out acceptance length
        rows = {n: judged["drafters"][n]["llama_cpp"]["heldout"]["0"]["acceptance_length"] or 0
                for n in (p, f"{p}-our-lr") if n in judged["drafters"]}
        if rows:
            judged["drafters"][max(rows, key=rows.get)]["better_of_its_two_lrs"] = True
    steps = load_state(args.work / "state.json")["steps"]
    trainers = {k.removeprefix("train-"): {f: s["result"].get(f) for f in TRAINED}
                for k, s in steps.items() if k.startswith("train-") and s["status"] == "done" and "result" in s}
    results = {"command": shlex.join(["python", "scripts/bench_peers.py", *sys.argv[1:]]), "settings": vars(args) | {
        "work": str(args.work)}, "machine": {"processor": platform.processor() or platform.machine(),
                                             "cpus": os.cpu_count(), "python": platform.python_version()},
               "steps": steps, "trainers": trainers, "at_equal_tokens": at_equal_tokens(judged["drafters"]), **judged}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, r in judged["drafters"].items():
        for ax, (x, unit) in zip(axes, (("minutes", 1), ("tokens", 1e6)), strict=True):
            pts = sorted((c[x] / unit, c["acceptance_length"]) for c in r.get("checkpoints", [])
                         if c.get(x) is not None and c.get("acceptance_length"))
            ax.plot([v for v, _ in pts], [a for _, a in pts], marker="o", label=name)
    axes[0].set_xlabel("training minutes")
    axes[1].set_xlabel("tokens seen (millions)")
    axes[0].set_ylabel("acceptance length, llama-server, T=0, held-out")
    fig.suptitle(f"EAGLE-3 trainers on {TARGET}, {args.budget_minutes:g} min each")
    if axes[1].lines:
        axes[1].legend()
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    return {"report": str(args.out), "plot": str(args.plot)}


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "runs/bench-peers", help="inputs, runs, logs, state.json")
    parser.add_argument("--budget-minutes", type=float, default=30.0, help="training time of each trainer")
    parser.add_argument("--lr", type=float, default=1e-3, help="our lr (the recipe's): draftsmith's, and each "
                        "peer's second row")
    parser.add_argument("--conversations", type=int, default=0, help="the first N of the recipe's training "
                        "conversations (default: all)")
    parser.add_argument("--num-prompts", type=int, default=16, help="of each prompt set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-n", type=int, default=5, help="draft length: llama.cpp's and our chain's")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cool-seconds", type=float, default=COOL_S, help="wait after each step before its "
                        "'after' load average (0 for a run whose timings do not matter)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/peers.json")
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks/peers.png")
    parser.add_argument("--plan", action="store_true", help="print the phases and their commands, run nothing")
    args = parser.parse_args(argv)
    steps = plan(args)
    if args.plan:
        state = load_state(args.work / "state.json")
        for s in steps:
            what = shlex.join(s.argv) if s.argv else f"(in this process) {s.what}"
            print(f"[{s.phase}] {s.name}{' (done)' if done(state, s.name) else ''}: {what}")
        return None
    state = run_all(steps, args.work, args.cool_seconds)
    failed = [n for n, s in state["steps"].items() if s["status"] == "failed"]
    if failed:
        raise RuntimeError(f"{len(failed)} step(s) failed ({', '.join(failed)}), each named above with its log; fix "
                           "them and run again: finished steps are kept")
    return state
