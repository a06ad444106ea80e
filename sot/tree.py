"""Draft trees as data.

A draft tree holds ``N`` nodes in topological order. Node 0 is the *root*: the last committed
token, whose KV is not yet in the cache. Every other node is a proposed token whose parent comes
before it. All functions here are pure: they take lists or tensors and return new ones.

Worked example, root ``r`` with two candidate continuations ``a b`` and ``c``::

    index   0  1  2  3
    token   r  a  c  b
    parent -1  0  0  1
    depth   0  1  1  2

    ancestors (tree index at depth j, -1 past the node's own depth):
      node 3 -> [0, 1, 3]      (r -> a -> b)
    mask[3] = [1, 1, 0, 1]      (a node sees itself and its ancestors)
    leaf paths = [[0, 2, -1], [0, 1, 3]]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """One sequence's draft tree, plain Python lists (N is small, at most a few dozen).

    Attributes:
        tokens: ``[N]`` token ids; ``tokens[0]`` is the root.
        parents: ``[N]`` parent index; ``parents[0] == -1`` and ``parents[i] < i``.
        depths: ``[N]`` distance from the root.
        draft_probs: optional ``[N]`` draft confidence of each node (root: 1.0).
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    draft_probs: list[float] | None = None

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @classmethod
    def root_only(cls, token: int, confident: bool = False) -> "DraftTree":
        """The tree of the root alone (a plain step); ``confident`` gives it a draft
        confidence of 1."""
        return cls([token], [-1], [0], [1.0] if confident else None)

    def confidences(self) -> list[float]:
        """``[N]`` draft confidence per node; without ``draft_probs``, ``1 / (depth + 1)``."""
        return list(self.draft_probs) if self.draft_probs else [1.0 / (d + 1) for d in self.depths]

    def cut_at_depth(self, depth: int) -> "DraftTree":
        """The tree without its nodes deeper than ``depth`` (the rest keep their order)."""
        if self.max_depth <= depth:
            return self
        kept = [i for i, d in enumerate(self.depths) if d <= depth]
        index = {old: new for new, old in enumerate(kept)}
        probs = [self.draft_probs[i] for i in kept] if self.draft_probs else None
        return DraftTree([self.tokens[i] for i in kept], [index.get(self.parents[i], -1) for i in kept],
                         [self.depths[i] for i in kept], probs)

    def children(self) -> list[list[int]]:
        """``children[i]`` lists the indices whose parent is ``i``, in index order."""
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            out[p].append(i)
        return out


def tree_from_parents(
    tokens: list[int], parents: list[int], draft_probs: list[float] | None = None
) -> DraftTree:
    """Validate a (tokens, parents) description and compute depths."""
    if not tokens:
        raise ValueError("a draft tree needs at least the root node")
    if len(tokens) != len(parents):
        raise ValueError(f"tokens ({len(tokens)}) and parents ({len(parents)}) differ in length")
    if parents[0] != -1:
        raise ValueError("node 0 must be the root (parent -1)")
    depths = [0] * len(tokens)
    for i in range(1, len(tokens)):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must precede their children")
        depths[i] = depths[p] + 1
    return DraftTree(list(tokens), list(parents), depths, draft_probs)


def tree_from_paths(root: int, paths: list[list[int]], max_nodes: int) -> DraftTree:
    """Merge candidate continuations into a trie under ``root``.

    Paths are inserted in order, so earlier paths take precedence when the node budget
    (``max_nodes``, root included) runs out. Shared prefixes are stored once.
    """
    tokens, parents = [root], [-1]
    child_of: dict[tuple[int, int], int] = {}
    for path in paths:
        node = 0
        for tok in path:
            key = (node, int(tok))
            nxt = child_of.get(key)
            if nxt is None:
                if len(tokens) >= max_nodes:
                    break
                nxt = len(tokens)
                tokens.append(int(tok))
                parents.append(node)
                child_of[key] = nxt
            node = nxt
    return tree_from_parents(tokens, parents)


def merge_trees(trees: list[DraftTree], max_nodes: int) -> DraftTree:
    """One tree of the best ``max_nodes - 1`` nodes of ``trees`` (all rooted at the same
    token) by draft confidence; a node proposed by several keeps its highest confidence, and
    shared prefixes count once. Ties keep the order of ``trees``.

    Example: a drafted chain ``r -> a (0.9) -> b (0.5)`` and a lookup chain ``r -> a (0.7)
    -> c (0.6)`` with ``max_nodes=3`` give ``r -> a (0.9) -> c (0.6)``.
    """
    paths: list[tuple[float, tuple[int, ...]]] = []
    for tree in trees:
        probs = tree.confidences() if tree.draft_probs else [1.0] * tree.size
        node_path: list[tuple[int, ...]] = [()]
        for i in range(1, tree.size):
            node_path.append(node_path[tree.parents[i]] + (tree.tokens[i],))
            paths.append((probs[i], node_path[i]))
    # a prefix is never less confident than its extension, so this order inserts parents first
    paths.sort(key=lambda x: (-x[0], len(x[1])))
    tokens, parents, depths, conf = [trees[0].tokens[0]], [-1], [0], [1.0]
    index: dict[tuple[int, ...], int] = {(): 0}
    for p, path in paths:
        if path in index:
            conf[index[path]] = max(conf[index[path]], p)
            continue
        if len(tokens) >= max_nodes or path[:-1] not in index:
            continue
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
        depths.append(len(path))
        conf.append(p)
    return DraftTree(tokens, parents, depths, conf)


def ancestor_table(tree: DraftTree, width: int) -> list[list[int]]:
    """``[N][width]``: tree index of each node's ancestor at depth ``j`` (itself at its own
    depth), ``-1`` past the node's depth. ``width`` must exceed ``tree.max_depth``."""
    table: list[list[int]] = []
    for i in range(tree.size):
        row = [-1] * width
        node = i
        while node >= 0:
            row[tree.depths[node]] = node
            node = tree.parents[node]
        table.append(row)
    return table


def tree_mask(tree: DraftTree) -> torch.Tensor:
    """``[N, N]`` bool: ``mask[i, j]`` is true when ``j`` is ``i`` or an ancestor of ``i``."""
    n = tree.size
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        node = i
        while node >= 0:
            mask[i, node] = True
            node = tree.parents[node]
    return mask


def leaf_paths(tree: DraftTree) -> torch.Tensor:
    """``[num_leaves, max_depth + 1]`` root-to-leaf tree indices, right-padded with -1."""
    kids = tree.children()
    leaves = [i for i in range(tree.size) if not kids[i]]
    table = ancestor_table(tree, tree.max_depth + 1)
    return torch.tensor([table[i] for i in leaves], dtype=torch.long)


def chain_tree(root: int, tokens: list[int]) -> DraftTree:
    """A single-path tree: ``root -> tokens[0] -> tokens[1] -> ...``."""
    return tree_from_parents([root, *tokens], [-1, *range(len(tokens))])
