"""Adaptive drafting length: gamma (a chain's length, a tree's depth) chosen per step.

    curve = relative(verify_cost_curve(target))               # decoding/cost.py
    proposer = AdaptiveGamma(PromptLookup(), curve, knob="num_pred_tokens", max_gamma=10)
    tokens, stats = speculative_generate(target, proposer, input_ids, 128)

Each step picks the depth d that maximises the expected tokens per unit of step cost,

    E[tokens](d) = 1 + sum_{j=1..d} prod_{k=1..j} a_k        (bonus token included)
    cost(d)      = v(n_d + 1) + c * d                         (in 1-token target forwards)

where a_k is the running probability that the accepted path reaches depth k given that it reached k - 1,
over drafts as deep as k (for a chain: the `acceptance_by_position` of decoding/metrics.py; in a tree a path
that ends on a leaf counts as stopped, which the per-position acceptance leaves out), v the target's
verify-cost curve, n_d the nodes up to depth d (d for a chain) and c the drafter's measured time per depth
level (per token for a chain), timed over propose and accept (where EAGLE runs its drafter over the accepted
tokens: one forward per step, which a time over propose alone leaves out). It is cost.py's speedup model with
per-position acceptance instead of one alpha, since acceptance rises along a draft for copy-like drafters
(prompt lookup: 0.38 then 0.67, 0.84).
The estimates decay (`decay` per step) towards a prior that extends the previous position's rate, so a
position that a short gamma stopped observing drifts back and gets tried again.

Drafters with a length attribute (`knob`: DraftModel.gamma, EAGLE's chain gamma or tree depth,
PromptLookup.num_pred_tokens) draft at the chosen depth, so drafting time is saved too; n_d is then the
running mean of the drafts' nodes up to depth d. Any other draft (Medusa's static tree, suffix trees) is
drafted in full and cut at the chosen depth (`DraftTree.truncate`): its drafting time is spent anyway, so
only its verification is priced, with its own n_d. gamma depends only on past steps, never on the
current draft's acceptance, so greedy output stays the target's and exact sampling stays exact.
"""

from __future__ import annotations

import time

import torch

from draftsmith.decoding.cost import verify_cost
from draftsmith.decoding.proposers import Proposer, Verified
from draftsmith.decoding.tree import DraftTree, layout
from draftsmith.decoding.verify import Sampling


