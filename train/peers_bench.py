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
          more at our lr (--lr); the report names the better of a peer's two rows;
  judge   every drafter converted with llama.cpp's converter and served by llama-server (F32 target) on the held-out
          and the other-domain prompts at T=0 and T=1: acceptance length and by position, tokens/s against plain
          decoding, greedy equality; beside it our decoder's tau with the same drafter (a peer's layout our decoder
          cannot load is recorded as such); every intermediate checkpoint at T=0 on the held-out prompts;
  report  benchmarks/peers.json (every figure, the command, the machine, each step's load average before and after)
          and benchmarks/peers.png (acceptance length against training minutes).
A step with a 1-minute load average above 1.5 before it or after it (taken a minute after it ends, once its own
load has decayed) is recorded as loaded and run again on the next invocation. A step that fails prints one line
naming it and its log; the steps that do not need it still run, and the report holds what finished.
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


@dataclass
class Step:
    """One step of a phase: a command run in a child process (its output in WORK/logs/NAME.log), or `run` called in
    this process (`what` it does, for --plan). `out` is what it writes: removed before a step recorded as loaded
    runs again. It is skipped when a step it `needs` failed."""

    name: str
    phase: str
    argv: list[str] = field(default_factory=list)
    run: Callable[[], dict] | None = None
    what: str = ""
    out: Path | None = None
    needs: tuple[str, ...] = ()


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
             Step("train-draftsmith", "train", [
                 *py, "-m", "draftsmith.train.cli", "train", "eagle3", str(RECIPE), *DRAFTER,
                 f"offline.path={cache}", f"loop.max_minutes={args.budget_minutes:g}", f"loop.lr={args.lr:g}",
                 f"loop.output_dir={w / 'train/draftsmith'}", f"loop.keep_last={CHECKPOINTS + 2}",
                 f"loop.save_every={max(1, int(STEPS_PER_MINUTE * args.budget_minutes / CHECKPOINTS))}"],
                 out=w / "train/draftsmith", needs=("inputs-draftsmith",))]
    for suffix, lr in (("", None), ("-our-lr", args.lr)):
        steps += [Step(f"train-{p}{suffix}", "train", [
            *py, "-m", "draftsmith.train.peers", "train", p, "--inputs", str(inputs), "--out",
            str(w / f"train/{p}{suffix}"), "--budget-minutes", f"{args.budget_minutes:g}",
            *(["--lr", f"{lr:g}"] if lr else [])], out=w / f"train/{p}{suffix}", needs=(f"setup-{p}", "inputs-peers"))
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
    result = step.out / "result.json" if step.out is not None else None
    if result is not None and result.is_file():  # a peer's run: steps, training seconds, its export
        figures["result"] = json.loads(result.read_text())
    metrics = step.out / "metrics.jsonl" if step.out is not None else None
    if metrics is not None and metrics.is_file():  # draftsmith's run: its logged steps, epoch and tokens/s
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if '"tokens_per_s"' in line]
        figures["result"] = {"steps": rows[-1]["step"], "epochs": rows[-1]["epoch"],
                             "tokens_per_s": sum(r["tokens_per_s"] for r in rows) / len(rows)} if rows else {}
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


def checkpoints_by_minute(name: str, run: Path, started: float, inputs: Path, out: Path) -> dict[float, Path]:
    """Training minutes -> the drafter of each checkpoint a run kept: draftsmith's checkpoint's model/ (minutes from
    the step's start, loading included), a peer's checkpoint exported as llama.cpp's converter reads it
    (train/peers.py `export`; minutes from its first optimizer step)."""
    from draftsmith.data.core import checkpoints
    from draftsmith.train import peers

    if name == "draftsmith":
        return {round((c.stat().st_mtime - started) / 60, 1): c / "model" for c in checkpoints(run)}
    main = run / "main"
    first = peers.read_events(main / "events.txt")[0][:1] or [started]
    # speculators: a directory per epoch (and `interrupted`) beside links to them; SpecForge: <run_id>-step<N>
    found = [d for d in (main / "checkpoints").glob("*") if not d.is_symlink() and (
        (d / "model.safetensors").is_file() if name.startswith("speculators") else d.name.startswith(
            f"{peers.RUN_ID}-step"))]
    return {round((d.stat().st_mtime - first[0]) / 60, 1): peers.export(name.split("-")[0], inputs, d, out / d.name)
            for d in found}


