"""One test per failure class: each asserts the one-line message a user sees and what is left on disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_loop import Recorder, loop_cfg, tiny_method
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from draftsmith.data import core
from draftsmith.models.method import MethodBase
from draftsmith.models.target import REFERENCE_TARGET, load_target
from draftsmith.train import guard
from draftsmith.train import loop as L
from draftsmith.train import medusa as medusa_script
from draftsmith.train.guard import cli


def one_line_error(main, argv) -> str:
    """Run an entry point as its script does; the message it exits with (asserted to be one line)."""
    with pytest.raises(SystemExit) as e:
        cli(main, argv)
    message = str(e.value.code)
    assert "\n" not in message and "Traceback" not in message
    return message


TINY_MEDUSA = ["loop.max_steps=1", "loop.batch_size=2", "data.limit=8", "data.pack=false",
               "eval.num_prompts=0", "loop.best_metric=", "eval.heldout_examples=4", "eval.topk=1"]


# ---- config, target, data: refused before anything trains ------------------------------------------

@pytest.mark.parametrize("override, expected", [
    ("loop.best_metric=tauu", "loop.best_metric='tauu' is not a metric this recipe's evaluation produces; "
                              "did you mean 'tau'?"),
    ("eval.num_prompts=0", "loop.best_metric='tau' is not a metric this recipe's evaluation produces "
                           "(eval.num_prompts=0 turns decoding off, so tau is not measured)"),
    ("target.dtype=float33", "target.dtype: 'float33' is not one of ['float32', 'bfloat16', 'float16'] "
                             "(did you mean 'float32'?)"),
    ("loop.divergence_factor=0.5", "loop.divergence_factor: must be > 1"),
])
def test_config_errors_are_one_line_before_anything_loads(tmp_path, override, expected):
    message = one_line_error(medusa_script.main, [f"loop.output_dir={tmp_path / 'run'}", override])
    assert message.startswith(f"{Path(sys.argv[0]).name}: error: ")
    assert expected in message
    assert not (tmp_path / "run").exists()


def test_target_missing_or_truncated_is_named(tmp_path):
    missing = one_line_error(medusa_script.main, [f"loop.output_dir={tmp_path / 'run'}", "target.path=/no/such/model"])
    assert "target.path=/no/such/model does not exist; give a Hugging Face model directory, a hub id" in missing
    assert "or a named target (smollm2-135m-instruct, gemma3-270m)" in missing
    broken = tmp_path / "target"
    shutil.copytree(REFERENCE_TARGET, broken)
    with open(broken / "model.safetensors", "r+b") as fh:
        fh.truncate(1_000_000)
    message = one_line_error(medusa_script.main, [f"loop.output_dir={tmp_path / 'run'}", f"target.path={broken}"])
    assert f"target.path={broken}: model.safetensors is truncated or damaged (1000000 bytes, its header needs" in message
    assert "re-download or re-save the model" in message
    assert not (tmp_path / "run").exists()


def test_targets_load_without_hub_kernels():
    """transformers swaps layers for Hub kernels at load by default; on a GPU that needs the network (a load
    fails offline, as it did on the H200 check) and changes the target's numerics. draftsmith turns it off."""
    assert os.environ["USE_HUB_KERNELS"] == "NO"
    assert load_target(REFERENCE_TARGET).model.use_kernels is False


