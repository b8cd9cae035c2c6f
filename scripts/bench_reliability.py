"""Try bad inputs and faults as a new user would, and record what each one did.

    python scripts/bench_reliability.py [--out benchmarks/reliability.json] [--only NAME ...]

Every case runs the real command lines (train/*.py, the draftsmith command, scripts/main.sh) in a subprocess on the
committed reference target, with tiny overrides so that training cases take seconds. Per case it records
what was tried, the exit status, the message the user saw (the last line of the output), whether a
Python traceback was shown, what was left on disk (the run directory, each checkpoint and whether its
manifest verifies), and whether all of that matched what the case expects (`ok`). Free space cannot be
filled safely on a shared machine, so the two disk cases shrink the free space `shutil.disk_usage`
reports inside the command's own process (`simulated`: true). The server cases run `draftsmith regenerate
--server` against a scripted fake server in this process (tests/openai_server.py) with the retry backoff shortened
to 0.05 s (`simulated`: true), then the same command against a healthy one; the process case sends SIGTERM to a
process holding a stand-in llama-server that ignores SIGTERM (tests/fake_llama_server.py). The rank-fault cases
launch 2 CPU processes with `accelerate launch -q`, one of which tests/rank_faults.py kills, stops or makes raise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from draftsmith.data.server import TRIES
from draftsmith.models.target import REFERENCE_TARGET
from draftsmith.train import guard
from draftsmith.train.loop import checkpoints

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the fake servers of the tests
from fake_llama_server import install  # noqa: E402
from openai_server import FakeServer, echo  # noqa: E402

WORK = REPO / "runs" / "bench-reliability"
PY = sys.executable
DRAFTSMITH = [str(Path(PY).parent / "draftsmith")]  # the console script, as a user runs it
TINY = ["loop.max_steps=2", "loop.batch_size=2", "data.limit=16", "data.pack=false", "eval.num_prompts=1",
        "eval.max_new_tokens=8", "eval.heldout_examples=4", "loop.save_every=1", "loop.keep_last=2", "loop.log_every=1"]
LONG = [*TINY, "loop.max_steps=400", "loop.save_every=200", "eval.num_prompts=0", "loop.best_metric="]
# runs the command with shutil.disk_usage reporting 1 MiB free from the first checkpoint / the export on
LOW_DISK = ("import runpy, shutil, sys; real = shutil.disk_usage; "
            "shutil.disk_usage = lambda p: real(p)._replace(free=1 << 20); "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
# runs the command with data/server.py's backoff 0.05 s doubling (not 2 s): a server case takes seconds, not minutes
FAST_RETRIES = ("import runpy, sys; from draftsmith.data import server; server.BACKOFF = 0.05; "
                "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
PROMPTS = ["def add(a, b):", "def neg(a):", "def twice(a):", "def zero(a):"]  # one request each


@dataclass
class Case:
    name: str
    kind: str  # config, target, data, divergence, corrupt checkpoint, refused resume, lock, signal, disk, export ...
    tried: str  # in words, what a user did
    run: Callable[[Path], dict]  # work dir -> {"argv", "rc", "output", extra}
    expect_message: str = ""  # regex the message must match
    expect_rc: int | None = 1
    expect_disk: Callable[[Path], bool] = lambda d: True
    simulated: bool = False
    launcher_traceback: bool = False  # accelerate's own KeyboardInterrupt traceback is expected


def train_cmd(*overrides: str, script: str = "train/medusa.py", launcher: list[str] | None = None,
              pre: list[str] | None = None) -> list[str]:
    """A training command line: [launcher or python] [interpreter args] script overrides."""
    return [*(launcher or [PY]), *(pre or []), script, *overrides]


def command(argv: list[str], wait: bool = True, group: bool = False, env: dict | None = None) -> dict | subprocess.Popen:
    """Run argv from the repository (hub offline, no debug switch, `env` added): its record, or the process when not
    waiting (in a process group of its own with `group`, as a terminal would start it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    env.pop(guard.DEBUG, None)
    if not wait:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=group)
    p = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)  # one stream, in the order a terminal shows it
    return {"argv": argv, "rc": p.returncode, "output": p.stdout}


def finish(p: subprocess.Popen, argv: list[str]) -> dict:
    out, _ = p.communicate(timeout=900)
    return {"argv": argv, "rc": p.returncode, "output": out}


def wait_for(path: Path, seconds: float = 600) -> None:
    end = time.time() + seconds
    while not path.exists():
        if time.time() > end:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.5)


def message(output: str) -> str:
    """What the user reads last: the error or stop line, else the last line that is not a progress bar."""
    lines = [line.strip() for line in re.split(r"[\r\n]", output) if line.strip()]
    lines = [line for line in lines if "it/s]" not in line and "s/it]" not in line and "%|" not in line]
    for line in reversed(lines):
        if re.search(r"(^|: )error: |stopped by |^export: |^usage: ", line):
            return line
    return lines[-1] if lines else ""


