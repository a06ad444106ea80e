"""Prompt lookup decoding: propose continuations of earlier matches of the latest n-gram."""
from __future__ import annotations

import numpy as np

from sot.drafters.base import DraftInput, Drafter, DrafterKind, TreeBudget
from sot.tree import DraftTree, tree_from_paths


class PromptLookupDrafter(Drafter):
    """Finds the most recent occurrences of the context's last ``n`` tokens (``n`` from
    ``max_ngram`` down to ``min_ngram``) and proposes what followed them, several distinct
    continuations merged into one tree.

    Args:
        max_ngram, min_ngram: n-gram sizes to try, longest first.
        max_candidates: continuations merged into the tree.
    """

    kind = DrafterKind.PLD

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_candidates: int = 4) -> None:
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
