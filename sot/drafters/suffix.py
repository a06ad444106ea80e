"""Suffix drafts: continuation trees from everything already seen, at no model cost.

Two kinds of memory, in the spirit of SuffixDecoding (Oliaro et al., arXiv 2411.04975):

* each request's own context (prompt and answer so far);
* a global :class:`SuffixStore` of earlier requests' answers (each with the end of its
  prompt), shared by the requests of a process or a server (optionally one per tenant),
  capped in tokens with the oldest answers evicted first, and saved to / loaded from a file.

Both are indexed by their ``K``-grams (``K = min_match``). A step looks up the last ``K``
tokens of the context, extends each occurrence's match backwards (up to ``max_match``
tokens), and keeps the occurrences of the longest match: the node of a suffix tree for that
pattern. What followed them is counted into a trie, and the draft tree is grown best first
by the estimated probability of each path (its count over the number of occurrences),
with at most ``max_spec_factor`` times the match length in tokens (so a weak match proposes
little) and no path under ``min_prob``.

Example: the store holds ``a b c d`` and ``x b c e``; the context ends in ``b c``: both
occurrences match 2 tokens, so the tree is ``c -> d`` (1/2) and ``c -> e`` (1/2). A context
ending in ``a b c`` matches only the first, 3 tokens long: ``c -> d`` (1).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from sot.errors import ConfigError
from sot.files import replace_file
from sot.tree import DraftTree


@dataclass(frozen=True)
class SuffixConfig:
    """Settings of suffix drafting.

    Attributes:
        min_match: the shortest pattern that counts as a match (the index's n-gram size).
        max_match: patterns are matched up to this many tokens back.
        max_spec_factor: a match of ``m`` tokens proposes at most ``max_spec_factor * m``
            tokens (in depth and in count).
        min_prob: paths whose estimated probability is below this are not proposed.
        max_occurrences: the most recent occurrences of a pattern read per step.
        max_tokens: the global store's cap, in tokens; the oldest answers are evicted past it.
        prompt_tail: tokens of each prompt's end kept before its answer in the global store
            (so that the answer's first tokens can be matched).
    """

    min_match: int = 2
    max_match: int = 32
    max_spec_factor: float = 1.0
    min_prob: float = 0.1
    max_occurrences: int = 64
    max_tokens: int = 1_000_000
    prompt_tail: int = 16


class _Index:
    """Token sequences indexed by their ``K``-grams: ``K``-gram -> positions just after each
    occurrence, oldest first. A position is ``(sequence number, offset)``; sequences are
    numbered in the order they were added, and those below :attr:`first` are gone. Only the
    newest sequence grows, so each ``K``-gram's positions stay in ascending order and an
    evicted sequence's positions lead their lists: eviction cuts them off there, at a cost
    in proportion to the sequence's length (no pause to rebuild the index)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.seqs: dict[int, list[int]] = {}
        #: K-gram -> ``(sequence << 32) | end`` of its one occurrence, or of each in an int64
        #: array (8 bytes an entry against a list's 40; most K-grams occur once, and a plain
        #: int is one object fewer for each full garbage collection to walk)
        self.index: dict[tuple[int, ...], int | array] = {}
        self.indexed: dict[int, int] = {}  # per sequence: the positions indexed so far
        self.first = 0  # the oldest live sequence number
        self.next = 0
        self.tokens = 0  # live tokens

    def add(self, tokens: list[int]) -> int:
        """Add a sequence (it may grow later with :meth:`extend`); returns its number."""
        n = self.next
        self.next += 1
        self.seqs[n] = []
        self.indexed[n] = 0
        self.extend(n, tokens)
        return n

    def extend(self, n: int, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``n`` and index its new ``K``-grams."""
        if n != self.next - 1 and tokens:
            raise ValueError("only the newest sequence of an index grows")
        seq = self.seqs[n]
        seq.extend(tokens)
        self.tokens += len(tokens)
        k, index = self.k, self.index
        for end in range(max(self.indexed[n], k), len(seq) + 1):
            key = tuple(seq[end - k:end])
            found = index.get(key)
            if found is None:
                index[key] = n << 32 | end
            elif type(found) is int:
                index[key] = array("q", (found, n << 32 | end))
            else:
                found.append(n << 32 | end)
        self.indexed[n] = max(self.indexed[n], len(seq) + 1)

    def evict_oldest(self) -> None:
        """Forget the oldest sequence and its index entries."""
        seq = self.seqs.pop(self.first)
        self.indexed.pop(self.first)
        self.tokens -= len(seq)
        self.first += 1
        while self.first < self.next and self.first not in self.seqs:
            self.first += 1
        bound = self.first << 32  # positions below it belong to evicted sequences
        k = self.k
        for key in {tuple(seq[end - k:end]) for end in range(k, len(seq) + 1)}:
            found = self.index.get(key)
            if found is None:
                continue
            cut = (found < bound) if type(found) is int else bisect.bisect_left(found, bound)
            if cut == (1 if type(found) is int else len(found)):
                del self.index[key]
            elif cut:
                del found[:cut]

    def occurrences(self, context: list[int], limit: int, max_match: int, skip: tuple[int, int] | None
                    ) -> list[tuple[int, int, int]]:
        """The most recent ``limit`` occurrences of ``context``'s last ``K`` tokens as
        ``(match length, sequence, position)``; ``skip`` is the context's own end."""
        k = self.k
        if len(context) < k:
            return []
        found = self.index.get(tuple(context[-k:]))
        if found is None:
            return []
        if type(found) is int:
            found = (found,)
        out = []
        for packed in reversed(found):
            n, end = packed >> 32, packed & 0xFFFFFFFF
            if (n, end) == skip:
                continue
            seq = self.seqs[n]
            m = k
            top = min(max_match, end, len(context))
            while m < top and seq[end - m - 1] == context[-m - 1]:
                m += 1
            out.append((m, n, end))
            if len(out) >= limit:
                break
        return out


class SuffixStore:
    """The global store: earlier answers (each after the end of its prompt), capped at
    ``config.max_tokens`` tokens, oldest evicted first. ``on_add(change in tokens)`` (set by
    :class:`SuffixStores`) runs after each answer is added: the cap over all tenants."""

    def __init__(self, config: SuffixConfig = SuffixConfig()) -> None:
        self.config = config
        self._index = _Index(config.min_match)
        self.on_add: Callable[[int], None] | None = None

    @property
    def tokens(self) -> int:
        """Tokens held."""
        return self._index.tokens

    @property
    def sequences(self) -> int:
        return len(self._index.seqs)

    def add(self, prompt: list[int], answer: list[int]) -> None:
        """Remember an answer (with the last ``prompt_tail`` tokens of its prompt)."""
        if not answer:
            return
        tokens = list(prompt[-self.config.prompt_tail:]) + list(answer)
        before = self.tokens
        self._add(tokens)
        if self.on_add is not None:
            self.on_add(self.tokens - before)

    def _add(self, tokens: list[int]) -> None:
        """Index ``tokens`` (their last ``max_tokens``), evicting the oldest past the cap."""
        self._index.add(tokens[-self.config.max_tokens:])
        while self._index.tokens > self.config.max_tokens:
            self._index.evict_oldest()

    def occurrences(self, context: list[int]) -> list[tuple[int, list[int], int]]:
        """``(match length, sequence tokens, position after the match)`` of the most recent
        occurrences of ``context``'s end."""
        c = self.config
        return [(m, self._index.seqs[n], end)
                for m, n, end in self._index.occurrences(context, c.max_occurrences, c.max_match, None)]

    def all_sequences(self) -> list[list[int]]:
        return [self._index.seqs[n] for n in sorted(self._index.seqs)]


class SuffixStores:
    """Global stores by tenant: one shared store, or one per tenant when ``per_tenant``
    (so one tenant's answers never draft another's). ``config.max_tokens`` caps all the
    stores together: past it, the largest store forgets its oldest answer, and a store left
    empty is dropped, so clients that each send their own ``user`` hold no more than the cap
    (the largest is found through a heap: an answer costs the same however many tenants
    came before). ``vocab_size`` and ``tokenizer`` (a fingerprint of the vocabulary,
    :func:`sot.fingerprint.tokenizer_hash`), when set, are written with the stores and checked
    when they are read back."""

    def __init__(self, config: SuffixConfig = SuffixConfig(), per_tenant: bool = False,
                 vocab_size: int | None = None, tokenizer: str | None = None) -> None:
        self.config = config
        self.per_tenant = per_tenant
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.stores: dict[str, SuffixStore] = {}
        self._total = 0  # tokens in all the stores
        #: ``(-tokens, order, key)`` of each store as it last changed (older entries are skipped)
        self._heap: list[tuple[int, int, str]] = []
        self._order = itertools.count()

    def _key(self, tenant: str | None) -> str:
        return (tenant or "") if self.per_tenant else ""

    def get(self, tenant: str | None) -> SuffixStore:
        """The store of ``tenant`` (the shared one unless ``per_tenant``; a missing ``tenant``
        and ``""`` are one tenant), made when it has none."""
        key = self._key(tenant)
        store = self.stores.get(key)
        if store is None:
            store = self.stores[key] = SuffixStore(self.config)
            store.on_add = lambda change, key=key: self._added(key, change)
        return store

    def find(self, tenant: str | None) -> SuffixStore | None:
        """The store of ``tenant`` if it has one (a request that only reads makes none)."""
        return self.stores.get(self._key(tenant))

    def _added(self, key: str, change: int) -> None:
        self._total += change
        self._push(key)
        self._keep_cap()

    def _push(self, key: str) -> None:
        heapq.heappush(self._heap, (-self.stores[key].tokens, next(self._order), key))
        if len(self._heap) > 2 * len(self.stores) + 64:  # drop the entries of earlier sizes
            self._heap = [(-s.tokens, next(self._order), k) for k, s in self.stores.items()]
            heapq.heapify(self._heap)

    def _keep_cap(self) -> None:
        """Evict from the largest store until all of them hold at most ``max_tokens``."""
        while len(self.stores) > 1 and self._total > self.config.max_tokens and self._heap:
            size, _, key = heapq.heappop(self._heap)
            store = self.stores.get(key)
            if store is None or store.tokens != -size:
                continue  # (an entry of a store that has changed since, or is gone)
            store._index.evict_oldest()
            self._total -= -size - store.tokens
            if store.tokens:
                self._push(key)
            else:
                del self.stores[key]

    def _recount(self) -> None:
        self._total = sum(s.tokens for s in self.stores.values())
        self._heap = [(-s.tokens, next(self._order), k) for k, s in self.stores.items()]
        heapq.heapify(self._heap)

    @property
    def tokens(self) -> int:
        """Tokens held by all the stores."""
        return self._total

    def clear(self) -> None:
        """Forget every answer."""
        self.stores.clear()
        self._recount()

    def save(self, path: str | Path) -> None:
        """Write every store to ``path`` (``.npz``: the tokens, sequence lengths, tenants and
        vocabulary size). The file is replaced whole (written beside it, then renamed), so a
        process stopped while writing leaves the previous file; when two savers write one
        file, the last one's stores are kept. It holds earlier answers, so only its owner may
        read it."""
        names, lengths, owners, flat = [], [], [], []
        for t, (name, store) in enumerate(sorted(self.stores.items())):
            names.append(name)
            for seq in store.all_sequences():
                lengths.append(len(seq))
                owners.append(t)
                flat.extend(seq)

        def write(part: Path) -> None:
            with open(part, "wb") as fh:  # np.savez would append .npz to a name without it
                np.savez_compressed(fh, tokens=np.asarray(flat, dtype=np.int64),
                                    lengths=np.asarray(lengths, dtype=np.int64),
                                    owners=np.asarray(owners, dtype=np.int64), tenants=np.asarray(names, dtype=str),
                                    vocab_size=np.asarray(self.vocab_size or 0, dtype=np.int64),
                                    tokenizer=np.asarray(self.tokenizer or "", dtype=str))
                fh.flush()
                os.fsync(fh.fileno())

        replace_file(path, write, mode=None)  # (earlier answers: its owner's alone)

    def load(self, path: str | Path) -> None:
        """Add the stores saved at ``path`` (answers already held are not deduplicated; of a
        file over the cap, the newest answers). A file that is not a store, or one written for
        another vocabulary size, is a :class:`ConfigError`, and so, without ``per_tenant``, is
        a file of per-tenant stores (sharing them would mix the tenants' answers for good)."""
        tokens, lengths, owners, names = self._read(path)
        tenants = [n for n in names if n]
        if tenants and not self.per_tenant:
            raise ConfigError(f"{path} holds the stores of {len(tenants)} tenants, kept apart; read it with "
                              "per-tenant stores (sot serve --suffix-tenants user)")
        starts = np.concatenate(([0], np.cumsum(lengths)))
        keep: dict[str, int] = {}  # per store: tokens taken so far, newest answers first
        chosen = []
        for i in range(len(lengths) - 1, -1, -1):
            key = names[owners[i]] if self.per_tenant else ""
            room = self.config.max_tokens - keep.get(key, 0)
            if room > 0:
                take = min(int(lengths[i]), room)
                keep[key] = keep.get(key, 0) + take
                chosen.append((key, int(starts[i + 1]) - take, int(starts[i + 1])))
        for key, a, b in reversed(chosen):
            self.get(key or None)._add(tokens[a:b].tolist())
        self._recount()
        self._keep_cap()

    def _read(self, path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """The arrays of a store file, checked: ``tokens [N]`` ids (within the vocabulary),
        ``lengths [S]`` summing to ``N``, ``owners [S]`` indexing ``tenants``."""
        bad = (f"{path} is not a suffix store written by SoT (save_suffix_store, --suffix-store); "
               "delete it or give another file")
        try:
            with np.load(Path(path), allow_pickle=False) as data:  # (an .npy array is no context manager: bad)
                tokens, lengths, owners = data["tokens"], data["lengths"], data["owners"]
                names = [str(n) for n in data["tenants"].tolist()]
                vocab = int(data["vocab_size"]) if "vocab_size" in data.files else 0
                tokenizer = str(data["tokenizer"]) if "tokenizer" in data.files else ""  # (older files: none)
        except OSError as exc:
            raise ConfigError(f"cannot read suffix store {path}: {exc.strerror or exc}") from None
        except Exception:  # noqa: BLE001 (a damaged file fails in zipfile, zlib or numpy, each its own way)
            raise ConfigError(bad) from None
        arrays = (tokens, lengths, owners)
        if any(a.ndim != 1 or a.dtype.kind not in "iu" for a in arrays) or len(lengths) != len(owners) \
                or (lengths < 0).any() or int(lengths.sum()) != len(tokens) \
                or (len(owners) and (owners.min() < 0 or owners.max() >= len(names))):
            raise ConfigError(bad)
        if self.vocab_size and vocab and vocab != self.vocab_size:
            raise ConfigError(f"{path} holds answers of a model with {vocab} tokens, this one has "
                              f"{self.vocab_size}; give another file")
        if self.tokenizer and tokenizer and tokenizer != self.tokenizer:
            raise ConfigError(f"{path} holds answers in another tokenizer's token ids than this model's; give "
                              "another file")
        if self.vocab_size and len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ConfigError(f"{path} holds token ids outside this model's {self.vocab_size}: written for "
                              "another model; give another file")
        return tokens, lengths, owners, names


class SuffixMatcher:
    """One request's suffix drafts: its own context, indexed as it grows, and the global store."""

    def __init__(self, config: SuffixConfig, store: SuffixStore | None) -> None:
        self.config = config
        self.store = store
        self._own = _Index(config.min_match)
        self._n = self._own.add([])
        #: the length of the match behind the last tree (0: none)
        self.last_match = 0

    def tree(self, context: list[int], max_nodes: int, max_depth: int) -> DraftTree:
        """The continuation tree of ``context`` (rooted at its last token), at most
        ``max_nodes`` nodes with the root and ``max_depth`` deep; ``draft_probs`` hold each
        node's estimated probability. The context only grows between calls."""
        own = self._own
        seq = own.seqs[self._n]
        if len(context) < len(seq):
            raise ValueError("a suffix matcher follows one growing context")
        own.extend(self._n, context[len(seq):])
        c = self.config
        found = [(m, own.seqs[n], end) for m, n, end in
                 own.occurrences(context, c.max_occurrences, c.max_match, (self._n, len(context)))]
        if self.store is not None:
            found += self.store.occurrences(context)
        root = context[-1]
        self.last_match = 0
        if not found or max_nodes < 2 or max_depth < 1:
            return DraftTree.root_only(root)
        best = max(m for m, _, _ in found)
        self.last_match = best
        # a match of m tokens speculates at most factor * m tokens: deep and wide
        spec = max(1, math.floor(c.max_spec_factor * best))
        return grow_tree(root, [s[end:end + min(max_depth, spec)] for m, s, end in found if m == best],
                         min(max_nodes, spec + 1), c.min_prob)


def grow_tree(root: int, continuations: list[list[int]], max_nodes: int, min_prob: float) -> DraftTree:
    """The best ``max_nodes - 1`` paths of the trie of ``continuations`` by count, each node's
    probability its count over ``len(continuations)`` (best first: a parent before its children)."""
    total = len([c for c in continuations if c]) or 1
    children: dict[tuple[int, ...], dict[int, int]] = {}
    for cont in continuations:
        for d in range(len(cont)):
            kids = children.setdefault(tuple(cont[:d]), {})
            kids[cont[d]] = kids.get(cont[d], 0) + 1
    tokens, parents, depths, probs = [root], [-1], [0], [1.0]
    # best first; at equal probability the shallower node, then the more recent occurrence
    order = itertools.count()
    heap = [(-count / total, 1, next(order), (tok,), 0) for tok, count in children.get((), {}).items()]
    heapq.heapify(heap)
    while heap and len(tokens) < max_nodes:
        neg, depth, _, path, parent = heapq.heappop(heap)
        if -neg < min_prob:
            break
        node = len(tokens)
        tokens.append(path[-1])
        parents.append(parent)
        depths.append(depth)
        probs.append(-neg)
        for tok, count in children.get(path, {}).items():
            heapq.heappush(heap, (-count / total, depth + 1, next(order), path + (tok,), node))
    return DraftTree(tokens, parents, depths, probs)