def on_disk(d: Path) -> dict:
    """The run directory as left: its entries, and each checkpoint with what its manifest says."""
    if not d.exists():
        return {"exists": False}
    return {"exists": True, "entries": sorted(p.name for p in d.iterdir()),
            "checkpoints": {c.name: guard.verify(c) or "verifies" for c in checkpoints(d)}}


# ---- the set-ups --------------------------------------------------------------------------------------------

def trained(d: Path, *extra: str) -> Path:
    """A finished tiny Medusa run (2 steps, a checkpoint at each) to fault."""
    r = command(train_cmd(f"loop.output_dir={d}", *TINY, *extra))
    if r["rc"]:
        raise RuntimeError(f"set-up run failed: {message(r['output'])}")
    return d


def file_case(content: str, key: str, suffix: str = ".jsonl") -> Callable[[Path], dict]:
    def run(d: Path) -> dict:
        f = d.parent / f"{d.name}{suffix}"
        f.write_text(content)
        return command(train_cmd(f"loop.output_dir={d}", *TINY, f"{key}={f}", "data.cache=false"))
    return run


def truncated_target(d: Path) -> dict:
    t = d.parent / f"{d.name}-target"
    shutil.copytree(REFERENCE_TARGET, t)
    with open(t / "model.safetensors", "r+b") as fh:
        fh.truncate(1_000_000)
    return command(train_cmd(f"loop.output_dir={d}", *TINY, f"target.path={t}"))


def weightless_target(d: Path) -> dict:
    t = d.parent / f"{d.name}-target"
    shutil.copytree(REFERENCE_TARGET, t, ignore=shutil.ignore_patterns("*.safetensors"))
    return command(train_cmd(f"loop.output_dir={d}", *TINY, f"target.path={t}"))


def empty_target(d: Path) -> dict:
    (d.parent / f"{d.name}-target").mkdir()
    return command(train_cmd(f"loop.output_dir={d}", *TINY, f"target.path={d.parent / f'{d.name}-target'}"))


def diverging(d: Path) -> dict:
    return command(train_cmd(f"loop.output_dir={d}", *TINY, "loop.max_steps=40", "loop.lr=1e6", "eval.num_prompts=0",
                          "loop.best_metric="))


def signalled(signum: int, accelerate: bool = False) -> Callable[[Path], dict]:
    def run(d: Path) -> dict:
        launcher = [PY, "-m", "accelerate.commands.launch", "--num_processes", "1"] if accelerate else None
        argv = train_cmd(f"loop.output_dir={d}", *LONG, launcher=launcher)
        p = command(argv, wait=False, group=accelerate)
        wait_for(d / "metrics.jsonl")
        if accelerate:  # Ctrl-C in a terminal signals the launcher and the trainer alike
            os.killpg(p.pid, signum)
        else:
            p.send_signal(signum)
        return finish(p, argv)
    return run


def corrupt_latest(d: Path) -> dict:
    trained(d)
    with open(d / "checkpoint-2" / "trainable.safetensors", "r+b") as fh:
        fh.truncate(100)
    return command(train_cmd(f"loop.output_dir={d}", *TINY, "loop.max_steps=3"))


def corrupt_all(d: Path) -> dict:
    trained(d)
    for c in checkpoints(d):
        (c / "optimizer.pt").write_bytes(b"")
    return command(train_cmd(f"loop.output_dir={d}", *TINY, "loop.max_steps=3"))


def leftover_tmp(d: Path) -> dict:
    trained(d)
    shutil.copytree(d / "checkpoint-2", d / "checkpoint-3.tmp")
    (d / "checkpoint-3.tmp" / "trainable.safetensors").write_bytes(b"half")
    r = command(train_cmd(f"loop.output_dir={d}", *TINY, "loop.max_steps=3"))
    e = command([*DRAFTSMITH, "export", str(d), "--format", "medusa", "--out", str(d / "export")])
    return {**r, "output": r["output"] + e["output"], "rc": r["rc"] or e["rc"]}


def changed_shape(*change: str) -> Callable[[Path], dict]:
    def run(d: Path) -> dict:
        script = "train/eagle.py" if any(c.startswith("eagle.") for c in change) else "train/medusa.py"
        r = command(train_cmd(f"loop.output_dir={d}", *TINY, script=script))
        if r["rc"]:
            raise RuntimeError(message(r["output"]))
        before = (d / "config.yaml").read_text(), (d / "command.txt").read_text()
        r = command(train_cmd(f"loop.output_dir={d}", *TINY, "loop.max_steps=3", *change, script=script))
        r["config_unchanged"] = before == ((d / "config.yaml").read_text(), (d / "command.txt").read_text())
        return r
    return run


def second_trainer(d: Path) -> dict:
    argv = train_cmd(f"loop.output_dir={d}", *LONG)
    first = command(argv, wait=False)
    wait_for(d / "metrics.jsonl")
    r = command(argv)
    first.send_signal(signal.SIGTERM)
    finish(first, argv)
    return r


