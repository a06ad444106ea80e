"""Row-stable matrix products: a row's result never depends on the other rows of the call.

BLAS kernels choose their blocking by matrix shape, so the same row can round differently in
a 1-row and a 16-row product. Multiplying in fixed blocks of ``ROW_UNIT`` rows removes that
(see :class:`sot.models.fast_llama.PackedLinear`, which both model paths use).
"""
from __future__ import annotations

ROW_UNIT = 16
