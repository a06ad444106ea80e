"""Prompt lookup decoding: propose continuations of earlier matches of the latest n-gram."""
from __future__ import annotations

import bisect

import numpy as np

from sot.drafters.base import DraftInput, Drafter, DrafterKind, TreeBudget
from sot.tree import DraftTree, tree_from_paths

#: the longest n-gram prompt lookup matches (it tries this size first, then shorter ones): long
#: enough that a copy is told apart from the short phrases code and lists repeat inside it
#: (``docs/NOTEBOOK.md``, *Longer lookup n-grams*)
LOOKUP_MAX_NGRAM = 8
#: the longest match :class:`NgramIndex` measures behind a continuation (for :class:`MatchRates`)
MAX_MATCH = 64


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
        #: tokens the context's end shares with the occurrence :meth:`best` last used (at most
        #: :data:`MAX_MATCH`; 0 when nothing matched)
        self.match = 0

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
        self.match = 0
        for n in self.sizes:
            if n > end:
                continue
            start = self.last[n].get(hash(tuple(context[-n:])))
            if start is not None:
                # how far back the match runs (a long one is a copy in progress)
                m = n
                while m < MAX_MATCH and start > m - n and context[start - (m - n) - 1] == context[-m - 1]:
                    m += 1
                self.match = m
                return context[start + n : start + n + depth]
        return []


class LookupRate:
    """How often one sequence's best prompt-lookup continuation matches what the target
    really generated, learned from the context alone.

    :meth:`proposed` records the lookup path offered at a step; the next :meth:`update` sees
    the tokens committed since and counts, per token of the path, whether it matched (the
    match at depth ``d`` is only tried when depths ``1..d-1`` matched). A path the commit
    policy pruned away still counts: the committed tokens are what the target generated
    either way. :attr:`rate` is the smoothed per-token match rate, starting from 1/2. With a
    shared ``table`` (:class:`MatchRates`), each outcome is also counted there, by the length
    of the match behind the path, and the path's confidences come from the table.
    """

    def __init__(self, decay: float = 0.8, table: MatchRates | None = None) -> None:
        self.decay = decay
        self.table = table
        self.hits = 0.0
        self.tries = 0.0
        self._path: list[int] = []
        self._at = 0
        self._match = 0

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
        if self.table is not None:
            self.table.record(self._match, hits, tries)
        self._path = []

    def proposed(self, context: list[int], path: list[int], match: int = 0) -> None:
        """Remember ``path``, offered after ``context`` behind a match of ``match`` tokens."""
        self._path, self._at, self._match = list(path), len(context), match

    def confidences(self, depth: int, match: int = 0) -> list[float]:
        """``[depth + 1]`` the chance that a path's first ``d`` tokens all match, ``d = 0..depth``:
        from the shared :class:`MatchRates` for a path behind ``match`` tokens where there is
        one, else ``rate ** d``."""
        if self.table is not None:
            return self.table.confidences(match, depth)
        r = self.rate
        return [r**d for d in range(depth + 1)]

    def chain(self, root: int, path: list[int], match: int = 0) -> DraftTree:
        """``path`` as a chain under ``root``, node ``d`` with confidence
        :meth:`confidences` ``[d]``."""
        n = len(path)
        return DraftTree([root] + list(path), list(range(-1, n)), list(range(n + 1)), self.confidences(n, match))


class MatchRates:
    """How often a free continuation matches, by the length of the match behind it and the
    depth: shared by every sequence of a drafter.

    A continuation found behind a long match of the context's end (a copy in progress) is
    accepted far more often, and deeper, than one behind a two-token match, and once a path's
    first tokens matched, its later ones match more often than its first did. One rate per
    sequence, with node ``d`` at ``rate ** d``, prices the deep nodes of a copy too low and the
    first node of a weak match too high. This keeps, for each band of match lengths and of
    depths, the chance that the token at depth ``d`` matches given that tokens ``1..d-1`` did
    (counted with :meth:`LookupRate.update`'s rule over all sequences, so a new sequence, a
    conversation's next turn for one, starts from what earlier ones measured); a path's node
    ``d`` gets the product of those chances up to ``d``.

    A band with few tries leans on the band above it (the depths just shallower), worth
    ``prior_tries`` tries, and the first depth band on ``prior``: depths no step has verified
    yet are priced like the deepest ones measured, not at a guess, so a copy's chain can grow
    past what the policy verified so far. Counts are halved once a cell holds :attr:`window`
    tries, so the rates follow a change of workload.
    """

    #: band ``b`` holds the match lengths below ``MATCH_BANDS[b]`` (the last band, the rest)
    MATCH_BANDS = (2, 4, 8, 16, 32)
    #: band ``b`` holds the depths below ``DEPTH_BANDS[b]``
    DEPTH_BANDS = (2, 3, 5, 9, 17)

    def __init__(self, prior: float = 0.5, prior_tries: float = 2.0, window: float = 256.0) -> None:
        rows, cols = len(self.MATCH_BANDS) + 1, len(self.DEPTH_BANDS) + 1
        self.hits = [[0.0] * cols for _ in range(rows)]
        self.tries = [[0.0] * cols for _ in range(rows)]
        self.prior, self.prior_tries, self.window = prior, prior_tries, window
        self._rates = [self._band_rates(m) for m in range(rows)]

    @classmethod
    def match_band(cls, match: int) -> int:
        return bisect.bisect_right(cls.MATCH_BANDS, match)

    @classmethod
    def depth_band(cls, depth: int) -> int:
        return bisect.bisect_right(cls.DEPTH_BANDS, depth)

    def _band_rates(self, m: int) -> list[float]:
        out, above = [], self.prior
        for h, t in zip(self.hits[m], self.tries[m]):
            above = (h + self.prior_tries * above) / (t + self.prior_tries)
            out.append(above)
        return out

    def rate(self, match: int, depth: int) -> float:
        """The chance that depth ``depth`` (>= 1) matches once ``1..depth-1`` did."""
        return self._rates[self.match_band(match)][self.depth_band(depth)]

    def confidences(self, match: int, depth: int) -> list[float]:
        """``[depth + 1]``: node ``d``'s chance, the product of :meth:`rate` over ``1..d``."""
        rates = self._rates[self.match_band(match)]
        out, p = [1.0], 1.0
        for d in range(1, depth + 1):
            p *= rates[self.depth_band(d)]
            out.append(p)
        return out

    def record(self, match: int, hits: int, tries: int) -> None:
        """A path behind ``match`` tokens was tried at depths ``1..tries`` and matched at
        ``1..hits``."""
        m = self.match_band(match)
        for d in range(1, tries + 1):
            b = self.depth_band(d)
            self.tries[m][b] += 1.0
            self.hits[m][b] += 1.0 if d <= hits else 0.0
            if self.tries[m][b] >= self.window:
                self.tries[m][b] /= 2
                self.hits[m][b] /= 2
        self._rates[m] = self._band_rates(m)
