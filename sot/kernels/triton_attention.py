"""Row-invariant tree attention on a GPU, in Triton.

GPU libraries choose their reduction trees by shape: a softmax over 96 keys groups its terms
differently from one over 64, and a matrix product picks its kernel by row count. The PyTorch
attention path (:func:`sot.attention.tree_attention`) sizes its reductions by the whole pass
(the batch's longest far part, the tree's row count), so on a GPU a row's result can depend on
what shares the pass (measured on an H200 in float32: tokens equal, logits rows not).

This kernel computes each (row, KV head) in one program that walks the row's own keys in
position order, in chunks of ``BLOCK`` absolute positions (chunk ``c`` covers positions
``[c * BLOCK, (c + 1) * BLOCK)``), with an online softmax in float32. Every reduction has a
fixed shape, and what a program reads depends only on its row: its position, its ancestors
and the cache. So a row computes the same bits in any pass, as the compiled CPU kernel does.

Imported only where a CUDA GPU and Triton are present (:func:`sot.attention.use_gpu_kernel`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: keys per chunk of the walk (a compile-time constant: never chosen per call)
BLOCK = 32
NUM_WARPS = 4


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, len_ptr, anc_ptr, rows_ptr,
    T, W,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sv_b, sv_h, sv_s, sv_d,
    so_b, so_t, so_h, so_d,
    sa_b, sa_t,
    scale, window, softcap,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, WP: tl.constexpr,
):
    row = tl.program_id(0)  # b * T + t
    kvh = tl.program_id(1)
    b = row // T
    t = row % T
    n_rows = tl.load(rows_ptr + b)
    length = tl.load(len_ptr + b)
    widx = tl.arange(0, WP)
    anc_row = tl.load(anc_ptr + b * sa_b + t * sa_t + widx, mask=widx < W, other=-1)
    depth = tl.sum((anc_row >= 0).to(tl.int32), axis=0) - 1
    p = length + depth  # the row's position (a padding row, depth -1, walks the committed keys; never stored)
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    start = (lo // BLOCK) * BLOCK
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    heads = kvh * G + g
    qmask = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + t * sq_t + d[None, :] * sq_d, mask=qmask, other=0.0)
    q = q.to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    kb = tl.arange(0, BLOCK)
    for c in range(start, p + 1, BLOCK):
        pos = c + kb
        valid = (pos >= lo) & (pos <= p)
        from_tree = pos >= length
        tree_slot = tl.load(anc_ptr + b * sa_b + t * sa_t + (pos - length), mask=valid & from_tree, other=0)
        slot = tl.where(valid, tl.where(from_tree, tree_slot, pos), 0)
        kmask = valid[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + b * sk_b + kvh * sk_h + slot[:, None] * sk_s + d[None, :] * sk_d, mask=kmask, other=0.0)
        v = tl.load(v_ptr + b * sv_b + kvh * sv_h + slot[:, None] * sv_s + d[None, :] * sv_d, mask=kmask, other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # [GP, BLOCK]
        if softcap > 0.0:
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * (s / softcap))) - 1.0)  # cap * tanh(s / cap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # every chunk holds a valid key: finite
        alpha = tl.exp(m - m_new)
        e = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(e, axis=1)
        acc = acc * alpha[:, None] + tl.sum(e[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # (padding rows walk nothing)
    tl.store(out_ptr + b * so_b + t * so_t + heads[:, None] * so_h + d[None, :] * so_d, out,
             mask=qmask & (t < n_rows))


def tree_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                   ancestors: torch.Tensor, rows: torch.Tensor, scaling: float, window: int = 0,
                   softcap: float = 0.0) -> torch.Tensor:
    """Attention of tree rows against one layer's cache.

    Args:
        query: ``[B, H, T, D]`` after rotary embedding.
        keys, values: ``[B, Hkv, S, D]`` the layer's cache (the rows' own K/V written).
        lengths: ``[B]`` committed length of each sequence (int32, on the device).
        ancestors: ``[B, T, W]`` cache slots of each row's ancestors, root first, itself
            last, -1 after (int32).
        rows: ``[B]`` real rows per sequence (int32).
        window: a row at position ``p`` sees positions ``p - window + 1 .. p`` (0: all).
        softcap: attention-logit soft cap (0: none).
    Returns:
        ``[B, T, H, D]`` float32; rows past a sequence's real rows are zero.
    """
    batch, heads, num_rows, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    width = ancestors.shape[2]
    out = torch.zeros(batch, num_rows, heads, dim, device=query.device, dtype=torch.float32)
    _tree_attention_kernel[(batch * num_rows, kv_heads)](
        query, keys, values, out, lengths, ancestors, rows,
        num_rows, width,
        *query.stride(), *keys.stride(), *values.stride(), *out.stride(),
        ancestors.stride(0), ancestors.stride(1),
        float(scaling), int(window), float(softcap),
        G=group, GP=triton.next_power_of_2(group), D=dim, DP=triton.next_power_of_2(dim), BLOCK=BLOCK,
        WP=triton.next_power_of_2(width), num_warps=NUM_WARPS,
    )
    return out
