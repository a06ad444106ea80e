"""Row-stable matrix products: a row's result never depends on the other rows of the call.

BLAS kernels choose their blocking by matrix shape, so the same row can round differently in
a 1-row and a 16-row product. Multiplying in fixed blocks of ``ROW_UNIT`` rows removes that.
"""
from __future__ import annotations

import torch

ROW_UNIT = 16


def stable_matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight_t + bias`` computed in blocks of ``ROW_UNIT`` rows.

    Args:
        x: ``[..., K]``; the leading dims are flattened to ``M`` rows, padded to a multiple
            of ``ROW_UNIT``.
        weight_t: ``[K, N]``.
    Returns:
        ``[..., N]``.
    """
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    pad = -rows % ROW_UNIT
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    blocks = [flat[i : i + ROW_UNIT] @ weight_t for i in range(0, flat.shape[0], ROW_UNIT)]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    if bias is not None:
        out = out + bias
    return out[:rows].reshape(*lead, -1)
