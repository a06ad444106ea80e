"""Row-invariant attention over the KV cache.

Bit-exact speculative decoding needs every row of a verify pass to compute exactly what plain
decoding computes for the same token, whatever else is in the pass. Ordinary attention breaks
that in two ways: a tree node's ancestors sit in scratch slots rather than at their positions,
so reductions group its terms differently; and matmul kernels are chosen by shape.

Here each query row's keys are split by the row's *position* ``p`` alone:

* the **far part**, positions ``[0, far_end(p))``: committed tokens, stored at their own
  positions, so the same slots in every pass. One matmul per sequence covers all rows;
* the **tail**, positions ``[far_end(p), p]`` (at most ``TAIL`` keys): gathered per row in
  position order (recent committed slots, then the row's ancestors' scratch slots) and
  attended with one small matmul per row, whose shape never changes.

The two partial softmaxes are merged with a fixed formula. Plain decoding is a tree with one
node and runs through the same code, so each row gets the same numbers either way. Only the
real rows of a tree are computed (rounded up to ``ROW_ALIGN``); padding rows get zeros.

On the CPU a compiled kernel (:mod:`sot.kernels`) replaces all of this: it walks each row's
keys in position order with one fixed instruction sequence, which is exact by construction
and much cheaper than the many small tensor operations above. On a CUDA GPU a Triton kernel
does the same (:mod:`sot.kernels.triton_attention`): there the PyTorch path is not row-invariant,
since GPU reductions and products choose their grouping by the whole pass's shape. The PyTorch
path remains for machines without a compiler (and GPUs without Triton).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch

from sot.cache import KVCache
from sot.kernels import cpu_kernels
from sot.models.rows import round_up

# Rows of a tree may be up to MAX_TREE_DEPTH below the committed length.
MAX_TREE_DEPTH = 64
# Nodes of one tree at most (each is a verify row, a cache slot and a timed point of the cost model)
MAX_TREE_NODES = 256
FAR_ALIGN = 32
TAIL = MAX_TREE_DEPTH + FAR_ALIGN
# Attention rows are computed in multiples of this (keeps matmul shapes out of the
# one- and two-row kernels, whose rounding differs from the rest).
ROW_ALIGN = 4


def use_kernel(cache: KVCache) -> bool:
    """Whether tree attention runs through the compiled CPU kernel for this cache."""
    return cache.tiled_keys and cpu_kernels() is not None


def use_gpu_kernel(cache: KVCache) -> bool:
    """Whether tree attention runs through the Triton kernel (:mod:`sot.kernels.triton_attention`):
    a cache on a CUDA GPU where Triton is installed, unless ``SOT_NO_GPU_KERNEL=1``. Elsewhere
    on a GPU the PyTorch path runs, whose rows can round differently by what shares the pass."""
    if cache.keys.device.type != "cuda" or os.environ.get("SOT_NO_GPU_KERNEL") == "1":
        return False
    return importlib.util.find_spec("triton") is not None


def far_end(position: int | torch.Tensor) -> int | torch.Tensor:
    """End of the far part for a query at ``position`` (an int, or a tensor of them): a
    multiple of ``FAR_ALIGN`` at least ``MAX_TREE_DEPTH`` below it, so every far key is
    committed for any tree row."""
    end = (position - MAX_TREE_DEPTH) // FAR_ALIGN * FAR_ALIGN
    return end.clamp(min=0) if isinstance(end, torch.Tensor) else max(0, end)


@dataclass(frozen=True)
class KernelInputs:
    """Inputs of the compiled kernel: ``lengths [B]``, ``ancestors [B, T, W]`` (cache slots
    of each row's ancestors, root first, itself last, -1 after), ``rows [B]`` (real rows)."""

    lengths: torch.Tensor
    ancestors: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True)
