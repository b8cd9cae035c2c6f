"""Processes draftsmith starts (data/process.py, llama_cpp.Server) never outlive it: a child that ignores SIGTERM is
killed after the grace period, whether the block ends, raises, is interrupted, or draftsmith itself gets SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_llama_server import install

from draftsmith.data import process
from draftsmith.models import llama_cpp

# A "server" that ignores SIGTERM, says so, and sleeps.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
GRACE = 0.5


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(process, "GRACE", GRACE)


def gone(pid: int) -> bool:
    """No process `pid` (a child stopped and reaped; an orphan would still be there, adopted by init)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    os.kill(pid, signal.SIGKILL)  # leave nothing behind even when the test fails
    return False


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period():
    before = signal.getsignal(signal.SIGTERM)
    with process.Child([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline() == "ready\n"  # SIGTERM is ignored from here on
        assert signal.getsignal(signal.SIGTERM) is not before
        start = time.monotonic()
    assert GRACE <= time.monotonic() - start < GRACE + 2
    assert proc.returncode == -signal.SIGKILL and gone(proc.pid)
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored

    with process.Child([sys.executable, "-c", "import time; time.sleep(60)"]) as polite:
        start = time.monotonic()
    assert polite.returncode == -signal.SIGTERM and time.monotonic() - start < GRACE  # no wait for the kill


def test_an_error_or_ctrl_c_in_the_block_stops_the_child():
    for error in (KeyboardInterrupt, ValueError):
        with pytest.raises(error), process.Child([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE,
                                                 text=True) as proc:
            proc.stdout.readline()
            raise error()
        assert proc.returncode == -signal.SIGKILL and gone(proc.pid)


def test_sigterm_to_draftsmith_stops_its_child():
    """SIGTERM to the process holding the child (as a scheduler stops a job): it exits 143 and the child is gone."""
    script = ("import subprocess, sys, time\n"
              "from draftsmith.data import process\n"
              f"process.GRACE = {GRACE}\n"
              f"with process.Child([sys.executable, '-c', {STUBBORN!r}], stdout=subprocess.PIPE, text=True) as child:\n"
              "    child.stdout.readline()\n"
              "    print(child.pid, flush=True)\n"
              "    time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(GRACE + 10) == 128 + signal.SIGTERM
    finally:
        parent.kill()
        parent.wait()
    assert gone(child)


def test_llama_server_is_stopped_even_when_it_ignores_sigterm(tmp_path, monkeypatch):
    """llama_cpp.Server with a stand-in llama-server (tests/fake_llama_server.py: answers /health, ignores SIGTERM)
    found through DRAFTSMITH_LLAMA_CPP: started, then killed after the grace period when the block ends."""
    fake = install(tmp_path)
    monkeypatch.setenv(llama_cpp.ENV, str(tmp_path))
    with llama_cpp.Server(Path("model.gguf"), threads=1) as server:
        assert server.proc.poll() is None and Path(server.proc.args[0]) == fake
        start = time.monotonic()
    assert GRACE <= time.monotonic() - start < GRACE + 2
    assert server.proc.returncode == -signal.SIGKILL and gone(server.proc.pid)
