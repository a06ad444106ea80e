"""Free drafts: what costs no model pass, for one sequence per step.

Two sources, each calibrated by how often its best path matched what the target really
generated, by the length of the match behind the path and by depth
(:class:`~sot.drafters.pld.MatchRates`, one table per source, learned over all sequences):

* **prompt lookup**: the continuation of the most recent earlier occurrence of the context's
  longest matching n-gram (:class:`~sot.drafters.pld.NgramIndex`), a chain whose node at depth
  ``d`` has the chance that its first ``d`` tokens match;
* **suffix trees** (:mod:`sot.drafters.suffix`): the frequency-weighted continuations of the
  longest match in the sequence's own context and in the global store of earlier answers;
  a node's confidence is its estimated probability times that chance at its depth.

The state drafter merges them into its drafted trees and offers them alone on the steps the
commit policy keeps its model idle; the suffix drafter offers them every step.
"""
from __future__ import annotations

import dataclasses

from sot.drafters.base import DraftInput, Drafter, DrafterKind, TreeBudget
from sot.drafters.pld import LookupRate, MatchRates, NgramIndex, PromptLookupDrafter
from sot.drafters.suffix import SuffixMatcher, SuffixStores
from sot.tree import DraftTree, merge_trees


class FreeDrafts:
    """Prompt-lookup chains and suffix trees of the sequences a drafter holds.

    Args:
        lookup: propose prompt-lookup chains.
        lookup_confidence: the confidence of the ``d``-th lookup token is this to the ``d``;
            ``None`` uses the sequence's measured match rate.
        suffix: the global suffix stores; ``None``: no suffix trees.
    """

    def __init__(self, lookup: bool = True, lookup_confidence: float | None = None,
                 suffix: SuffixStores | None = None) -> None:
        self.lookup = PromptLookupDrafter() if lookup else None
        self.lookup_confidence = lookup_confidence
        self.suffix = suffix
        self.rates: dict[int, LookupRate] = {}
        # the match rates of each source, shared by the sequences (kept across reset: a
        # sequence that joins later starts from what the earlier ones measured)
        self.lookup_table = MatchRates()
        self.suffix_table = MatchRates()
        self.indexes: dict[int, NgramIndex] = {}  # each sequence's n-grams, for the lookup
        # per sequence: (context length, best lookup continuation, whether it reached the
        # context's end, the match behind it) of this step's search
        self._found: dict[int, tuple[int, list[int], bool, int]] = {}
        # per sequence with a prediction: its tokens, -1, then the context (the lookup's text)
        self._joined: dict[int, list[int]] = {}
        self.matchers: dict[int, SuffixMatcher] = {}
        self.suffix_rates: dict[int, LookupRate] = {}
        # per sequence: ((context length, max nodes, depth), tree) of this step's suffix search
        self._suffix_found: dict[int, tuple[tuple[int, int, int], DraftTree | None]] = {}

    def reset(self) -> None:
        for table in (self.rates, self.indexes, self._found, self._joined, self.matchers, self.suffix_rates,
                      self._suffix_found):
            table.clear()

    def release(self, sequence: int) -> None:
        for table in (self.rates, self.indexes, self._found, self._joined, self.matchers, self.suffix_rates,
                      self._suffix_found):
            table.pop(sequence, None)

    def remember(self, prompt: list[int], answer: list[int], tenant: str | None) -> None:
        """Add a finished answer to the global store of its tenant."""
        if self.suffix is not None and answer:  # (an answer aborted before its first token makes no store)
            self.suffix.get(tenant).add(prompt, answer)

    def index(self, sequence: int) -> NgramIndex:
        """The sequence's n-gram index of its context, for the lookup."""
        if sequence not in self.indexes:
            self.indexes[sequence] = NgramIndex(self.lookup.max_ngram, self.lookup.min_ngram)
        return self.indexes[sequence]

    def _rate(self, sequence: int) -> LookupRate:
        if sequence not in self.rates:
            self.rates[sequence] = LookupRate(table=self.lookup_table)
        return self.rates[sequence]

    # ----------------------------------------------------------------- prompt lookup
    def lookup_path(self, x: DraftInput, depth: int) -> list[int]:
        """The best prompt-lookup continuation of ``x.context``, at most ``depth`` tokens (empty
        when nothing matches), recorded with the sequence's :class:`LookupRate`. A step searches
        once per sequence: a second call on the same context (the drafter merging the path
        that :meth:`free_tree` found) reuses the first search, cut to ``depth``; the best
        match is the same, since it is the most recent occurrence of the longest n-gram."""
        rate = self._rate(x.sequence)
        rate.update(x.context)
        known = self._found.get(x.sequence)
        if known is not None and known[0] == len(x.context) and (len(known[1]) >= depth or known[2]):
            best, match = known[1][:depth], known[3]
        else:
            index = self.index(x.sequence)
            if x.prediction:  # (a match in the prediction copies from it; -1, no token, keeps the two apart)
                joined = self._joined.setdefault(x.sequence, [*x.prediction, -1])
                joined.extend(x.context[len(joined) - len(x.prediction) - 1:])  # (what the context added)
                best = index.best(joined, depth)
                best = best[:best.index(-1)] if -1 in best else best
            else:
                best = index.best(x.context, depth)
            match = index.match
            # a continuation shorter than asked for ends at the context's end: it is complete
            self._found[x.sequence] = (len(x.context), best, len(best) < depth, match)
        if best:
            rate.proposed(x.context, best, match)
        return best

    def _lookup_chain(self, x: DraftInput, depth: int) -> DraftTree | None:
        if self.lookup is None:
            return None
        best = self.lookup_path(x, depth)
        if not best:
            return None
        root = x.context[-1]
        if self.lookup_confidence is None:
            return self._rate(x.sequence).chain(root, best, self._found[x.sequence][3])
        r, n = self.lookup_confidence, len(best)
        return DraftTree([root] + best, list(range(-1, n)), list(range(n + 1)), [r**d for d in range(n + 1)])

    # ----------------------------------------------------------------- suffix trees
    def suffix_tree(self, x: DraftInput, max_nodes: int, max_depth: int) -> DraftTree | None:
        """The suffix tree of ``x`` with calibrated confidences; ``None`` when nothing matches."""
        if self.suffix is None:
            return None
        key = x.sequence
        asked = (len(x.context), max_nodes, max_depth)
        known = self._suffix_found.get(key)
        if known is not None and known[0] == asked:  # searched already this step
            return known[1]
        if key not in self.matchers:
            self.matchers[key] = SuffixMatcher(self.suffix.config, self.suffix.find(x.tenant))
            self.suffix_rates[key] = LookupRate(table=self.suffix_table)
        matcher = self.matchers[key]
        if matcher.store is None or matcher.store.tokens == 0:  # (the tenant's store made, or remade, since)
            matcher.store = self.suffix.find(x.tenant)
        rate = self.suffix_rates[key]
        rate.update(x.context)
        tree: DraftTree | None = matcher.tree(x.context, max_nodes, max_depth)
        if tree.size < 2:
            tree = None
        else:
            match = matcher.last_match
            rate.proposed(x.context, _best_path(tree), match)
            conf = rate.confidences(tree.max_depth, match)
            tree = dataclasses.replace(tree, draft_probs=[p * conf[d] for p, d in zip(tree.draft_probs, tree.depths)])
        self._suffix_found[key] = (asked, tree)
        return tree

    # ----------------------------------------------------------------- both
    def free_tree(self, x: DraftInput, budget: TreeBudget) -> DraftTree:
        """Everything free for ``x`` as one tree (root-only, marked confident, when nothing
        matches)."""
        depth = min(budget.max_depth, budget.max_nodes - 1)
        found = [t for t in (self._lookup_chain(x, depth), self.suffix_tree(x, budget.max_nodes, depth)) if t]
        if not found:
            return DraftTree.root_only(x.context[-1], confident=True)
        return found[0] if len(found) == 1 else merge_trees(found, budget.max_nodes)

    def merge_into(self, tree: DraftTree, x: DraftInput, budget: TreeBudget) -> DraftTree:
        """``tree`` with the free drafts of ``x`` merged in: the best ``max_nodes - 1`` nodes of
        all, by confidence (shared prefixes count once)."""
        found = [t for t in (self._lookup_chain(x, budget.max_depth),
                             self.suffix_tree(x, budget.max_nodes, budget.max_depth)) if t]
        if not found:
            return tree
        return merge_trees([tree, *found], budget.max_nodes)