def killed_then_restarted(d: Path) -> dict:
    argv = train_cmd(f"loop.output_dir={d}", *LONG)
    p = command(argv, wait=False)
    wait_for(d / "metrics.jsonl")
    p.kill()  # kill -9: no handler runs, the lock stays behind
    p.wait()
    lock_left = (d / guard.LOCK).exists()
    r = command(train_cmd(f"loop.output_dir={d}", *TINY, "loop.max_steps=1"))
    return {**r, "lock_left_by_kill": lock_left}


def logged_steps(d: Path) -> list[int]:
    """The steps of the training lines in d/metrics.jsonl, in order (a line still being written is left out)."""
    lines = (d / "metrics.jsonl").read_text().splitlines(keepends=True) if (d / "metrics.jsonl").is_file() else []
    return [r["step"] for r in (json.loads(line) for line in lines if line.endswith("\n")) if "loss" in r]


def killed_between_checkpoints(d: Path) -> dict:
    """kill -9 a run once it logged a step past a checkpoint, before the next one, then run the same command again."""
    argv = train_cmd(f"loop.output_dir={d}", *LONG, "loop.max_steps=12", "loop.save_every=4")
    p = command(argv, wait=False)
    while p.poll() is None and not (checkpoints(d) and logged_steps(d)
                                    and logged_steps(d)[-1] > int(checkpoints(d)[-1].name.split("-")[1])):
        time.sleep(0.05)
    p.kill()
    finish(p, argv)
    before, resumed_from = logged_steps(d), checkpoints(d)[-1].name
    r = command(argv)
    past = before[-1] > int(resumed_from.split("-")[1])  # the kill came between two checkpoints
    return {**r, "logged_before_resume": before, "resumed_from": resumed_from, "logged_after_resume": logged_steps(d),
            "each_step_once": past and logged_steps(d) == list(range(1, 13))}


def stale_build_lock(d: Path) -> dict:
    """A DeepSpeed launch (ZeRO-2, one CPU process) meeting the lock of a build of its op killed an hour ago, in a
    TORCH_EXTENSIONS_DIR of its own (the user's builds stay as they are; the op is built there afresh)."""
    lock = d.parent / f"{d.name}-torch-extensions" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    for p in (lock, lock.parent):
        os.utime(p, (time.time() - 3600,) * 2)
    launcher = [PY, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/zero2.yaml",
                "--num_processes", "1"]
    r = command(train_cmd(f"loop.output_dir={d}", *TINY, launcher=launcher),
                env={"TORCH_EXTENSIONS_DIR": str(lock.parent.parent)})
    return {**r, "lock_named": f"warning: removing {lock}, the lock of a build that is gone" in r["output"]}


def rank_fault(fault: str, rank: int, config: str = "") -> Callable[[Path], dict]:
    """A 2-process launch on CPU (gloo; FSDP2 through tests/fsdp_on_cpu.py) whose rank `rank` faults after step 6
    (tests/rank_faults.py; checkpoints every 4 steps, collectives time out after 20 s); then the same command
    without the fault, which must resume to the end."""
    def run(d: Path) -> dict:
        how = ["--config_file", config] if config else ["--multi_gpu"]
        fsdp = ["tests/fsdp_on_cpu.py"] if config else []
        launcher = [PY, "-m", "accelerate.commands.launch", "-q", *how, "--num_processes", "2"]
        overrides = [f"loop.output_dir={d}", *LONG, "loop.max_steps=12", "loop.save_every=4",
                     "loop.collective_timeout_minutes=0.33"]
        env = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
        r = command(train_cmd(*overrides, launcher=launcher, pre=["tests/rank_faults.py", fault, str(rank), "6", *fsdp]),
                    env=env)
        ended = time.time()
        fault_at = re.search(r"fault: \w+ rank \d+ at (\S+)", r["output"])
        alive = [p.pid for p in psutil.process_iter(["cmdline"]) if f"loop.output_dir={d}" in (p.info["cmdline"] or [])]
        kept = not guard.verify(d / "checkpoint-4")
        again = command(train_cmd(*overrides, launcher=launcher, pre=fsdp), env=env)
        after = ended - float(fault_at.group(1)) if fault_at else math.inf
        return {**r, "seconds_after_fault": round(after, 1),
                # at once, or (a stopped rank) the 20-s collective timeout plus the launcher's 30-s grace to SIGKILL
                "ended_in_time": after < (60 if fault == "hang" else 10),
                "one_error_line": r["output"].count(": error: ") == 1,
                "nothing_left_running": not alive, "last_checkpoint_verifies": kept,
                "resumed_to_the_end": again["rc"] == 0 and f"resumed from {d}/checkpoint-4" in again["output"]}
    return run


def low_disk_checkpoint(d: Path) -> dict:
    return command(train_cmd(f"loop.output_dir={d}", *TINY, pre=["-c", LOW_DISK]))


def low_disk_export(d: Path) -> dict:
    trained(d)
    return command([PY, "-c", LOW_DISK, DRAFTSMITH[0], "export", str(d), "--format", "hf", "--out", str(d / "export")])