@pytest.mark.parametrize("content, expected", [
    ("", "is empty; give a file with one JSON object per line"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n', ":2: not valid JSON"),
    ('{"messages": []}\n\n{"question": "no known key"}\n', ":3: each row needs one of ['messages', 'conversations', 'text']"),
])
def test_data_errors_name_file_and_line(tmp_path, content, expected):
    data = tmp_path / "chats.jsonl"
    data.write_text(content)
    message = one_line_error(medusa_script.main, [f"loop.output_dir={tmp_path / 'run'}", f"data.path={data}",
                                                  "data.cache=false"])
    assert f"{data}{expected}" in message or expected in message
    assert str(data) in message
    assert not (tmp_path / "run").exists()


def test_prompts_file_errors_name_file_and_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n{"text": "no prompt key"}\n')
    message = one_line_error(medusa_script.main, [f"loop.output_dir={tmp_path / 'run'}", f"eval.prompts={prompts}",
                                                  "loop.max_steps=1", "data.limit=8", "eval.heldout_examples=2"])
    assert f"{prompts}:2: each row needs one of ['messages', 'prompt']" in message


def test_declared_metric_names_cover_what_the_evaluation_logs(tmp_path):
    """The names check_best_metric accepts are the names a real checkpoint evaluation writes."""
    run = tmp_path / "run"
    argv = [f"loop.output_dir={run}", *TINY_MEDUSA, "eval.num_prompts=1", "eval.max_new_tokens=4", "eval.topk=2",
            "medusa.num_heads=2", "loop.best_metric=tau"]
    medusa_script.main(argv)
    logged = {k.removeprefix("eval/") for r in map(json.loads, open(run / "metrics.jsonl")) for k in r
              if k.startswith("eval/")}
    declared = set(medusa_script.metric_names(medusa_script.C.load(medusa_script.Recipe, None, argv)))
    assert logged and logged <= declared, logged - declared


# ---- divergence ------------------------------------------------------------------------------------

class AtStep(MethodBase):
    """A tiny causal LM whose loss goes through `fault(loss, first)` from step `at` on (first: its first
    micro-batch; the loop config has 2 micro-batches a step)."""

    def __init__(self, at: int, fault):
        super().__init__()
        self.inner, self.at, self.fault, self.calls = tiny_method(), at, fault, 0

    def forward(self, batch):
        self.calls += 1
        loss, metrics = self.inner(batch)
        due = self.calls > 2 * (self.at - 1)
        return (self.fault(loss, self.calls == 2 * (self.at - 1) + 1) if due else loss), metrics


def Exploding(at: int, factor: float) -> AtStep:
    return AtStep(at, lambda loss, first: loss * factor)


def SignalAt(at: int, signum: int) -> AtStep:
    return AtStep(at, lambda loss, first: (os.kill(os.getpid(), signum) if first else None) or loss)


def test_divergence_stops_on_an_exploding_loss_keeping_the_last_good_checkpoint(tmp_path):
    loop = L.Loop(loop_cfg(tmp_path, max_steps=20, save_every=4), Exploding(at=7, factor=1e3), Recorder(40))
    with pytest.raises(L.TrainingDiverged) as e:
        loop.run()
    message = core.one_line(e.value)
    assert message.startswith("training diverged at step 7: loss ")
    assert "> 10 x the median" in message and f"the last good checkpoint {tmp_path / 'checkpoint-4'} is kept" in message
    assert [c.name for c in L.checkpoints(tmp_path)] == ["checkpoint-4"] and guard.verify(tmp_path / "checkpoint-4") == ""
    assert not (tmp_path / guard.LOCK).exists()


def test_divergence_factor_zero_only_stops_on_nan(tmp_path):
    L.Loop(loop_cfg(tmp_path, max_steps=8, divergence_factor=0), Exploding(at=3, factor=1e3), Recorder()).run()
    assert [c.name for c in L.checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-8"]


# ---- resume ----------------------------------------------------------------------------------------

def test_corrupt_latest_checkpoint_is_skipped_for_the_newest_that_verifies(tmp_path, capsys):
    L.Loop(loop_cfg(tmp_path, max_steps=8), tiny_method(), Recorder()).run()
    with open(tmp_path / "checkpoint-8" / "optimizer.pt", "r+b") as fh:
        fh.truncate(100)
    (tmp_path / "checkpoint-12.tmp").mkdir()  # a half-written checkpoint of a killed run
    loop = L.Loop(loop_cfg(tmp_path, max_steps=8), tiny_method(seed=5), Recorder())
    out = capsys.readouterr().out
    assert f"warning: skipping {tmp_path / 'checkpoint-8'}: optimizer.pt has 100 bytes, the manifest says" in out
    assert loop.state.step == 4 and f"resumed from {tmp_path / 'checkpoint-4'}" in out
    loop.run()
    assert guard.verify(tmp_path / "checkpoint-8") == ""  # rewritten whole
    for ckpt in L.checkpoints(tmp_path):
        assert set(json.loads((ckpt / guard.MANIFEST).read_text())["files"]) >= {
            "trainable.safetensors", "optimizer.pt", "scheduler.pt", "rng.safetensors", "state.json", "config.yaml"}


def test_no_checkpoint_verifies_is_refused(tmp_path):
    L.Loop(loop_cfg(tmp_path, max_steps=4), tiny_method(), Recorder()).run()
    (tmp_path / "checkpoint-4" / "rng.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"no checkpoint in .* verifies .*set loop.resume=never with a new"):
        L.Loop(loop_cfg(tmp_path, max_steps=8), tiny_method(), Recorder())
    assert (tmp_path / "checkpoint-4" / "rng.safetensors").read_bytes() == b"x"  # left for the user to inspect


def test_resume_with_another_shape_is_refused_naming_keys_and_leaving_the_run_as_it_was(tmp_path):
    run = tmp_path / "run"
    medusa_script.main([f"loop.output_dir={run}", *TINY_MEDUSA])
    config, command = (run / "config.yaml").read_text(), (run / "command.txt").read_text()
    message = one_line_error(medusa_script.main, [f"loop.output_dir={run}", *TINY_MEDUSA, "loop.max_steps=2",
                                                  "medusa.num_heads=2"])
    assert f"cannot resume {run / 'checkpoint-1'}: it was trained with another model shape (changed keys: " \
           "medusa.num_heads: 4 -> 2)" in message
    assert "restore those values to resume, or train afresh in a new loop.output_dir" in message
    assert (run / "config.yaml").read_text() == config and (run / "command.txt").read_text() == command
    assert yaml.safe_load(config)["medusa"]["num_heads"] == 4
    assert [c.name for c in L.checkpoints(run)] == ["checkpoint-1"] and not (run / guard.LOCK).exists()


# ---- the run-directory lock --------------------------------------------------------------------------

def test_a_second_trainer_on_a_locked_run_directory_refuses(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / guard.LOCK).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(),
                                                       "started": "2026-01-01T00:00:00"}))
        with pytest.raises(guard.RunLocked) as e:
            L.Loop(loop_cfg(tmp_path), tiny_method(), Recorder())
    finally:
        other.kill()
        other.wait()
    assert core.one_line(e.value) == (
        f"{tmp_path} is in use by pid {other.pid} on {socket.gethostname()} (since 2026-01-01T00:00:00); wait for it "
        f"or stop it, or use another loop.output_dir (if that trainer is gone, delete {tmp_path / guard.LOCK})")
    assert sorted(p.name for p in tmp_path.iterdir()) == [guard.LOCK]  # nothing written


