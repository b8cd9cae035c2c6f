"""Run a peer trainer on a CPU, unchanged on disk: what it assumes of an accelerator is patched in memory first.

    PEER_VENV/bin/python peer_cpu.py speculators ARGS...   # = speculators train ARGS...
    PEER_VENV/bin/python peer_cpu.py specforge ARGS...     # = specforge ARGS... (train -c RUN.yaml, export ...)

Run with the peer venv's python (train/peers.py does), never imported by draftsmith: it imports the peer, not
draftsmith. With $DRAFTSMITH_PEER_EVENTS set it appends to that file one line per optimizer step,
`step <unix time>`, and for speculators one line per epoch, `epoch_steps <steps in the epoch>`: what draftsmith plans
the run's steps and reads its training time from.
"""

from __future__ import annotations

import os
import sys
import time

EVENTS = "DRAFTSMITH_PEER_EVENTS"


def record(line: str) -> None:
    if os.environ.get(EVENTS):
        with open(os.environ[EVENTS], "a") as fh:
            fh.write(line + "\n")


def after(cls, name: str, event) -> None:
    """Call `event(self, result)` after each call of `cls.name`."""
    method = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        event(self, result)
        return result

    setattr(cls, name, wrapped)


def speculators(argv: list[str]) -> None:
    import torch
    from speculators.train import checkpointer, trainer
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    # The trainer moves the model and every batch `.to(get_local_rank())`, the int 0, i.e. cuda:0.
    trainer.get_local_rank = lambda: "cpu"
    # Resuming maps the checkpoint to get_current_device(), which falls back to "cuda:0" without an accelerator.
    checkpointer.get_current_device = lambda: "cpu"
    # Its step timer calls torch.accelerator.synchronize(), which raises when there is no accelerator; a CPU has
    # nothing to wait for.
    torch.accelerator.synchronize = lambda device=None: None
    # its autocast device falls back to "cuda" without an accelerator
    after(trainer.Trainer, "__init__", lambda self, _: setattr(self, "device_type", "cpu"))
    # one line per optimizer step (_schedulers_step: once per step, after the one or two optimizers stepped) and the
    # length of each epoch, for the step plan of a time budget
    after(trainer.Trainer, "_schedulers_step", lambda self, _: record(f"step {time.time()}"))
    original_epoch = trainer.Trainer.train_epoch

    def train_epoch(self, *args, **kwargs):  # recorded as the epoch starts: a probe stops inside its first
        record(f"epoch_steps {len(self.train_loader)}")
        return original_epoch(self, *args, **kwargs)

    trainer.Trainer.train_epoch = train_epoch
    main(TrainConfig.resolve(argv))


def specforge(argv: list[str]) -> int:
    import types

    import torch

    # specforge/core/loss.py imports triton at module level and its EAGLE-3 loss, LogSoftmaxLoss (imported by the
    # EAGLE-3 and P-EAGLE models), is a Triton kernel with no CPU path: the module is replaced, before anything
    # imports it, by the same maths in torch, its own reference `_compute_loss`: per position
    # -sum_v target * log_softmax(logits), positions whose mask is 0 count 0, mean over the B*T positions.
    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits, target, position_mask):  # [B, T, V], [B, T, V], [B, T, 1]
            loss = -(target * torch.log_softmax(logits.float(), -1)).sum(-1)  # [B, T]
            return (loss * position_mask.squeeze(-1).bool()).mean()

    loss = types.ModuleType("specforge.core.loss")
    loss.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules["specforge.core.loss"] = loss
    from specforge import cli
    from specforge.optimizer import BF16Optimizer

    after(BF16Optimizer, "step", lambda self, _: record(f"step {time.time()}"))  # once per optimizer step
    return cli.main(argv)


if __name__ == "__main__":
    peer, args = sys.argv[1], sys.argv[2:]
    sys.exit(speculators(args) if peer == "speculators" else specforge(args))
