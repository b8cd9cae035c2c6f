"""EAGLE drafting on the shared verifier (`EagleProposer`: chain, EAGLE-2 greedy tree, sampled tree) and the
leaderboard's ways to decode with an EAGLE drafter."""

from __future__ import annotations

import heapq
import math
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.decoding import cache as kv
from draftsmith.decoding.bench import Drafting
from draftsmith.decoding.proposers import Proposer, Verified, draw
from draftsmith.decoding.tree import DraftTree, layout
from draftsmith.decoding.verify import Sampling, warp
from draftsmith.models.eagle_drafter import EagleDrafter, additive, load_drafter
from draftsmith.models.target import Target

ALPHA_PRIOR, ALPHA_PRIOR_N = 0.7, 4  # sampled trees: each draw's acceptance before any verification, its weight


class EagleProposer(Proposer):
    """EAGLE drafting on the shared verifier: feature-space autoregression with the drafter's own KV cache.

    Before each draft (`catch_up`) the cache is cut back to the committed positions and extended with the
    target's features of the tokens committed since the last draft (entry p holds feature f_p with token
    x_{p+1}, at rope position p), so drafting always restarts from the target's own hidden states. Then:
    - chain: gamma tokens, each fed back with the drafter's output hidden state;
    - tree, greedy (EAGLE-2's dynamic tree): `depth` rounds; each round expands the `top_k` best frontier nodes
      by their `top_k` children, scored by the cumulative log draft probability q, the greedy chain's tip always
      among them. The tree is the greedy chain (each node's top-1 child from the root: the chain proposer's own
      draft, `depth` deep) and the best other nodes over all depths up to `total_tokens` (ancestors score at
      least as high as descendants, so it is closed). EAGLE-2 keeps the best nodes alone and drops the chain's
      deep tokens wherever q is unsure early: its greedy tree accepted less than a chain as deep (README).
    - tree, sampling: a shape fixed before anything is drawn, then filled level by level with draws without
      replacement (each node records the q it was drawn from, for the exact verifier). The j-th draw at a node is
      the child the verifier accepts with chance prod_{i<j} (1 - a_i) a_j, a_j the rate at which a j-th draw was
      accepted once tested, learnt from the verifications so far; a node is reached with the product of the
      chances along its path, and the `total_tokens` likeliest nodes within `depth` levels, closed under
      ancestors and earlier draws, form the shape. The shape must not depend on the drawn tokens: a draw kept
      or dropped for its own q (as EAGLE-2's scores would) skews which tokens the verifier lets out
      (tests/test_eagle.py, `test_a_sampled_tree_keeps_the_targets_distribution_where_a_q_scored_one_did_not`).
    """

    def __init__(self, drafter: EagleDrafter, embed: nn.Module, target_head: nn.Module, layers,
                 mode: Literal["chain", "tree"] = "chain", gamma: int = 5, top_k: int = 8, depth: int = 5,
                 total_tokens: int = 32):
        if mode not in ("chain", "tree") or min(gamma, top_k, depth, total_tokens) < 1:
            raise ValueError("EAGLE proposer: mode must be chain or tree and gamma, top_k, depth, total_tokens >= 1")
        self.drafter, self.embed, self.head = drafter, embed, target_head
        self.hidden_layers = tuple(layers) or (-1,)
        self.mode, self.gamma, self.top_k, self.depth, self.total_tokens = mode, gamma, top_k, depth, total_tokens
        self.draws = [[ALPHA_PRIOR * ALPHA_PRIOR_N, ALPHA_PRIOR_N] for _ in range(top_k)]  # sampled trees: per draw
        # index j at a node, [accepted, tested]
        self.reset()

    def reset(self) -> None:
        self.cache, self.n, self.last = kv.new_cache(), 0, None  # committed entries, output at the last one [H]
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tokens [m], features [m, k*H]) not yet fed

    def _step(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
              ) -> torch.Tensor:
        """Feed q entries: tokens [q], h [q, D], positions [q], visible [q, cache + q] bool -> outputs [q, H]."""
        emb = self.embed(tokens[None]).to(h.dtype)  # [1, q, H]
        return self.drafter(emb, h[None], positions[None], additive(visible)[None, None], self.cache)[0]

    @torch.no_grad()
    def accept(self, ids: torch.Tensor, verified: Verified) -> None:
        """Records the committed entries; `catch_up` feeds them when the next draft needs them, so a step that
        drafts nothing (adaptive gamma's depth 0) costs no drafter forward, and several such steps cost one. The
        prompt's entries are fed at once (a cost per sequence, not per draft)."""
        if verified.hidden is None:
            return
        tree = verified.tree
        if tree is not None and tree.q is not None and self.mode == "tree":  # a_j: each tested draw, accepted or not
            for node, taken in zip([-1, *verified.path], [*verified.path, None], strict=True):
                for j, child in enumerate(tree.children(node)):  # tested in draw order until one is accepted
                    self.draws[j][1] += 1
                    if child == taken:
                        self.draws[j][0] += 1
                        break
        k, m, H = verified.hidden.shape
        feats = verified.hidden.permute(1, 0, 2).reshape(m, k * H).to(self.drafter.fc.weight.dtype)  # [m, k*H]
        self.pending.append((ids[ids.numel() - m:], feats))
        if verified.tree is None:
            self.catch_up(ids)

    def take_pending(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The recorded entries at once: tokens [M], features [M, k*H], rope positions [M] (n .. t - 2); the cache
        is cut back to the committed entries first (dropping the last draft's)."""
        kv.crop(self.cache, self.n)
        tokens, feats = (torch.cat(x) for x in zip(*self.pending, strict=True))
        self.pending = []
        if self.n + tokens.numel() != ids.numel() - 1:
            raise RuntimeError("EAGLE proposer: accept was not called after every verification")
        return tokens, feats, torch.arange(self.n, self.n + tokens.numel(), device=ids.device)

    @torch.no_grad()
    def catch_up(self, ids: torch.Tensor) -> None:
        """Feeds the entries recorded since the last draft in one forward (entry p: feature f_p, token x_{p+1})."""
        if not self.pending:
            return
        tokens, feats, positions = self.take_pending(ids)
        m = tokens.numel()
        visible = torch.ones(m, self.n + m, dtype=torch.bool, device=ids.device).tril(self.n)
        out = self._step(tokens, feats, positions, visible)  # [m, H]
        self.n, self.last = self.n + m, out[-1]

    def _draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.drafter.logits(out, self.head).float()  # [.., Vd]

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        self.catch_up(ids)
        if self.last is None:
            return DraftTree.empty(ids.device)
        return self._chain(ids, sampling) if self.mode == "chain" else self._tree(ids, sampling)

    def _over_target(self, qs: list[torch.Tensor]) -> torch.Tensor:
        """Draft-vocabulary distributions [Vd] each -> one [n, V] over the target's vocabulary, zero elsewhere.
        Drafting warps and samples the draft logits alone: the same as over the target's vocabulary with every
        other token at -inf, without a [V]-sized tensor per drafted token."""
        q = qs[0].new_zeros(len(qs), self.drafter.t2d.numel())
        q[:, self.drafter.draft_ids] = torch.stack(qs)
        return q

    def _chain(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        draft_ids = self.drafter.draft_ids  # [Vd]
        h, tokens, qs = self.last, [], []
        for i in range(self.gamma):
            x = int(draft_ids[draw(self._draft_logits(h), sampling, qs)])  # qs gets the [Vd] q when sampling
            tokens.append(x)
            if i + 1 < self.gamma:
                visible = torch.ones(1, self.n + i + 1, dtype=torch.bool, device=ids.device)
                pos = torch.tensor([self.n + i], device=ids.device)
                h = self._step(torch.tensor([x], device=ids.device), h[None], pos, visible)[0]
        return DraftTree.chain(torch.tensor(tokens, device=ids.device), self._over_target(qs) if qs else None)

    def _feed(self, nodes: list[int], level: int, tokens: list[int], parents: list[int], slot: dict[int, int],
              out_of: dict[int, torch.Tensor]) -> None:
        """Feeds tree nodes at depth `level` to the drafter in one forward, each after the committed entries and
        its ancestors' cache entries; records each node's cache entry (`slot`) and output [H] (`out_of`)."""
        dev, start = self.last.device, self.n + len(slot)
        visible = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool, device=dev)
        visible[:, : self.n] = True
        for r, i in enumerate(nodes):
            slot[i] = start + r
            a = parents[i]
            while a >= 0:
                visible[r, slot[a]] = True
                a = parents[a]
            visible[r, slot[i]] = True
        h_in = torch.stack([out_of[parents[i]] if parents[i] >= 0 else self.last for i in nodes])  # [F, H]
        pos = torch.full((len(nodes),), self.n + level - 1, device=dev)
        outs = self._step(torch.tensor([tokens[i] for i in nodes], device=dev), h_in, pos, visible)  # [F, H]
        for r, i in enumerate(nodes):
            out_of[i] = outs[r]

    def _tree(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        """EAGLE-2 (greedy), the greedy chain kept: expand the chain's tip and the top_k - 1 best other frontier
        nodes per round; keep the chain and the best nodes up to total_tokens, ordered by depth. Sampling:
        `_sampled_tree`."""
        if not sampling.greedy:
            return self._sampled_tree(ids, sampling)
        draft_ids, K = self.drafter.draft_ids, self.top_k  # [Vd]
        tokens, parents, scores, depth = [], [], [], []  # per node
        out_of: dict[int, torch.Tensor] = {}  # node -> drafter output after feeding it [H]
        slot: dict[int, int] = {}  # node -> its entry in the drafter cache

        def expand(h: torch.Tensor, froms: list[int]) -> list[int]:
            """The top_k children of `froms` (outputs h [F, H]) by log q -> indices of the new candidate nodes."""
            top = F.log_softmax(self._draft_logits(h), -1).topk(min(K, draft_ids.numel()), -1)  # [F, k] each
            new = []
            for parent, values, picks in zip(froms, top.values.tolist(), top.indices.tolist(), strict=True):
                for lq, x in zip(values, picks, strict=True):
                    new.append(len(tokens))
                    tokens.append(int(draft_ids[x]))
                    parents.append(parent)
                    scores.append(lq + (scores[parent] if parent >= 0 else 0.0))
                    depth.append(1 + (depth[parent] if parent >= 0 else 0))
            return new

        frontier = expand(self.last[None], [-1])
        chain = [frontier[0]]  # the greedy chain, each node its parent's top-1 child: the chain proposer's draft
        for level in range(1, self.depth):
            frontier = [chain[-1], *sorted((i for i in frontier if i != chain[-1]), key=lambda i: -scores[i])[:K - 1]]
            self._feed(frontier, level, tokens, parents, slot, out_of)
            frontier = expand(torch.stack([out_of[i] for i in frontier]), frontier)
            chain.append(frontier[0])  # the chain's tip is expanded first
        keep = chain[: self.total_tokens]
        best = sorted(range(len(tokens)), key=lambda i: (-scores[i], depth[i]))  # closed under ancestors, any prefix
        keep += [i for i in best if i not in chain][: self.total_tokens - len(keep)]
        return kept_tree(sorted(keep, key=lambda i: (depth[i], i)), tokens, parents, ids.device)

    def shape(self) -> list[int]:
        """The sampled tree's shape from the learnt draw chances alone (the class docstring): parents per node,
        -1 for the root's, parents before children, by depth, a node's children in draw order."""
        chance, left = [], 1.0  # chance[j]: the j-th draw is the accepted child; non-increasing in j
        for accepted, tested in self.draws:
            a = accepted / tested
            chance.append(min(left * a, chance[-1] if chance else 1.0))
            left *= 1 - a
        log_c = [math.log(c) for c in chance]  # each a_j lies strictly within (0, 1) (ALPHA_PRIOR)
        # best first: a popped node (parent, j) offers its next sibling and its first child, neither likelier than
        # it, so the pops are the likeliest nodes, closed under ancestors and earlier draws
        heap, nodes = [(-log_c[0], 1, 0, -1, 0)], []  # (-log reach, depth, tie-break, parent, j); nodes: (parent, depth)
        while heap and len(nodes) < self.total_tokens:
            score, d, _, parent, j = heapq.heappop(heap)
            nodes.append((parent, d))
            if j + 1 < len(log_c):
                heapq.heappush(heap, (score - log_c[j + 1] + log_c[j], d, len(nodes), parent, j + 1))
            if d < self.depth:
                heapq.heappush(heap, (score - log_c[0], d + 1, len(nodes), len(nodes) - 1, 0))
        order = sorted(range(len(nodes)), key=lambda i: (nodes[i][1], i))  # by depth, draw order kept
        index = {old: new for new, old in enumerate(order)}
        return [index[nodes[i][0]] if nodes[i][0] >= 0 else -1 for i in order]

    def _sampled_tree(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        """`shape()` filled level by level: each parent's children are its first draws without replacement from
        its warped q (fewer where q has fewer tokens: the missing draws' subtrees are dropped)."""
        draft_ids, parents = self.drafter.draft_ids, self.shape()  # [Vd]
        lay = layout(parents)
        n, levels = len(parents), lay.depth[1:].tolist()
        tokens, qs, alive = [0] * n, [None] * n, [False] * n
        out_of: dict[int, torch.Tensor] = {}  # node -> drafter output after feeding it [H]
        slot: dict[int, int] = {}  # node -> its entry in the drafter cache
        for level in range(1, max(levels, default=0) + 1):
            froms = sorted({parents[i] for i in range(n) if levels[i] == level and (parents[i] < 0 or alive[parents[i]])})
            if level > 1:
                self._feed(froms, level - 1, tokens, parents, slot, out_of)
            h = torch.stack([out_of[a] if a >= 0 else self.last for a in froms])  # [F, H]
            for a, q in zip(froms, warp(self._draft_logits(h), sampling), strict=True):  # [Vd] per parent
                kids = lay.kids[a + 1]  # in draw order
                k = min(len(kids), int((q > 0).sum()))
                # k sequential draws without replacement, each from q renormalised over what is left (multinomial
                # without replacement draws exactly so, in this order); draw j's q has draws 0..j-1 zeroed
                picks = torch.multinomial(q, k, replacement=False, generator=sampling.generator)  # [k]
                drawn = F.one_hot(picks, q.numel()).to(q.dtype)  # [k, Vd]
                left = q * (1 - (drawn.cumsum(0) - drawn))  # [k, Vd]
                for i, x, q_node in zip(kids, picks.tolist(), left / left.sum(-1, keepdim=True), strict=False):
                    tokens[i], qs[i], alive[i] = int(draft_ids[x]), q_node, True
        keep = [i for i in range(n) if alive[i]]
        return kept_tree(keep, tokens, parents, ids.device, self._over_target([qs[i] for i in keep]))


def kept_tree(keep: list[int], tokens: list[int], parents: list[int], device, q: torch.Tensor | None = None
              ) -> DraftTree:
    """The nodes `keep` (a list closed under parents, parents first) of a candidate tree, renumbered."""
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree(torch.tensor([tokens[i] for i in keep], device=device),
                     torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in keep], device=device), q)


def load_proposer(path: str | Path, target, **kwargs) -> EagleProposer:
    """The plug-in's proposer loader (models/registry.py) for an EAGLE drafter dir."""
    target = target if isinstance(target, Target) else Target(target, None, "")
    drafter, meta = load_drafter(path, target.lm_head.weight.device, target.lm_head.weight.dtype)
    return EagleProposer(drafter, target.embed, target.lm_head, meta["aux_layers"], **kwargs)


def variants(drafter_dir: Path, target: nn.Module) -> dict[str, Drafting]:
    """The leaderboard's ways to decode with an EAGLE drafter (on the target's embedding and LM head): a chain, and
    the EAGLE-2 tree at scripts/bench_eagle.py's CPU size (top 8 per node, 5 rounds, 24 nodes kept)."""
    first = load_proposer(drafter_dir, target)
    runs = [first.drafter, first.embed, first.head]
    return {"chain": Drafting(target, lambda g: sibling(first, mode="chain", gamma=g), runs, gamma=5),
            "tree": Drafting(target, lambda g: sibling(first, mode="tree", top_k=8, depth=5, total_tokens=24), runs)}


def sibling(proposer: EagleProposer, **kwargs) -> EagleProposer:
    """A fresh proposer (per-sequence state of its own) on `proposer`'s drafter, embedding and head, with `kwargs`'
    settings: one per sequence decoded together, without loading the drafter again."""
    return EagleProposer(proposer.drafter, proposer.embed, proposer.head, proposer.hidden_layers, **kwargs)