def export_case(script: str, fmt: str, *extra: str) -> Callable[[Path], dict]:
    """Train a tiny run of `script` from the repository with its recipe's relative target.path, export it, and
    evaluate the export with `draftsmith evaluate`; the record keeps the export's target fields and both taus."""
    def run(d: Path) -> dict:
        r = command(train_cmd(f"loop.output_dir={d}", *TINY, *extra, script=script))
        if r["rc"]:
            return r
        out = d / f"export-{fmt}"
        e = command([*DRAFTSMITH, "export", str(d), "--format", fmt, "--out", str(out)])
        if e["rc"]:
            return e
        best = json.loads((d / "best" / "best.json").read_text())
        logged = best.get("tau", best.get("tau_exit2"))
        v = command([*DRAFTSMITH, "evaluate", "--drafter", str(out), "--num-prompts", "1", "--max-new-tokens", "8",
                     "--out", str(d / "evaluate.json")])
        side = json.loads((out / "draftsmith_export.json").read_text())
        measured = json.loads((d / "evaluate.json").read_text())["tau"] if not v["rc"] else None
        return {**v, "export": {k: side.get(k) for k in ("method", "format", "target", "target_as_given")},
                "tau_logged_at_checkpoint": logged, "tau_from_export": measured,
                "assistant_early_exit": json.loads((out / "generation_config.json").read_text()).get(
                    "assistant_early_exit") if (out / "generation_config.json").is_file() else None}
    return run


def main_sh(d: Path) -> dict:
    r = command(["bash", "scripts/main.sh", f"loop.output_dir={d}", *TINY])
    r["export_in_output_dir"] = (d / "export" / "medusa_lm_head.safetensors").is_file()
    return r


def exported(d: Path, *args: str) -> dict:
    trained(d)
    (d / "taken").mkdir()
    (d / "taken" / "file").write_text("user data")
    return command([*DRAFTSMITH, "export", str(d), *args])


def cut(f: Path, keep: int = 200) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(keep)


def cache_shard_cut(d: Path) -> dict:
    """An EAGLE-1 hidden-state cache of 16 rows in 2 shards, the second cut to 200 bytes; train from it."""
    cache = d.parent / f"{d.name}-cache"
    r = command([*DRAFTSMITH, "cache", "--config", "recipes/eagle/tiny-code.yaml", "--out", str(cache),
                 "--shard-tokens", "2000", "data.limit=16", "data.cache=false"])
    if r["rc"]:
        raise RuntimeError(f"set-up cache failed: {message(r['output'])}")
    cut(sorted(cache.glob("shard-*.safetensors"))[-1])
    return command(train_cmd(f"loop.output_dir={d}", *TINY, f"offline.path={cache}", script="train/eagle.py"))


def damaged_drafter(name: str, damage: Callable[[Path], None]) -> Callable[[Path], dict]:
    """A finished tiny Medusa run whose best/ drafter has `name` damaged; export it."""
    def run(d: Path) -> dict:
        trained(d)
        damage(d / "best" / name)
        return command([*DRAFTSMITH, "export", str(d), "--format", "medusa", "--out", str(d / "export")])
    return run


def damaged_export(d: Path) -> dict:
    """A Medusa export whose weights are cut; evaluate it."""
    trained(d)
    e = command([*DRAFTSMITH, "export", str(d), "--format", "medusa", "--out", str(d / "export")])
    if e["rc"]:
        raise RuntimeError(f"set-up export failed: {message(e['output'])}")
    cut(d / "export" / "medusa_lm_head.safetensors")
    return command([*DRAFTSMITH, "evaluate", "--drafter", str(d / "export"), "--num-prompts", "1",
                    "--max-new-tokens", "8", "--out", str(d / "evaluate.json")])


def bad_recipe(d: Path) -> dict:
    f = d.parent / f"{d.name}.yaml"
    f.write_text("loop:\n  max_steps: 2\n  lr: 1e-3: x\n")
    return command(train_cmd("--config", str(f), f"loop.output_dir={d}"))


def pickled_target(d: Path) -> dict:
    """A copy of the target whose weights are a pickle that runs a shell command when loaded unchecked."""
    t = d.parent / f"{d.name}-target"
    shutil.copytree(REFERENCE_TARGET, t, ignore=shutil.ignore_patterns("*.safetensors"))
    code = (f"import os, torch\nclass Code:\n    def __reduce__(self):\n        return os.system, ('touch {t}/ran',)\n"
            f"torch.save({{'model.embed_tokens.weight': Code()}}, '{t}/pytorch_model.bin')")
    subprocess.run([PY, "-c", code], check=True)
    r = command(train_cmd(f"loop.output_dir={d}", *TINY, f"target.path={t}"))
    return {**r, "code_ran": (t / "ran").exists()}


def regenerate_cmd(d: Path, url: str, *extra: str) -> list[str]:
    """`draftsmith regenerate --server url` of PROMPTS into d/out.jsonl, one request at a time."""
    data = d.parent / f"{d.name}.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                            for i, q in enumerate(PROMPTS)))
    return [PY, "-c", FAST_RETRIES, DRAFTSMITH[0], "regenerate", "--target", str(REFERENCE_TARGET), "--data",
            str(data), "--out", str(d / "out.jsonl"), "--max-new-tokens", "8", "--batch-size", "1", "--server", url,
            *extra]