class AdaptiveGamma(Proposer):
    """Wraps a proposer; chooses its draft length per step (see the module docstring).

    Args:
        proposer: the drafter.
        rel: the verify-cost curve relative to a 1-token forward, {k: v(k)} (`cost.relative`).
        plain_step_s: seconds of a 1-token target forward (`curve[1]`), which prices the drafter's time;
            0 ignores drafting cost (n-gram and suffix drafters cost next to nothing).
        knob: the proposer's draft-depth attribute, set before drafting; None cuts the draft instead.
        max_gamma: the longest draft (default: the knob's value at construction, else 16).
        decay: weight of the past per step (0.9: about the last 10 steps count).
        prior: pseudo-count of the prior at each position.
    """

    def __init__(self, proposer: Proposer, rel: dict[int, float], plain_step_s: float = 0.0,
                 knob: str | None = None, max_gamma: int | None = None, decay: float = 0.9, prior: float = 1.0):
        if knob is not None and not isinstance(getattr(proposer, knob, None), int):
            raise ValueError(f"adaptive gamma: {type(proposer).__name__} has no integer attribute {knob!r}")
        ks = sorted(rel)  # a measured curve is noisy: a verification never costs less than a shorter one
        self.rel = {k: max(rel[j] for j in ks[: i + 1]) for i, k in enumerate(ks)}
        self.proposer, self.plain_step_s, self.knob = proposer, plain_step_s, knob
        self.max_gamma = max_gamma or (getattr(proposer, knob) if knob else 16)
        if self.max_gamma < 1 or not 0 <= decay < 1 or prior <= 0:
            raise ValueError("adaptive gamma: need max_gamma >= 1, 0 <= decay < 1, prior > 0")
        self.decay, self.prior = decay, prior
        self.passed = [0.0] * (self.max_gamma + 1)  # decayed counts per position k (index 0 unused)
        self.reached = [0.0] * (self.max_gamma + 1)
        self.drafter_s, self.levels = 0.0, 0.0  # decayed drafting time and depth levels drafted
        self.nodes = [0.0] * (self.max_gamma + 1)  # decayed sums of the drafts' nodes up to depth d
        self.seen = [0.0] * (self.max_gamma + 1)  # decayed count of drafts that reached depth d
        self.gammas: list[int] = []  # the depth chosen at each step (for benchmarks)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.proposer.hidden_layers

    def __getattr__(self, name: str):  # optional hooks of the wrapped proposer (target_forward)
        if name == "proposer":
            raise AttributeError(name)
        return getattr(self.proposer, name)

    def reset(self) -> None:
        self.proposer.reset()  # the acceptance estimates carry over: they describe the drafter, not the text

    def acceptance(self) -> list[float]:
        """a_1..a_max: decayed counts shrunk towards the previous position's rate (1/2 before position 1)."""
        out, prev = [], 0.5
        for k in range(1, self.max_gamma + 1):
            prev = (self.passed[k] + self.prior * prev) / (self.reached[k] + self.prior)
            out.append(prev)
        return out

    def best_depth(self, nodes: list[int], drafting: float) -> int:
        """argmax over d >= 1 of E[tokens](d) / (v(nodes[d - 1] + 1) + drafting * d); nodes[d - 1] = nodes up
        to depth d."""
        best, best_rate, tokens, survive = 1, 0.0, 1.0, 1.0
        for d, (a, n) in enumerate(zip(self.acceptance(), nodes, strict=False), 1):
            survive *= a
            tokens += survive
            rate = tokens / (verify_cost(self.rel, n + 1) + drafting * d)
            if rate > best_rate:
                best, best_rate = d, rate
        return best

    def c(self) -> float:
        """Drafting time per depth level, in 1-token target forwards."""
        return self.drafter_s / self.levels / self.plain_step_s if self.levels and self.plain_step_s else 0.0

    def expected_nodes(self) -> list[float]:
        """n_1..n_max: the drafts' mean nodes up to depth d; unseen depths extend the last level's width."""
        out, width = [], 1.0
        for d in range(1, self.max_gamma + 1):
            n = self.nodes[d] / self.seen[d] if self.seen[d] else (out[-1] if out else 0.0) + width
            width = n - (out[-1] if out else 0.0)
            out.append(n)
        return out

    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        if self.knob:
            setattr(self.proposer, self.knob, self.best_depth(self.expected_nodes(), self.c()))
        t0 = time.perf_counter()
        tree = self.proposer.propose(ids, sampling)
        spent = time.perf_counter() - t0
        depth = layout(tree.parents).depth[1:]  # [n]
        nodes = torch.bincount(depth, minlength=self.max_gamma + 1)[1:].cumsum(0).tolist()  # up to depth d
        height = layout(tree.parents).height
        self.drafter_s, self.levels = self.drafter_s * self.decay + spent, self.levels * self.decay + height
        for d in range(1, self.max_gamma + 1):
            self.nodes[d], self.seen[d] = self.nodes[d] * self.decay, self.seen[d] * self.decay
            if d <= height:
                self.nodes[d], self.seen[d] = self.nodes[d] + nodes[d - 1], self.seen[d] + 1
        if len(tree) and not self.knob:
            tree = tree.truncate(self.best_depth(nodes, 0.0))
        self.gammas.append(layout(tree.parents).height)
        return tree

    def accept(self, ids: torch.Tensor, verified: Verified) -> None:
        if verified.tree is not None and len(verified.tree):
            accepted, height = len(verified.path), layout(verified.tree.parents).height
            for k in range(1, self.max_gamma + 1):  # a_k: P(path reaches depth k | it reached k - 1, the draft has k)
                self.passed[k] = self.passed[k] * self.decay + (k <= accepted)
                self.reached[k] = self.reached[k] * self.decay + (k <= height and k - 1 <= accepted)
        t0 = time.perf_counter()
        self.proposer.accept(ids, verified)
        if verified.tree is not None:  # a step's drafting cost (EAGLE's forward over the accepted tokens), not the prefill's
            self.drafter_s += time.perf_counter() - t0