def test_a_stale_lock_is_taken_over_and_released_at_the_end(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / guard.LOCK).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    loop = L.Loop(loop_cfg(tmp_path, max_steps=4), tiny_method(), Recorder())
    assert "removing the stale lock" in capsys.readouterr().err
    assert json.loads((tmp_path / guard.LOCK).read_text())["pid"] == os.getpid()
    loop.run()
    assert not (tmp_path / guard.LOCK).exists() and guard.verify(tmp_path / "checkpoint-4") == ""


# ---- torch extension build locks (DeepSpeed's ops) ---------------------------------------------------

BUILDER = ("import os, subprocess, sys, time\n"
           "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)  # FileBaton.try_acquire: the lock, held open\n"
           "print(subprocess.Popen(['sleep', '600'], cwd=os.path.dirname(sys.argv[1])).pid, flush=True)  # its ninja\n"
           "time.sleep(600)\n")


def start_build(lock: Path) -> tuple[subprocess.Popen, int]:
    """A builder that holds `lock` as torch's does, and the pid of the compiler it runs in the lock's directory."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(lock)], stdout=subprocess.PIPE, text=True)
    return builder, int(builder.stdout.readline())


def age(d: Path, seconds: float) -> None:
    """Make `d` and its files look untouched for `seconds`."""
    for p in (d, *d.iterdir()):
        os.utime(p, (time.time() - seconds,) * 2)


def checking(root: Path) -> threading.Thread:
    """The check before a DeepSpeed launch, running (polling every 0.05 s) in a thread the test can wait on."""
    check = threading.Thread(target=guard.clear_stale_build_locks, args=(root, 600, 0.05), daemon=True)
    check.start()
    return check


def test_the_build_lock_of_a_killed_deepspeed_build_is_removed_before_torch_waits_on_it(tmp_path, monkeypatch, capsys):
    """kill -9 a build (its builder and compiler): its lock stays where torch builds the op and torch's FileBaton would
    wait for it for ever; the check a DeepSpeed launch runs first finds it there, removes it and says so."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))  # ~/.cache/torch_extensions
    lock = Path(cpp_extension._get_build_directory("deepspeed_shm_comm", False)) / "lock"
    builder, compiler = start_build(lock)
    os.kill(compiler, signal.SIGKILL)
    builder.kill()
    builder.wait()
    age(lock.parent, 3600)
    baton = FileBaton(str(lock), wait_seconds=0.01)
    assert not baton.try_acquire()
    waiter = threading.Thread(target=baton.wait, daemon=True)  # what the next launch's build does
    waiter.start()
    waiter.join(1)
    assert waiter.is_alive()
    guard.clear_stale_build_locks()
    waiter.join(5)
    assert not waiter.is_alive() and not lock.exists()
    assert capsys.readouterr().err == (f"warning: removing {lock}, the lock of a build that is gone (nothing on this "
                                       "machine builds there, nothing changed there for 60 min)\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "elsewhere"))
    assert guard.extensions_root() == tmp_path / "elsewhere"


def test_a_build_lock_is_left_to_its_live_builder_and_waited_on_while_its_compiler_runs(tmp_path, capsys):
    """A lock its builder holds open is left at once, however old; with the builder killed but its compiler still
    working in the directory, the check waits, naming the file and how to remove it, until the compiler is gone."""
    lock = tmp_path / "fused_adam" / "lock"
    builder, compiler = start_build(lock)
    try:
        age(lock.parent, 3600)
        check = checking(tmp_path)
        check.join(5)
        assert not check.is_alive() and lock.exists() and capsys.readouterr().err == ""
        builder.kill()
        builder.wait()
        check = checking(tmp_path)
        check.join(1)
        assert check.is_alive() and lock.exists()
    finally:
        builder.kill()
        os.kill(compiler, signal.SIGKILL)
    check.join(5)
    assert not check.is_alive() and not lock.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"waiting for {lock}: no process on this machine holds it; if no other machine is building there, remove it: "
        f"rm {lock}", f"warning: removing {lock}, the lock of a build that is gone (nothing on this machine builds "
        "there, nothing changed there for 60 min)"]


