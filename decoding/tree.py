"""Draft token trees and the attention mask that verifies them in one target forward.

A proposer drafts a tree below the *root*, the last committed token (which is not yet in the
target's KV cache). Node i holds `tokens[i]`, its parent `parents[i]` (-1 = child of the root,
otherwise an earlier node, so parents[i] < i) and optionally `q[i]`, the draft distribution the
node was drawn from (None for deterministic drafters such as prompt lookup: q is then the point
mass on the drafted token). A chain is a tree whose node i has parent i - 1.

The verifying forward feeds [root, node_0, ..., node_{n-1}] at positions `cache_len + depth`
(root depth 0) with a mask in which every row sees the committed prefix, its ancestors and itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, -1 = child of the root
    q: torch.Tensor | None = None  # [n, V] float, the distribution node i was sampled from

    def __post_init__(self):
        n = self.tokens.numel()
        if self.parents.numel() != n or (self.q is not None and self.q.shape[0] != n):
            raise ValueError(f"DraftTree: tokens ({n}), parents ({self.parents.numel()}) and q rows must agree")
        if n and bool((self.parents >= torch.arange(n, device=self.parents.device)).any()):
            raise ValueError("DraftTree: parents[i] must be -1 or an earlier node (< i); list parents before children")

    def __len__(self) -> int:
        return self.tokens.numel()

    @classmethod
    def chain(cls, tokens: torch.Tensor, q: torch.Tensor | None = None) -> DraftTree:
        """A single path: node i is the child of node i - 1 (node 0 of the root)."""
        tokens = tokens.reshape(-1).long()
        return cls(tokens, torch.arange(-1, tokens.numel() - 1, device=tokens.device), q)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> DraftTree:
        """No draft: verification degenerates to one plain decoding step."""
        return cls(torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, dtype=torch.long, device=device))

    @classmethod
    def from_paths(cls, paths: list[list[int]], device: torch.device | str = "cpu"
                   ) -> tuple[DraftTree, list[list[int]]]:
        """A trie of token paths below the root (shared prefixes merged) and each path's node indices."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        nodes_of = []
        for path in paths:
            parent, nodes = -1, []
            for tok in path:
                if (parent, tok) not in index:
                    index[parent, tok] = len(tokens)
                    tokens.append(tok)
                    parents.append(parent)
                parent = index[parent, tok]
                nodes.append(parent)
            nodes_of.append(nodes)
        tree = cls(torch.tensor(tokens, dtype=torch.long, device=device),
                   torch.tensor(parents, dtype=torch.long, device=device))
        return tree, nodes_of

    def to(self, device: torch.device | str) -> DraftTree:
        return DraftTree(self.tokens.to(device), self.parents.to(device), None if self.q is None else self.q.to(device))

    @property
    def depth(self) -> torch.Tensor:
        """Depth of every node, 1 for children of the root. [n] long."""
        return depths(self.parents)[1:]

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root), in drafting order (the order siblings are tested in)."""
        return (self.parents == node).nonzero().flatten().tolist()

    def truncate(self, max_depth: int) -> DraftTree:
        """Drop nodes deeper than max_depth (a prefix-closed cut, since parents come first)."""
        keep = (self.depth <= max_depth).nonzero().flatten()  # [m]
        if keep.numel() == len(self):
            return self
        new_index = torch.full((len(self) + 1,), -1, dtype=torch.long, device=self.tokens.device)
        new_index[keep] = torch.arange(keep.numel(), device=keep.device)
        parents = self.parents[keep]
        parents = torch.where(parents < 0, parents, new_index[parents.clamp_min(0)])
        return DraftTree(self.tokens[keep], parents, None if self.q is None else self.q[keep])


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[n+1] depths of [root, nodes]: 0 for the root, parent's depth + 1 for a node."""
    d = [0]
    for p in parents.tolist():
        d.append(d[p + 1] + 1)
    return torch.tensor(d, device=parents.device)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n+1, n+1] bool over [root, nodes]: row i may attend column j iff j is i or an ancestor of i."""
    n = parents.numel()
    m = torch.eye(n + 1, dtype=torch.bool)
    m[:, 0] = True  # everyone sees the root
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            m[i + 1] |= m[p + 1]
    return m.to(parents.device)


def tree_attention_mask(parents: torch.Tensor, cache_len: int, dtype: torch.dtype,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Additive 4-D mask [1, 1, n+1, cache_len+n+1] for the verifying forward (0 = attend, min = blocked).

    Rows are [root, nodes]; columns are the cached prefix then [root, nodes]. With `sliding_window`
    a query at position i only sees keys at positions j > i - sliding_window, as Hugging Face does.
    """
    n = parents.numel()
    depth = depths(parents.cpu())  # [n+1]
    allowed = torch.cat([torch.ones(n + 1, cache_len, dtype=torch.bool), ancestor_mask(parents.cpu())], 1)
    if sliding_window is not None:
        q_pos = cache_len + depth  # [n+1]
        k_pos = torch.cat([torch.arange(cache_len), cache_len + depth])  # [cache_len+n+1]
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(parents.device)  # [1, 1, n+1, cache_len+n+1]


def position_ids(parents: torch.Tensor, cache_len: int) -> torch.Tensor:
    """[1, n+1] positions of [root, nodes]: cache_len + depth."""
    return (cache_len + depths(parents))[None]
