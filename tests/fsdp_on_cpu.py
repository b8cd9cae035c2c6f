"""Run an entry script under accelerate's FSDP2 on CPU processes (gloo), for the tests.

accelerate turns a launch with an FSDP config into FSDP only on accelerators; on CPU processes it stays
plain multi-process (DDP) although the launcher hands the FSDP settings to every process. The sharding
itself is torch's fully_shard, which runs on CPU with gloo, so this shim lifts that one gate and the
loop's FSDP2 paths run for real without GPUs:

    ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 2 \\
        tests/fsdp_on_cpu.py train/medusa.py --config ...
"""

import runpy
import sys
from pathlib import Path

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_init = AcceleratorState.__init__


def _init_with_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        # every later AcceleratorState() copies the process state's type over its own: set both
        PartialState().distributed_type = self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


def lift_fsdp_gate() -> None:
    AcceleratorState.__init__ = _init_with_fsdp


def run_entry(script: str) -> None:
    """Run train/METHOD.py as its package module, as `python train/METHOD.py` would."""
    runpy.run_module(f"draftsmith.train.{Path(script).stem}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    lift_fsdp_gate()
    sys.argv = sys.argv[1:]
    run_entry(sys.argv[0])
