"""One verify pass: the draft trees of the live sequences packed into rows, and each tree's
acceptance under the logits the pass computed."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sot.acceptance import Acceptance, accept_coupled, accept_greedy, accept_rejection
from sot.attention import TreeLayout, build_tree_layout, flat_packing
from sot.cache import KVCache
from sot.models.adapter import ForwardOutput, TargetModel
from sot.models.rows import round_up
from sot.requests import LiveRequest, SequenceResult
from sot.sampling import SamplingMode, SamplingParams
from sot.tree import DraftTree, ancestor_table


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


def pack_trees(trees: list[DraftTree], cache: KVCache, target: TargetModel) -> VerifyInput:
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
    ids = torch.zeros(len(trees), rows, dtype=torch.long)
    pos = torch.zeros(len(trees), rows, dtype=torch.long)
    ancestors = []
    lengths = cache.lengths[: len(trees)]
    for b, tree in enumerate(trees):
        ids[b] = tree.tokens[0]
        ids[b, : tree.size] = torch.tensor(tree.tokens)
        pos[b] = lengths[b]
        pos[b, : tree.size] = torch.tensor(tree.depths) + lengths[b]
        ancestors.append(ancestor_table(tree, width))
    view = cache.narrow(len(trees))
    layout = build_tree_layout(lengths, ancestors, rows, view)
    if target.packs_flat(view):  # the products run over the trees' real rows only
        index, offsets = flat_packing([t.size for t in trees], rows, target.row_multiple)
        layout = dataclasses.replace(layout, flat_index=index, flat_offsets=offsets)
    return VerifyInput(trees, ids, pos, layout)


def record_depths(result: SequenceResult, tree: DraftTree, acc: Acceptance) -> None:
    """Per draft depth d (1-based): was a node at depth d offered, and accepted?"""
    depth = tree.max_depth
    while len(result.depth_attempts) < depth:
        result.depth_attempts.append(0)
        result.depth_accepts.append(0)
    for d in range(1, depth + 1):
        # Depth d is attempted only if the path reached depth d - 1.
        if acc.num_accepted >= d - 1:
            result.depth_attempts[d - 1] += 1
            if acc.num_accepted >= d:
                result.depth_accepts[d - 1] += 1

def accept_tree(sampling: SamplingParams, index: int, generator: torch.Generator | None, tree: DraftTree,
                logits: torch.Tensor, root_position: int) -> Acceptance:
    """Acceptance of ``tree`` under ``logits [T, V]`` with a request's sampling settings
    (``index``: the request's label, which keys coupled sampling; ``generator``: its random
    stream for rejection sampling)."""
    sp = sampling
    if sp.greedy:
        return accept_greedy(tree, logits)
    if sp.mode is SamplingMode.COUPLED:
        return accept_coupled(tree, logits, sp, index, root_position)
    assert generator is not None
    return accept_rejection(tree, logits, sp, generator)


def accept_all(seqs: list[LiveRequest], trees: list[DraftTree], out: ForwardOutput, cache: KVCache,
               trace: bool = False) -> list[Acceptance]:
    """Accept each sequence's tree against its logits rows (``out.seq_logits(b)``: ``[T, V]``);
    the cache keeps the accepted rows, and the target states of each accepted path
    (``out.seq_states(b)[path]``: ``[n, S, D]``) wait in the sequence (``add_states``) for the drafter. With
    ``trace``, each committed token's logits row joins its result's ``logit_trace``."""
    lengths = cache.lengths
    accepted, keep = [], []
    for b, (seq, tree) in enumerate(zip(seqs, trees)):
        logits = out.seq_logits(b)
        acc = accept_tree(seq.params.sampling, seq.result.index, seq.generator, tree, logits, lengths[b])
        accepted.append(acc)
        keep.append([lengths[b] + i for i in acc.path])
        if out.states is not None:
            new = out.seq_states(b)[acc.path]
            seq.add_states(new)
        if trace:
            seq.result.logit_trace.extend(logits[i].clone() for i in acc.path)
    cache.narrow(len(seqs)).keep_rows(keep)
    return accepted
