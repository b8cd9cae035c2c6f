"""Draft token trees and the attention mask that verifies them in one target forward.

A proposer drafts a tree below the *root*, the last committed token (which is not yet in the
target's KV cache). Node i holds `tokens[i]`, its parent `parents[i]` (-1 = child of the root,
otherwise an earlier node, so parents[i] < i) and optionally `q[i]`, the draft distribution the
node was drawn from (None for deterministic drafters such as prompt lookup: q is then the point
mass on the drafted token). A chain is a tree whose node i has parent i - 1.

The verifying forward feeds [root, node_0, ..., node_{n-1}] at positions `cache_len + depth`
(root depth 0) with a mask in which every row sees the committed prefix, its ancestors and itself.
Depths, the ancestor mask and the child lists depend only on the tree's shape (`parents`): `layout`
builds them once per shape, with tensor ops rather than a loop over nodes, and caches them, so a
static tree (Medusa) or a recurring shape (every chain of a given length) costs a dictionary look-up.
"""

from __future__ import annotations

import functools
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
        return list(layout(self.parents).kids[node + 1])

    def truncate(self, max_depth: int) -> DraftTree:
        """Drop nodes deeper than max_depth (a prefix-closed cut, since parents come first)."""
        if layout(self.parents).height <= max_depth:
            return self
        keep = (self.depth <= max_depth).nonzero().flatten()  # [m]
        new_index = torch.full((len(self) + 1,), -1, dtype=torch.long, device=self.tokens.device)
        new_index[keep] = torch.arange(keep.numel(), device=keep.device)
        parents = self.parents[keep]
        parents = torch.where(parents < 0, parents, new_index[parents.clamp_min(0)])
        return DraftTree(self.tokens[keep], parents, None if self.q is None else self.q[keep])


@dataclass(frozen=True)
class Layout:
    """What verifying one tree shape needs, built once per shape (`layout`) and reused every step."""

    depth: torch.Tensor  # [n+1] long: depths of [root, nodes], root 0
    visible: torch.Tensor  # [n+1, n+1] bool: row i sees column j iff j is i or an ancestor of i
    kids: tuple[tuple[int, ...], ...]  # kids[i + 1] = children of node i, kids[0] = of the root, drafting order
    chain: bool  # node i is the child of node i - 1: the model's own causal mask verifies it
    height: int  # the deepest node's depth (0 for an empty tree)


@functools.lru_cache(maxsize=256)
def _layout(parents: tuple[int, ...], device: str) -> Layout:
    n = len(parents)
    p = torch.tensor(parents, dtype=torch.long) + 1  # [n] parent rows over [root, nodes]
    step = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    step[torch.arange(1, n + 1), p] = True  # row i -> its parent
    visible = torch.eye(n + 1, dtype=torch.bool) | step
    for _ in range(max(1, n).bit_length()):  # transitive closure by squaring: ancestors up to 2^r levels up
        visible = (visible.float() @ visible.float()).bool()  # [n+1, n+1]
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for i, par in enumerate(parents):
        kids[par + 1].append(i)
    chain = parents == tuple(range(-1, n - 1))
    depth = visible.sum(1) - 1  # [n+1]: ancestors of each row, itself excluded
    return Layout(depth.to(device), visible.to(device), tuple(map(tuple, kids)), chain, int(depth.max()))


def layout(parents: torch.Tensor | list[int]) -> Layout:
    """The cached layout of a tree shape, keyed by its parent list (one small host copy of `parents`)."""
    device = str(parents.device) if isinstance(parents, torch.Tensor) else "cpu"
    key = tuple(parents.tolist() if isinstance(parents, torch.Tensor) else parents)
    return _layout(key, device)


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[n+1] depths of [root, nodes]: 0 for the root, parent's depth + 1 for a node."""
    return layout(parents).depth


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n+1, n+1] bool over [root, nodes]: row i may attend column j iff j is i or an ancestor of i."""
    return layout(parents).visible


def tree_attention_mask(parents: torch.Tensor, cache_len: int, dtype: torch.dtype,
                        sliding_window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """Additive 4-D mask [1, 1, n+1, cache_len+n+1] for the verifying forward (0 = attend, min = blocked).

    Rows are [root, nodes]; columns are the cached prefix then [root, nodes]. With `sliding_window`
    a query at position i only sees keys at positions j > i - sliding_window, with `chunk` (Llama 4's
    chunked attention) only keys in its own chunk, j // chunk == i // chunk, as Hugging Face does.
    """
    lay = layout(parents)
    n1, device = lay.depth.numel(), lay.depth.device
    mask = torch.zeros(n1, cache_len + n1, dtype=dtype, device=device)  # the prefix is visible to every row
    mask[:, cache_len:].masked_fill_(~lay.visible, torch.finfo(dtype).min)
    if sliding_window is not None or chunk is not None:
        q_pos = cache_len + lay.depth  # [n+1]
        k_pos = torch.cat([torch.arange(cache_len, device=device), q_pos])  # [cache_len+n+1]
        hidden = k_pos[None, :] <= q_pos[:, None] - sliding_window if sliding_window is not None else \
            k_pos[None, :] // chunk != q_pos[:, None] // chunk  # [n+1, cache_len+n+1]
        mask.masked_fill_(hidden, torch.finfo(dtype).min)
    return mask[None, None]  # [1, 1, n+1, cache_len+n+1]


def position_ids(parents: torch.Tensor, cache_len: int) -> torch.Tensor:
    """[1, n+1] positions of [root, nodes]: cache_len + depth."""
    return (cache_len + depths(parents))[None]
