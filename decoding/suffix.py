"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975): a model-free proposer over a suffix trie of the
request's own text (prompt and generated tokens), as vLLM's `suffix` method does per request.

The trie holds every substring of the text up to `max_depth` tokens (a suffix tree truncated at that
depth), each node counting how often its substring occurred. To draft, the proposer takes the longest
suffix of the committed text (of at most max_depth - max_spec tokens, leaving room for the continuation)
that occurred before with a continuation, and expands the continuations
below it best-first by their empirical probability count(child) / (occurrences of the node that were continued), the product along a path
being a node's score: nodes scoring below `min_prob` are not proposed, and at most `max_spec` nodes are.
With `max_children=1` the draft is a chain (the single most frequent continuation); otherwise a small
tree, verified in one forward like any other. Drafts are deterministic (q = point mass), so exact
verification stays exact.

Memory: the trie grows by up to `max_depth` nodes per token; when it would exceed `max_nodes` it is
rebuilt from the most recent half of the text that fits, so it never holds more than `max_nodes` nodes.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from draftsmith.decoding.proposers import Proposer
from draftsmith.decoding.tree import DraftTree
from draftsmith.decoding.verify import Sampling


class SuffixTrie:
    """Counts of every substring of length <= max_depth of an appended-to token stream, capped at max_nodes."""

    def __init__(self, max_depth: int = 24, max_nodes: int = 200_000):
        if max_depth < 2 or max_nodes < 2 * max_depth:
            raise ValueError("suffix trie: max_depth >= 2 and max_nodes >= 2 * max_depth")
        self.max_depth, self.max_nodes = max_depth, max_nodes
        self.text: list[int] = []
        self._clear()

    def _clear(self) -> None:
        self.children: list[dict[int, int]] = [{}]  # node -> {token: child}; node 0 is the root (empty string)
        self.count, self.depth = [0], [0]
        self.active = [0]  # nodes of the text's suffixes shorter than max_depth, shortest (the root) first

    def __len__(self) -> int:
        return len(self.children)

    def _child(self, node: int, token: int) -> int:
        child = self.children[node].get(token)
        if child is None:
            child = len(self.children)
            self.children[node][token] = child
            self.children.append({})
            self.count.append(0)
            self.depth.append(self.depth[node] + 1)
        return child

    def append(self, token: int) -> None:
        """Extend every active suffix by `token` (counting one more occurrence of each)."""
        if len(self) + self.max_depth > self.max_nodes:  # rebuild from the newest text that fits
            keep = self.text[-max(1, self.max_nodes // (2 * self.max_depth)):]
            self.text = []
            self._clear()
            for t in keep:
                self.append(t)
        self.text.append(token)
        nxt = [0]
        for node in self.active:
            if self.depth[node] < self.max_depth:
                child = self._child(node, token)
                self.count[child] += 1
                nxt.append(child)
        self.active = nxt[: self.max_depth]

    def match(self, min_length: int = 1, max_length: int | None = None) -> int | None:
        """The deepest node of a suffix of the text (min_length..max_length tokens) that occurred before with a
        continuation, or None."""
        for node in reversed(self.active):
            if min_length <= self.depth[node] <= (max_length or self.max_depth) and self.children[node]:
                return node
        return None


class SuffixDecoding(Proposer):
    """Drafts the most frequent continuations of the longest matching suffix (see the module docstring)."""

    def __init__(self, max_spec: int = 16, max_depth: int = 24, min_prob: float = 0.1, max_children: int = 1,
                 min_match: int = 1, max_nodes: int = 200_000):
        if max_spec < 1 or max_children < 1 or min_match < 1 or not 0 <= min_prob <= 1:
            raise ValueError("suffix decoding: max_spec, max_children, min_match >= 1 and 0 <= min_prob <= 1")
        self.max_spec, self.min_prob, self.max_children, self.min_match = max_spec, min_prob, max_children, min_match
        self.max_depth, self.max_nodes = max_depth, max_nodes
        self.reset()

    def reset(self) -> None:
        self.trie = SuffixTrie(self.max_depth, self.max_nodes)

    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        for token in ids[len(self.trie.text):].tolist():  # committed tokens not yet in the trie
            self.trie.append(token)
        # the match leaves max_spec levels of the trie below it for the continuation (where max_depth allows)
        tokens, parents = self.expand(self.trie.match(self.min_match, max(self.min_match, self.max_depth - self.max_spec)))
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=ids.device),
                         torch.tensor(parents, dtype=torch.long, device=ids.device))

    def expand(self, start: int | None) -> tuple[list[int], list[int]]:
        """Best-first expansion below trie node `start`: (tokens, parents), parents before children (a child
        scores at most its parent's score, and enters the heap only once its parent is drafted)."""
        trie, tokens, parents = self.trie, [], []
        heap: list[tuple[float, int, int, int, int]] = []  # (-score, tie, trie node, token, parent in the draft)
        tie = itertools.count()

        def push(node: int, score: float, parent: int) -> None:
            kids = sorted(trie.children[node].items(), key=lambda kv: -trie.count[kv[1]])[: self.max_children]
            seen = sum(trie.count[c] for c in trie.children[node].values())  # occurrences with a continuation
            for token, child in kids:
                p = score * trie.count[child] / seen  # p(path) = prod count(child) / count(continued parent)
                if p >= self.min_prob:
                    heapq.heappush(heap, (-p, next(tie), child, token, parent))

        if start is not None:
            push(start, 1.0, -1)
        while heap and len(tokens) < self.max_spec:
            score, _, node, token, parent = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            push(node, -score, len(tokens) - 1)
        return tokens, parents
