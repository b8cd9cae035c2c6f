"""Adaptive drafting length: gamma (a chain's length, a tree's depth) chosen per step, 0 (no draft) included.

    curve = verify_cost_curve(target)                                        # decoding/cost.py
    proposer = AdaptiveGamma(PromptLookup(), relative(curve), curve[1], knob="num_pred_tokens", max_gamma=10)
    tokens, stats = speculative_generate(target, proposer, input_ids, 128)

Each step picks the depth d that maximises the expected tokens per unit of step cost,

    E[tokens](d) = 1 + sum_{j=1..d} prod_{k=1..j} a_k        (bonus token included)
    cost(d)      = r * v(n_d + 1) + c * d + a                 (in 1-token target forwards)

where a_k is the running probability that the accepted path reaches depth k given that it reached k - 1,
over drafts as deep as k (for a chain: the `acceptance_by_position` of decoding/metrics.py; in a tree a path
that ends on a leaf counts as stopped, which the per-position acceptance leaves out), v the target's
verify-cost curve, n_d the nodes up to depth d (d for a chain), r the decoder's measured verification time
(from a draft's return to the verifier's answer: the forward with its tree mask, the accept rule, the
rollback) over what the curve prices it at, c the drafter's time per depth level of `propose` and a its
time per step in `accept` (where EAGLE runs its drafter over the accepted tokens: one forward per step,
drafted or not). It is cost.py's speedup model with per-position acceptance instead of one alpha, since
acceptance rises along a draft for copy-like drafters (prompt lookup: 0.38 then 0.67, 0.84). d = 0 is one
plain step through the decoder (cost r + a): where no draft pays for itself (a drafter slower than the
tokens it saves, as small drafters are on a CPU), the wrapper stops drafting. The estimates decay (`decay` per step, drafted or
not) towards a prior that extends the previous position's rate, so a position that a short gamma (or no
draft) stopped observing drifts back and gets tried again.

Drafters with a length attribute (`knob`: DraftModel.gamma, EAGLE's chain gamma or tree depth,
PromptLookup.num_pred_tokens) draft at the chosen depth, so drafting time is saved too; n_d is then the
running mean of the drafts' nodes up to depth d. Any other draft (Medusa's static tree, suffix trees) is
drafted in full and cut at the chosen depth (`DraftTree.truncate`): its drafting time, c times its mean
height, is spent anyway once it drafts, so the cut adds the time it took to every depth alike, with the draft's
own n_d.

The model's errors are measured and corrected per depth: an EAGLE-2 tree of depth d is not a deeper tree
cut at d (with a fixed node budget it is wider at every level), so acceptance pooled across depths misprices
it, and a prompt-lookup draft of length d often finds no match at all. For the steps that chose depth d, the
committed tokens over the tokens predicted and the predicted cost over the step's measured time (from
`propose` to the end of `accept`), decayed like the estimates and shrunk towards depth d - 1's, multiply the
predicted rate of depth d (`measured`).

gamma depends only on past steps, never on the current draft's acceptance, so greedy output stays the
target's and exact sampling stays exact.
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
        plain_step_s: seconds of a 1-token target forward (`curve[1]`), which prices the drafter's and the
            decoder's time; 0 ignores both (n-gram and suffix drafters cost next to nothing).
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
        self.nodes = [0.0] * (self.max_gamma + 1)  # decayed sums of the drafts' nodes up to depth d
        self.seen = [0.0] * (self.max_gamma + 1)  # decayed count of drafts that reached depth d
        # decayed seconds and what they are per: propose per depth level, accept per step, verification per its price
        self.propose_s, self.levels, self.drafts = 0.0, 0.0, 0.0
        self.accept_s, self.steps = 0.0, 0.0
        self.verify_s, self.priced_s = 0.0, 0.0
        self.proposed: tuple[float, int] | None = None  # (when the current draft was handed over, its nodes)
        # per chosen depth d, decayed: steps, committed tokens and step seconds measured, and the model's predictions
        self.chosen = [0.0] * (self.max_gamma + 1)
        self.got, self.expected = [0.0] * (self.max_gamma + 1), [0.0] * (self.max_gamma + 1)
        self.spent, self.priced = [0.0] * (self.max_gamma + 1), [0.0] * (self.max_gamma + 1)
        self.step: tuple[float, int, float, float] | None = None  # (start, depth, predicted tokens, predicted cost)
        self.gammas: list[int] = []  # the depth chosen at each step (for benchmarks)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.proposer.hidden_layers

    def __getattr__(self, name: str):  # optional hooks of the wrapped proposer (target_forward)
        if name == "proposer":
            raise AttributeError(name)
        return getattr(self.proposer, name)

    def reset(self) -> None:
        self.proposer.reset()  # the estimates carry over: they describe the drafter and the machine, not the text
        self.proposed = None

    def acceptance(self) -> list[float]:
        """a_1..a_max: decayed counts shrunk towards the previous position's rate (1/2 before position 1)."""
        out, prev = [], 0.5
        for k in range(1, self.max_gamma + 1):
            prev = (self.passed[k] + self.prior * prev) / (self.reached[k] + self.prior)
            out.append(prev)
        return out

    def _per(self, seconds: float, count: float) -> float:
        """A decayed time per unit, in 1-token target forwards (0 when unmeasured or unpriced)."""
        return seconds / count / self.plain_step_s if count and self.plain_step_s else 0.0

    def c(self) -> float:
        """The drafter's propose time per depth level, in 1-token target forwards."""
        return self._per(self.propose_s, self.levels)

    def a(self) -> float:
        """The drafter's accept time per step, in 1-token target forwards."""
        return self._per(self.accept_s, self.steps)

    def r(self) -> float:
        """The decoder's measured verification time over the curve's price of it (1 until measured)."""
        return self.verify_s / self.priced_s if self.priced_s else 1.0

    def measured(self) -> list[float]:
        """Per depth d = 0..max: what steps at depth d achieved over what the model predicted for them, (tokens
        got / expected) x (cost priced / spent), shrunk by `prior` pseudo-steps towards depth d - 1's (1 for d = 0),
        as the acceptance is: a depth never chosen takes its shallower neighbour's correction."""
        out, prev, m = [], 1.0, self.prior
        for n, got, expected, spent, priced in zip(self.chosen, self.got, self.expected, self.spent, self.priced,
                                                   strict=True):
            ratio = (got / expected) * (priced / spent if spent and priced else 1.0) if n else prev
            prev = (n * ratio + m * prev) / (n + m)
            out.append(prev)
        return out

    def best_depth(self, nodes: list[float], drafting: list[float]) -> int:
        """argmax over d >= 0 of E[tokens](d) / (r v(nodes[d - 1] + 1) + a + drafting[d - 1]), times `measured()[d]`;
        nodes[d - 1] = nodes up to depth d, drafting[d - 1] the drafter's cost of a depth-d draft; d = 0 drafts
        nothing. Keeps the chosen depth's prediction for `measured`."""
        r, accept = self.r(), self.a()
        predicted = [(1.0, r + accept)]  # (E[tokens], cost) per depth
        tokens, survive = 1.0, 1.0
        for a, n, c in zip(self.acceptance(), nodes, drafting, strict=False):
            survive *= a
            tokens += survive
            predicted.append((tokens, r * verify_cost(self.rel, n + 1) + accept + c))
        measured = self.measured()
        best = max(range(len(predicted)), key=lambda d: predicted[d][0] / predicted[d][1] * measured[d])
        self.step = (self.step[0] if self.step else time.perf_counter(), best, *predicted[best])
        return best

    def expected_nodes(self) -> list[float]:
        """n_1..n_max: the drafts' mean nodes up to depth d; unseen depths extend the last level's width."""
        out, width = [], 1.0
        for d in range(1, self.max_gamma + 1):
            n = self.nodes[d] / self.seen[d] if self.seen[d] else (out[-1] if out else 0.0) + width
            width = n - (out[-1] if out else 0.0)
            out.append(n)
        return out

    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        depths = range(1, self.max_gamma + 1)
        self.step = None  # set by best_depth: this step's start, depth and prediction
        # a knob drafts d levels; a cut draft costs its whole (mean) height whatever depth it is cut to
        height = self.levels / self.drafts if self.drafts else 1.0
        d = self.best_depth(self.expected_nodes(), [self.c() * (k if self.knob else height) for k in depths])
        if d == 0:
            tree = DraftTree.empty(ids.device)
        else:
            if self.knob:
                setattr(self.proposer, self.knob, d)
            t0 = time.perf_counter()
            tree = self.proposer.propose(ids, sampling)
            self.propose_s = self.propose_s * self.decay + time.perf_counter() - t0
            lay = layout(tree.parents)
            nodes = torch.bincount(lay.depth[1:], minlength=self.max_gamma + 1)[1:].cumsum(0).tolist()  # up to d
            self.levels, self.drafts = self.levels * self.decay + lay.height, self.drafts * self.decay + 1
            for k in depths:
                self.nodes[k], self.seen[k] = self.nodes[k] * self.decay, self.seen[k] * self.decay
                if k <= lay.height:
                    self.nodes[k], self.seen[k] = self.nodes[k] + nodes[k - 1], self.seen[k] + 1
            if len(tree) and not self.knob:  # its drafting time is spent whatever the cut: priced alike for all
                sunk = self._per(time.perf_counter() - t0, 1.0)
                tree = tree.truncate(self.best_depth(nodes, [sunk] * self.max_gamma))
        self.gammas.append(layout(tree.parents).height)
        self.proposed = (time.perf_counter(), len(tree))
        return tree

    def accept(self, ids: torch.Tensor, verified: Verified) -> None:
        t0 = time.perf_counter()
        if verified.tree is not None:  # a step (the prefill's accept is neither priced nor observed)
            if self.proposed is not None and self.plain_step_s:  # the decoder's time since the draft was handed over
                handed, n = self.proposed
                self.verify_s = self.verify_s * self.decay + t0 - handed
                self.priced_s = self.priced_s * self.decay + self.plain_step_s * verify_cost(self.rel, n + 1)
            accepted, height = len(verified.path), layout(verified.tree.parents).height
            for k in range(1, self.max_gamma + 1):  # a_k: P(path reaches depth k | it reached k - 1, the draft has k)
                self.passed[k] = self.passed[k] * self.decay + (k <= accepted)
                self.reached[k] = self.reached[k] * self.decay + (k <= height and k - 1 <= accepted)
        self.proposed = None
        t1 = time.perf_counter()
        self.proposer.accept(ids, verified)
        if verified.tree is not None:
            t2 = time.perf_counter()
            self.accept_s = self.accept_s * self.decay + t2 - t1
            self.steps = self.steps * self.decay + 1
            if self.step is not None:  # the whole step against its prediction, at the depth it was chosen for
                start, d, tokens, cost = self.step
                for k in range(self.max_gamma + 1):
                    for stat in (self.chosen, self.got, self.expected, self.spent, self.priced):
                        stat[k] *= self.decay
                self.chosen[d] += 1
                self.got[d] += len(verified.path) + 1
                self.expected[d] += tokens
                if self.plain_step_s:
                    self.spent[d] += (t2 - start) / self.plain_step_s
                    self.priced[d] += cost
                self.step = None