def rows(d: Path) -> list[str]:
    out = d / "out.jsonl"
    return out.read_text().splitlines() if out.is_file() else []


def server_erring(d: Path) -> dict:
    """A server that answers 429 (Retry-After: 1), then 503, then works."""
    with FakeServer(echo, faults=["429", "503"]) as server:
        r = command(regenerate_cmd(d, server.url))
    return {**r, "retries_announced": r["output"].count("; trying again in ") == 2,
            "retry_after_honoured": server.tries[1] - server.tries[0] >= 1.0}


def server_failing(fault: str, *extra: str) -> Callable[[Path], dict]:
    """A server that answers two requests, then fails every one with `fault`; then the same command against a
    healthy server: it must ask only the two prompts left and keep the two rows written."""
    def run(d: Path) -> dict:
        with FakeServer(echo, faults=itertools.chain([None] * 2, itertools.repeat(fault))) as server:
            r = command(regenerate_cmd(d, server.url, *extra))
        kept = rows(d)
        with FakeServer(echo) as healthy:
            again = command(regenerate_cmd(d, healthy.url, *extra))
        done = rows(d)
        return {**r, "rows_kept": len(kept), "stall_lines": len(re.findall(r": no answer in [\d.]+ s; trying again", r["output"])),
                "retries_announced": r["output"].count("; trying again in ") == TRIES - 1,
                "rerun_complete": again["rc"] == 0 and len(kept) == 2 and done[:2] == kept and len(done) == 4
                and len({json.loads(row)["id"] for row in done}) == 4 and len(healthy.requests) == 2}
    return run


def llama_server_sigterm(d: Path) -> dict:
    """SIGTERM to a process holding llama_cpp.Server, whose llama-server (a stand-in) ignores SIGTERM."""
    d.mkdir(parents=True)
    install(d)
    code = (f"import os, time; os.environ['DRAFTSMITH_LLAMA_CPP'] = {str(d)!r}\n"
            "from pathlib import Path\nfrom draftsmith.models import llama_cpp\n"
            "with llama_cpp.Server(Path('model.gguf'), threads=1) as server:\n"
            "    print(f'llama-server pid {server.proc.pid} at {server.url}', flush=True)\n"
            "    time.sleep(600)\n")
    argv = [PY, "-c", code]
    p = command(argv, wait=False)
    line = p.stdout.readline()
    while line and not line.startswith("llama-server pid "):
        line = p.stdout.readline()
    p.send_signal(signal.SIGTERM)
    r = finish(p, argv)
    pid = int(line.split()[2])
    try:
        os.kill(pid, 0)
        os.kill(pid, signal.SIGKILL)  # an orphan: recorded, then ended
        orphan = True
    except ProcessLookupError:
        orphan = False
    return {**r, "output": line + r["output"], "orphan_left": orphan}


# ---- the cases -----------------------------------------------------------------------------------------------

