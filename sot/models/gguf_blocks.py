"""Exact blocks of a GGUF file's K-quant and IQ4 weights, read from the file itself.

A float32 weight dequantized from Q4_1, Q8_0, Q5_0 or Q4_0 blocks is found to be a grid of
blocks by searching its values (:func:`sot.kernels.linear.block_grid`): their scales are
float16 values. The K-quants' are not. A Q4_K block of 32 weights is ``w = d * q + m`` too
(``q`` in 0..15), but its ``d`` and ``m`` are products of a float16 super-block scale and a
6-bit integer: exact in float32, not float16 values, and a block whose smallest ``q`` is not 0
does not show its ``m``. A Q5_K block is the same with 5-bit codes (0..31), held in 8 bits. A
Q6_K block of 32 is two halves of 16, each with its own 8-bit scale under one float16
super-block scale ``d``: ``w = (d * scale) * q``, ``q`` in -32..31, so it is an 8-bit block of
16 whose scale ``d * scale`` is exact in float32; Q3_K's blocks of 16 are the same with 3-bit
codes, Q2_K's with 2-bit codes and minimums. IQ4_NL and IQ4_XS pick each weight from a table
of 16 int8 values, under a float16 scale per 32 (IQ4_NL) or a float16 one times a 6-bit one.
So they are read from the file: each tensor's blocks are decoded into ``(q, d, m)`` (``m``
``None`` without minimums), and the model weight that equals ``d * q + m`` value for value (as
transformers dequantized it) gets them (:func:`sot.kernels.linear.register_blocks`); its
products then read 4-bit blocks of 32 (Q4_K), or 8-bit blocks of 32 or 16 (the others), with
float32 scales (``linear_blocks_f32``): a fifth to about a third of the float32 bytes.
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


#: bytes of one Q5_K super-block of 256 weights: Q4_K's scales, then 32 bytes of fifth bits
#: and 128 bytes of low 4 bits
Q5_K_BYTES = 176


def q5_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q5_K tensor's bytes as blocks of 32, Q4_K's form with 5-bit codes: ``(q [rows,
    cols/32, 32] uint8 (0..31), d, m [rows, cols/32] float32)``, ``w = d * q + m`` the weights
    gguf-py's dequantization gives (``d * q`` exact: 11 + 6 + 5 bits)."""
    from gguf.quants import Q4_K

    blocks = np.ascontiguousarray(raw).reshape(-1, Q5_K_BYTES)
    n = blocks.shape[0]
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = d * sc.astype(np.float32)  # [n, 8]
    low = -(dmin * mn.astype(np.float32))
    codes = (blocks[:, 48:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    fifth = (blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = (codes.reshape(n, 8, 32) | (fifth << np.uint8(4))).reshape(rows, cols // 32, 32)
    return (torch.from_numpy(q), torch.from_numpy(scale.reshape(rows, cols // 32)),
            torch.from_numpy(low.reshape(rows, cols // 32)))


#: GGUF metadata value types: the byte size of each fixed-size one (8: string, 9: array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: ggml's type numbers of the formats read here, and their (weights, bytes) per block
K_QUANTS = {"Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, Q4_K_BYTES),
            "Q5_K": (13, 256, Q5_K_BYTES), "Q6_K": (14, 256, 210), "IQ4_NL": (20, 32, 18),
            "IQ4_XS": (23, 256, 136)}


def k_quant_tensors(path: Path) -> Iterator[tuple[str, str, int, int, np.ndarray]]:
    """The tensors of a GGUF file in the formats read here (:data:`K_QUANTS`), as ``(format,
    name, rows, cols, bytes)`` (the bytes memory-mapped).

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
    formats = {number: (name, weights, size) for name, (number, weights, size) in K_QUANTS.items()}
    for name, shape, kind, offset in infos:
        if kind in formats and len(shape) == 2:
            cols, rows = shape
            label, weights, size = formats[kind]
            if cols % weights == 0:
                end = start + offset + rows * cols // weights * size
                yield label, name, rows, cols, data[start + offset:end]


def q6_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, None]:
    """A Q6_K tensor's bytes as 8-bit blocks of 16: ``(q [rows, cols/32, 32] int8, d [rows,
    cols/16] float32, None)``, ``q`` the 6-bit codes (-32..31) and ``d`` each half-block's
    8-bit scale times the super-block's float16 scale, so that ``d * q`` is gguf-py's
    dequantization (``(d * scale) * q``: both products exact in float32, 11 + 7 + 5 bits at most)."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 210)  # (128 bytes of low 4 bits, 64 of high 2 bits,
    # 16 8-bit scales, d float16)
    n = blocks.shape[0]
    low = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = ((low & np.uint8(15)).reshape(n, 8, 32) | ((high & np.uint8(3)).reshape(n, 8, 32) << np.uint8(4)))
    q = (codes.astype(np.int16) - 32).astype(np.int8).reshape(rows, cols // 32, 32)
    scale = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]: one per half-block
    d = blocks[:, 208:210].view(np.float16).astype(np.float32) * scale
    return torch.from_numpy(q), torch.from_numpy(d.reshape(rows, cols // 16)), None


def q3_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, None]:
    """A Q3_K tensor's bytes as 8-bit blocks of 16 (Q6_K's form): ``(q [rows, cols/32, 32] int8
    (-4..3), d [rows, cols/16] float32, None)``, ``d`` the super-block's float16 scale times the
    block's 6-bit scale less 32 (exact)."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 110)  # (32 bytes of third bits, 64 of low 2 bits,
    # 12 of 6-bit scales, d float16)
    n = blocks.shape[0]
    low = (blocks[:, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    third = (blocks[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = low.reshape(n, 8, 32).astype(np.int8) - ((third ^ 1) << 2).astype(np.int8)  # (a clear bit: minus 4)
    packed = blocks[:, 96:108]
    lows = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)) & 15
    highs = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 3
    scale = (lows.reshape(n, 16) | (highs.reshape(n, 16) << 4)).astype(np.float32) - 32
    d = blocks[:, 108:110].view(np.float16).astype(np.float32) * scale
    return torch.from_numpy(q.reshape(rows, cols // 32, 32)), torch.from_numpy(d.reshape(rows, cols // 16)), None


def q2_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q2_K tensor's bytes as 8-bit blocks of 16 with minimums: ``(q [rows, cols/32, 32] uint8
    (0..3), d, m [rows, cols/16] float32)``, ``d`` and ``-m`` float16 super-block scales times
    4-bit ones (exact), ``w = d * q + m`` gguf-py's dequantization."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 84)  # (16 bytes of 4-bit scale and minimum pairs,
    # 64 of 2-bit codes, d, dmin float16)
    n = blocks.shape[0]
    q = (blocks[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    d = blocks[:, 80:82].view(np.float16).astype(np.float32) * (blocks[:, :16] & 15).astype(np.float32)
    low = -(blocks[:, 82:84].view(np.float16).astype(np.float32) * (blocks[:, :16] >> 4).astype(np.float32))
    return (torch.from_numpy(q.reshape(rows, cols // 32, 32)), torch.from_numpy(d.reshape(rows, cols // 16)),
            torch.from_numpy(low.reshape(rows, cols // 16)))


def _iq4_codes(nibbles: np.ndarray) -> np.ndarray:
    """IQ4's 4-bit indices (``[..., 16]`` bytes, low nibbles then high ones: 32 weights) as the
    int8 values of its non-linear table."""
    from gguf.quants import IQ4_NL

    table = np.array(IQ4_NL.kvalues, dtype=np.int8)
    idx = nibbles[..., None, :] >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return table[(idx & 15).reshape(*nibbles.shape[:-1], 32)]


def iq4_nl_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, None]:
    """An IQ4_NL tensor's bytes as 8-bit blocks of 32: ``(q [rows, cols/32, 32] int8, d [rows,
    cols/32] float32 (float16 values), None)``, ``q`` the table values the 4-bit indices pick."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 18)  # (d float16, 16 bytes of indices)
    q = _iq4_codes(blocks[:, 2:]).reshape(rows, cols // 32, 32)
    d = blocks[:, :2].view(np.float16).astype(np.float32).reshape(rows, cols // 32)
    return torch.from_numpy(q), torch.from_numpy(d), None


def iq4_xs_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, None]:
    """An IQ4_XS tensor's bytes as 8-bit blocks of 32: IQ4_NL's table values, each block's scale
    the super-block's float16 one times a 6-bit scale less 32 (exact in float32)."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 136)  # (d float16, 2 bytes of high scale bits, 4 of
    # low ones, 128 of indices)
    n = blocks.shape[0]
    high = (blocks[:, 2:4].view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, 8]
    low = ((blocks[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8)) & 15).reshape(n, 8)
    scale = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
    d = blocks[:, :2].view(np.float16).astype(np.float32) * scale
    q = _iq4_codes(blocks[:, 8:].reshape(n, 8, 16))
    return torch.from_numpy(q.reshape(rows, cols // 32, 32)), torch.from_numpy(d.reshape(rows, cols // 32)), None


#: each format's decoder: ``(bytes, rows, cols) -> (q, d, m)``
DECODERS = {"Q2_K": q2_k_blocks, "Q3_K": q3_k_blocks, "Q4_K": q4_k_blocks, "Q5_K": q5_k_blocks,
            "Q6_K": q6_k_blocks, "IQ4_NL": iq4_nl_blocks, "IQ4_XS": iq4_xs_blocks}


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
    """Give each float32 weight of ``model`` that a tensor of ``gguf_path`` in a format read here
    (:data:`K_QUANTS`) dequantizes to, value for value, that tensor's blocks
    (:func:`sot.kernels.linear.register_blocks`).
    Returns how many weights got them; a tensor that matches no weight (another layout, or
    weights changed since) is left out, and those weights keep their float32 products."""
    tensors = list(k_quant_tensors(gguf_path))
    if not tensors:
        return 0
    weights: dict[tuple[int, int], list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.dim() == 2 and p.dtype == torch.float32 and p.device.type == "cpu":
            weights.setdefault(tuple(p.shape), []).append(p)
    config = getattr(model, "config", None)
    heads = {".attn_q.": getattr(config, "num_attention_heads", None),
             ".attn_k.": getattr(config, "num_key_value_heads", None)}
    found = 0
    for kind, name, rows, cols, raw in tensors:
        candidates = weights.get((rows, cols), [])
        if not candidates:
            continue
        grid = DECODERS[kind](raw, rows, cols)
        grids = [grid]
        for key, count in heads.items():  # (a Llama file's query and key rows, in the converter's order)
            if key in name and count and rows % (2 * count) == 0:
                grids.append(tuple(t if t is None else llama_rows(t, count) for t in grid))
        for q, d, m in grids:
            length = cols // d.shape[1]  # inputs a scale covers: 32, or 16 (Q6_K, Q3_K, Q2_K)
            decoded = d[..., None] * q.reshape(rows, -1, length).float()
            decoded = (decoded if m is None else decoded + m[..., None]).reshape(rows, cols)
            # (equal values: Q6_K's zeros may carry the other sign, which no product over them shows;
            # a first row that differs rules a weight out without reading the rest)
            matched = [p for p in candidates
                       if torch.equal(decoded[0], p.detach()[0]) and torch.equal(decoded, p.detach())]
            for p in matched:
                register_blocks(p, q, d, m)
            found += len(matched)
            if matched:
                break
    return found


def llama_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a Llama GGUF file's query or key tensor ``t [heads * head_dim, ...]`` in the
    model's order: llama.cpp's converter interleaves each head's two rotary halves, and
    transformers puts them back when it loads the file; a row's blocks move with it."""
    half = t.shape[0] // heads // 2
    return t.reshape(heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
