"""What keeps a run safe to start, stop and restart: one-line errors, the run-directory lock, stale locks of torch
extension builds (DeepSpeed's ops), checkpoint manifests and signal handling (the free-space checks are in
data/core.py).

    if __name__ == "__main__":
        cli(main)          # an entry script: one line per error, the traceback with DRAFTSMITH_DEBUG=1

Every error a user can act on is raised with one line saying what, where and the fix; `cli` prints
that line (under `accelerate launch -q` nothing else follows it, but for several processes the launcher's summary
of the failed ranks, which quotes it) and exits 1. A multi-process launch prints one line for all its ranks
(train/ranks.py).
"""

from __future__ import annotations

import atexit
import contextlib
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
from draftsmith.train import ranks

MANIFEST = "manifest.json"
LOCK = "run.lock"
DEBUG = "DRAFTSMITH_DEBUG"


class RunLocked(RuntimeError):
    """Another trainer holds the run directory."""


class PeerLost(RuntimeError):
    """Another rank of the launch failed, died or stopped answering; the message names it and the step."""


class Stopped(KeyboardInterrupt):
    """Training stopped on SIGINT/SIGTERM after writing a checkpoint; `code` is the exit status (128 + signal)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def cli(main: Callable, argv: list[str] | None = None):
    """Run an entry point and return what it returns (a rank of a multi-process launch ends here: `end_rank`); on
    an error print `<script>: error: <one line>` and exit 1 (the traceback too when DRAFTSMITH_DEBUG=1). In a
    multi-process launch the line names the rank, and only the rank that failed first prints it (`ranks.claim`):
    the others, ended by its failure, exit 1 quietly."""
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
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            sys.exit(f"{Path(sys.argv[0]).name}: error: {one_line(e)} (DRAFTSMITH_DEBUG=1 shows the traceback)")
        line = one_line(e) if isinstance(e, PeerLost) else f"rank {os.environ['RANK']}: {one_line(e)}"
        if ranks.claim(line):
            print(f"{Path(sys.argv[0]).name}: error: {line} (DRAFTSMITH_DEBUG=1 shows the traceback)", file=sys.stderr)
        end_rank(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        end_rank()
    return result


def end_rank(status: int = 0) -> NoReturn:
    """End a rank of a multi-process launch, without the interpreter's teardown: exit handlers run, output is flushed.
    torch's DTensor caches keep a sharded run's process group, and its gloo C++ threads, alive past
    destroy_process_group; torn down with the interpreter, one of them can call std::terminate and the rank dies with
    SIGABRT after a run whose checkpoints are all written (2 of about 400 FSDP2 runs on CPU). A rank that failed is
    spared the teardown too: with a peer gone, it takes seconds that the launcher's grace period counts."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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


# ---- torch extension build locks ---------------------------------------------------------------------

BUILD_QUIET_SECONDS = 300.0  # longer than one compile: a build on another machine writes in its directory that often


def extensions_root() -> Path:
    """Where torch JIT-builds extensions, DeepSpeed's ops among them, as torch.utils.cpp_extension's
    `_get_build_directory` names it: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py<XY>_<cuXYZ|rocmXY|cpu>."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    hip, cuda = torch.version.hip, torch.version.cuda
    accelerator = f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # the process or descriptor is gone, or is not ours to look at
        return ""


def _in_use(path: Path, how: str) -> bool:
    """Whether a process of this machine has `path` open (how="fd") or as its working directory (how="cwd"), read
    from /proc (no /proc, or another user's process: not seen)."""
    path_str = os.path.realpath(path)
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        if how == "cwd":
            links = [_readlink(f"/proc/{pid}/cwd")]
        else:
            try:
                links = [_readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            except OSError:
                continue
        if path_str in links:
            return True
    return False


def _last_change(d: Path) -> float:
    """The newest modification time of `d` and the files in it (torch builds an extension flat in its directory)."""
    times = [d.stat().st_mtime]
    for entry in os.scandir(d):
        with contextlib.suppress(OSError):  # a file the build removed meanwhile
            times.append(entry.stat(follow_symlinks=False).st_mtime)
    return max(times)


def clear_stale_build_locks(root: Path | None = None, quiet_seconds: float = BUILD_QUIET_SECONDS,
                            poll_seconds: float = 1.0) -> None:
    """Remove each `<root>/<extension>/lock` whose build is gone, before torch's FileBaton meets it: torch creates
    the lock, builds, then deletes it, and every later build of that extension polls for as long as the file
    exists, so a builder killed mid-build (DeepSpeed's ops build at its first launch: deepspeed_shm_comm on CPU)
    hangs every launch after it.

    The lock holds no pid, so the builder's absence is read from what a build does: torch keeps the lock open for the
    whole build and runs ninja and the compilers in the extension's directory. A lock no process of this machine
    holds open is left by a dead builder here, or belongs to a build on another machine sharing the directory, which
    writes object files there: once nothing of this machine works in the directory and nothing there changed for
    `quiet_seconds`, the lock is removed (the next build redoes, with ninja, whatever the killed one left unfinished).
    Until then this waits, saying which file it waits on and the command that removes it."""
    for lock in sorted((root or extensions_root()).glob("*/lock")):
        waiting = False
        while lock.exists() and not _in_use(lock, "fd"):  # a live builder holds it open: FileBaton waits for it
            with contextlib.suppress(FileNotFoundError):  # the lock went meanwhile
                idle = time.time() - _last_change(lock.parent)
                if idle >= quiet_seconds and not _in_use(lock.parent, "cwd"):
                    print(f"warning: removing {lock}, the lock of a build that is gone (nothing on this machine "
                          f"builds there, nothing changed there for {idle / 60:.0f} min)", file=sys.stderr, flush=True)
                    lock.unlink(missing_ok=True)
                    break
            if not waiting:
                print(f"waiting for {lock}: no process on this machine holds it; if no other machine is building "
                      f"there, remove it: rm {lock}", file=sys.stderr, flush=True)
                waiting = True
            time.sleep(poll_seconds)


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
    a second one of them stops at once. `lost()`: why this rank cannot go on, if another rank failed or died (the
    launcher then sends SIGTERM to end this one): that error is raised at once instead, and signals are ignored
    from then on."""

    def __init__(self, lost: Callable[[], BaseException | None] = lambda: None):
        self.received: int = 0
        self._old: dict = {}
        self.lost = lost

    def _handle(self, signum, frame) -> None:
        error = self.lost()
        if error is not None:
            self.ignore()
            raise error
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

    def ignore(self) -> None:
        """Ignore SIGINT and SIGTERM from now on: this rank of a launch is ending on an error and must get to say why
        (the launcher ends the other ranks with SIGTERM as soon as one fails, and with SIGKILL 30 s later)."""
        for s in self._old:
            signal.signal(s, signal.SIG_IGN)
        self._old = {}

    def __exit__(self, *exc) -> None:
        self.restore()
