"""Adaptive drafting length: gamma (a chain's length, a tree's depth) chosen per step, 0 (no draft) included.

    curve = verify_cost_curve(target)                                        # decoding/cost.py
    proposer = AdaptiveGamma(PromptLookup(), relative(curve), curve[1], knob="num_pred_tokens", max_gamma=10)
    tokens, stats = speculative_generate(target, proposer, input_ids, 128)

Each step picks the depth d that maximises the expected tokens per unit of step cost,

    E[tokens](d) = 1 + sum_{j=1..d} prod_{k=1..j} a_k        (bonus token included)
    cost(d)      = r * v(n_d + 1) + b + (c0 + c * d) + a      (in 1-token target forwards; cost(0) = r + a)

where a_k is the running probability that the accepted path reaches depth k given that it reached k - 1,
over drafts as deep as k (for a chain: the `acceptance_by_position` of decoding/metrics.py; in a tree a path
that ends on a leaf counts as stopped, which the per-position acceptance leaves out; with a knob, over drafts
asked for k or more, where a shorter draft, as prompt lookup's when it finds no match, stops the path), v the
target's verify-cost curve, n_d the nodes up to depth d (d for a chain), r the decoder's measured verification
time (from a draft's return to the verifier's answer: the forward with its tree mask, the accept rule, the
rollback) over what the curve prices it at, c0 + c * d the drafter's `propose` time for a depth-d draft (a line
fitted to the drafts' times by decayed least squares: prompt lookup's search costs the same at every depth,
EAGLE's first level costs a head where the others add a drafter forward), b its time in the optional `catch_up`
hook, called before a draft (EAGLE feeds its drafter the tokens committed since its last draft there, in one
forward however many steps drafted nothing), measured on drafts that follow a draft (after steps without one
it also does their deferred work, which drafting nothing never pays), and a its time per step in `accept`.
It is cost.py's speedup model with per-position acceptance instead of one alpha, since acceptance rises along a
draft for copy-like drafters (prompt lookup: 0.38 then 0.67, 0.84). d = 0 is one plain step through the decoder
(cost r + a; EAGLE's drafter skips such steps and catches up at its next draft): where no draft pays for itself
(a drafter slower than the tokens it saves, as small drafters are on a CPU), the wrapper stops drafting. The
estimates decay (`decay` per step, drafted or not) towards a prior: the rate of the position's own last
observations, however old, so that what short drafts (or none) stop observing keeps its value; at position 1 at
least 1/2, so that a drafter no longer tried drifts back and gets tried again.

Drafters with a length attribute (`knob`: DraftModel.gamma, EAGLE's chain gamma or tree depth,
PromptLookup.num_pred_tokens) draft at the chosen depth, so drafting time is saved too; n_d is then the
running mean of the drafts' nodes up to depth d. Any other draft (Medusa's static tree, suffix trees) is
drafted in full and cut at the chosen depth (`DraftTree.truncate`): its drafting time, c0 + c times its mean
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
        memory: weight of the past per observation in each position's long-run rate, the estimates' prior (0.98:
            about its last 50 observations, enough that the streak that stopped drafting does not define it).
        prior: pseudo-count of the prior at each position.
    """

    def __init__(self, proposer: Proposer, rel: dict[int, float], plain_step_s: float = 0.0,
                 knob: str | None = None, max_gamma: int | None = None, decay: float = 0.9, prior: float = 1.0,
                 memory: float = 0.98):
        if knob is not None and not isinstance(getattr(proposer, knob, None), int):
            raise ValueError(f"adaptive gamma: {type(proposer).__name__} has no integer attribute {knob!r}")
        ks = sorted(rel)  # a measured curve is noisy: a verification never costs less than a shorter one
        self.rel = {k: max(rel[j] for j in ks[: i + 1]) for i, k in enumerate(ks)}
        self.proposer, self.plain_step_s, self.knob = proposer, plain_step_s, knob
        self.max_gamma = max_gamma or (getattr(proposer, knob) if knob else 16)
        if self.max_gamma < 1 or not 0 <= decay < 1 or not 0 <= memory < 1 or prior <= 0:
            raise ValueError("adaptive gamma: need max_gamma >= 1, 0 <= decay < 1, 0 <= memory < 1, prior > 0")
        self.decay, self.prior, self.memory = decay, prior, memory
        self.passed = [0.0] * (self.max_gamma + 1)  # decayed counts per position k (index 0 unused)
        self.reached = [0.0] * (self.max_gamma + 1)
        self.last_passed = [0.0] * (self.max_gamma + 1)  # the same, decayed by `memory` when position k is observed
        self.last_reached = [0.0] * (self.max_gamma + 1)
        self.nodes = [0.0] * (self.max_gamma + 1)  # decayed sums of the drafts' nodes up to depth d
        self.seen = [0.0] * (self.max_gamma + 1)  # decayed count of drafts that reached depth d
        self.fit = [0.0] * 5  # decayed sums over drafts of 1, x, x^2, t, x t (x its depth, t its propose seconds)
        self.levels, self.drafts = 0.0, 0.0  # decayed sums of the drafts' heights and count
        # decayed seconds and what they are per: catch-up per draft after a draft, accept per step, verification
        # per its price
        self.catch_up_s, self.catch_ups, self.drafted = 0.0, 0.0, False  # drafted: the previous step did
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
        self.proposed, self.drafted = None, False

    def acceptance(self) -> list[float]:
        """a_1..a_max: decayed counts shrunk towards a prior, the position's rate over its last observations however
        long ago (shrunk towards position k - 1's, 1/2 before position 1), so that while short drafts (or none)
        stop observing a position it keeps what it was (prompt lookup: 0.67, 0.84 after 0.38) rather than
        becoming position 1's; at position 1 at least 1/2, so that a drafter once bad is tried again."""
        out, prev = [], 0.5
        for k in range(1, self.max_gamma + 1):
            last = (self.last_passed[k] + self.prior * prev) / (self.last_reached[k] + self.prior)
            prev = (self.passed[k] + self.prior * (max(last, 0.5) if k == 1 else last)) / (self.reached[k] + self.prior)
            out.append(prev)
        return out

    def _per(self, seconds: float, count: float) -> float:
        """A decayed time per unit, in 1-token target forwards (0 when unmeasured or unpriced)."""
        return seconds / count / self.plain_step_s if count and self.plain_step_s else 0.0

    def drafting(self) -> tuple[float, float]:
        """(c0, c): the drafter's propose time for a depth-d draft is c0 + c d, in 1-token target forwards (0, 0
        until measured or unpriced); through the origin while the depths drafted barely vary (variance < 0.2)."""
        n, sx, sxx, st, sxt = self.fit
        if not n or not self.plain_step_s:
            return 0.0, 0.0
        st, sxt = st / self.plain_step_s, sxt / self.plain_step_s
        spread = n * sxx - sx * sx  # n^2 times the depths' variance
        if spread < 0.2 * n * n:
            return (0.0, st / sx) if sx else (st / n, 0.0)
        c = max(0.0, (n * sxt - sx * st) / spread)
        return (st - c * sx) / n, c

    def c(self) -> float:
        """The drafter's propose time per depth level (the line's slope), in 1-token target forwards."""
        return self.drafting()[1]

    def b(self) -> float:
        """The drafter's `catch_up` time per draft that follows a draft, in 1-token target forwards."""
        return self._per(self.catch_up_s, self.catch_ups)

    def a(self) -> float:
        """The drafter's accept time per step, in 1-token target forwards."""
        return self._per(self.accept_s, self.steps)

    def r(self) -> float:
        """The decoder's measured verification time over the curve's price of it (1 until measured)."""
        return self.verify_s / self.priced_s if self.priced_s else 1.0

    def measured(self) -> list[float]:
        """Per depth d = 0..max: what steps at depth d achieved over what the model predicted for them, (tokens
        got / expected) x (cost priced / spent) capped at 1, shrunk by `prior` pseudo-steps towards depth d - 1's (1
        for d = 0): a depth is marked down for its shortfall, never up (a depth that did better than predicted did
        so because the estimates lag, which every depth shares), and one never chosen takes its neighbour's."""
        out, prev, m = [], 1.0, self.prior
        for n, got, expected, spent, priced in zip(self.chosen, self.got, self.expected, self.spent, self.priced,
                                                   strict=True):
            ratio = min(1.0, (got / expected) * (priced / spent if spent and priced else 1.0)) if n else prev
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
        """n_1..n_max: the drafts' mean nodes up to depth d (never fewer than up to d - 1: the means are over
        different drafts); unseen depths extend the last level's width."""
        out, width = [], 1.0
        for d in range(1, self.max_gamma + 1):
            prev = out[-1] if out else 0.0
            n = max(prev, self.nodes[d] / self.seen[d]) if self.seen[d] else prev + width
            width = n - prev
            out.append(n)
        return out

    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        depths = range(1, self.max_gamma + 1)
        self.step = None  # set by best_depth: this step's start, depth and prediction
        # a knob drafts d levels; a cut draft costs its whole (mean) height whatever depth it is cut to
        height = self.levels / self.drafts if self.drafts else 1.0
        (c0, c), b = self.drafting(), self.b()
        d = self.best_depth(self.expected_nodes(), [b + max(0.0, c0 + c * (k if self.knob else height)) for k in depths])
        if d == 0:
            tree = DraftTree.empty(ids.device)
        else:
            if self.knob:
                setattr(self.proposer, self.knob, d)
            if hasattr(self.proposer, "catch_up"):
                t0 = time.perf_counter()
                self.proposer.catch_up(ids)
                if self.drafted:  # one step's catch-up; after steps without a draft it also does theirs
                    self.catch_up_s = self.catch_up_s * self.decay + time.perf_counter() - t0
                    self.catch_ups = self.catch_ups * self.decay + 1
            t0 = time.perf_counter()
            tree = self.proposer.propose(ids, sampling)
            t = time.perf_counter() - t0
            lay = layout(tree.parents)
            x = d if self.knob else lay.height  # the depth asked for (a drafter may find less: prompt lookup)
            self.fit = [s * self.decay + v for s, v in zip(self.fit, (1.0, x, x * x, t, x * t), strict=True)]
            nodes = torch.bincount(lay.depth[1:], minlength=self.max_gamma + 1)[1:].cumsum(0).tolist()  # up to d
            self.levels, self.drafts = self.levels * self.decay + lay.height, self.drafts * self.decay + 1
            for k in depths:  # a short draft (no match, the context's end) counts at every depth asked for
                self.nodes[k], self.seen[k] = self.nodes[k] * self.decay, self.seen[k] * self.decay
                if k <= x:
                    self.nodes[k], self.seen[k] = self.nodes[k] + nodes[k - 1], self.seen[k] + 1
            if len(tree) and not self.knob:  # its drafting time is spent whatever the cut: priced alike for all
                sunk = self._per(time.perf_counter() - t0, 1.0)
                tree = tree.truncate(self.best_depth(nodes, [sunk] * self.max_gamma))
        self.gammas.append(layout(tree.parents).height)
        self.drafted = d > 0
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
            if self.knob and self.step is not None:  # the depth asked for: a shorter draft stopped the path there
                height = max(height, self.step[1])
            for k in range(1, self.max_gamma + 1):  # a_k: P(path reaches depth k | it reached k - 1, drafted to k)
                passed, reached = k <= accepted, k <= height and k - 1 <= accepted
                self.passed[k] = self.passed[k] * self.decay + passed
                self.reached[k] = self.reached[k] * self.decay + reached
                if reached:
                    self.last_passed[k] = self.last_passed[k] * self.memory + passed
                    self.last_reached[k] = self.last_reached[k] * self.memory + 1
        self.proposed = None
        t1 = time.perf_counter()
        self.proposer.accept(ids, verified)
        if verified.tree is not None:
            t2 = time.perf_counter()
            self.accept_s = self.accept_s * self.decay + t2 - t1
            self.steps = self.steps * self.decay + 1
            if self.step is not None:  # the whole step against its prediction, at the depth it was chosen for
                start, d, tokens, cost = self.step
                for stat in (self.chosen, self.got, self.expected, self.spent, self.priced):
                    stat[:] = [x * self.decay for x in stat]
                self.chosen[d] += 1
                self.got[d] += len(verified.path) + 1
                self.expected[d] += tokens
                if self.plain_step_s:
                    self.spent[d] += (t2 - start) / self.plain_step_s
                    self.priced[d] += cost
                self.step = None
