"""Row-stable matrix products: a row's result never depends on the other rows of the call.

BLAS kernels choose their blocking by matrix shape, so the same row can round differently in
a 1-row and a 16-row product. Multiplying in fixed blocks of ``ROW_UNIT`` rows removes that
(see :class:`sot.kernels.linear.PackedLinear`, which both model paths use).
"""
from __future__ import annotations

ROW_UNIT = 16


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (``round_up(17, 16) == 32``)."""
    return -(-n // multiple) * multiple