def judge(args: argparse.Namespace, name: str) -> dict:
    """Trainer `name`'s drafter served by llama-server on both prompt sets at T=0 and T=1, greedy outputs compared
    with plain decoding's (the step judge-plain), our decoder's tau beside it; each of its intermediate checkpoints at
    T=0 on the held-out prompts. Written to WORK/judge/NAME.json."""
    import torch

    from draftsmith.data.core import find_drafter, one_line
    from draftsmith.data.reference import load_prompts
    from draftsmith.decoding.evaluate import render_prompts
    from draftsmith.models import llama_cpp
    from draftsmith.models import registry as R
    from draftsmith.models.serve_bench import ours, serve, target_ggufs
    from draftsmith.models.target import load_target

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
    if name == "plain":
        r = {k: serve(gguf, [], ids[k], args.max_new_tokens, temps, args.threads) for k in prompts}
    else:
        plain = json.loads((w / "judge" / "plain.json").read_text())
        step, run = state[f"train-{name}"], w / "train" / name
        final = find_drafter(run) if name == "draftsmith" else Path(step["result"]["export"])
        spec = ["--spec-type", "draft-eagle3", "-md", str(gguf_of(final, here / "final"))]
        r = {"drafter": str(final), "llama_cpp": {}, "ours": {}, "by_minute": {}}
        for k, p in prompts.items():
            r["llama_cpp"][k] = serve(gguf, spec + n, ids[k], args.max_new_tokens, temps, args.threads)
            r["llama_cpp"][k]["greedy_equals_plain"] = r["llama_cpp"][k]["0"]["outputs"] == plain[k]["0"]["outputs"]
            try:
                r["ours"][k] = ours(target.model, final, p, args.max_new_tokens, args.draft_n, temps)
            except Exception as e:  # a peer's layout our registry has no reader for
                r["ours"][k] = {"not_loadable": one_line(e)}
        for minute, d in checkpoints_by_minute(name, run, step["started"], w / "inputs/peers",
                                               here / "checkpoints").items():
            model = ["--spec-type", "draft-eagle3", "-md", str(gguf_of(d, here / f"m{minute:g}"))]
            r["by_minute"][f"{minute:g}"] = serve(gguf, model + n, ids["heldout"], args.max_new_tokens, [0.0],
                                                  args.threads)["0"]["acceptance_length"]
    judged.write_text(json.dumps(r, indent=1) + "\n")
    return {"judgement": str(judged)}


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
    results = {"command": shlex.join(["python", "scripts/bench_peers.py", *sys.argv[1:]]), "settings": vars(args) | {
        "work": str(args.work)}, "machine": {"processor": platform.processor() or platform.machine(),
                                             "cpus": os.cpu_count(), "python": platform.python_version()},
               "steps": load_state(args.work / "state.json")["steps"], **judged}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in judged["drafters"].items():
        pts = sorted((float(m), a) for m, a in r["by_minute"].items() if a)
        ax.plot([m for m, _ in pts], [a for _, a in pts], marker="o", label=name)
    ax.set_xlabel("training minutes")
    ax.set_ylabel("acceptance length, llama-server, T=0, held-out")
    ax.set_title(f"EAGLE-3 trainers on {TARGET}, {args.budget_minutes:g} min each")
    ax.legend()
    fig.tight_layout()
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
    state = run_all(steps, args.work)
    failed = [n for n, s in state["steps"].items() if s["status"] == "failed"]
    if failed:
        raise RuntimeError(f"{len(failed)} step(s) failed ({', '.join(failed)}), each named above with its log; fix "
                           "them and run again: finished steps are kept")
    return state

