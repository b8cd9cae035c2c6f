"""A rank that dies, stops or raises in a multi-process launch, and the ranks' watch on one another (train/ranks.py).

The launches run DDP and FSDP2 on 2 CPU processes over gloo, as users launch them (`accelerate launch -q`), with
tests/rank_faults.py injecting the fault into one rank after step 6 (checkpoints every 4 steps). Each must end within
loop.collective_timeout_minutes of the fault (sooner when the rank died or raised; a stopped rank is killed by the
launcher after its 30-s SIGTERM grace), print one line naming the rank and the step, leave no process of the launch
running and its last checkpoint verifying; the same command then resumes to the end. DeepSpeed is not launched: on
CPU it runs one process only, and two are refused (tests/test_distributed.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from test_distributed import FSDP2, REPO, launch_command

from draftsmith.train import ranks
from draftsmith.train.config import ConfigError, LoopConfig
from draftsmith.train.guard import verify

TIMEOUT_MINUTES = 0.33  # 20 s: a collective's wait for a stopped rank, and a silent rank's
STEP = 6  # the fault comes after this step; checkpoint-4 is the last one written before it
RUN = ["eval.num_prompts=0", "loop.best_metric=", "loop.max_steps=12", "loop.save_every=4", "loop.batch_size=2",
       f"loop.collective_timeout_minutes={TIMEOUT_MINUTES}"]
LAUNCHER_GRACE = 30  # seconds torch's elastic agent waits after SIGTERM before SIGKILL
SLACK = 10  # seconds for what else a loaded machine may take
LINES = {  # what the one line says, past `medusa.py: error: `
    "kill": r"rank {r} died after step 6 \(its process \d+ is gone\); the last checkpoint is \S+/checkpoint-4; "
            r"rerun the same command to resume",
    "hang": r"rank {r} stopped answering after step 6 \(no sign of life for \d+ s, loop.collective_timeout_minutes="
            r"0.33\); the last checkpoint is \S+/checkpoint-4; rerun the same command to resume",
    "raise": r"rank {r}: row 7 of the training data is unreadable \(a fault injected on rank {r}\)",
}


def launched(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, str, set[int], float]:
    """Run a launch to its end: exit status, output, the pid of every process it started, and when it ended."""
    seen: set[int] = set()
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        launcher, deadline = psutil.Process(p.pid), time.time() + 600
        while p.poll() is None and time.time() < deadline:
            try:
                seen |= {c.pid for c in launcher.children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.1)
        if p.poll() is None:  # past the deadline: end it all (the time check below fails)
            for pid in seen | {p.pid}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        rc, ended = p.wait(), time.time()
    return rc, log.read_text(), seen, ended


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("backend, fault, rank", [
    ("ddp", "kill", 1),
    pytest.param("ddp", "hang", 1, marks=pytest.mark.slow),
    pytest.param("ddp", "raise", 1, marks=pytest.mark.slow),
    pytest.param("fsdp2", "kill", 1, marks=pytest.mark.slow),
    pytest.param("fsdp2", "hang", 0, marks=pytest.mark.slow),  # rank 0, which holds the run's lock
    pytest.param("fsdp2", "raise", 0, marks=pytest.mark.slow),
])
def test_a_faulty_rank_ends_the_launch_with_one_line_and_the_same_command_resumes(backend, fault, rank,
                                                                                   tiny_chat_target, tmp_path):
    run, config = tmp_path / "run", FSDP2 if backend == "fsdp2" else ""
    cmd, env = launch_command("medusa1", tiny_chat_target, run, 2, *RUN, config_file=config,
                              front=("-q", "tests/rank_faults.py", fault, str(rank), str(STEP)))
    rc, output, pids, ended = launched(cmd, env, tmp_path / "fault.log")
    assert rc != 0 and len(pids) >= 2, output[-3000:]  # the launcher's children: the 2 ranks
    fault_at = float(re.search(rf"fault: {fault} rank {rank} at (\S+)", output).group(1))
    # a stopped rank: the other's collective times out, then the launcher ends the stopped one; else: at once
    limit = 60 * TIMEOUT_MINUTES + LAUNCHER_GRACE + SLACK if fault == "hang" else SLACK
    assert ended - fault_at < limit, f"ended {ended - fault_at:.0f} s after the fault"
    errors = [line for line in output.splitlines() if ": error: " in line]
    assert len(errors) == 1 and re.search(LINES[fault].format(r=rank), errors[0]), errors or output[-3000:]
    assert "Traceback" not in output and "finishing this step" not in output
    assert not [pid for pid in pids if running(pid)], "a process of the launch is still running"
    assert verify(run / "checkpoint-4") == "" and not (run / "checkpoint-8").exists()

    cmd, env = launch_command("medusa1", tiny_chat_target, run, 2, *RUN, config_file=config, front=("-q",))
    rc, output, _, _ = launched(cmd, env, tmp_path / "resume.log")
    assert rc == 0 and f"resumed from {run}/checkpoint-4 at step 4" in output, output[-3000:]
    assert verify(run / "checkpoint-12") == ""


@pytest.mark.slow
def test_ranks_wait_for_a_checkpoint_longer_than_the_collective_timeout(tiny_chat_target, tmp_path):
    """Rank 0 takes 9 s more than the 6-s collective timeout to decode its share of the held-out prompts (twice:
    tau, then the plain-decoding baseline) and to write the checkpoint, while rank 1 waits for it."""
    run = tmp_path / "run"
    cmd, env = launch_command("medusa1", tiny_chat_target, run, 2, "loop.max_steps=2", "loop.batch_size=2",
                              "loop.collective_timeout_minutes=0.1", front=("-q", "tests/rank_faults.py", "slow", "0", "9"))
    rc, output, _, _ = launched(cmd, env, tmp_path / "slow.log")
    assert rc == 0 and output.count("fault: slow rank 0") == 3, output[-3000:]
    assert "done at step 2" in output and verify(run / "checkpoint-2") == ""


@pytest.fixture
def launch_store(monkeypatch):
    """A store like the launcher's, in this process, and the environment that points 2 ranks at it."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "2", "RANK": "1",
                       "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    return store