class TreeLayout:
    """Where the rows of one tree-verify forward live. ``B`` sequences by ``T`` rows, of
    which the first ``n`` (``rows``) are attended.

    Attributes:
        write_slots: ``[B, T]`` cache slot each row's K/V is written to (scratch); on the
            host, whatever the cache's device.
        rows: ``n``, attended rows per sequence.
        far_len: width of the far part computed for the batch (max over rows, aligned).
        far_bias: ``[B, 1, 1, n, far_len]`` 0 where a slot is in the row's far part, else -inf.
        tail_index: ``[B * Hkv * n * TAIL]`` row of each tail key in the layer's K/V storage
            viewed as ``[B * Hkv * S, D]``, in position order per (sequence, head, row).
        tail_bias: ``[B, 1, n, 1, TAIL]`` 0 for a real tail key, -inf for padding.
        row_positions: ``[B, n]`` position of each attended row (for sliding windows).
        tail_positions: ``[B, n, TAIL]`` position of each tail key.
        flat_index: ``[R]`` with flat packing, the row ``b * T + t`` of the ``[B, T]`` grid
            behind each of the pass's ``R`` computed rows: the products run over these rows
            only, and attention scatters them back onto the grid. Sequence ``b``'s real rows
            come in order, sequences one after the other; entries past ``flat_rows`` pad
            ``R`` to the target's row multiple (they repeat row 0 and are dropped).
            Example: trees of 3 and 1 nodes, ``T = 4``: ``flat_index = [0, 1, 2, 4]``,
            ``flat_offsets = (0, 3, 4)``.
        flat_offsets: ``[B + 1]`` sequence ``b``'s rows are ``flat_offsets[b] .. flat_offsets[b + 1]``.
        write_rows: ``[B * Hkv * T]`` on a GPU, :meth:`KVCache.write_rows` of ``write_slots``:
            the K/V writes then read nothing on the host (a pass can replay as a CUDA graph).
    """

    write_slots: torch.Tensor
    rows: int = 0
    far_len: int = 0
    far_bias: torch.Tensor | None = None
    tail_index: torch.Tensor | None = None
    tail_bias: torch.Tensor | None = None
    row_positions: torch.Tensor | None = None
    tail_positions: torch.Tensor | None = None
    kernel: KernelInputs | None = None
    flat_index: torch.Tensor | None = None
    flat_offsets: tuple[int, ...] | None = None
    write_rows: torch.Tensor | None = None
    #: (far, tail) biases per sliding window, built by the first layer that uses the window
    window_biases: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False)

    @property
    def flat_rows(self) -> int:
        """Real rows of a flat-packed pass."""
        return self.flat_offsets[-1] if self.flat_offsets else 0


