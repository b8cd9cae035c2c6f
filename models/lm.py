"""Causal-LM training of a Hugging Face model on masked tokens (the reference target's method)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models.method import MethodBase


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` (bool or 0/1, same shape) is set; 0 where none is."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1)


def masked_ce(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose *predicted* token has loss_mask 1.

    logits [b, s, V]; input_ids, loss_mask [b, s].
    """
    target = input_ids[:, 1:]  # [b, s-1]
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target.flatten(), reduction="none")
    return masked_mean(ce.view_as(target), loss_mask[:, 1:])


class CausalLM(MethodBase):
    """Trains every parameter of `model` with masked next-token cross-entropy."""

    def __init__(self, model: nn.Module, tokenizer=None):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"),
                            attention_mask=batch.get("attention_mask"), use_cache=False).logits  # [b, s, V]
        loss = masked_ce(logits, batch["input_ids"], batch["loss_mask"])
        return loss, {}

    def save_pretrained(self, out: Path) -> None:
        self.model.save_pretrained(out)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)