def test_ranks_meet_as_long_as_the_late_one_beats_and_name_one_that_goes_silent(launch_store):
    first, second = ranks.Ranks(0, 2, 2.0, "t=2"), ranks.Ranks(1, 2, 2.0, "t=2")  # 2-s timeout, beats every 0.2 s
    met = []
    waiting = threading.Thread(target=lambda: met.append(first.meet()))
    waiting.start()
    time.sleep(3)  # longer than the timeout, beating
    assert waiting.is_alive() and second.meet() is None
    waiting.join(5)
    assert met == [None] and first.lost() is None
    second.close()  # its heartbeat stops, as under SIGSTOP
    start = time.monotonic()
    lost = first.meet()
    assert lost.rank == 1 and lost.how == "stopped answering" and "t=2" in lost.seen
    assert 1.5 < time.monotonic() - start < 4
    first.close()


def test_the_first_rank_to_fail_claims_the_launch_failure(launch_store, monkeypatch, tmp_path):
    watcher = ranks.Ranks(0, 2, 1.0, "t=1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert ranks.claim("rank 1: it broke")
    assert '"message": "rank 1: it broke"' in (tmp_path / "error.json").read_text()  # the launcher's summary shows it
    monkeypatch.setenv("RANK", "0")
    assert not ranks.claim("rank 0: a collective failed"), "a later failure stays quiet"
    lost = watcher.lost()
    assert (lost.rank, lost.how) == (1, "failed")
    watcher.close()


def test_collective_timeout_is_range_checked():
    with pytest.raises(ConfigError, match="loop.collective_timeout_minutes: must be > 0"):
        LoopConfig(collective_timeout_minutes=0)
