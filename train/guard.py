"""What keeps a run safe to start, stop and restart: one-line errors, the run-directory lock, checkpoint
manifests and signal handling (the free-space checks are in data/core.py).

    if __name__ == "__main__":
        cli(main)          # an entry script: one line per error, the traceback with DRAFTSMITH_DEBUG=1

Every error a user can act on is raised with one line saying what, where and the fix; `cli` prints
that line (under `accelerate launch -q` nothing else follows it) and exits 1.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from draftsmith.data.core import one_line
from draftsmith.data.dataset import sha256_file

MANIFEST = "manifest.json"
LOCK = "run.lock"
DEBUG = "DRAFTSMITH_DEBUG"


class RunLocked(RuntimeError):
    """Another trainer holds the run directory."""


class Stopped(KeyboardInterrupt):
    """Training stopped on SIGINT/SIGTERM after writing a checkpoint; `code` is the exit status (128 + signal)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def cli(main: Callable, argv: list[str] | None = None):
    """Run an entry point and return what it returns (a rank of a multi-process launch ends here: `end_rank`); on
    an error print `<script>: error: <one line>` and exit 1 (the traceback too when DRAFTSMITH_DEBUG=1)."""
    try:
        result = main(argv)
    except Stopped as e:
        print(f"{Path(sys.argv[0]).name}: {e}", file=sys.stderr, flush=True)
        sys.exit(e.code)
    except KeyboardInterrupt:
        sys.exit(f"{Path(sys.argv[0]).name}: interrupted")
    except Exception as e:
        if os.environ.get(DEBUG, "") not in ("", "0"):
            raise
        sys.exit(f"{Path(sys.argv[0]).name}: error: {one_line(e)} (DRAFTSMITH_DEBUG=1 shows the traceback)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        end_rank()
    return result


def end_rank() -> NoReturn:
    """End a rank of a multi-process launch that finished, without the interpreter's teardown: exit handlers run,
    output is flushed, status 0. torch's DTensor caches keep a sharded run's process group, and its gloo C++ threads,
    alive past destroy_process_group; torn down with the interpreter, one of them can call std::terminate and the
    rank dies with SIGABRT after a run whose checkpoints are all written (2 of about 400 FSDP2 runs on CPU)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the run-directory lock ------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """`run_dir/run.lock` = {"pid", "host", "started"}, created exclusively. A lock whose process is gone from
    this host is stale and taken over with a warning; a live one (or one from another host) is refused."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                here = owner is not None and owner.get("host") == me["host"]
                if here and owner.get("pid") == me["pid"]:  # this process's own earlier lock
                    self.held = True
                    return
                if owner is None or (here and not _alive(int(owner.get("pid", -1)))):
                    print(f"warning: removing the stale lock {self.path} of a trainer that is gone "
                          f"({owner or 'unreadable'})", file=sys.stderr, flush=True)
                    self.path.unlink(missing_ok=True)
                    continue
                raise RunLocked(f"{self.path.parent} is in use by pid {owner.get('pid')} on {owner.get('host')} "
                                f"(since {owner.get('started')}); wait for it or stop it, or use another "
                                f"loop.output_dir (if that trainer is gone, delete {self.path})") from None
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
            self.held = True
            return
        raise RunLocked(f"could not take the lock {self.path}; another trainer is starting in {self.path.parent}")

    def _owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


# ---- checkpoint manifests --------------------------------------------------------------------------

def write_manifest(d: Path) -> None:
    """Size and sha256 of every file under `d`, written last (a checkpoint without it is incomplete)."""
    files = {p.relative_to(d).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(d.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (d / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def verify(d: Path) -> str:
    """Why checkpoint `d` cannot be trusted, or '' when every file in its manifest is there, whole and unchanged."""
    try:
        files = json.loads((d / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (incomplete, or written before manifests existed)"
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable {MANIFEST} ({one_line(e)})"
    for name, want in files.items():
        p = d / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, the manifest says {want['bytes']}"
        if sha256_file(p) != want["sha256"]:
            return f"{name} does not match its checksum"
    return ""


def manifest_bytes(d: Path) -> int:
    """Bytes a verified directory holds according to its manifest (0 if it has none)."""
    try:
        return sum(f["bytes"] for f in json.loads((d / MANIFEST).read_text())["files"].values())
    except (OSError, ValueError, KeyError):
        return 0


# ---- signals ---------------------------------------------------------------------------------------

class StopSignals:
    """While active, SIGINT and SIGTERM only set `received` (the loop finishes its step, checkpoints and exits);
    a second one of them stops at once."""

    def __init__(self):
        self.received: int = 0
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received:
            self.restore()
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopped without a checkpoint")
        self.received = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopSignals:
        try:
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._old = {}
        return self

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def __exit__(self, *exc) -> None:
        self.restore()
