"""Prompt lookup decoding: propose continuations of earlier matches of the latest n-gram."""
from __future__ import annotations

import numpy as np

from sot.drafters.base import DraftInput, Drafter, DrafterKind, TreeBudget
from sot.tree import DraftTree, tree_from_paths

#: the longest n-gram prompt lookup matches (it tries this size first, then shorter ones): long
#: enough that a copy is told apart from the short phrases code and lists repeat inside it
#: (``docs/NOTEBOOK.md``, *Longer lookup n-grams*)
LOOKUP_MAX_NGRAM = 8


class PromptLookupDrafter(Drafter):
    """Finds the most recent occurrences of the context's last ``n`` tokens (``n`` from
    ``max_ngram`` down to ``min_ngram``) and proposes what followed them, several distinct
    continuations merged into one tree.

    Args:
        max_ngram, min_ngram: n-gram sizes to try, longest first.
        max_candidates: continuations merged into the tree.
    """

    kind = DrafterKind.PLD

    def __init__(self, max_ngram: int = LOOKUP_MAX_NGRAM, min_ngram: int = 1, max_candidates: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_candidates = max_candidates

    def candidates(self, context: list[int], depth: int) -> list[list[int]]:
        """Up to ``max_candidates`` distinct continuations, best first."""
        tokens = np.asarray(context, dtype=np.int64)
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            pattern = tokens[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == pattern).all(axis=1))
            for start in starts[::-1]:  # most recent first
                cont = tokens[start + n : start + n + depth].tolist()
                key = tuple(cont)
                if cont and key not in seen:
                    seen.add(key)
                    found.append(cont)
                    if len(found) >= self.max_candidates:
                        return found
        return found

    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        trees = []
        for x in inputs:
            paths = self.candidates(x.context, budget.max_depth) if budget.max_nodes > 1 else []
            trees.append(tree_from_paths(x.context[-1], paths, budget.max_nodes))
        return trees


class NgramIndex:
    """The most recent start of every n-gram (``min_ngram <= n <= max_ngram``) of one growing
    context, updated with the tokens appended since the last call, so a step's lookup costs
    a few dictionary reads instead of a scan of the whole context. The tables are keyed by the
    n-grams' hashes (a collision only proposes a continuation the verify pass rejects).

    :meth:`best` gives what :meth:`PromptLookupDrafter.candidates` ranks first: the tokens
    that followed the most recent earlier occurrence of the longest matching suffix.
    Example: context ``a b c a b``: the suffix ``a b`` occurred at 0, so ``best`` is ``c a b``
    (up to ``depth`` tokens).
    """

    def __init__(self, max_ngram: int = LOOKUP_MAX_NGRAM, min_ngram: int = 1) -> None:
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.last: dict[int, dict[int, int]] = {n: {} for n in self.sizes}
        self.next = {n: 0 for n in self.sizes}  # per size: the first window start not yet indexed
        self.seen = 0  # length of the context at the last call

    def best(self, context: list[int], depth: int) -> list[int]:
        """The best continuation of ``context`` (which only grew since the last call), at most
        ``depth`` tokens; empty when nothing matches."""
        if len(context) < self.seen:
            raise ValueError("an n-gram index follows one growing context")
        self.seen = len(context)
        end = len(context) - 1  # windows end before the last token, the suffix's own end
        for n in self.sizes:
            table = self.last[n]
            for start in range(self.next[n], end - n + 1):
                table[hash(tuple(context[start : start + n]))] = start
            self.next[n] = max(self.next[n], end - n + 1)
        for n in self.sizes:
            if n > end:
                continue
            start = self.last[n].get(hash(tuple(context[-n:])))
            if start is not None:
                return context[start + n : start + n + depth]
        return []


class LookupRate:
    """How often one sequence's best prompt-lookup continuation matches what the target
    really generated, learned from the context alone.

    :meth:`proposed` records the lookup path offered at a step; the next :meth:`update` sees
    the tokens committed since and counts, per token of the path, whether it matched (the
    match at depth ``d`` is only tried when depths ``1..d-1`` matched). A path the commit
    policy pruned away still counts: the committed tokens are what the target generated
    either way. :attr:`rate` is the smoothed per-token match rate, starting from 1/2.
    """

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.hits = 0.0
        self.tries = 0.0
        self._path: list[int] = []
        self._at = 0

    @property
    def rate(self) -> float:
        return (self.hits + 0.5) / (self.tries + 1.0)

    def update(self, context: list[int]) -> None:
        """Score the last recorded path against the tokens committed after it."""
        if not self._path or len(context) <= self._at:
            return
        new = context[self._at :]
        hits = 0
        while hits < min(len(self._path), len(new)) and self._path[hits] == new[hits]:
            hits += 1
        tries = min(hits + 1, len(self._path), len(new))
        self.hits = self.decay * self.hits + hits
        self.tries = self.decay * self.tries + tries
        self._path = []

    def proposed(self, context: list[int], path: list[int]) -> None:
        """Remember ``path``, offered after ``context``."""
        self._path, self._at = list(path), len(context)

    def chain(self, root: int, path: list[int]) -> DraftTree:
        """``path`` as a chain under ``root``, node ``d`` with confidence ``rate ** d``."""
        r = self.rate
        n = len(path)
        return DraftTree([root] + list(path), list(range(-1, n)), list(range(n + 1)), [r**d for d in range(n + 1)])
