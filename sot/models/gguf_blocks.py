"""Exact 4-bit blocks of a GGUF file's Q4_K weights, read from the file itself.

A float32 weight dequantized from Q4_1, Q8_0, Q5_0 or Q4_0 blocks is found to be a grid of
blocks by searching its values (:func:`sot.kernels.linear.block_grid`): their scales are
float16 values. A Q4_K block of 32 weights is ``w = d * q + m`` too (``q`` in 0..15), but its
``d`` and ``m`` are products of a float16 super-block scale and a 6-bit integer: exact in
float32, not float16 values, and a block whose smallest ``q`` is not 0 does not show its ``m``.
So they are read from the file: each Q4_K tensor's blocks are decoded into ``(q, d, m)``, and
the model weight that equals ``d * q + m`` bit for bit (as transformers dequantized it) gets
them (:func:`sot.kernels.linear.register_blocks`); its products then read 4-bit blocks with
float32 scales (``linear_blocks_f32``), about a fifth of the float32 bytes.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from sot.kernels.linear import register_blocks

#: bytes of one Q4_K super-block of 256 weights: d, dmin (float16), 12 bytes of 6-bit scales
#: and minimums, 128 bytes of 4-bit codes
Q4_K_BYTES = 144


def q4_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K tensor's bytes (``rows`` rows of ``cols`` weights) as blocks of 32:
    ``(q [rows, cols/32, 32] uint8, d [rows, cols/32], m [rows, cols/32])`` float32, with
    ``w = d * q + m`` the weights gguf-py's dequantization gives (``d * q - dmin * m'``, in
    float32: ``d * q`` is exact)."""
    from gguf.quants import Q4_K

    blocks = np.ascontiguousarray(raw).reshape(-1, Q4_K_BYTES)
    n = blocks.shape[0]
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = d * sc.astype(np.float32)  # [n, 8]: exact (11 bits times 6)
    low = -(dmin * mn.astype(np.float32))
    codes = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (codes & np.uint8(15)).reshape(rows, cols // 32, 32)
    return (torch.from_numpy(q), torch.from_numpy(scale.reshape(rows, cols // 32)),
            torch.from_numpy(low.reshape(rows, cols // 32)))


#: GGUF metadata value types: the byte size of each fixed-size one (8: string, 9: array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: ggml's type number of Q4_K
Q4_K_TYPE = 12


def q4_k_tensors(path: Path) -> Iterator[tuple[str, int, int, np.ndarray]]:
    """The Q4_K tensors of a GGUF file, as ``(name, rows, cols, bytes)`` (the bytes memory-mapped).

    Reads the header and skips the metadata without decoding it: gguf-py's reader builds every
    field, the vocabulary's strings included, which takes most of a minute for a 262k-token
    vocabulary; this takes a fraction of a second."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos, alignment = 24, 32

    def string() -> str:
        nonlocal pos
        (size,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + size
        return bytes(buf[pos - size:pos]).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            (size,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + size
        elif kind == 9:
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item in _SIZES:
                pos += count * _SIZES[item]
            else:
                for _ in range(count):
                    skip(item)
        else:
            pos += _SIZES[kind]

    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", buf, pos)
        skip(kind)
    infos = []
    for _ in range(n_tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        infos.append((name, shape, kind, offset))
    start = -(-pos // alignment) * alignment
    for name, shape, kind, offset in infos:
        if kind == Q4_K_TYPE and len(shape) == 2:
            cols, rows = shape
            size = rows * cols // 256 * Q4_K_BYTES
            yield name, rows, cols, data[start + offset:start + offset + size]


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a cached conversion was made from (``None``: none, or it is gone)."""
    source = folder / "sot_source.json"
    if not source.is_file():
        return None
    try:
        path = Path(json.loads(source.read_text())["gguf"])
    except (ValueError, KeyError, TypeError):
        return None
    return path if path.is_file() else None


def attach_q4_k_blocks(model: torch.nn.Module, gguf_path: Path) -> int:
    """Give each float32 weight of ``model`` that a Q4_K tensor of ``gguf_path`` dequantizes
    to, bit for bit, that tensor's blocks (:func:`sot.kernels.linear.register_blocks`).
    Returns how many weights got them; a tensor that matches no weight (another layout, or
    weights changed since) is left out, and those weights keep their float32 products."""
    tensors = list(q4_k_tensors(gguf_path))
    if not tensors:
        return 0
    weights: dict[tuple[int, int], list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.dim() == 2 and p.dtype == torch.float32 and p.device.type == "cpu":
            weights.setdefault(tuple(p.shape), []).append(p)
    found = 0
    for _, rows, cols, raw in tensors:
        candidates = weights.get((rows, cols), [])
        if not candidates or cols % 256:
            continue
        q, d, m = q4_k_blocks(raw, rows, cols)
        decoded = (d[..., None] * q.float() + m[..., None]).reshape(rows, cols)
        for p in candidates:
            if torch.equal(decoded.view(torch.int32), p.detach().view(torch.int32)):  # (bits, signed zeros too)
                register_blocks(p, q, d, m)
                found += 1
    return found
