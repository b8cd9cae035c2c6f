"""P-EAGLE (parallel drafting; arXiv 2602.01469): an EAGLE-3 drafter that proposes all K tokens in one forward.

Position 1 of the block is EAGLE-3's next-token prediction (NTP): the last committed entry, the bonus
token x_{t+1} with the target's fused feature g_t. Positions 2..K feed placeholders instead of what EAGLE-3
feeds back: the embedding of a fixed token `ptd_token_id` and a learned feature `mask_hidden` [1, 3H] (in
the target's feature space, before fc), at rope positions t+1..t+K-1. Each position attends to every
committed entry and to the block's earlier positions, so the K drafts come from one drafter forward
instead of K:

    EAGLE-3:  h_1 = layer(e(x_{t+1}), fc(g_t)); h_k = layer(e(x^_{t+k}), h_{k-1})     K sequential forwards
    P-EAGLE:  h_1 = layer(e(x_{t+1}), fc(g_t)); h_k = layer(e(ptd), fc(mask_hidden))   one forward, k = 2..K

Training reuses EAGLE-3's training-time test (models/eagle.py) with those placeholder inputs at steps
k >= 1: step k at query t sees the step-0 keys causally and its own anchor's steps 1..k, which is the
block attention above. The steps no longer depend on one another, so this is exactly P-EAGLE's parallel
objective over every anchor (the paper's COD sampling of anchors per depth only saves memory on long
sequences and is not needed at these lengths). vLLM serves it as an EAGLE-3 drafter with
`parallel_drafting` (config `ptd_token_id`, tensor `mask_hidden`); see models/p_eagle_export.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from draftsmith.data.core import ConfigError, read_drafter_meta, write_drafter_meta
from draftsmith.decoding.bench import Drafting
from draftsmith.decoding.proposers import draw
from draftsmith.decoding.tree import DraftTree
from draftsmith.decoding.verify import Sampling
from draftsmith.models.eagle import Eagle
from draftsmith.models.eagle_config import EagleConfig
from draftsmith.models.eagle_drafter import EagleDrafter, load_drafter
from draftsmith.models.eagle_proposer import EagleProposer
from draftsmith.models.target import Target


@dataclasses.dataclass
class PEagleConfig:
    """The `p_eagle` section of a recipe (the drafter itself is configured by the `eagle` section)."""

    ptd_token_id: int = -1  # token whose embedding positions 2..K read; -1: the tokenizer's pad token (else 0)


class PEagle(Eagle):
    """EAGLE-3 trained for parallel drafting: the same drafter plus `mask_hidden`, and a fixed ptd token."""

    def __init__(self, target: Target, cfg: EagleConfig, draft_ids: torch.Tensor | None = None,
                 ptd_token_id: int = 0):
        if cfg.version != 3:
            raise ConfigError("eagle.version: P-EAGLE extends EAGLE-3; set eagle.version=3")
        super().__init__(target, cfg, draft_ids)
        if not 0 <= ptd_token_id < self.drafter.t2d.numel():
            raise ConfigError(f"p_eagle.ptd_token_id: {ptd_token_id} is not a token id of the target's vocabulary")
        self.ptd_token_id = ptd_token_id
        n_features = self.drafter.fc.in_features
        self.drafter.mask_hidden = nn.Parameter(torch.randn(1, n_features, device=self.drafter.fc.weight.device,
                                                            dtype=self.drafter.fc.weight.dtype) * 0.02)

    def step_input(self, k: int, emb: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 as EAGLE-3; steps k >= 1 read e(ptd) [b, s, H] and mask_hidden (fc maps it to H), which the drafter
        fills in for the features [b, 0, 3H] given here."""
        if k == 0:
            return emb, h
        b, s, _ = emb.shape
        ptd = self.target.embed(torch.tensor([self.ptd_token_id], device=emb.device)).to(emb.dtype)  # [1, H]
        return ptd.expand(b, s, -1), emb.new_empty(b, 0, self.drafter.fc.in_features)

    def proposer(self, target=None, **kwargs) -> PEagleProposer:
        return PEagleProposer(self.drafter, self.target.embed, self.target.lm_head, self.layers, self.ptd_token_id,
                              **kwargs)

    def save_pretrained(self, out: str | Path) -> None:
        """EAGLE's files (mask_hidden among the tensors); drafter.json names the method and the ptd token."""
        super().save_pretrained(out)
        meta = {k: v for k, v in read_drafter_meta(out).items() if k not in ("schema_version", "method")}
        write_drafter_meta(out, "p_eagle", **meta, ptd_token_id=self.ptd_token_id, parallel_drafting=True)


