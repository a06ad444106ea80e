"""Prompt prefix caching: the KV rows and target states of prompt chunks already read, reused
by later prompts that start with the same tokens (a chat's next turn, requests sharing a system
prompt, an agent's next round).

Exactness. A prompt is always read in chunks of :data:`PREFILL_CHUNK` tokens aligned to its
start, so the pass that computes chunk ``j`` has the same shape and the same inputs (its tokens,
and the KV rows of the chunks before it) whether or not the earlier chunks came from this cache.
Only whole chunks that a prompt pass computed are kept, never rows written by decoding, so a
reused row has exactly the bits a fresh read would give it, and the output with the cache is
token-identical to the output without it.

Entries are keyed by the chain of their chunks (a chunk's key covers every token before it, and
the tenant when tenants are kept apart), checked token for token on a hit, and evicted least
recently used first under a byte cap, the chunks at the end of a chain before its start.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

#: tokens per prompt chunk: the unit of prompt passes and of reuse
PREFILL_CHUNK = 64
#: the default byte cap of a prefix cache, in MiB (``--prefix-cache-mb``)
DEFAULT_PREFIX_CACHE_MB = 512


@dataclass
class PrefixChunk:
    """One stored chunk: its tokens, its KV rows and the target states the drafter reads."""

    tokens: tuple[int, ...]
    keys: torch.Tensor  # [L, Hkv, C, D], or [L, Hkv, D, C] for a cache with transposed keys
    values: torch.Tensor  # [L, Hkv, C, D]
    states: torch.Tensor | None  # [C, S, D]

    @property
    def nbytes(self) -> int:
        parts = [self.keys, self.values] + ([self.states] if self.states is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


class PrefixCache:
    """Prompt chunks by prefix, least recently used first out above ``max_bytes``.

    Args:
        max_bytes: the cap on the stored KV rows and states.
        per_tenant: keep each tenant's prompts apart, so that one tenant's prompts never
            shorten (and so time) another's.
        chunk: tokens per chunk (the engine reads prompts in chunks of this size).
    """

    def __init__(self, max_bytes: int, per_tenant: bool = False, chunk: int = PREFILL_CHUNK) -> None:
        if max_bytes < 0 or chunk < 1:
            raise ValueError("a prefix cache needs max_bytes >= 0 and chunk >= 1")
        self.max_bytes = max_bytes
        self.per_tenant = per_tenant
        self.chunk = chunk
        self._chunks: OrderedDict[bytes, PrefixChunk] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def _keys(self, prompt: list[int], tenant: str | None, count: int) -> list[bytes]:
        """The keys of the first ``count`` chunks of ``prompt``: each hashes its tokens after
        the previous key (the first, after the tenant when tenants are kept apart)."""
        key = hashlib.blake2b(((tenant or "") if self.per_tenant else "").encode(), digest_size=16).digest()
        out = []
        for j in range(count):
            part = torch.tensor(prompt[j * self.chunk:(j + 1) * self.chunk], dtype=torch.int64).numpy().tobytes()
            key = hashlib.blake2b(key + part, digest_size=16).digest()
            out.append(key)
        return out

    def reusable(self, prompt_len: int) -> int:
        """Whole chunks of a prompt that may come from the cache: at least one token is left
        for the prompt pass that gives the first new token."""
        return (prompt_len - 1) // self.chunk if prompt_len > 0 else 0

    def lookup(self, prompt: list[int], tenant: str | None = None) -> list[PrefixChunk]:
        """The stored chunks that begin ``prompt``, in order (possibly none)."""
        count = self.reusable(len(prompt))
        found: list[tuple[bytes, PrefixChunk]] = []
        for j, key in enumerate(self._keys(prompt, tenant, count)):
            entry = self._chunks.get(key)
            if entry is None or list(entry.tokens) != prompt[j * self.chunk:(j + 1) * self.chunk]:
                break
            found.append((key, entry))
        for key, _ in reversed(found):  # the chain's start is the most recently used
            self._chunks.move_to_end(key)
        return [entry for _, entry in found]

    def insert(self, prompt: list[int], tenant: str | None, first: int, chunks: list[PrefixChunk]) -> None:
        """Store ``chunks``, the prompt's chunks ``first, first + 1, ...``, then evict down to
        the cap."""
        if not chunks or self.max_bytes == 0:
            return
        chain = self._keys(prompt, tenant, first + len(chunks))
        for key, entry in zip(chain[first:], chunks):
            old = self._chunks.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._chunks[key] = entry
            self.nbytes += entry.nbytes
        for key in reversed(chain):  # the chain's start is the most recently used
            if key in self._chunks:
                self._chunks.move_to_end(key)
        while self.nbytes > self.max_bytes and self._chunks:
            _, entry = self._chunks.popitem(last=False)
            self.nbytes -= entry.nbytes

    def clear(self) -> None:
        self._chunks.clear()
        self.nbytes = 0