def flat_packing(sizes: list[int], rows: int, multiple: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``flat_index [R]`` and ``flat_offsets [B + 1]`` of trees of ``sizes`` nodes on a
    ``[B, rows]`` grid, ``R`` rounded up to ``multiple`` (see :class:`TreeLayout`)."""
    index = [b * rows + t for b, n in enumerate(sizes) for t in range(n)]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    index += [0] * (-len(index) % multiple)
    return torch.tensor(index), tuple(offsets)


def _tail_slots(
    length: int, depths: torch.Tensor, ancestors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tail key slots ``[n, TAIL]``, validity and key positions for one sequence.

    Worked example: length 100 (root at position 100), a node at depth 2 (position 102,
    ancestors ``[0, 3, 5]``): ``far_end(102) == 32``, so its tail is positions 32..102:
    slots 32..99 (committed), then 100 + 0, 100 + 3, 100 + 5 (root, ancestor, itself).
    """
    positions = length + depths  # [n]
    starts = far_end(positions)
    virtual = starts[:, None] + torch.arange(TAIL)  # [n, TAIL]
    valid = virtual <= positions[:, None]
    depth_index = (virtual - length).clamp(0, ancestors.shape[1] - 1)
    from_tree = length + ancestors.gather(1, depth_index)
    slots = torch.where(virtual < length, virtual, from_tree)
    return torch.where(valid, slots, torch.zeros_like(slots)), valid, virtual


def build_tree_layout(
    lengths: list[int], ancestors: list[list[list[int]]], num_rows: int, cache: KVCache
) -> TreeLayout:
    """Build the attention layout of one verify pass.

    Args:
        lengths: committed length of each sequence (its tree root sits at that position).
        ancestors: per sequence, per tree node, the tree index of its ancestor at each depth
            (``sot.tree.ancestor_table``, all of one width).
        num_rows: ``T``, rows per sequence in the pass.
        cache: the cache the pass runs against (for its shape and device).
    """
    batch = len(lengths)
    write_slots = torch.tensor([list(range(n, n + num_rows)) for n in lengths])
    gpu = use_gpu_kernel(cache)
    if gpu or use_kernel(cache):
        width = len(ancestors[0][0])
        # On a GPU the table's width is rounded up to a power of two (the kernel rounds its
        # reads up to one anyway), so passes of one row count share a CUDA graph.
        extra = [-1] * ((1 << (width - 1).bit_length()) - width if gpu else 0)
        pad_row = [-1] * (width + len(extra))
        table = [
            [[a + length if a >= 0 else -1 for a in row] + extra for row in anc] + [pad_row] * (num_rows - len(anc))
            for length, anc in zip(lengths, ancestors)
        ]
        # the CPU kernel reads int64 on the host, the GPU kernel int32 on the cache's device
        kind, dev = (torch.int32, cache.keys.device) if gpu else (torch.int64, None)
        kernel = KernelInputs(*(torch.tensor(v, dtype=kind, device=dev)
                                for v in (lengths, table, [len(a) for a in ancestors])))
        return TreeLayout(write_slots=write_slots, kernel=kernel,
                          write_rows=cache.write_rows(write_slots) if gpu else None)
    n = min(num_rows, round_up(max(len(a) for a in ancestors), ROW_ALIGN))
    far_ends = torch.zeros(batch, n, dtype=torch.long)
    tail_slots = torch.zeros(batch, n, TAIL, dtype=torch.long)
    tail_valid = torch.zeros(batch, n, TAIL, dtype=torch.bool)
    tail_positions = torch.zeros(batch, n, TAIL, dtype=torch.long)
    row_positions = torch.zeros(batch, n, dtype=torch.long)
    for b, (length, anc) in enumerate(zip(lengths, ancestors)):
        # Rows past the tree are padding: they repeat the root, attend like it, and are ignored.
        table = torch.tensor(anc + [anc[0]] * (n - len(anc)), dtype=torch.long)[:n]
        depths = (table >= 0).sum(dim=1) - 1
        far_ends[b] = far_end(length + depths)
        tail_slots[b], tail_valid[b], tail_positions[b] = _tail_slots(length, depths, table.clamp(min=0))
        row_positions[b] = length + depths
    far_len = max(FAR_ALIGN, int(far_ends.max()))
    neg = float("-inf")
    far_bias = torch.zeros(batch, n, far_len).masked_fill_(torch.arange(far_len) >= far_ends[..., None], neg)
    tail_bias = torch.zeros(batch, n, TAIL).masked_fill_(~tail_valid, neg)
    kv_heads, capacity = cache.values.shape[2], cache.capacity
    # Flat row of (b, h, slot) in a [B * Hkv * S, D] view: (b * Hkv + h) * S + slot.
    base = (torch.arange(batch)[:, None] * kv_heads + torch.arange(kv_heads)) * capacity  # [B, Hkv]
    tail_index = base[:, :, None] + tail_slots.view(batch, 1, n * TAIL)
    device = cache.keys.device
    return TreeLayout(
        write_slots=write_slots,  # (stays on the host: writes read each sequence's first slot)
        rows=n,
        far_len=far_len,
        far_bias=far_bias[:, None, None].to(device),
        tail_index=tail_index.reshape(-1).to(device),
        tail_bias=tail_bias[:, None, :, None].to(device),
        row_positions=row_positions.to(device),
        tail_positions=tail_positions.to(device),
    )


def _soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)`` in place (Gemma 2's attention-logit soft cap), or as is."""
    return scores.div_(cap).tanh_().mul_(cap) if cap else scores


def _window_bias(key_positions: torch.Tensor, row_positions: torch.Tensor, window: int) -> torch.Tensor:
    """0 where a key at ``key_positions`` lies in the window ``(row - window, row]`` of the
    row at ``row_positions`` (broadcast together), else -inf."""
    outside = key_positions <= row_positions - window
    return torch.zeros(outside.shape, device=outside.device).masked_fill_(outside, float("-inf"))


def tree_attention(
    query: torch.Tensor, cache: KVCache, layer: int, layout: TreeLayout, scaling: float,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Attention of tree rows against the cache (the rows' own K/V already written).

    Args:
        query: ``[B, H, T, D]`` after rotary embedding.
        window: sliding window of the layer: a row at position ``p`` sees the keys at
            positions ``p - window + 1 .. p`` only (``None``: all keys).
        softcap: attention-logit soft cap, ``cap * tanh(score / cap)`` (``None``: none).
    Returns:
        ``[B, T, H, D]``, float32 from the PyTorch path and the GPU kernel, the cache dtype
        from the CPU kernel; rows past the tree are zero.
    """
    if layout.kernel is not None:
        k = layout.kernel
        keys, values = cache.layer(layer)
        if not cache.tiled_keys:  # the GPU kernel's layout (the CPU kernel's keys are in tiles)
            from sot.kernels.triton_attention import tree_attention as gpu_tree_attention

            return gpu_tree_attention(query, keys, values, k.lengths, k.ancestors, k.rows, scaling, window or 0,
                                      softcap or 0.0)
        # (a float32 query stays float32 over a smaller cache: the kernel widens what it reads)
        q = query if query.dtype == torch.float32 else query.to(keys.dtype)
        return cpu_kernels().tree_attention_exact(q, keys, values, k.lengths, k.ancestors, k.rows, scaling,
                                                  window or 0, softcap or 0.0)
    batch, heads, rows, dim = query.shape
    n = layout.rows
    keys, values = cache.layer(layer)  # [B, Hkv, S, D]
    kv_heads = keys.shape[1]
    if cache.tiled_keys:
        raise RuntimeError("the PyTorch attention path needs a cache without tiled keys")
    group = heads // kv_heads
    q = query[:, :, :n].float().view(batch, kv_heads, group, n, dim)

    # Far part: one matmul per (sequence, KV head) over the same slots in every pass.
    far_k = keys[:, :, : layout.far_len].float()
    far_v = values[:, :, : layout.far_len].float()
    far_scores = torch.matmul(q.reshape(batch, kv_heads, group * n, dim), far_k.transpose(-1, -2))
    far_bias, tail_bias = layout.far_bias, layout.tail_bias
    if window:
        if window not in layout.window_biases:
            rows_at = layout.row_positions  # [B, n]
            slots = torch.arange(layout.far_len, device=rows_at.device)
            layout.window_biases[window] = (
                far_bias + _window_bias(slots, rows_at[..., None], window)[:, None, None],
                tail_bias + _window_bias(layout.tail_positions, rows_at[..., None], window)[:, None, :, None],
            )
        far_bias, tail_bias = layout.window_biases[window]
    far_scores = _soft_cap(far_scores.view(batch, kv_heads, group, n, -1).mul_(scaling), softcap).add_(far_bias)
    far_max = far_scores.amax(dim=-1, keepdim=True).clamp_(min=-1e30)  # empty far part: weights 0
    far_weights = far_scores.sub_(far_max).exp_()
    far_sum = far_weights.sum(dim=-1, keepdim=True)
    far_out = torch.matmul(far_weights.view(batch, kv_heads, group * n, -1), far_v)
    # -> [B, Hkv, n, g, *] to line up with the tail.
    far_out = far_out.view(batch, kv_heads, group, n, dim).transpose(2, 3)
    far_max, far_sum = far_max.transpose(2, 3), far_sum.transpose(2, 3)

    # Tail: per row, its own keys in position order; one fixed-shape matmul per row.
    tail_k = keys.reshape(-1, dim).index_select(0, layout.tail_index).view(batch, kv_heads, n, TAIL, dim).float()
    tail_v = values.reshape(-1, dim).index_select(0, layout.tail_index).view(batch, kv_heads, n, TAIL, dim).float()
    q_rows = q.transpose(2, 3)  # [B, Hkv, n, g, D]
    tail_scores = _soft_cap(torch.matmul(q_rows, tail_k.transpose(-1, -2)).mul_(scaling), softcap).add_(tail_bias)
    tail_max = tail_scores.amax(dim=-1, keepdim=True)
    tail_weights = tail_scores.sub_(tail_max).exp_()
    tail_sum = tail_weights.sum(dim=-1, keepdim=True)
    tail_out = torch.matmul(tail_weights, tail_v)  # [B, Hkv, n, g, D]

    top = torch.maximum(far_max, tail_max)
    far_scale = torch.exp(far_max - top)
    tail_scale = torch.exp(tail_max - top)
    out = (far_out * far_scale + tail_out * tail_scale) / (far_sum * far_scale + tail_sum * tail_scale)
    # [B, Hkv, n, g, D] -> [B, n, Hkv * g, D]; head h = kv_head * g + j as in repeat_kv.
    out = out.permute(0, 2, 1, 3, 4).reshape(batch, n, heads, dim)
    if n < rows:
        out = torch.cat([out, out.new_zeros(batch, rows - n, heads, dim)], dim=1)
    return out
