"""Packing draft trees into the rows of one verify pass (a prompt chunk is packed the same way,
as a chain)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from sot.attention import TreeLayout, build_tree_layout, flat_packing
from sot.cache import KVCache
from sot.models.rows import round_up
from sot.tree import DraftTree, ancestor_table


class RowTarget(Protocol):
    """What packing needs of the target model (:class:`sot.models.adapter.TargetModel`)."""

    row_multiple: int

    def packs_flat(self, cache: KVCache) -> bool: ...


@dataclass(frozen=True)
class VerifyInput:
    """One verify pass over ``B`` live sequences with ``T`` rows each.

    Attributes:
        trees: ``[B]`` the verified trees, in slot order.
        ids: ``[B, T]`` token of each row (padding rows repeat the root).
        positions: ``[B, T]`` position of each row.
        layout: the attention layout of the pass.
    """

    trees: list[DraftTree]
    ids: torch.Tensor
    positions: torch.Tensor
    layout: TreeLayout

    @property
    def rows(self) -> int:
        """Rows the pass computes: ``R`` flat-packed, else ``B * T``."""
        index = self.layout.flat_index
        return int(index.numel()) if index is not None else self.ids.numel()


def pack_trees(trees: list[DraftTree], cache: KVCache, target: RowTarget) -> VerifyInput:
    """Pack the trees of the ``B`` live sequences (cache slots ``0 .. B-1``) into one pass on
    a ``[B, T]`` grid (``T``: the largest tree, rounded up to the target's row multiple; rows
    past a tree repeat its root). Where the target packs flat, the products run over the
    trees' real rows only (the sum of the tree sizes); otherwise over the whole grid.

    Example: trees of 3 and 5 nodes, row multiple 4 -> ``T = 8``; sequence 0's rows are its
    3 nodes then 5 copies of its root, at positions ``length + depth``; flat, the pass
    computes 8 rows instead of 16.
    """
    unit = target.row_multiple
    rows = round_up(max(t.size for t in trees), unit)
    width = max(t.max_depth for t in trees) + 1
    lengths = cache.lengths[: len(trees)]
    # (built as lists, then one tensor each: per-tree tensor writes cost more than the pass's
    # bookkeeping is worth at batch 16)
    ids = torch.tensor([[*t.tokens, *[t.tokens[0]] * (rows - t.size)] for t in trees], dtype=torch.long)
    pos = torch.tensor([[*(n + d for d in t.depths), *[n] * (rows - t.size)] for t, n in zip(trees, lengths)],
                       dtype=torch.long)
    ancestors = [ancestor_table(tree, width) for tree in trees]
    view = cache.narrow(len(trees))
    layout = build_tree_layout(lengths, ancestors, rows, view)
    if target.packs_flat(view):  # the products run over the trees' real rows only
        index, offsets = flat_packing([t.size for t in trees], rows, target.row_multiple)
        layout = dataclasses.replace(layout, flat_index=index, flat_offsets=offsets)
    return VerifyInput(trees, ids, pos, layout)
