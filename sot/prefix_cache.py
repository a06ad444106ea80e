"""Prefix caching: the KV rows and target states of sequences already read or written, reused
by later prompts that start with the same tokens (a chat's next turn, whose prompt holds the
last answer; requests sharing a system prompt; an agent's next round).

Exactness. Every row in the KV cache, whether a prompt pass or a decoding pass computed it,
has the bits plain decoding gives its token: prompts are read through verify passes, as chains
(:meth:`sot.models.adapter.TargetModel.prefill`), and a verify pass computes each row as plain
decoding does. So a stored row is the row a fresh read would compute, whatever split of the
prompt or whichever step wrote it, and the output with the cache is token-identical to the
output without it. Reuse is exact at token granularity: a prompt may take part of a stored
chunk.

Storage. A sequence is stored in chunks of :data:`PREFILL_CHUNK` tokens on a grid from its
start; only its last chunk may be shorter. A chunk's key covers every token before it (and the
tenant when tenants are kept apart), so the store is a tree of chunks: a lookup walks it from
the root, taking at each level the child that shares the longest run of tokens with the
prompt. A chunk that is a prefix of a sibling adds nothing and is dropped. Entries are evicted
least recently used first under a byte cap, the chunks at the end of a chain before its
start, and a chunk leaves with the chunks below it (no lookup could reach them).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

#: tokens per prompt pass and per stored chunk
PREFILL_CHUNK = 64
#: the default byte cap of a prefix cache, in MiB (``--prefix-cache-mb``)
DEFAULT_PREFIX_CACHE_MB = 512


@dataclass
class PrefixChunk:
    """One stored chunk: its tokens (``C`` of them), their KV rows and the target states the
    drafter reads."""

    tokens: tuple[int, ...]
    keys: torch.Tensor  # [L, Hkv, C, D] (KVCache.read_span, in either key layout)
    values: torch.Tensor  # [L, Hkv, C, D]
    states: torch.Tensor | None  # [C, S, D]
    parent: bytes = b""  # the key of the chunk before it (the root key for a first chunk)

    @property
    def nbytes(self) -> int:
        parts = [self.keys, self.values] + ([self.states] if self.states is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


@dataclass(frozen=True)
class PrefixHit:
    """What a lookup found: the chunks that begin the prompt, in order, and the prompt tokens
    they cover (``tokens``); the last chunk may be used in part (its first
    ``tokens - PREFILL_CHUNK * (len(chunks) - 1)`` rows)."""

    chunks: list[PrefixChunk]
    tokens: int


#: reads a sequence's rows ``[start, end)`` for the store: ``(keys, values, states)``
SpanReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def _common(a: tuple[int, ...], b: list[int]) -> int:
    """Length of the common start of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Chunks of earlier sequences by prefix, least recently used first out above ``max_bytes``.

    Args:
        max_bytes: the cap on the stored KV rows and states.
        per_tenant: keep each tenant's sequences apart, so that one tenant's requests never
            shorten (and so time) another's.
        chunk: tokens per chunk.
    """

    def __init__(self, max_bytes: int, per_tenant: bool = False, chunk: int = PREFILL_CHUNK) -> None:
        if max_bytes < 0 or chunk < 1:
            raise ValueError("a prefix cache needs max_bytes >= 0 and chunk >= 1")
        self.max_bytes = max_bytes
        self.per_tenant = per_tenant
        self.chunk = chunk
        self._chunks: OrderedDict[bytes, PrefixChunk] = OrderedDict()
        self._children: dict[bytes, list[bytes]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def _root(self, tenant: str | None, salt: str | None = None) -> bytes:
        """The tree a request's chunks hang from: its tenant's (when tenants are kept apart)
        and its salt's; requests share chunks only under one root."""
        who = (tenant or "") if self.per_tenant else ""
        return hashlib.blake2b(f"{len(who)}:{who}:{salt or ''}".encode(), digest_size=16).digest()

    @staticmethod
    def _key(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
        data = torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()
        return hashlib.blake2b(parent + data, digest_size=16).digest()

    def lookup(self, prompt: list[int], tenant: str | None = None, salt: str | None = None) -> PrefixHit:
        """The stored chunks that begin ``prompt``, covering at most ``len(prompt) - 1`` of
        its tokens (one is left for the pass that gives the first new token); only chunks
        stored under the same tenant (when kept apart) and ``salt`` are found."""
        limit = len(prompt) - 1
        parent, pos = self._root(tenant, salt), 0
        found: list[tuple[bytes, PrefixChunk]] = []
        while pos < limit:
            want = prompt[pos:pos + self.chunk]
            best, best_n = None, 0
            for key in self._children.get(parent, ()):
                n = _common(self._chunks[key].tokens, want)
                if n > best_n:
                    best, best_n = key, n
            if best is None:
                break
            found.append((best, self._chunks[best]))
            pos += min(best_n, limit - pos)
            if best_n < self.chunk:
                break
            parent = best
        for key, _ in reversed(found):  # the chain's start is the most recently used
            self._chunks.move_to_end(key)
        return PrefixHit([entry for _, entry in found], pos)

    def insert(self, tokens: list[int], tenant: str | None, read: SpanReader, salt: str | None = None) -> int:
        """Store the chunks of the sequence ``tokens`` that the store lacks (under ``tenant``
        and ``salt``), reading their rows with ``read(start, end)``, then evict down to the
        cap. Returns the tokens read."""
        if self.max_bytes == 0 or not tokens:
            return 0
        parent, chain, copied = self._root(tenant, salt), [], 0
        for start in range(0, len(tokens), self.chunk):
            part = tokens[start:start + self.chunk]
            siblings = self._children.setdefault(parent, [])
            cover = next((k for k in siblings if _common(self._chunks[k].tokens, part) == len(part)), None)
            if cover is None:  # new: it replaces the siblings it extends
                for k in [k for k in siblings if _common(self._chunks[k].tokens, part) == len(self._chunks[k].tokens)]:
                    self._drop(k)
                keys, values, states = read(start, start + len(part))
                cover = self._key(parent, part)
                entry = PrefixChunk(tuple(part), keys, values, states, parent)
                self._chunks[cover] = entry
                self._children.setdefault(parent, []).append(cover)
                self.nbytes += entry.nbytes
                copied += len(part)
            chain.append(cover)
            if len(self._chunks[cover].tokens) < self.chunk:
                break
            parent = cover
        for key in reversed(chain):  # the chain's start is the most recently used
            if key in self._chunks:
                self._chunks.move_to_end(key)
        while self.nbytes > self.max_bytes and self._chunks:
            self._drop(next(iter(self._chunks)))
        return copied

    def _drop(self, key: bytes) -> None:
        """Remove a chunk and every chunk below it."""
        entry = self._chunks.pop(key, None)
        if entry is None:
            return
        self.nbytes -= entry.nbytes
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.remove(key)
            if not siblings:
                del self._children[entry.parent]
        for child in self._children.pop(key, []):  # (their list is gone: nothing to detach)
            self._drop(child)

    def clear(self) -> None:
        self._chunks.clear()
        self._children.clear()
        self.nbytes = 0