def cases() -> list[Case]:
    def cfg(name, override, expect):
        return Case(name, "config", f"override {override}",
                    lambda d: command(train_cmd(f"loop.output_dir={d}", *TINY, override)), expect,
                    expect_disk=lambda d: not d.exists())
    ckpts = lambda *names: lambda d: list(on_disk(d).get("checkpoints", {})) == list(names)  # noqa: E731
    return [
        cfg("best_metric_typo", "loop.best_metric=tauu", r"loop.best_metric='tauu' is not a metric .*did you mean 'tau'"),
        cfg("best_by_tau_without_decoding", "eval.num_prompts=0", r"eval.num_prompts=0 turns decoding off"),
        cfg("dtype_typo", "target.dtype=float33", r"target.dtype: 'float33' is not one of"),
        cfg("lr_not_a_number", "loop.lr=fast", r"loop.lr: expected float, got 'fast'"),
        cfg("unknown_key", "loop.max_step=10", r"unknown config key 'loop.max_step'; did you mean 'loop.max_steps'"),
        cfg("schedule_typo", "loop.schedule=cosin", r"loop.schedule: 'cosin' is not one of .*did you mean 'cosine'"),
        cfg("override_without_value", "loop.lr", r"override 'loop.lr' must look like key=value"),
        cfg("divergence_factor_below_one", "loop.divergence_factor=0.5", r"loop.divergence_factor: must be > 1"),
        cfg("negative_steps", "loop.max_steps=-3", r"loop.max_steps: must be > 0"),
        cfg("override_bad_yaml", "eval.exit_layers=[2", r"override 'eval.exit_layers=\[2': the value is not valid YAML"),
        Case("recipe_missing", "config", "--config recipes/medusa/nope.yaml",
             lambda d: command([PY, "train/medusa.py", "--config", "recipes/medusa/nope.yaml"]), r"recipe .* not found"),
        Case("prompts_missing", "config", "eval.prompts=a file that does not exist",
             lambda d: command(train_cmd(f"loop.output_dir={d}", *TINY, f"eval.prompts={d}-none.jsonl")),
             r"prompts file .* not found"),
        Case("prompts_bad_line", "config", "eval.prompts=a JSONL whose 2nd line has no prompt",
             file_case('{"prompt": "def f():"}\n{"text": "x"}\n', "eval.prompts"),
             r"\.jsonl:2: each row needs one of \['messages', 'prompt'\]"),
        Case("target_missing", "target", "target.path=/no/such/model",
             lambda d: command(train_cmd(f"loop.output_dir={d}", *TINY, "target.path=/no/such/model")),
             r"target.path=/no/such/model does not exist"),
        Case("target_truncated", "target", "target.path=a copy of the target with model.safetensors cut to 1 MB",
             truncated_target, r"model.safetensors is truncated or damaged \(1000000 bytes, its header needs"),
        Case("target_without_weights", "target", "target.path=a copy of the target without its weights",
             weightless_target, r"holds no weights"),
        Case("target_empty_dir", "target", "target.path=an empty directory", empty_target, r"has no config.json"),
        Case("target_hub_offline", "target", "target.path=org/model (a hub id) with no hub reachable",
             lambda d: command(train_cmd(f"loop.output_dir={d}", *TINY, "target.path=someone/no-such-model")),
             r"target.path=someone/no-such-model \(a hub id .*\) does not load"),
        Case("data_empty", "data", "data.path=an empty .jsonl", file_case("", "data.path"), r"is empty"),
        Case("data_bad_json", "data", "data.path=a .jsonl whose 2nd line is not JSON",
             file_case('{"text": "a"}\n{oops\n', "data.path"), r"\.jsonl:2: not valid JSON"),
        Case("data_no_known_keys", "data", "data.path=rows with neither messages, conversations nor text",
             file_case('{"question": "q", "answer": "a"}\n', "data.path"), r"\.jsonl:1: each row needs one of"),
        Case("data_missing", "data", "data.path=./missing.jsonl",
             lambda d: command(train_cmd(f"loop.output_dir={d}", *TINY, "data.path=./missing.jsonl")),
             r"data.path ./missing.jsonl does not exist"),
        Case("data_csv", "data", "data.path=a .csv file", file_case("a,b\n1,2\n", "data.path", ".csv"),
             r"unsupported file type '.csv'"),
        Case("data_no_assistant", "data", "data.path=chats without an assistant turn",
             file_case('{"messages": [{"role": "user", "content": "hi"}]}\n', "data.path"),
             r"have no assistant token to train on"),
        Case("data_content_null", "data", "data.path=OpenAI rows, one whose assistant content is null",
             file_case('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                       '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}\n',
                       "data.path"), r"\.jsonl row 1: turn 1 \(assistant\) has content null, not text"),
        Case("data_content_parts", "data", "data.path=OpenAI rows with content as a list of text parts",
             file_case('{"messages": [{"role": "user", "content": [{"type": "text", "text": "Add two numbers."}]}, '
                       '{"role": "assistant", "content": [{"type": "text", "text": "def add(a, b):"}, '
                       '{"type": "text", "text": "\\n    return a + b"}]}]}\n' * 4, "data.path"), r"done at step 2", 0),
        Case("cache_shard_truncated", "damaged file", "offline.path=a hidden-state cache whose last shard is cut",
             cache_shard_cut, r"shard-\d+\.safetensors is truncated .*; delete it and rerun `draftsmith cache ",
             expect_disk=lambda d: not checkpoints(d)),
        Case("export_drafter_truncated", "damaged file", "export a run whose best/ heads file is cut",
             damaged_drafter("medusa_heads.safetensors", cut),
             r"best/medusa_heads.safetensors is truncated .*; pass another checkpoint's model/",
             expect_disk=lambda d: not (d / "export").exists()),
        Case("export_drafter_json_damaged", "damaged file", "export a run whose best/drafter.json is cut",
             damaged_drafter("drafter.json", lambda f: cut(f, 20)), r"best/drafter.json:\d+: not valid JSON",
             expect_disk=lambda d: not (d / "export").exists()),
        Case("evaluate_export_truncated", "damaged file", "evaluate a Medusa export whose weights are cut",
             damaged_export, r"medusa_lm_head.safetensors is truncated .*; export the run again"),
        Case("recipe_bad_yaml", "config", "--config a recipe whose 3rd line does not parse", bad_recipe,
             r"\.yaml:3: not valid YAML \(mapping values are not allowed here\); fix the recipe",
             expect_disk=lambda d: not d.exists()),
        Case("target_pickle_with_code", "target", "target.path=a model whose pytorch_model.bin pickles a shell command",
             pickled_target, r"pytorch_model\*\.bin holds pickled code, not only tensors, and was refused"),
        Case("lr_1e6", "divergence", "loop.lr=1e6 (the loss explodes)", diverging,
             r"training diverged at step \d+: loss .* > 10 x the median", expect_disk=ckpts("checkpoint-1")),
        Case("sigint", "signal", "Ctrl-C (SIGINT) during training", signalled(signal.SIGINT),
             r"stopped by SIGINT at step \d+; checkpoint-\d+ is saved", 130,
             expect_disk=lambda d: len(checkpoints(d)) == 1 and not guard.verify(checkpoints(d)[0])),
        Case("sigterm", "signal", "SIGTERM (a scheduler's stop) during training", signalled(signal.SIGTERM),
             r"stopped by SIGTERM at step \d+", 143,
             expect_disk=lambda d: len(checkpoints(d)) == 1 and not guard.verify(checkpoints(d)[0])),
        Case("ctrl_c_under_accelerate", "signal", "Ctrl-C to `accelerate launch` (the whole process group)",
             signalled(signal.SIGINT, accelerate=True), r"stopped by SIGINT at step \d+", None,
             expect_disk=lambda d: len(checkpoints(d)) == 1 and not guard.verify(checkpoints(d)[0]),
             launcher_traceback=True),
        Case("corrupt_latest", "corrupt checkpoint", "truncate the newest checkpoint's weights, run again",
             corrupt_latest, r"done at step 3", 0, expect_disk=ckpts("checkpoint-2", "checkpoint-3")),
        Case("corrupt_all", "corrupt checkpoint", "empty every checkpoint's optimizer.pt, run again", corrupt_all,
             r"no checkpoint in .* verifies", expect_disk=ckpts("checkpoint-1", "checkpoint-2")),
        Case("leftover_tmp", "corrupt checkpoint", "a half-written checkpoint-3.tmp left by a crash; resume, export",
             leftover_tmp, r"exported .* as medusa", 0),
        Case("resume_fewer_heads", "refused resume", "resume a 4-head Medusa run with medusa.num_heads=2",
             changed_shape("medusa.num_heads=2"), r"changed keys: medusa.num_heads: 4 -> 2",
             expect_disk=ckpts("checkpoint-1", "checkpoint-2")),
        Case("resume_eagle_intermediate_size", "refused resume", "resume an EAGLE-1 run with eagle.intermediate_size=256",
             changed_shape("eagle.intermediate_size=256"), r"changed keys: eagle.intermediate_size: .* -> 256",
             expect_disk=ckpts("checkpoint-1", "checkpoint-2")),
        Case("second_trainer", "lock", "start the same command while it is already training", second_trainer,
             r"is in use by pid \d+ on .*; wait for it or stop it"),
        Case("kill_9_then_restart", "lock", "kill -9 the trainer, then start it again", killed_then_restarted,
             r"done at step 1", 0),
        Case("kill_9_between_checkpoints", "resume", "kill -9 the trainer between two checkpoints, run it again",
             killed_between_checkpoints, r"done at step 12", 0),
        Case("stale_deepspeed_build_lock", "lock", "a DeepSpeed launch after a killed build of its op left its lock",
             stale_build_lock, r"done at step 2", 0),
        *(Case(f"rank_{fault}_{backend}", "rank fault", f"{tried} in a 2-process {backend.upper()} launch on CPU "
               "(loop.collective_timeout_minutes=0.33), then the same command again", rank_fault(fault, rank, config),
               line, expect_disk=ckpts("checkpoint-8", "checkpoint-12"))
          for backend, config in [("ddp", ""), ("fsdp2", "recipes/accelerate/fsdp2.yaml")]
          for fault, rank, tried, line in [
              ("kill", 1, "SIGKILL rank 1 after step 6", r"rank 1 died after step 6 \(its process \d+ is gone\); the "
               r"last checkpoint is .*checkpoint-4; rerun the same command to resume"),
              ("hang", 1, "SIGSTOP rank 1 after step 6", r"rank 1 stopped answering after step 6 \(no sign of life for "
               r"\d+ s, loop.collective_timeout_minutes=0.33\); the last checkpoint is .*checkpoint-4"),
              ("raise", 1, "rank 1's data raises after step 6", r"rank 1: row 7 of the training data is unreadable")]),
        Case("low_disk_checkpoint", "disk", "train with 1 MiB free", low_disk_checkpoint,
             r"not enough disk space for checkpoint-1: needs about", expect_disk=ckpts(), simulated=True),
        Case("low_disk_export", "disk", "export with 1 MiB free", low_disk_export,
             r"not enough disk space for the hf export", expect_disk=lambda d: not (d / "export").exists(),
             simulated=True),
        Case("export_over_user_files", "export", "export into a non-empty directory without --overwrite",
             lambda d: exported(d, "--format", "medusa", "--out", str(d / "taken")), r"exists and is not empty",
             expect_disk=lambda d: (d / "taken" / "file").read_text() == "user data"),
        Case("export_unknown_format", "export", "export --format onnx", lambda d: exported(
            d, "--format", "onnx", "--out", str(d / "x")), r"format 'onnx' is not available for medusa"),
        Case("export_eagle3_reference", "export reference", "EAGLE-3 from the recipe (relative target.path, one layer: SGLang loads one), export "
             "sglang, evaluate the export", export_case("train/eagle3.py", "sglang", "eagle.draft_vocab_size=512",
                                                   "eagle.num_layers=1"),
             r"^\s*0\s+\d", 0),
        Case("export_medusa_evaluate", "export evaluation", "Medusa-1 export (original layout), evaluate the export",
             export_case("train/medusa.py", "medusa"), r"^\s*0\s+\d", 0),
        Case("export_layerskip", "export evaluation", "LayerSkip run, export hf, evaluate the export",
             export_case("train/layerskip.py", "hf", "eval.exit_layers=[2]", "loop.best_metric=tau_exit2"),
             r"^\s*0\s+\d", 0),
        Case("main_sh_output_dir", "export", "bash scripts/main.sh loop.output_dir=X (tiny)", main_sh, r"exported .*", 0),
        Case("server_429_then_503", "server", "regenerate --server: 429 with Retry-After 1, then 503, then answers",
             server_erring, r"regenerate: 4/4 conversations", 0, expect_disk=lambda d: len(rows(d)) == 4,
             simulated=True),
        *(Case(f"server_{name}", "server", f"regenerate --server: two answers, then {tried} every time; rerun "
                                           "against a healthy server", server_failing(fault, *extra),
               rf"gave up on http://127.0.0.1:\d+/v1/completions after {TRIES} of {TRIES} tries in \d+ s, the last: "
               rf"{last}; 2 of 4 conversations were written to .*: rerun the same command once the server answers to "
               r"continue",
               simulated=True)
          for name, fault, tried, last, extra in [
              ("503_forever", "503", "HTTP 503", r"HTTP 503: .*", ()),
              ("malformed_json", "malformed", "JSON cut short", r"did not answer JSON .*", ()),
              ("truncated_body", "truncated", "a body shorter than its Content-Length",
               r"no answer \(IncompleteRead.*\)", ()),
              ("hangs", "hang", "no answer at all (--request-timeout 1)", r"no answer in 1 s",
               ("--request-timeout", "1"))]),
        Case("llama_server_sigterm", "process", "SIGTERM to a process running llama-server (which ignores SIGTERM)",
             llama_server_sigterm, r"llama-server pid \d+", 143),
    ]


