"""The ranks of a multi-process launch watching one another, so that one that dies, stops or fails ends the launch
with one line instead of leaving the others waiting in a collective.

torchrun (what `accelerate launch` runs) keeps a key-value store for the launch in its own process, at
MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): it outlives every rank. In it each rank publishes its host
and pid and, from a background thread, a heartbeat (its clock, every `period` seconds). A peer is lost when

  * it failed first: the first rank to fail `claim`s the launch's failure and prints why; the others end quietly;
  * it runs on this host and its process is gone (SIGKILL, the OOM killer): seen at once;
  * its heartbeat stopped (SIGSTOP, a host gone): seen within 3 periods once a collective failed on it, or when
    it has been silent for the timeout while the others wait for it (`meet`).

Collectives are bounded by the process group's timeout (loop.collective_timeout_minutes). Where a rank waits for
another's long work instead (rank 0 writing or verifying a checkpoint, a rank decoding a longer share of the held-out
prompts), the ranks `meet` on the store: the wait lasts as long as the others beat, and ends naming the rank that
stopped once it is silent for that timeout.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from torch import distributed as dist

KEYS = "draftsmith"  # the store's keys of this module: KEYS/pid/<rank>, KEYS/beat/<rank>, KEYS/failed, KEYS/meet/<n>
FAILED = f"{KEYS}/failed"


def launcher_store() -> bool:
    """Whether this process is one rank of several, started by a launcher that keeps the launch's store."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _client(timeout: float) -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout))


def _gone(pid: int) -> bool:
    """Whether process `pid` of this host has ended (a zombie its launcher has not reaped yet included)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except ProcessLookupError:
        return True
    except OSError:  # not ours to signal, or no /proc: alive as far as this host tells
        return False


@dataclass(frozen=True)
class Lost:
    """A peer that cannot go on: `rank`, what happened to it (`how`) and what showed it (`seen`)."""

    rank: int
    how: str
    seen: str


class Ranks:
    """This rank's part: publish its pid and heartbeat; find lost peers; meet the others outside any collective.
    `timeout`: seconds a peer may stay silent while others wait for it; `setting`: the config that sets it, for
    messages."""

    def __init__(self, rank: int, world: int, timeout: float, setting: str):
        self.rank, self.world, self.timeout, self.setting = rank, world, timeout, setting
        self.period = min(5.0, timeout / 10)
        self.store = _client(timeout)
        self.store.set(f"{KEYS}/pid/{rank}", json.dumps([socket.gethostname(), os.getpid()]))
        self.store.set(f"{KEYS}/beat/{rank}", str(time.time()))
        self.meetings = 0
        self.pids: dict[int, tuple[str, int]] = {}
        self.stop = threading.Event()
        threading.Thread(target=self._beat, name="draftsmith-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        store = _client(self.timeout)  # its own connection: the main thread's may be in a call
        try:
            while not self.stop.wait(self.period):
                store.set(f"{KEYS}/beat/{self.rank}", str(time.time()))
        except RuntimeError:  # the launcher's store is gone: the launch is ending
            return

    def close(self) -> None:
        self.stop.set()

    def _peers(self, kind: str) -> dict[int, str]:
        """KEYS/<kind>/<rank> of every other rank, or {} until all of them have written theirs."""
        ranks = [r for r in range(self.world) if r != self.rank]
        keys = [f"{KEYS}/{kind}/{r}" for r in ranks]
        return dict(zip(ranks, (v.decode() for v in self.store.multi_get(keys)), strict=True)) \
            if self.store.check(keys) else {}

    def _find(self, stale: float) -> Lost | None:
        if self.store.check([FAILED]):
            rank, _, line = self.store.get(FAILED).decode().partition(" ")
            return Lost(int(rank), "failed", line)
        if len(self.pids) < self.world - 1:
            self.pids = {r: tuple(json.loads(v)) for r, v in self._peers("pid").items()}
        here = socket.gethostname()
        for r, (host, pid) in sorted(self.pids.items()):
            if host == here and _gone(pid):
                return Lost(r, "died", f"its process {pid} is gone")
        ages = {r: time.time() - float(v) for r, v in self._peers("beat").items()}
        oldest = max(ages, key=ages.get, default=None)
        if oldest is not None and ages[oldest] > stale:
            return Lost(oldest, "stopped answering", f"no sign of life for {ages[oldest]:.0f} s, {self.setting}")
        return None

    def lost(self, wait: bool = False) -> Lost | None:
        """The peer that failed first, died or went silent for 3 heartbeat periods; None when all of them live.
        `wait`: after a collective failed, look for up to 4 periods (a peer on another host that died is known only
        once its heartbeat stops) before concluding that none is lost."""
        end = time.monotonic() + (4 * self.period if wait else 0)
        while (found := self._find(3 * self.period)) is None and time.monotonic() < end:
            time.sleep(self.period / 2)
        return found

    def meet(self) -> Lost | None:
        """Wait, on the store, until every rank got here, for as long as the missing ones beat: None once all are
        here, or the peer found lost (one silent for `timeout` seconds)."""
        self.meetings += 1
        key = f"{KEYS}/meet/{self.meetings}"
        self.store.add(key, 1)
        checked = time.monotonic()
        while self.store.add(key, 0) < self.world:
            if time.monotonic() - checked >= self.period:
                if found := self._find(self.timeout):
                    return found
                checked = time.monotonic()
            time.sleep(self.period / 10)
        return None


def claim(line: str) -> bool:
    """Record `line` as the launch's first failure, in the store (the ranks that fail after this one then end
    quietly) and in torchelastic's error file (the launcher's summary shows it as the root cause): whether this rank
    failed first and is to print it. True outside a launch with a store."""
    if not launcher_store():
        return True
    rank = os.environ["RANK"]
    try:
        first = _client(10).compare_set(FAILED, "", f"{rank} {line}").decode().split(" ")[0] == rank
    except RuntimeError:  # the launcher's store is gone: say it anyway
        return True
    if first and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fh:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, fh)
    return first