def load_proposer(path: str | Path, target, **kwargs) -> PEagleProposer:
    """The plug-in's proposer loader (models/registry.py) for a P-EAGLE drafter dir."""
    target = target if isinstance(target, Target) else Target(target, None, "")
    drafter, meta = load_drafter(path, target.lm_head.weight.device, target.lm_head.weight.dtype)
    return PEagleProposer(drafter, target.embed, target.lm_head, meta["aux_layers"], meta["ptd_token_id"], **kwargs)


class PEagleProposer(EagleProposer):
    """Parallel drafting on the shared verifier: one drafter forward per step.

    `accept` only records the newly committed entries; `propose` feeds them (extending the drafter's KV
    cache as EAGLE does) together with gamma - 1 placeholder positions in one forward, and drafts token 1
    from the last entry's output and token k from placeholder k - 1's. Each token is drawn from its own
    position's distribution (q per node), which keeps exact verification exact. A chain only (the EAGLE-2
    tree settings a recipe's eval section passes are not used).
    """

    def __init__(self, drafter: EagleDrafter, embed: nn.Module, target_head: nn.Module, layers, ptd_token_id: int,
                 mode: str = "chain", gamma: int = 5, **tree_kwargs):
        if mode != "chain":
            raise ValueError("P-EAGLE drafts a chain of gamma tokens in one forward; use mode='chain'")
        super().__init__(drafter, embed, target_head, layers, "chain", gamma)
        self.ptd_token_id = ptd_token_id

    def catch_up(self, ids: torch.Tensor) -> None:
        """Nothing: `propose` feeds the recorded entries (the prompt's too) with its placeholders, in one forward."""

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        if not self.pending:
            return DraftTree.empty(ids.device)
        tokens, feats, positions = self.take_pending(ids)  # also drops the previous block's placeholders
        m, slots = tokens.numel(), self.gamma - 1
        tokens = torch.cat([tokens, tokens.new_full((slots,), self.ptd_token_id)])  # [m + K-1]
        positions = torch.cat([positions, positions[-1] + torch.arange(1, slots + 1, device=ids.device)])
        visible = torch.ones(m + slots, self.n + m + slots, dtype=torch.bool, device=ids.device).tril(self.n)
        out = self._step(tokens, feats, positions, visible)[m - 1:]  # [K, H]: the last entry, then the placeholders
        self.n += m
        qs: list[torch.Tensor] = []  # [Vd] each when sampling
        drafted = self.drafter.draft_ids[[draw(row, sampling, qs) for row in self._draft_logits(out)]]  # [K]
        return DraftTree.chain(drafted, self._over_target(qs) if qs else None)


def variants(drafter_dir: Path, target: nn.Module) -> dict[str, Drafting]:
    """The leaderboard's P-EAGLE chain, up to the depths it was trained to draft (ttt_steps)."""
    first = load_proposer(drafter_dir, target)
    K = read_drafter_meta(drafter_dir)["ttt_steps"]

    def proposer(g: int) -> PEagleProposer:
        return PEagleProposer(first.drafter, first.embed, first.head, first.hidden_layers, first.ptd_token_id, gamma=g)
    return {"chain": Drafting(target, proposer, [first.drafter, first.embed, first.head], gamma=K, max_gamma=K)}