def judge(case: Case, r: dict, d: Path) -> bool:
    ok = re.search(case.expect_message, r["message"]) is not None and case.expect_disk(d)
    ok &= case.launcher_traceback or not r["traceback_shown"]
    ok &= case.expect_rc is None or r["rc"] == case.expect_rc
    if "tau_from_export" in r:
        ok &= r["tau_from_export"] is not None and abs(r["tau_from_export"] - r["tau_logged_at_checkpoint"]) < 1e-9
        ok &= Path(r["export"]["target"]).is_absolute()
    for key in ("config_unchanged", "export_in_output_dir", "lock_left_by_kill", "rerun_complete",
                "retry_after_honoured", "retries_announced", "each_step_once", "lock_named", "ended_in_time",
                "one_error_line", "nothing_left_running", "last_checkpoint_verifies", "resumed_to_the_end"):
        ok &= r.get(key, True)
    ok &= not r.get("code_ran", False) and not r.get("orphan_left", False)
    return bool(ok)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reliability.json"))
    parser.add_argument("--only", nargs="*", help="case names to run; their records replace those of the same "
                        "names in --out, the other cases' records are kept")
    args = parser.parse_args(argv)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    records, load_before = [], os.getloadavg()
    for case in cases():
        if args.only and case.name not in args.only:
            continue
        d, start = WORK / case.name, time.perf_counter()
        r = case.run(d)
        output = r.pop("output")
        r.update(message=message(output), traceback_shown="Traceback" in output)
        if case.name.startswith("export_") and "export" in r:  # the table of a successful evaluate.py run
            r["message"] = next((line for line in output.splitlines() if re.match(r"^\s*0\s+\d", line)), r["message"])
        record = {"name": case.name, "class": case.kind, "tried": case.tried,
                  "command": " ".join(str(a) for a in r.pop("argv", [])).replace(str(REPO) + "/", ""),
                  "exit_code": r.pop("rc"), **r, "left_on_disk": on_disk(d), "simulated": case.simulated,
                  "seconds": round(time.perf_counter() - start, 1)}
        record["ok"] = judge(case, {**record, "rc": record["exit_code"]}, d)
        records.append(record)
        print(f"{'ok  ' if record['ok'] else 'FAIL'} {case.name}: {record['message'][:160]}", flush=True)
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    for r in records:
        r["load_average"] = load
    if args.only and Path(args.out).is_file():  # the new records in their cases' order, the earlier ones of cases
        order = [case.name for case in cases()]  # that still exist kept
        new = {r["name"]: r for r in records}
        kept = [r for r in json.loads(Path(args.out).read_text())["cases"] if r["name"] not in new and r["name"] in order]
        records = sorted(kept + records, key=lambda r: order.index(r["name"]))
    summary = {"cases": len(records), "ok": sum(r["ok"] for r in records),
               "one_line_errors": sum(not r["traceback_shown"] for r in records),
               "classes": sorted({r["class"] for r in records}), "seconds": round(sum(r["seconds"] for r in records), 1)}
    result = {"summary": summary, "cases": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary))
    return result


if __name__ == "__main__":
    main()
