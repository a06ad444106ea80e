"""Row-invariant attention over the KV cache.

Bit-exact speculative decoding needs every row of a verify pass to compute exactly what plain
decoding computes for the same token, whatever else is in the pass. Two things break that in
ordinary attention: reductions whose grouping depends on where keys sit in memory (a tree
node's ancestors sit in scratch slots, not at their positions), and matmul kernels chosen by
shape. This module splits each query row's keys by the row's *position* ``p`` alone:

* the **far part**: keys at positions ``[0, far_end(p))``, all committed and stored at their
  own positions, reduced in float32 over the same slot layout in every pass;
* the **near part**: the remaining keys (recent committed tokens and the row's tree
  ancestors, at most ``NEAR_WINDOW`` keys), reduced in float64 so that the order of terms
  cannot change the float32 result in practice.

The two partial softmaxes are merged in float64. Plain decoding is a tree with one node, so it
runs through the same function and gets the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sot.cache import KVCache

# Rows of a tree may be up to MAX_TREE_DEPTH below the committed length.
MAX_TREE_DEPTH = 64
NEAR_ALIGN = 64


def far_end(position: int) -> int:
    """End of the far part for a query at ``position``: a multiple of ``NEAR_ALIGN`` at least
    ``MAX_TREE_DEPTH`` below it, so every far key is committed for any tree row."""
    return max(0, (position - MAX_TREE_DEPTH) // NEAR_ALIGN * NEAR_ALIGN)


@dataclass(frozen=True)
class TreeLayout:
    """Where the rows of one tree-verify forward live. ``B`` sequences by ``T`` rows.

    Attributes:
        write_slots: ``[B, T]`` cache slot each row's K/V is written to (scratch).
        far_len: width of the far part computed for the batch (max over rows, aligned).
        far_mask: ``[B, 1, 1, T, far_len]`` true where a slot belongs to the row's far part.
        near_slots: ``[B, W]`` cache slots of the near window (gathered per sequence).
        near_mask: ``[B, 1, 1, T, W]`` true where a window slot is a near key of the row.
    """

    write_slots: torch.Tensor
    far_len: int
    far_mask: torch.Tensor
    near_slots: torch.Tensor
    near_mask: torch.Tensor


@dataclass(frozen=True)
class PrefillLayout:
    """A prompt chunk of one sequence: rows at positions ``start .. start + T - 1``."""

    batch_index: int
    start: int


def build_tree_layout(
    lengths: list[int], ancestors: list[list[list[int]]], num_rows: int, device: torch.device | str = "cpu"
) -> TreeLayout:
    """Build the attention layout of one verify pass.

    Args:
        lengths: committed length of each sequence (its tree root sits at that position).
        ancestors: per sequence, per tree node, the tree index of its ancestor at each depth
            (``sot.tree.ancestor_table``); rows past a sequence's tree size are padding.
        num_rows: ``T``, rows per sequence in the pass (a multiple of the GEMM row unit).

    Worked example: length 130, a node at depth 2 sits at position 132; its far part is
    slots ``[0, 64)`` (``far_end(132) == 64``) and its near keys are slots ``[64, 130)`` plus
    its ancestors' scratch slots ``130 + ancestor`` for depths 0, 1 and itself.
    """
    batch = len(lengths)
    far_ends = [[far_end(length + len([a for a in row if a >= 0]) - 1) for row in anc] for length, anc in zip(lengths, ancestors)]
    far_len = max((max(f) for f in far_ends if f), default=0)
    far_len = -(-max(far_len, 1) // NEAR_ALIGN) * NEAR_ALIGN
    window_start = [far_end(length) for length in lengths]
    width = max(length - start for length, start in zip(lengths, window_start)) + num_rows
    far_mask = torch.zeros(batch, num_rows, far_len, dtype=torch.bool)
    near_mask = torch.zeros(batch, num_rows, width, dtype=torch.bool)
    near_slots = torch.zeros(batch, width, dtype=torch.long)
    write_slots = torch.zeros(batch, num_rows, dtype=torch.long)
    for b, (length, anc) in enumerate(zip(lengths, ancestors)):
        start = window_start[b]
        committed = length - start
        near_slots[b, : committed + num_rows] = torch.arange(start, length + num_rows)
        write_slots[b] = torch.arange(length, length + num_rows)
        for r, row in enumerate(anc):
            fe = far_ends[b][r]
            far_mask[b, r, :fe] = True
            near_mask[b, r, fe - start : committed] = True
            for a in row:
                if a >= 0:
                    near_mask[b, r, committed + a] = True
        # Padding rows attend to the root only, so their softmax is well defined.
        for r in range(len(anc), num_rows):
            near_mask[b, r, committed] = True
    return TreeLayout(
        write_slots=write_slots.to(device),
        far_len=far_len,
        far_mask=far_mask[:, None, None].to(device),
        near_slots=near_slots.to(device),
        near_mask=near_mask[:, None, None].to(device),
    )


def tree_attention(
    query: torch.Tensor, cache: KVCache, layer: int, layout: TreeLayout, scaling: float
) -> torch.Tensor:
    """Attention of tree rows against the cache (the rows' own K/V already written).

    Args:
        query: ``[B, H, T, D]`` after rotary embedding.
    Returns:
        ``[B, T, H, D]`` float32.
    """
    batch, heads, rows, dim = query.shape
    keys, values = cache.layer(layer)  # [B, Hkv, S, D]
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = query.float().reshape(batch, kv_heads, group * rows, dim)  # [B, Hkv, g*T, D]

    # Far part: float32 over slots [0, far_len), the same layout in every pass.
    far_k = keys[:, :, : layout.far_len]
    far_v = values[:, :, : layout.far_len]
    far_scores = torch.matmul(q, far_k.transpose(-1, -2)).mul_(scaling)
    far_scores = far_scores.view(batch, kv_heads, group, rows, -1).masked_fill(~layout.far_mask, float("-inf"))
    far_max = far_scores.amax(dim=-1, keepdim=True)
    far_max = torch.where(torch.isfinite(far_max), far_max, torch.zeros_like(far_max))
    far_weights = torch.exp(far_scores - far_max)  # masked -> exactly 0
    far_sum = far_weights.sum(dim=-1, keepdim=True)
    far_out = torch.matmul(far_weights.view(batch, kv_heads, group * rows, -1), far_v)
    far_out = far_out.view(batch, kv_heads, group, rows, dim)

    # Near part: float64 over the window gathered per sequence (order-insensitive sums).
    index = layout.near_slots[:, None, :, None].expand(-1, kv_heads, -1, dim)
    near_k = keys.gather(2, index).double()
    near_v = values.gather(2, index).double()
    near_scores = torch.matmul(q.double(), near_k.transpose(-1, -2)).mul_(scaling)
    near_scores = near_scores.view(batch, kv_heads, group, rows, -1).masked_fill(~layout.near_mask, float("-inf"))
    near_max = near_scores.amax(dim=-1, keepdim=True)
    near_weights = torch.exp(near_scores - near_max)
    near_sum = near_weights.sum(dim=-1, keepdim=True)
    near_out = torch.matmul(near_weights.view(batch, kv_heads, group * rows, -1), near_v)
    near_out = near_out.view(batch, kv_heads, group, rows, dim)

    # Merge the two partial softmaxes.
    far_sum = far_sum.double()
    far_max = torch.where(far_sum > 0, far_max.double(), torch.full_like(near_max, float("-inf")))
    top = torch.maximum(far_max, near_max)
    far_scale = torch.exp(far_max - top)  # 0 when the far part is empty
    near_scale = torch.exp(near_max - top)
    out = (far_out.double() * far_scale + near_out * near_scale) / (far_sum * far_scale + near_sum * near_scale)
    # [B, Hkv, g, T, D] -> [B, T, Hkv * g, D]; head h = kv_head * g + j as in repeat_kv.
    return out.float().permute(0, 3, 1, 2, 4).reshape(batch, rows, heads, dim)


def prefill_attention(
    query: torch.Tensor, cache: KVCache, layer: int, layout: PrefillLayout, scaling: float
) -> torch.Tensor:
    """Causal attention of one sequence's prompt chunk over its cache (chunk K/V written).

    Args:
        query: ``[1, H, T, D]``.
    Returns:
        ``[1, T, H, D]`` float32.
    """
    _, heads, rows, dim = query.shape
    keys, values = cache.layer(layer)
    end = layout.start + rows
    k = keys[layout.batch_index, :, :end]  # [Hkv, end, D]
    v = values[layout.batch_index, :, :end]
    group = heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)[None]
    v = v.repeat_interleave(group, dim=0)[None]
    positions = torch.arange(layout.start, end, device=query.device)
    mask = torch.arange(end, device=query.device)[None, :] <= positions[:, None]  # [T, end]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float(), k, v, attn_mask=mask, scale=scaling
    )
    return out.transpose(1, 2)
