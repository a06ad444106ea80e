"""The KV cache: the only code that reads or writes KV storage.

Storage is one tensor per K and V of shape ``[L, B, Hkv, S, D]`` (layers, batch, KV heads,
slots, head dim) in the model dtype; attention accumulates in float32.
Sequence ``b`` holds its committed tokens in slots ``[0, lengths[b])``, the token at position
``p`` always in slot ``p``. A forward writes its rows into *scratch* slots starting at
``lengths[b]``; :meth:`KVCache.keep_rows` then moves the accepted rows into place.
"""
from __future__ import annotations

import torch

SLOT_ALIGN = 64


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
    ) -> None:
        capacity = -(-capacity // SLOT_ALIGN) * SLOT_ALIGN
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        # Zeros, not empty: masked slots still enter matmuls (with weight 0) and must be finite.
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths: list[int] = [0] * batch_size

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V storage of one layer, each ``[B, Hkv, S, D]``."""
        return self.keys[layer], self.values[layer]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows to scratch slots.

        Args:
            slots: ``[B, T]`` slot of each row (``lengths[b] + row`` for a tree step).
            keys, values: ``[B, Hkv, T, D]`` the new rows.
        """
        if slots.shape[0] == 1:  # one sequence: its slots are a contiguous run
            start = int(slots[0, 0])
            end = start + slots.shape[1]
            self.keys[layer, :, :, start:end] = keys
            self.values[layer, :, :, start:end] = values
            return
        index = slots[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        self.keys[layer].scatter_(2, index, keys.to(self.keys.dtype))
        self.values[layer].scatter_(2, index, values.to(self.values.dtype))

    def write_sequence(self, layer: int, b: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``T`` contiguous rows of sequence ``b`` at ``start`` (prefill).

        Args:
            keys, values: ``[Hkv, T, D]``.
        """
        end = start + keys.shape[1]
        self.keys[layer, b, :, start:end] = keys
        self.values[layer, b, :, start:end] = values

    def keep_rows(self, src_slots: list[list[int]]) -> None:
        """Commit accepted rows for every sequence and every layer at once.

        ``src_slots[b]`` lists the scratch slots to keep, in order; they move to
        ``lengths[b], lengths[b] + 1, ...`` and the length grows by their count.
        Example: ``lengths = [5]``, ``src_slots = [[5, 7, 8]]`` (tree rows 0, 2, 3 accepted)
        moves slots 7 -> 6 and 8 -> 7 (slot 5 stays) and sets ``lengths = [8]``.
        """
        # Rows already in place (plain decoding, or an accepted main branch) need no move.
        moves = [[(s, self.lengths[b] + i) for i, s in enumerate(slots) if s != self.lengths[b] + i] for b, slots in enumerate(src_slots)]
        if not any(moves):
            for b, slots in enumerate(src_slots):
                self.lengths[b] += len(slots)
            return
        width = max((len(s) for s in src_slots), default=0)
        src, dst = [], []
        for b, slots in enumerate(src_slots):
            start = self.lengths[b]
            pad = width - len(slots)
            # Padding re-copies the last kept slot onto itself (or slot 0 onto itself): a no-op.
            filler = slots[-1] if slots else 0
            src.append(list(slots) + [filler] * pad)
            dst.append(list(range(start, start + len(slots))) + [filler if slots else 0] * pad)
            if slots and any(d > s for d, s in zip(dst[-1], slots)):
                raise ValueError("accepted rows must come from slots at or after their destination")
        dev = self.keys.device
        src_t = torch.tensor(src, device=dev)
        dst_t = torch.tensor(dst, device=dev)
        for store in (self.keys, self.values):
            # store: [L, B, Hkv, S, D]; gather along slots, per batch row.
            idx_src = src_t[None, :, None, :, None].expand(store.shape[0], -1, store.shape[2], -1, store.shape[4])
            idx_dst = dst_t[None, :, None, :, None].expand_as(idx_src)
            rows = store.gather(3, idx_src)
            store.scatter_(3, idx_dst, rows)
        for b, slots in enumerate(src_slots):
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

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2
