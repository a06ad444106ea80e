"""Exact blocks of a GGUF file's Q4_K and Q6_K weights, read from the file itself.

A float32 weight dequantized from Q4_1, Q8_0, Q5_0 or Q4_0 blocks is found to be a grid of
blocks by searching its values (:func:`sot.kernels.linear.block_grid`): their scales are
float16 values. A Q4_K block of 32 weights is ``w = d * q + m`` too (``q`` in 0..15), but its
``d`` and ``m`` are products of a float16 super-block scale and a 6-bit integer: exact in
float32, not float16 values, and a block whose smallest ``q`` is not 0 does not show its ``m``.
A Q6_K block of 32 is two halves of 16, each with its own 8-bit scale under one float16
super-block scale ``d``: ``w = d * (scale * q)``, ``q`` in -32..31, so with the product of the
two integers (at most 4,096 in magnitude) it is ``d * Q`` with ``Q`` in 16 bits.
So they are read from the file: each tensor's blocks are decoded into ``(q, d, m)`` (``m``
``None`` for Q6_K), and the model weight that equals ``d * q + m`` value for value (as
transformers dequantized it) gets them (:func:`sot.kernels.linear.register_blocks`); its
products then read 4-bit blocks with float32 scales, or 16-bit blocks (``linear_blocks_f32``):
about a fifth, or a half, of the float32 bytes.
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


#: bytes of one Q6_K super-block of 256 weights: 128 bytes of low 4 bits, 64 of high 2 bits,
#: 16 8-bit scales, d (float16)
Q6_K_BYTES = 210
#: GGUF metadata value types: the byte size of each fixed-size one (8: string, 9: array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: ggml's type numbers of the formats read here, and their bytes per 256 weights
K_QUANTS = {"Q4_K": (12, Q4_K_BYTES), "Q6_K": (14, Q6_K_BYTES)}


def k_quant_tensors(path: Path) -> Iterator[tuple[str, str, int, int, np.ndarray]]:
    """The Q4_K and Q6_K tensors of a GGUF file, as ``(format, name, rows, cols, bytes)`` (the
    bytes memory-mapped).

    Reads the header and skips the metadata without decoding it: gguf-py's reader builds every
    field, the vocabulary's strings included (17-25 s for a 262k-token vocabulary on two cores
    here; this takes 0.05 s). Raises ``ValueError`` on what is not a GGUF file, ``struct.error``
    on a truncated one."""
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
    formats = {number: (name, size) for name, (number, size) in K_QUANTS.items()}
    for name, shape, kind, offset in infos:
        if kind in formats and len(shape) == 2:
            cols, rows = shape
            size = rows * cols // 256 * formats[kind][1]
            yield formats[kind][0], name, rows, cols, data[start + offset:start + offset + size]


def q6_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, None]:
    """A Q6_K tensor's bytes as blocks of 32: ``(Q [rows, cols/32, 32] int16, d [rows, cols/32]
    float32, None)``, ``Q`` each half-block's 8-bit scale times its 6-bit codes (-32..31) and
    ``d`` the super-block's float16 scale, so that ``d * Q`` is gguf-py's dequantization
    (``(d * scale) * q``; both products exact in float32: 11 + 7 + 5 bits at most)."""
    blocks = np.ascontiguousarray(raw).reshape(-1, Q6_K_BYTES)
    n = blocks.shape[0]
    low = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = ((low & np.uint8(15)).reshape(n, 8, 32) | ((high & np.uint8(3)).reshape(n, 8, 32) << np.uint8(4)))
    q = codes.astype(np.int16) - 32  # [n, 8 blocks of 32]
    scale = blocks[:, 192:208].view(np.int8).astype(np.int16).reshape(n, 8, 2, 1)  # one per half-block
    big = (q.reshape(n, 8, 2, 16) * scale).reshape(rows, cols // 32, 32)
    d = np.repeat(blocks[:, 208:210].view(np.float16).astype(np.float32), 8, axis=1)  # [n, 8]
    return torch.from_numpy(big), torch.from_numpy(d.reshape(rows, cols // 32)), None


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


def attach_k_quant_blocks(model: torch.nn.Module, gguf_path: Path) -> int:
    """Give each float32 weight of ``model`` that a Q4_K or Q6_K tensor of ``gguf_path``
    dequantizes to, value for value, that tensor's blocks (:func:`sot.kernels.linear.register_blocks`).
    Returns how many weights got them; a tensor that matches no weight (another layout, or
    weights changed since) is left out, and those weights keep their float32 products."""
    tensors = list(k_quant_tensors(gguf_path))
    if not tensors:
        return 0
    weights: dict[tuple[int, int], list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.dim() == 2 and p.dtype == torch.float32 and p.device.type == "cpu":
            weights.setdefault(tuple(p.shape), []).append(p)
    found = 0
    for kind, _, rows, cols, raw in tensors:
        candidates = weights.get((rows, cols), [])
        if not candidates or cols % 256:
            continue
        q, d, m = (q4_k_blocks if kind == "Q4_K" else q6_k_blocks)(raw, rows, cols)
        decoded = d[..., None] * q.float()
        decoded = (decoded if m is None else decoded + m[..., None]).reshape(rows, cols)
        for p in candidates:
            # (equal values: Q6_K's zeros may carry the other sign, which no product over them shows)
            if torch.equal(decoded, p.detach()):
                register_blocks(p, q, d, m)
                found += 1
    return found
