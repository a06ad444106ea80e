"""The KV cache: it owns the layout of KV storage (the attention kernels and CUDA graphs
receive its tensors).

Values are stored as ``[L, B, Hkv, S, D]`` (layers, batch, KV heads, slots, head dim). Keys
use the same layout, or ``[L, B, Hkv, S / 16, D, 16]`` when ``tiled_keys`` is set: the layout
of the compiled CPU kernel, in tiles of 16 slots, each holding its 16 keys' dimensions in
turn. The kernel scores 16 keys per vector instruction, and a block of 16 keys is then one
contiguous read: a single stream the hardware prefetcher follows, where 64 rows of slots (one
per dimension) were more streams than it tracks. Sequence ``b`` holds
its committed tokens in slots ``[0, lengths[b])``, the token at position ``p`` always in slot
``p``. A forward writes its rows into *scratch* slots starting at ``lengths[b]``;
:meth:`KVCache.keep_rows` then moves the accepted rows into place.
"""
from __future__ import annotations

import torch

from sot.models.rows import round_up

SLOT_ALIGN = 64
#: slots per tile of tiled keys (the CPU kernel's 16 lanes); SLOT_ALIGN is a multiple of it
KEY_TILE = 16


class KVCache:
    """Static per-sequence KV storage with explicit append / keep / truncate operations."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        tiled_keys: bool = False,
    ) -> None:
        capacity = round_up(capacity, SLOT_ALIGN)
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        key_shape = ((num_layers, batch_size, num_kv_heads, capacity // KEY_TILE, head_dim, KEY_TILE) if tiled_keys
                     else shape)
        # Zeros, not empty: masked slots still enter matmuls (with weight 0) and must be finite.
        self.keys = torch.zeros(key_shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.tiled_keys = tiled_keys
        self.lengths: list[int] = [0] * batch_size

    @property
    def capacity(self) -> int:
        return self.values.shape[3]

    @property
    def batch_size(self) -> int:
        return self.values.shape[1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw K and V storage of one layer: ``[B, Hkv, S, D]`` each, or K ``[B, Hkv, S / 16, D,
        16]`` with ``tiled_keys``."""
        return self.keys[layer], self.values[layer]

    def _key_rows(self, b: int, t0: int, t1: int) -> torch.Tensor:
        """A copy of sequence ``b``'s tiled keys in tiles ``[t0, t1)`` as rows: ``[L, Hkv, (t1 -
        t0) * 16, D]`` (slot ``16 * t0`` first)."""
        tiles = self.keys[:, b, :, t0:t1]  # [L, Hkv, t, D, 16]
        return tiles.transpose(-1, -2).reshape(*tiles.shape[:2], -1, tiles.shape[3])

    def _put_key_rows(self, b: int, t0: int, rows: torch.Tensor) -> None:
        """Write ``rows [L, Hkv, 16 * t, D]`` into sequence ``b``'s tiles ``[t0, t0 + t)``."""
        layers, heads, n, dim = rows.shape
        tiles = rows.view(layers, heads, n // KEY_TILE, KEY_TILE, dim).transpose(-1, -2)
        self.keys[:, b, :, t0:t0 + n // KEY_TILE] = tiles

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
        """Append rows to scratch slots.

        Args:
            slots: ``[B, T]`` slot of each row, on the host; a tree step writes ``lengths[b] + row``.
            keys, values: ``[B, Hkv, T, D]`` the new rows.
            rows: the same places as :meth:`write_rows` gives them, on the cache's device: two
                scatters that read nothing on the host (what a CUDA graph replays); keys not
                tiled only.
        """
        k_store, v_store = self.layer(layer)
        if rows is not None and not self.tiled_keys:
            dim = v_store.shape[-1]
            k_store.view(-1, dim).index_copy_(0, rows, keys.reshape(-1, dim))
            v_store.view(-1, dim).index_copy_(0, rows, values.reshape(-1, dim))
            return
        if self.tiled_keys:  # slot s: lane s % 16 of tile s // 16; [B, T, Hkv, D] in that order
            batch = torch.arange(slots.shape[0])[:, None]
            k_store[batch, :, slots // KEY_TILE, :, slots % KEY_TILE] = keys.transpose(1, 2).to(k_store.dtype)
        if slots.shape[0] == 1:  # one sequence: its slots are a contiguous run
            start = int(slots[0, 0])
            end = start + slots.shape[1]
            if not self.tiled_keys:
                k_store[:, :, start:end] = keys
            v_store[:, :, start:end] = values
            return
        for b in range(slots.shape[0]):
            start = int(slots[b, 0])
            end = start + slots.shape[1]
            if not self.tiled_keys:
                k_store[b, :, start:end] = keys[b]
            v_store[b, :, start:end] = values[b]

    def write_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """``[B * Hkv * T]`` (int64, on the cache's device): for host ``slots [B, T]``, the row
        of each new K/V row in a layer's storage viewed as ``[B * Hkv * S, D]``, that is
        ``(b * Hkv + h) * S + slots[b, t]``, in the order of ``[B, Hkv, T]``.

        Example: 2 KV heads, 64 slots, ``slots = [[5, 6]]`` -> ``[5, 6, 69, 70]``."""
        batch, kv_heads = slots.shape[0], self.values.shape[2]
        base = (torch.arange(batch)[:, None] * kv_heads + torch.arange(kv_heads)) * self.capacity  # [B, Hkv]
        return (base[:, :, None] + slots[:, None, :]).reshape(-1).to(self.values.device)

    def read_span(self, b: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of sequence ``b``'s rows in slots ``[start, end)`` of every layer: keys and
        values ``[L, Hkv, n, D]``, in either key layout."""
        if self.tiled_keys:
            t0 = start // KEY_TILE
            keys = self._key_rows(b, t0, -(-end // KEY_TILE))[:, :, start - t0 * KEY_TILE:end - t0 * KEY_TILE]
        else:
            keys = self.keys[:, b, :, start:end]
        return keys.clone(), self.values[:, b, :, start:end].clone()

    def write_span(self, b: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put rows read by :meth:`read_span` (``[L, Hkv, n, D]`` each) into sequence ``b``'s
        slots from ``start``."""
        n = values.shape[2]
        if self.tiled_keys:  # the tiles the span touches, as rows: the span's keys put in, then back
            t0 = start // KEY_TILE
            rows = self._key_rows(b, t0, -(-(start + n) // KEY_TILE))
            rows[:, :, start - t0 * KEY_TILE:start - t0 * KEY_TILE + n] = keys
            self._put_key_rows(b, t0, rows)
        else:
            self.keys[:, b, :, start:start + n] = keys
        self.values[:, b, :, start:start + n] = values

    def keep_rows(self, src_slots: list[list[int]]) -> None:
        """Commit accepted rows for every sequence and every layer at once.

        ``src_slots[b]`` lists the scratch slots to keep, in order; they move to
        ``lengths[b], lengths[b] + 1, ...`` and the length grows by their count.
        Example: ``lengths = [5]``, ``src_slots = [[5, 7, 8]]`` (tree rows 0, 2, 3 accepted)
        moves slots 7 -> 6 and 8 -> 7 (slot 5 stays) and sets ``lengths = [8]``.
        """
        for b, slots in enumerate(src_slots):
            start = self.lengths[b]
            if any(s < start + i for i, s in enumerate(slots)):
                raise ValueError("accepted rows must come from slots at or after their destination")
            moved = [(s, start + i) for i, s in enumerate(slots) if s != start + i]
            if moved:  # rows already in place (plain decoding, a main branch) need no move
                src = torch.tensor([m[0] for m in moved], device=self.values.device)
                dst = torch.tensor([m[1] for m in moved], device=self.values.device)
                # views of sequence b; gather first, then scatter
                if self.tiled_keys:  # slot s: lane s % 16 of tile s // 16
                    keys = self.keys[:, b]  # [L, Hkv, S / 16, D, 16]
                    keys[:, :, dst // KEY_TILE, :, dst % KEY_TILE] = keys[:, :, src // KEY_TILE, :, src % KEY_TILE]
                else:
                    self.keys[:, b].index_copy_(2, dst, self.keys[:, b].index_select(2, src))
                self.values[:, b].index_copy_(2, dst, self.values[:, b].index_select(2, src))
            self.lengths[b] += len(slots)

    def truncate(self, b: int, length: int) -> None:
        """Forget everything of sequence ``b`` from slot ``length`` on."""
        if not 0 <= length <= self.lengths[b]:
            raise ValueError(f"cannot truncate sequence {b} of length {self.lengths[b]} to {length}")
        self.lengths[b] = length

    def set_length(self, b: int, length: int) -> None:
        """Declare ``length`` slots of sequence ``b`` committed (after a prefill wrote them)."""
        if length > self.capacity:
            raise ValueError(f"length {length} exceeds cache capacity {self.capacity}")
        self.lengths[b] = length

    def narrow(self, n: int) -> "KVCache":
        """The first ``n`` sequences as a cache of batch ``n`` over the same storage (a verify
        pass over the live sequences only). It shares this cache's ``lengths`` list, so its
        commits are this cache's; only entries ``[0, n)`` are its own."""
        if not 0 < n <= self.batch_size:
            raise ValueError(f"cannot narrow a cache of {self.batch_size} sequences to {n}")
        view = KVCache.__new__(KVCache)
        view.keys, view.values = self.keys[:, :n], self.values[:, :n]
        view.tiled_keys = self.tiled_keys
        view.lengths = self.lengths
        return view

    def single(self, b: int) -> "KVCache":
        """Sequence ``b`` alone, as a cache of batch 1 over the same storage, with a length
        of its own (a copy of ``lengths[b]``: the caller commits to this cache)."""
        if not 0 <= b < self.batch_size:
            raise ValueError(f"no sequence {b} in a cache of {self.batch_size}")
        view = KVCache.__new__(KVCache)
        view.keys, view.values = self.keys[:, b:b + 1], self.values[:, b:b + 1]
        view.tiled_keys = self.tiled_keys
        view.lengths = [self.lengths[b]]
        return view

    def move(self, src: int, dst: int) -> None:
        """Copy sequence ``src``'s committed slots into sequence ``dst`` (which is overwritten)
        and give it ``src``'s length; ``src`` keeps its data until it is reused."""
        n = self.lengths[src]
        if src != dst and n:
            self.values[:, dst, :, :n] = self.values[:, src, :, :n]
            if self.tiled_keys:  # whole tiles: slots past n are scratch
                tiles = -(-n // KEY_TILE)
                self.keys[:, dst, :, :tiles] = self.keys[:, src, :, :tiles]
            else:
                self.keys[:, dst, :, :n] = self.keys[:, src, :, :n]
        self.lengths[dst] = n

    def resized(self, batch_size: int, capacity: int) -> "KVCache":
        """A cache of ``batch_size`` sequences and ``capacity`` slots (each at least this
        one's) holding this one's sequences and lengths: the slots below the longest length
        (rounded up to a key tile) are copied, every slot after them is zero."""
        if batch_size < self.batch_size or capacity < self.capacity:
            raise ValueError("a resized cache must not be smaller than the original")
        num_layers, _, kv_heads, _, head_dim = self.values.shape
        out = KVCache(num_layers, batch_size, kv_heads, head_dim, capacity, self.values.device, self.values.dtype,
                      self.tiled_keys)
        old_b = self.batch_size
        # only the slots a sequence holds carry over (the rest of the new cache stays zero, as
        # masked slots must stay finite): a copy of what is used, not of the whole capacity
        used = min(round_up(max(self.lengths, default=0), KEY_TILE), self.capacity)
        out.values[:, :old_b, :, :used] = self.values[:, :, :, :used]
        if self.tiled_keys:
            out.keys[:, :old_b, :, :used // KEY_TILE] = self.keys[:, :, :, :used // KEY_TILE]
        else:
            out.keys[:, :old_b, :, :used] = self.keys[:, :, :, :used]
        out.lengths[:old_b] = self.lengths[:old_b]
        return out

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def grown_to(self, batch_size: int, capacity: int, most: int | None = None) -> "KVCache":
        """This cache if it holds ``batch_size`` sequences of ``capacity`` slots, else a
        larger copy. Capacity grows by at least half, and the sequences at least double, up to
        ``most`` (the most the caller will ever hold; ``None``: no limit), so that a batch
        filling a sequence at a time, or a long-running server, copies its cache a few times,
        not once a sequence (every copy reads all of it)."""
        if self.batch_size >= batch_size and self.capacity >= capacity:
            return self
        grown = self.capacity if self.capacity >= capacity else max(capacity, self.capacity * 3 // 2)
        seqs = self.batch_size
        if seqs < batch_size:
            seqs = max(batch_size, 2 * seqs if most is None else min(2 * seqs, most))
        return self.resized(seqs, grown)
