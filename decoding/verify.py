"""Accept rules: which drafted nodes the target keeps, and the token it adds after them.

Every rule walks the tree from the root and returns `(path, bonus)`: the accepted node indices,
root to leaf, and one token sampled from the target at the last accepted node (the "bonus").
`p` rows are over [root, nodes]: row 0 is the target's distribution for the root's children,
row i + 1 the one for node i's children.

- greedy: accept the child equal to argmax p (lossless at temperature 0).
- exact: speculative sampling (Leviathan et al. 2023, Chen et al. 2023) generalised to trees by
  multi-round rejection sampling over siblings (SpecInfer, Miao et al. 2023): child c with draft
  distribution q_c is accepted with probability min(1, p(x)/q_c(x)); on rejection the target
  distribution becomes the residual (p - q_c)+ / |(p - q_c)+| and the next sibling is tested
  against it; when every child is rejected the bonus is drawn from the last residual. Each node
  carries the q it was drawn from, so siblings drawn without replacement simply record the
  renormalised q. Deterministic drafts (q None) are point masses. The emitted tokens follow the
  target's (warped) distribution exactly; a chain is the one-child case.
- typical: Medusa's typical acceptance (Cai et al. 2024), lossy: a node is accepted when
  p(x) > min(epsilon, delta * exp(-H(p))); the deepest accepted path wins.

Temperature, top-k and top-p warp p here and q in the proposers through the same `warp`.
All acceptance arithmetic is float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.decoding.tree import DraftTree, layout

RULES = ("auto", "greedy", "exact", "typical")


@dataclass
class Sampling:
    """How tokens are drawn: temperature 0 = greedy; top_k 0 and top_p 1 disable the filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling settings {self}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, in float32 (one-hot argmax at temperature 0)."""
    logits = logits.float()  # [..., V]
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / s.temperature
    if s.top_k:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        probs, order = logits.softmax(-1).sort(-1, descending=True)  # [..., V]
        drop = probs.cumsum(-1) - probs >= s.top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from a [V] distribution, drawn on the CPU where the seeded generator lives (the same draws on
    any device)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def accept_greedy(tree: DraftTree, logits) -> tuple[list[int], int]:
    """Follow children equal to the target's argmax. logits: a [n+1, V] tensor (argmax of every row in one
    op and one host copy) or lazy rows [V] indexable 0..n (only the rows on the path are computed)."""
    tokens, kids = tree.tokens.tolist(), layout(tree.parents).kids
    argmax = logits.argmax(-1).tolist() if isinstance(logits, torch.Tensor) else None  # [n+1]
    path, node = [], -1
    while True:
        best = argmax[node + 1] if argmax is not None else int(logits[node + 1].argmax())
        match = [c for c in kids[node + 1] if tokens[c] == best]
        if not match:
            return path, best
        node = match[0]
        path.append(node)


def accept_exact(tree: DraftTree, p, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Multi-round rejection sampling over siblings (SpecInfer); p: rows [V] of warped target probabilities."""
    tokens, kids = tree.tokens.tolist(), layout(tree.parents).kids
    path, node = [], -1
    while True:
        residual = p[node + 1].float()  # [V]
        for c in kids[node + 1]:
            x = tokens[c]
            q = tree.q[c].float() if tree.q is not None else \
                torch.nn.functional.one_hot(tree.tokens[c], residual.numel()).float()  # [V]
            u = float(torch.rand((), generator=generator))
            if u * q[x] < residual[x]:  # u < min(1, p(x) / q(x))
                path.append(c)
                node = c
                break
            rest = (residual - q).clamp_min(0)  # (p - q)+
            if rest.sum() > 0:  # (p == q leaves no residual; rejection then has probability 0)
                residual = rest / rest.sum()
        else:
            return path, sample(residual, generator)


def accept_typical(tree: DraftTree, p: torch.Tensor, epsilon: float = 0.09, delta: float = 0.3,
                   generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Medusa typical acceptance (lossy): deepest path whose every node has p(x) > min(eps, delta e^-H)."""
    p = p.float()  # [n+1, V]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [n+1]
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))  # [n+1]
    ok: list[bool] = []
    depth: list[int] = []
    for par, x in zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True):
        ok.append(bool(p[par + 1, x] > threshold[par + 1]) and (par < 0 or ok[par]))
        depth.append(1 if par < 0 else depth[par] + 1)
    best = max((i for i in range(len(tree)) if ok[i]), key=lambda i: (depth[i], -i), default=-1)
    path = []
    while best >= 0:
        path.append(best)
        best = int(tree.parents[best])
    path.reverse()
    return path, sample(p[path[-1] + 1 if path else 0], generator)


def verify(tree: DraftTree, logits, sampling: Sampling, rule: str = "auto",
           typical: tuple[float, float] = (0.09, 0.3)) -> tuple[list[int], int]:
    """Apply an accept rule to the target's logits over [root, nodes]: a [n+1, V] tensor or lazy rows
    (`generate.LazyLogits`); only the rows the rule visits are computed.

    rule "auto" is greedy at temperature 0 and exact otherwise; `typical` = (epsilon, delta).
    """
    if rule not in RULES:
        raise ValueError(f"unknown accept rule {rule!r}; choose one of {RULES}")
    if rule == "greedy" or (rule == "auto" and sampling.greedy):
        return accept_greedy(tree, logits)
    if rule == "typical":
        full = logits.full() if hasattr(logits, "full") else logits  # [n+1, V]
        return accept_typical(tree, warp(full, sampling), *typical, generator=sampling.generator)
    return accept_exact(tree, _Warped(logits, sampling), sampling.generator)


class _Warped:
    """Rows of warp(logits[i]), computed on first access."""

    def __init__(self, logits, sampling: Sampling):
        self.logits, self.sampling, self.rows = logits, sampling, {}

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.rows:
            self.rows[i] = warp(self.logits[i], self.sampling)  # [V]
        return self.rows[i]
