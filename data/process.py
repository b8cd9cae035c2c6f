"""Processes draftsmith starts (llama-server for the benchmarks and tests), held so that none outlives draftsmith.

    with Child([binary, "--port", "8080"], stdout=log) as proc:   # proc: the subprocess.Popen
        ...                                                     # stopped here however the block ends

`stop` ends a process in one way everywhere: SIGTERM, then SIGKILL when it is still alive GRACE seconds later (a
server busy finishing a request, or one that ignores SIGTERM), then reaped, so no zombie stays either.
"""

from __future__ import annotations

import atexit
import functools
import signal
import subprocess
import threading

GRACE = 5.0  # seconds a process has to exit after SIGTERM before it is killed


def stop(proc: subprocess.Popen) -> None:
    """End `proc` and reap it: SIGTERM, then SIGKILL if it is still alive GRACE seconds later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds the main thread, so every `with Child` on the way stops its process


class Child:
    """`with Child(argv, **popen_kwargs) as proc:` a subprocess that never outlives this process. It is stopped when
    the block ends however it ends (an error, Ctrl-C), at interpreter exit when the block never ended (a thread
    left it open), and on SIGTERM to this process: while a child runs, SIGTERM (where nothing else handles it)
    raises SystemExit(143) in the main thread instead of ending the process on the spot, which would leave the
    child behind. (A process killed with SIGKILL cannot stop its children; they are then orphans.)"""

    def __init__(self, argv: list[str], **popen):
        self.argv, self.popen = argv, popen
        self.old_sigterm = None

    def __enter__(self) -> subprocess.Popen:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self.old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self.proc = subprocess.Popen(self.argv, **self.popen)
        except BaseException:
            self._restore()
            raise
        self.at_exit = functools.partial(stop, self.proc)
        atexit.register(self.at_exit)
        return self.proc

    def __exit__(self, *exc) -> None:
        stop(self.proc)  # a SIGTERM during the grace period leaves at_exit registered: it stops the child again
        atexit.unregister(self.at_exit)
        self._restore()

    def _restore(self) -> None:
        if self.old_sigterm is not None:
            signal.signal(signal.SIGTERM, self.old_sigterm)
            self.old_sigterm = None