# ---- signals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_and_says_how_to_resume(tmp_path, signum):
    before = signal.getsignal(signum)  # SIG_IGN for SIGINT when the suite runs in a background job
    loop = L.Loop(loop_cfg(tmp_path, max_steps=20, save_every=4), SignalAt(6, signum), Recorder(40))
    with pytest.raises(SystemExit) as e:
        cli(lambda argv: loop.run())
    assert e.value.code == 128 + signum
    assert [c.name for c in L.checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-6"]
    assert guard.verify(tmp_path / "checkpoint-6") == "" and not (tmp_path / guard.LOCK).exists()
    assert json.loads((tmp_path / "checkpoint-6" / "state.json").read_text())["step"] == 6
    assert signal.getsignal(signum) == before  # handlers restored
    resumed = L.Loop(loop_cfg(tmp_path, max_steps=20, save_every=4), SignalAt(10**6, signum), Recorder(40))
    assert resumed.state.step == 6


def test_the_signal_message_is_one_line(tmp_path, capsys):
    loop = L.Loop(loop_cfg(tmp_path, max_steps=20, save_every=4), SignalAt(3, signal.SIGTERM), Recorder(40))
    with pytest.raises(SystemExit):
        cli(lambda argv: loop.run())
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"stopped by SIGTERM at step 3; checkpoint-3 is saved in {tmp_path}; resume by running "
                         "the same command again (loop.resume=auto)")


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_launched_rank_that_finished_skips_the_interpreter_teardown(world_size):
    """A rank of a multi-process launch ends in `cli` once its entry point returns: exit handlers run and it exits
    0, but no object is torn down with the interpreter (where gloo's threads can abort it); a lone process ends as
    Python ends."""
    script = ("import atexit\n"
              "from draftsmith.train.guard import cli\n"
              "class Torn:\n"
              "    def __del__(self): print('torn down', flush=True)\n"
              "held = Torn()\n"
              "cli(lambda argv: atexit.register(print, 'exit handler ran', flush=True))\n"
              "print('after cli', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WORLD_SIZE": world_size})
    assert done.returncode == 0, done.stderr
    launched = world_size != "1"
    assert ("exit handler ran" in done.stdout, "torn down" in done.stdout, "after cli" in done.stdout) == (
        True, not launched, not launched), done.stdout


# ---- disk ------------------------------------------------------------------------------------------

def test_too_little_free_space_refuses_the_checkpoint_before_writing(tmp_path, monkeypatch):
    loop = L.Loop(loop_cfg(tmp_path, max_steps=8), tiny_method(), Recorder())
    free = shutil.disk_usage(tmp_path)
    real = shutil.disk_usage
    monkeypatch.setattr(core.shutil, "disk_usage",
                        lambda p: free._replace(free=1 << 20) if loop.state.step >= 8 else real(p))
    with pytest.raises(core.DiskFull) as e:
        loop.run()
    message = core.one_line(e.value)
    assert message.startswith("not enough disk space for checkpoint-8: needs about ") and "0.00 GB free under" in message
    assert f"the last good checkpoint {tmp_path / 'checkpoint-4'} is intact" in message
    assert [c.name for c in L.checkpoints(tmp_path)] == ["checkpoint-4"] and not (tmp_path / "checkpoint-8.tmp").exists()


def test_disk_filling_up_during_a_write_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    loop = L.Loop(loop_cfg(tmp_path, max_steps=8), tiny_method(), Recorder())
    real = torch.save

    def full(obj, path, *a, **k):
        if "checkpoint-8" in str(path):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return real(obj, path, *a, **k)

    monkeypatch.setattr(L.torch, "save", full)
    with pytest.raises(core.DiskFull) as e:
        loop.run()
    assert core.one_line(e.value).startswith("the disk filled up while writing checkpoint-8 (")
    assert "nothing of it was kept" in core.one_line(e.value)
    assert [c.name for c in L.checkpoints(tmp_path)] == ["checkpoint-4"] and not (tmp_path / "checkpoint-8.tmp").exists()
