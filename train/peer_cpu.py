"""Run a peer trainer on a CPU, unchanged on disk: what it assumes of an accelerator is patched in memory first.

    PEER_VENV/bin/python peer_cpu.py speculators ARGS...   # = speculators train ARGS...
    PEER_VENV/bin/python peer_cpu.py specforge ARGS...     # = specforge ARGS... (train -c RUN.yaml, export ...)

Run with the peer venv's python (train/peers.py does), never imported by draftsmith: it imports the peer, not
draftsmith. With $DRAFTSMITH_PEER_EVENTS set it appends to that file one line per optimizer step,
`step <unix time> <tokens>`, the tokens being the non-padding positions of the batch (or micro-batches) that step
trained on, and for speculators one line per epoch, `epoch_steps <steps in the epoch>`: what draftsmith plans the
run's steps and reads its training time and tokens seen from.
"""

from __future__ import annotations

import os
import sys
import time

EVENTS = "DRAFTSMITH_PEER_EVENTS"
pending = [0]  # tokens of the micro-batches trained on since the last optimizer step


def record(line: str) -> None:
    if os.environ.get(EVENTS):
        with open(os.environ[EVENTS], "a") as fh:
            fh.write(line + "\n")


def batch(tokens) -> None:
    """A micro-batch of `tokens` (an int or a 0-d tensor) is trained on."""
    pending[0] += int(tokens)


def step() -> None:
    """An optimizer step: its time and the tokens it trained on."""
    record(f"step {time.time()} {pending[0]}")
    pending[0] = 0


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

    # Tokens of a training batch (the model is in train mode; validation runs it in eval mode): the positions of its
    # packed row that hold a conversation, `document_ids != -1`, what its own step timer counts as num_tokens. Its
    # batches are shifted by one (models/eagle3/data.py), so a conversation of T tokens counts T - 1.
    def count(model, args, kwargs) -> None:
        if model.training:
            batch((kwargs["document_ids"] != -1).sum())

    def setup(self, _) -> None:
        self.device_type = "cpu"  # its autocast device falls back to "cuda" without an accelerator
        self.model.register_forward_pre_hook(count, with_kwargs=True)  # called as self.model(**batch)

    after(trainer.Trainer, "__init__", setup)
    # one line per optimizer step (_schedulers_step: once per step, after the one or two optimizers stepped) and the
    # length of each epoch, for the step plan of a time budget
    after(trainer.Trainer, "_schedulers_step", lambda self, _: step())
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
    from specforge.training.controller import TrainerCore

    # Tokens of a micro-batch (TrainerCore.train_step runs one, and the optimizer step at an accumulation boundary):
    # the ones of its attention_mask [B, T], set over each sample's first max_length tokens and 0 on the collator's
    # padding (algorithms/eagle3/data.py); a conversation of T tokens counts T.
    original_train_step = TrainerCore.train_step

    def train_step(self, micro_batch, *args, **kwargs):
        batch(micro_batch.tensors["attention_mask"].sum())
        return original_train_step(self, micro_batch, *args, **kwargs)

    TrainerCore.train_step = train_step
    after(BF16Optimizer, "step", lambda self, _: step())  # once per optimizer step
    return cli.main(argv)


if __name__ == "__main__":
    peer, args = sys.argv[1], sys.argv[2:]
    sys.exit(speculators(args) if peer == "speculators" else specforge(args))
