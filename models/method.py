"""The method contract: what the shared loop (train/loop.py) and its checkpoints (train/checkpoint.py) ask of a method.

`Method` is the contract as a typing.Protocol; a method derives from `MethodBase`, which holds the defaults, and
overrides what it needs. The loop refuses a module that does not meet the contract, naming what it lacks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Method(Protocol):
    """A trainable method: its trainable parameters are those with `requires_grad`."""

    progress: Callable[[], float]  # fraction of training done; the loop sets it (schedules inside the method read it)
    measuring: bool  # the loop sets it True on the steps whose metrics it logs, False on the others (skip costly ones)
    sharded_refusal: str  # why it cannot run on ZeRO-3's or FSDP2's sharded parameters, and the fix; "" if it can

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """A batch -> (loss, metrics)."""

    def param_groups(self, lr: float) -> list[dict]:
        """The optimizer's parameter groups (per-group learning rates)."""

    def extra_state(self) -> dict | None:
        """JSON state beyond the weights (a curriculum, a draft vocabulary) checkpointed with them; None: none."""

    def load_extra_state(self, state: dict) -> None:
        """Restore what `extra_state` returned."""

    def save_pretrained(self, out: Path) -> None:
        """Write the artefact evaluation and export read (a checkpoint's model/ and best/)."""


class MethodBase(nn.Module):
    """`Method`'s defaults: one parameter group, no state beyond the weights, no artefact, runs sharded."""

    measuring = True
    sharded_refusal = ""

    def __init__(self):
        super().__init__()
        self.progress: Callable[[], float] = lambda: 1.0

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": [p for p in self.parameters() if p.requires_grad]}]

    def extra_state(self) -> dict | None:
        return None

    def load_extra_state(self, state: dict) -> None:
        raise ValueError(f"{type(self).__name__} keeps no state beyond its weights, but the checkpoint holds some")

    def save_pretrained(self, out: Path) -> None:
        return None


MEMBERS = [*Method.__annotations__, *(n for n, v in vars(Method).items() if callable(v) and not n.startswith("_"))]


def missing(method: nn.Module) -> list[str]:
    """The members of `Method` that `method` lacks (none: it meets the contract)."""
    return [] if isinstance(method, Method) else [n for n in MEMBERS if not hasattr(method, n)]
