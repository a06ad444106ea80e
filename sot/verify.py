"""Acceptance after a verify pass: each tree's accepted path under the logits the pass computed
(the trees are packed into the pass's rows by :mod:`sot.packing`)."""
from __future__ import annotations


import torch

from sot.acceptance import Acceptance, accept_coupled, accept_greedy, accept_rejection
from sot.cache import KVCache
from sot.logit_rules import AdjustedRows, adjusts
from sot.models.adapter import ForwardOutput
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
    """Accept each sequence's tree against its logits rows (``out.seq_logits(b)``: ``[T, V]``);
    the cache keeps the accepted rows, and the target states of each accepted path
    (``out.seq_states(b)[path]``: ``[n, S, D]``) wait in the sequence (``add_states``) for the drafter. With
    ``trace``, each committed token's logits row joins its result's ``logit_trace``."""
    lengths = cache.lengths
    accepted, keep = [], []
    # greedy sequences: every row's argmax in one call (a call per sequence costs more than
    # the arithmetic at batch 16); the same values, so the same tokens
    rules = [adjusts(s.params) for s in seqs]
    plain_greedy = [s.params.sampling.greedy and not r for s, r in zip(seqs, rules)]
    greedy = _argmax_rows(out) if any(plain_greedy) else None
    for b, (seq, tree) in enumerate(zip(seqs, trees)):
        logits = out.seq_logits(b)
        if greedy is not None and plain_greedy[b]:
            acc = accept_greedy(tree, logits, greedy[b])
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
        if out.states is not None:
            new = out.seq_states(b)[acc.path]
            seq.add_states(new)
        if trace:
            seq.result.logit_trace.extend(logits[i].clone() for i in acc.path)
        if seq.params.logprobs is not None:  # (commit keeps those of the tokens it takes)
            seq.result.logprobs.extend(token_logprobs(logits[acc.path], acc.tokens, seq.params.logprobs))
    cache.narrow(len(seqs)).keep_rows(keep)
    return accepted


def _argmax_rows(out: ForwardOutput) -> list[list[int]]:
    """Per sequence ``b``, the argmax of each of its logits rows (``out.seq_logits(b)``)."""
    ids = out.logits.argmax(dim=-1)  # [R] flat or [B, T] padded
    if out.offsets is None:
        return ids.tolist()
    flat = ids.tolist()
    return [flat[out.offsets[b]:out.offsets[b + 1]] for b in range(len(out.offsets) - 1)]
