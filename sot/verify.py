"""Acceptance after a verify pass: each tree's accepted path under the logits the pass computed
(the trees are packed into the pass's rows by :mod:`sot.packing`)."""
from __future__ import annotations


import torch

from sot.acceptance import Acceptance, accept_coupled, accept_greedy, accept_rejection
from sot.cache import KVCache
from sot.logit_rules import AdjustedRows, adjusts
from sot.models.adapter import ForwardOutput, TreeRows
from sot.requests import LiveRequest, SequenceResult
from sot.sampling import SamplingMode, SamplingParams, token_logprobs
from sot.tree import DraftTree


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
    """Accept each sequence's tree against its logits rows (``out.seq_logits(b)``: ``[T, V]``;
    where the pass left them to compute, only the rows the walks read are computed);
    the cache keeps the accepted rows, and the target states of each accepted path
    (``out.seq_states(b)[path]``: ``[n, S, D]``) wait in the sequence (``add_states``) for the drafter. With
    ``trace``, each committed token's logits row joins its result's ``logit_trace``."""
    lengths = cache.lengths
    accepted, keep = [], []
    # greedy sequences: the argmax of the rows their walks reach, in one call per round of
    # the walks (a call per sequence costs more than the arithmetic at batch 16); the same
    # values, so the same tokens
    rules = [adjusts(s.params) for s in seqs]
    plain_greedy = [s.params.sampling.greedy and not r for s, r in zip(seqs, rules)]
    views = [TreeRows(out, b, tree) for b, tree in enumerate(trees)]
    if out.lazy:
        # One call of the head: each greedy tree's most confident chain (most greedy walks read
        # no other row; another branch is fetched for all the walks that turn, together), and
        # every row of the other trees (a sampled walk fetches alone what it lacks, so it gets
        # all its rows in this call, as before the head was left to the walks)
        out.prefetch([v.start + n for v, g in zip(views, plain_greedy)
                      for n in (v.chain(0) if g else range(v.tree.size))])
    greedy = greedy_walks(out, trees, [b for b, g in enumerate(plain_greedy) if g], views)
    for b, (seq, tree) in enumerate(zip(seqs, trees)):
        logits = views[b]  # node i's row: logits[i : i + 1]
        if plain_greedy[b]:
            acc = accept_greedy(tree, None, greedy[b])
        elif rules[b]:  # each walked node's row adjusted for its own context
            scores = AdjustedRows(logits, tree, seq)
            try:
                acc = accept_tree(seq.params.sampling, seq.result.index, seq.generator, tree, scores, lengths[b])
            finally:
                scores.close()
        else:
            acc = accept_tree(seq.params.sampling, seq.result.index, seq.generator, tree, logits, lengths[b])
        accepted.append(acc)
        keep.append([lengths[b] + i for i in acc.path])
        if trace or seq.params.logprobs is not None:
            start = out.seq_start(b)
            rows = out.rows([start + i for i in acc.path])  # [n, V] the walked rows
            if trace:
                seq.result.logit_trace.extend(r.clone() for r in rows)
            if seq.params.logprobs is not None:  # (commit keeps those of the tokens it takes)
                seq.result.logprobs.extend(token_logprobs(rows, acc.tokens, seq.params.logprobs))
    if out.states is not None:
        for seq, states in zip(seqs, out.path_states([acc.path for acc in accepted])):
            seq.add_states(states)
    cache.narrow(len(seqs)).keep_rows(keep)
    return accepted


def greedy_walks(out: ForwardOutput, trees: list[DraftTree], which: list[int],
                 views: list[TreeRows] | None = None) -> dict[int, list[int]]:
    """For each sequence ``b`` in ``which``: the argmax of its tree's rows, ``[T_b]`` with
    ``-1`` for the rows its greedy walk does not reach (:func:`accept_greedy` reads only
    those it reaches). Where the pass left its logits to compute on demand, each round
    computes, for every walk still open, the rows of the most confident chain below the node
    it stands on; a walk that turns into another branch opens that branch's chain next round.
    A tree whose walk follows its most confident chain costs one round. ``views``: each
    sequence's :class:`TreeRows` of ``out``, where the caller made them already."""
    known = {b: [-1] * trees[b].size for b in which}
    views = {b: views[b] if views is not None else TreeRows(out, b, trees[b]) for b in which}
    kids = {b: views[b].children for b in which}
    pending = {b: 0 for b in which}  # the node whose row each open walk needs next
    while pending:
        wanted = [(b, n) for b, node in pending.items() for n in views[b].chain(node)]  # (sequence, node)
        ids = out.argmax_rows([out.seq_start(b) + n for b, n in wanted])
        for (b, n), i in zip(wanted, ids):
            known[b][n] = i
        pending = {}
        for b in which:  # walk again: does it end, or reach a row not computed yet?
            tree, node = trees[b], 0
            while True:
                want = known[b][node]
                if want < 0:
                    pending[b] = node
                    break
                child = next((c for c in kids[b][node] if tree.tokens[c] == want), None)
                if child is None:
                    break
                node = child
    return known
