"""Accept rules: sampling exactness by a chi-square test (chains and trees), and the rules' basics.

Toy target and drafter are bigram tables over a vocabulary of 5: the target's distribution of the
next token given the last is P[last], the drafter's Q[last]. Every trial decodes until two tokens
are emitted, so depth-2 acceptance and the bonus token are both exercised; the empirical joint of
the two tokens must match P[0, x1] * P[x1, x2] at significance 1e-3 (25 cells, 24 dof).
"""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.decoding.tree import DraftTree
from draftsmith.decoding.verify import (
    Sampling,
    accept_exact,
    accept_greedy,
    accept_typical,
    sample,
    verify,
    warp,
)

V, TRIALS = 5, 12000
torch.manual_seed(0)
P = torch.softmax(torch.randn(V, V) * 1.5, -1)  # target bigram: P[last] = p(next | last)
Q = torch.softmax(torch.randn(V, V) * 1.5, -1)  # drafter bigram, deliberately different


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Upper 1e-3 quantile of chi-square (Wilson-Hilferty approximation)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def draft_tree(last: int, width: int, depth: int, replacement: bool, g: torch.Generator,
               record_renormalised: bool = True) -> DraftTree:
    """`width` children per node, `depth` levels, drawn from Q; q per node as drawn."""
    tokens, parents, qs = [], [], []
    frontier = [(-1, last)]
    for _ in range(depth):
        nxt = []
        for parent, tok in frontier:
            q = Q[tok].clone()
            for _ in range(width):
                x = sample(q, g)
                tokens.append(x)
                parents.append(parent)
                qs.append(q.clone())
                nxt.append((len(tokens) - 1, x))
                if not replacement:
                    q[x] = 0
                    q = q / q.sum()
        frontier = nxt
    if not record_renormalised:  # the classic bug: every sibling tested against the unrenormalised q
        qs = [Q[last if p < 0 else tokens[p]] for p in parents]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.stack(qs))


def target_probs(tree: DraftTree, last: int) -> torch.Tensor:
    rows = [last] + tree.tokens.tolist()
    return P[rows]  # [n+1, V]


def wrong_siblings(tree: DraftTree, p: torch.Tensor, g: torch.Generator) -> tuple[list[int], int]:
    """The classic mistake: each sibling tested independently against the same p."""
    path, node = [], -1
    while True:
        kids = tree.children(node)
        for c in kids:
            x = int(tree.tokens[c])
            if float(torch.rand((), generator=g)) < min(1.0, float(p[node + 1, x] / tree.q[c, x])):
                path.append(c)
                node = c
                break
        else:
            residual = p[node + 1].clone()
            if kids:
                residual = (residual - tree.q[kids[0]]).clamp_min(0)
            return path, sample(residual / residual.sum(), g)


def chi2_two_tokens(rule, width: int, depth: int, replacement: bool = True, renormalise: bool = True,
                    trials: int = TRIALS) -> float:
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        out, last = [], 0
        while len(out) < 2:
            tree = draft_tree(last, width, depth, replacement, g, renormalise)
            path, bonus = rule(tree, target_probs(tree, last), g)
            out += tree.tokens[path].tolist() + [bonus]
            last = out[-1]
        counts[out[0], out[1]] += 1
    expected = trials * P[0][:, None] * P  # [V, V] joint of (x1, x2)
    return float(((counts - expected) ** 2 / expected).sum())


CRITICAL = chi2_critical(V * V - 1)


@pytest.mark.parametrize("width,depth,replacement,trials", [(1, 3, True, TRIALS), (3, 2, True, TRIALS // 2),
                                                            (3, 2, False, TRIALS // 2)],
                         ids=["chain", "tree-iid", "tree-without-replacement"])
def test_exact_rule_matches_target_distribution(width, depth, replacement, trials):
    assert chi2_two_tokens(accept_exact, width, depth, replacement, trials=trials) < CRITICAL


def test_statistical_test_catches_independent_sibling_testing():
    assert chi2_two_tokens(wrong_siblings, 3, 2, trials=TRIALS // 4) > 3 * CRITICAL


def test_statistical_test_catches_unrenormalised_q_without_replacement():
    assert chi2_two_tokens(accept_exact, 3, 2, replacement=False, renormalise=False, trials=TRIALS // 4) > 3 * CRITICAL


def test_deterministic_drafts_are_point_masses():
    """q None: accept x with probability p(x); the emitted distribution is still p."""
    g = torch.Generator().manual_seed(2)
    counts = torch.zeros(V)
    tree = DraftTree.from_paths([[3], [1]])[0]
    p = P[[0, 3, 1]]  # [3, V]
    for _ in range(TRIALS):
        path, bonus = accept_exact(tree, p, g)
        counts[(tree.tokens[path].tolist() + [bonus])[0]] += 1
    expected = TRIALS * P[0]
    assert float(((counts - expected) ** 2 / expected).sum()) < chi2_critical(V - 1)


def test_greedy_follows_argmax_through_a_tree():
    tree = DraftTree.from_paths([[1, 2], [3, 4, 0], [3, 1]])[0]  # nodes: 1, 2, 3, 4, 0, 1
    logits = torch.full((len(tree) + 1, V), -1.0)
    for row, best in [(0, 3), (3, 4), (4, 0), (5, 2)]:  # root -> 3 -> 4 -> 0, bonus 2
        logits[row, best] = 1.0
    path, bonus = accept_greedy(tree, logits)
    assert tree.tokens[path].tolist() == [3, 4, 0] and bonus == 2


def test_typical_accepts_plausible_and_rejects_implausible_tokens():
    tree = DraftTree.chain(torch.tensor([0, 1]))
    confident = torch.tensor([0.9, 0.05, 0.03, 0.01, 0.01])
    p = torch.stack([confident, confident.roll(1), confident])  # node 1 (token 1) is likely after node 0
    assert accept_typical(tree, p)[0] == [0, 1]
    p[1] = confident  # token 1 now has p = 0.05 < min(0.09, 0.3 * exp(-H)) at that position
    assert accept_typical(tree, p)[0] == [0]


def test_warp_applies_top_k_top_p_and_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.equal(warp(logits, Sampling(0.0)), torch.tensor([[1.0, 0, 0, 0]]))
    assert (warp(logits, Sampling(1.0, top_k=2))[0, 2:] == 0).all()
    p = warp(logits, Sampling(1.0, top_p=0.7))  # softmax = .61 .22 .14 .03: keep the first two
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    hot, cold = warp(logits, Sampling(2.0)), warp(logits, Sampling(0.5))
    assert hot[0, 0] < torch.softmax(logits, -1)[0, 0] < cold[0, 0]


def test_bad_settings_fail_clearly():
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0)
    with pytest.raises(ValueError, match="accept rule"):
        verify(DraftTree.empty(), torch.zeros(1, V), Sampling(), rule="lenient")