def _best_path(tree: DraftTree) -> list[int]:
    """The tokens of the chain that follows each node's most confident child."""
    kids = tree.children()
    probs = tree.confidences()
    path, node = [], 0
    while kids[node]:
        node = max(kids[node], key=lambda c: probs[c])
        path.append(tree.tokens[node])
    return path


class _ModelFreeDrafter(Drafter):
    """A drafter whose trees cost no model pass (:attr:`~sot.drafters.base.Drafter.runs_model`
    False): each step, :meth:`FreeDrafts.free_tree` of every sequence, offered as free drafts
    (their ``draft_probs`` calibrated by how often such drafts matched the committed tokens,
    learned whether or not the policy verified them)."""

    runs_model = False
    free: FreeDrafts

    def reset(self, batch_size: int = 0) -> None:
        self.free.reset()

    def release(self, sequence: int) -> None:
        self.free.release(sequence)

    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        return [self.free.free_tree(x, budget) for x in inputs]

    def propose_free(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        """The same trees as :meth:`propose`: an adaptive commit policy takes them as free
        drafts every step."""
        return self.propose(inputs, budget)


class SuffixDrafter(_ModelFreeDrafter):
    """Drafts from suffix trees and prompt lookup alone: no model, so every step drafts.

    Args:
        stores: the global stores of earlier answers (default: a new shared one).
        lookup: merge prompt-lookup chains into the suffix trees.
    """

    kind = DrafterKind.SUFFIX

    def __init__(self, stores: SuffixStores | None = None, lookup: bool = True) -> None:
        self.stores = stores if stores is not None else SuffixStores()
        self.free = FreeDrafts(lookup, None, self.stores)

    @property
    def suffix_stores(self) -> SuffixStores | None:
        return self.free.suffix if self.free is not None else None

    def remember(self, prompt: list[int], answer: list[int], tenant: str | None = None) -> None:
        self.free.remember(prompt, answer, tenant)


class LookupDrafter(_ModelFreeDrafter):
    """Prompt lookup alone (``pld``): each step, the continuation of the most recent earlier
    occurrence of the context's longest matching n-gram, as a chain whose node at depth ``d``
    carries the measured chance that the chain's first ``d`` tokens match (by the length of
    the match behind it, :class:`~sot.drafters.pld.MatchRates`). Those rates are learned from
    the tokens the target commits, whether or not the policy verified the chain, so a run of
    rejected chains lowers them without ever stopping the learning."""

    kind = DrafterKind.PLD

    def __init__(self) -> None:
        self.free = FreeDrafts(lookup=True, lookup_confidence=None, suffix=None)
