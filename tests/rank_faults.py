"""Run an entry script (or the FSDP2 shim in front of one) with a fault in one rank of the launch, for the tests.

    accelerate launch ... tests/rank_faults.py FAULT RANK N [tests/fsdp_on_cpu.py] train/medusa.py --config ...

FAULT happens on rank RANK once it has done N optimizer steps, as it reads its next batch:
    kill    it SIGKILLs itself (the OOM killer, a lost machine)
    hang    it SIGSTOPs itself (a hung rank: alive, never answering)
    raise   its data raises a ValueError
or, with slow, rank RANK spends N seconds more in each checkpoint: before it gathers its evaluation statistics, and
(rank 0) before it writes the checkpoint, while the other ranks wait for it.
The faulting rank prints `fault: FAULT rank RANK at <unix time>` first.
"""

import os
import signal
import sys
import time

from fsdp_on_cpu import lift_fsdp_gate, run_entry  # tests/ is this script's sys.path[0]

from draftsmith.decoding.evaluate import Shard
from draftsmith.train.loop import Loop

fault, rank, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.argv = sys.argv[4:]
mine = int(os.environ["RANK"]) == rank


def announce() -> None:
    print(f"fault: {fault} rank {rank} at {time.time():.3f}", flush=True)


def delayed(f):
    def slower(*args, **kwargs):
        announce()
        time.sleep(n)
        return f(*args, **kwargs)
    return slower


if mine and fault == "slow":
    Shard.gather = delayed(Shard.gather)
    Loop._write = delayed(Loop._write)
elif mine:
    batches = Loop.micro_batches

    def micro_batches(self):
        for item in batches(self):
            if self.state.step == n:
                announce()
                if fault == "raise":
                    raise ValueError(f"row 7 of the training data is unreadable (a fault injected on rank {rank})")
                os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            yield item

    Loop.micro_batches = micro_batches
if sys.argv[0].endswith("fsdp_on_cpu.py"):  # the FSDP2 shim in front of the entry script
    lift_fsdp_gate()
    sys.argv = sys.argv[1:]
run_entry(sys.argv[0])
