"""The Python side of SoT's row-stable products: weights packed once into 16-column panels
(or kept as exact GGUF 4/8-bit blocks) for the compiled ``linear_f32`` / ``linear_blocks_f32``,
with MKL or oneDNN packs as fallbacks, and the compiled RMSNorm. Used by the Llama fast
path, the generic adapter and the state predictor alike."""
from __future__ import annotations

import os
import weakref
from typing import Callable

import torch
import torch.nn.functional as F

from sot.kernels import cpu_kernels
from sot.models.rows import ROW_UNIT


def fused_rms_norm(dtype: torch.dtype, device: torch.device) -> Callable[..., list[torch.Tensor]] | None:
    """The compiled RMSNorm for bfloat16 or float32 rows on the CPU
    (``(x [..., D], weight [D], eps, residual [..., D] | None) -> [normed, x + residual]``),
    or ``None`` where it does not apply (other dtypes and devices, or no compiler)."""
    if dtype not in (torch.bfloat16, torch.float32) or device.type != "cpu":
        return None
    kernel = cpu_kernels()
    if kernel is None:
        return None
    return kernel.rms_norm_bf16 if dtype == torch.bfloat16 else kernel.rms_norm_f32


def pack_panels(weight: torch.Tensor, width: int = 16) -> torch.Tensor:
    """``weight [N, K] -> [ceil(N / width), K, width]``: panels of ``width`` output columns,
    each laid out k-major (the input of the compiled ``linear_f32``); the last panel is
    zero-padded."""
    n, k = weight.shape
    panels = -(-n // width)
    if panels * width != n:
        weight = torch.cat([weight, weight.new_zeros(panels * width - n, k)])
    return weight.reshape(panels, width, k).transpose(1, 2).contiguous()


def exact_16bit(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (float32) as bfloat16, or float16, where every value is one exactly (a
    checkpoint stored in 16 bits and loaded in float32); else ``weight`` itself. Panels of it
    give the float32 panels' products bit for bit (``linear_f32`` converts each weight exactly)
    from half the bytes."""
    for dtype in (torch.bfloat16, torch.float16):
        narrow = weight.to(dtype)
        if torch.equal(narrow.float(), weight):
            return narrow
    return weight


def _fp16_candidates(approx: torch.Tensor) -> list[torch.Tensor]:
    """float16 values at and next to ``approx`` (as float32), nearest first."""
    bits = approx.to(torch.float16).view(torch.int16)
    return [(bits + off).view(torch.float16).float() for off in (0, -1, 1, -2, 2)]


def _blocks_of(weight: torch.Tensor, width: int) -> torch.Tensor:
    """``weight [N, K]`` as ``[N', K/32, 32]`` blocks of 32 inputs, ``N`` zero-padded to ``N'``, a
    multiple of ``width`` (``K`` a multiple of 32)."""
    n, k = weight.shape
    padded = -(-n // width) * width
    w = weight.detach()
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    return w.reshape(padded, k // 32, 32)


#: weights whose loader gave them their blocks (:func:`register_blocks`), by storage and view
_REGISTERED: dict[tuple[int, tuple[int, ...], tuple[int, ...]], weakref.ref] = {}


def _view_key(weight: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return weight.data_ptr(), tuple(weight.shape), tuple(weight.stride())


def register_blocks(weight: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> None:
    """Give ``weight [N, K]`` float32, equal to ``d * q + m`` (or ``d * q``) block by block (in
    value: a zero's sign may differ), its blocks: ``q [N, K/32, 32]`` integers of up to 8 bits
    (0..31 with ``m``), ``d`` and ``m`` (or ``None``) ``[N, K/32]`` float32, or ``[N, K/16]``
    (one scale per 16 inputs): a GGUF file's K-quant or IQ4 blocks (:mod:`sot.models.gguf_blocks`).
    :func:`block_grid` returns them for the weight (and any tensor sharing its storage and
    shape) while it is unchanged; they live as long as the weight."""
    weight._sot_blocks = (weight._version, q, d, m)
    key = _view_key(weight)

    def forget(ref: weakref.ref) -> None:  # (the weight is gone: its entry goes too, unless replaced)
        if _REGISTERED.get(key) is ref:
            del _REGISTERED[key]

    _REGISTERED[key] = weakref.ref(weight, forget)


def _registered_grid(weight: torch.Tensor, width: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The blocks :func:`register_blocks` gave ``weight`` (rows zero-padded to a multiple of
    ``width``), or ``None``."""
    ref = _REGISTERED.get(_view_key(weight))
    owner = ref() if ref is not None else None
    if owner is None or _view_key(owner) != _view_key(weight):
        return None
    version, q, d, m = owner._sot_blocks
    if version != owner._version:  # (changed in place since)
        return None
    pad = -q.shape[0] % width
    if pad:
        q, d, m = (t if t is None else torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (q, d, m))
    return q.to(torch.int16), d, m


def _stacked_grid(weight: torch.Tensor, parts: list[torch.Tensor], width: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The blocks of ``weight = torch.cat(parts)`` from its parts' registered blocks, where every
    part has them, all of one kind (Q4_K query and key weights stacked with a Q6_K value weight
    are not one grid), and the stack holds the parts' values."""
    kinds = {_grid_kind(p) for p in parts}
    if len(kinds) != 1 or None in kinds:
        return None
    grids = [_registered_grid(p, 1) for p in parts]
    if sum(p.shape[0] for p in parts) != weight.shape[0] or not all(
            torch.equal(weight[at:at + p.shape[0]], p) for at, p in zip(
                [sum(q.shape[0] for q in parts[:i]) for i in range(len(parts))], parts)):
        return None
    q = torch.cat([g[0] for g in grids])
    d = torch.cat([g[1] for g in grids])
    m = None if grids[0][2] is None else torch.cat([g[2] for g in grids])
    pad = -q.shape[0] % width
    if pad:
        q, d, m = (t if t is None else torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (q, d, m))
    return q, d, m


def _grid_kind(part: torch.Tensor) -> tuple[bool, int, bool] | None:
    """The kind of blocks :func:`register_blocks` gave ``part``: ``(with minimums, scales a
    row, integers of more than 4 bits)``; ``None`` without them."""
    grid = _registered_grid(part, 1)
    return None if grid is None else (grid[2] is not None, grid[1].shape[1], bool(grid[0].max() > 15))


def _float16_values(t: torch.Tensor | None) -> bool:
    """Whether every value of ``t`` (float32) is a float16 value (``None``: yes)."""
    return t is None or bool((t.to(torch.float16).float() == t).all())


def block_grid(weight: torch.Tensor, width: int = 16, float32_kernel: bool = False,
               parts: list[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``weight [N, K]`` float32 as exact 4-bit (GGUF Q4_1: ``w = d * q + m``) or 8-bit (Q8_0, and
    Q5_0 and Q4_0 held in 8 bits: ``w = d * q``) blocks of 32 inputs: ``(q [N', K/32, 32] int16,
    d [N', K/32], m [N', K/32] or None for 8-bit)``, with ``N`` zero-padded to ``N'``, a multiple of ``width``; ``None``
    when some block is not exactly of that form. Every decoded weight is checked to equal the
    float32 one bit for bit (decoded as the kernels do: ``d * q``, then ``+ m``). A weight
    given its blocks by its loader (:func:`register_blocks`) has those; where their scales are
    not float16 values (Q4_K's), cover 16 inputs each (Q6_K's: ``d [N', K/16]``) or come with
    minimums on integers of more than 4 bits (Q5_K's), only the float32 block kernel's packer
    (``float32_kernel``) gets them. So does a weight stacked from ``parts`` (``torch.cat(parts)``,
    each equal to it in its rows) that all have such blocks of one kind."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % 32 or n == 0 or weight.device.type != "cpu":
        return None
    known = _registered_grid(weight, width)
    if known is None and parts:
        known = _stacked_grid(weight, parts, width)
    if known is not None:
        plain = (known[1].shape[1] * 32 == k and _float16_values(known[1]) and _float16_values(known[2])
                 and bool(known[0].abs().max() <= (127 if known[2] is None else 15)))
        return known if float32_kernel or plain else None
    blocks = _blocks_of(weight, width)
    kernel = cpu_kernels()
    if kernel is not None:  # the same arithmetic in one pass per block (a model loads seconds sooner)
        found = kernel.block_grid_f32(blocks)
        return (found[0], found[1], found[2] if len(found) == 3 else None) if found else None
    return _block_grid_torch(blocks)


#: the largest ``|q|`` of a signed block of each GGUF format, in the order the searches try them:
#: Q8_0 (127), Q5_0 (``q`` in -16..15: 16, or 15 where no weight takes -16), Q4_0 (-8..7: 8 or 7);
#: all are exact as 8-bit blocks (``linear.cpp``'s ``kSignedLevels``)
SIGNED_LEVELS = (127.0, 16.0, 15.0, 8.0, 7.0)


def _block_grid_torch(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """:func:`block_grid` of ``blocks [N', K/32, 32]`` in PyTorch (the compiled
    ``block_grid_f32`` does the same, block by block)."""

    def solve(levels: range, offset: torch.Tensor | None, spreads: list[torch.Tensor]):
        found = torch.zeros(blocks.shape[:2], dtype=torch.bool)
        scale = torch.zeros(blocks.shape[:2])
        q = torch.zeros(blocks.shape, dtype=torch.int16)
        for d in (d for spread in spreads for d in _fp16_candidates(spread)):
            safe = torch.where(d == 0, torch.ones_like(d), d)[..., None]
            base = blocks if offset is None else blocks - offset[..., None]
            cand = torch.round(base / safe).clamp(levels.start, levels.stop - 1)
            rebuilt = d[..., None] * cand if offset is None else d[..., None] * cand + offset[..., None]
            new = (rebuilt.view(torch.int32) == blocks.view(torch.int32)).all(-1) & ~found  # bits, signed zeros too
            scale = torch.where(new, d, scale)
            q = torch.where(new[..., None], cand.to(torch.int16), q)
            found |= new
            if bool(found.all()):
                break
        return bool(found.all()), scale, q

    low = blocks.min(-1).values
    if bool((low.to(torch.float16).float() == low).all()):
        ok, scale, q = solve(range(0, 16), low, [(blocks.max(-1).values - low) / 15])
        if ok:
            return q, scale, low
    top = blocks.abs().max(-1).values
    ok, scale, q = solve(range(-128, 128), None, [top / levels for levels in SIGNED_LEVELS])
    return (q, scale, None) if ok else None


def pack_blocks(weight: torch.Tensor, parts: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``weight [N, K]`` float32 as exact GGUF Q4_1 or Q8_0 blocks (:func:`block_grid`; the
    K-quants' and IQ4's too, given by the loader) in the panel layout of the compiled
    ``linear_blocks_f32``: ``(data, scale, mins)`` (``scale`` and ``mins`` float16, or float32
    where the format's are not float16 values, the K-quants': Q6_K's, Q3_K's and Q2_K's 8-bit
    blocks have one scale per 16 inputs, and Q5_K's and Q2_K's minimums; ``mins`` empty for the
    other 8-bit blocks), or ``None`` when the weight is not such a grid. A product over the
    blocks is taken as the format factors it, ``d * sum(x * q) + m * sum(x)`` per block of 32
    inputs in a fixed order (``linear.cpp``): the float32 product's value up to rounding, each
    row's bits independent of the other rows.

    A model dequantized from a GGUF file (the default model) has such weights: it then reads
    an eighth (4-bit) or a quarter (8-bit) of the bytes per token. ``parts``: the parameters
    ``weight`` was stacked from (``torch.cat(parts)``), whose loader's blocks it then takes."""
    grid = block_grid(weight, float32_kernel=True, parts=parts)
    if grid is None:
        return None
    q, scale, low = grid
    panels, k, scales = q.shape[0] // 16, weight.shape[1], scale.shape[1]  # (scales a row: K/32 or K/16)
    # 4 bits: minimums, integers 0..15, a scale per 32 (Q5_K's and Q2_K's minimums take 8-bit blocks)
    four = low is not None and bool(q.max() <= 15) and scales * 32 == k
    # the scales and minimums as the format stores them, float16 (exact), or float32 (the K-quants')
    plain = _float16_values(scale) and _float16_values(low) and (four or low is None)
    kept = torch.float16 if plain else torch.float32

    def per_panel(t: torch.Tensor) -> torch.Tensor:  # [panels * 16, scales] -> [panels, scales, 16]
        return t.reshape(panels, 16, scales).transpose(1, 2).to(kept).contiguous()

    if four:  # byte j holds column j (low nibble) and column j + 8 (high nibble)
        q = q.to(torch.uint8).reshape(panels, 16, k // 32, 32).permute(0, 2, 3, 1)
        data = (q[..., :8] | (q[..., 8:] << 4)).contiguous()
        return data, per_panel(scale), per_panel(low)
    data = q.to(torch.int8).reshape(panels, 16, k // 32, 32).permute(0, 2, 3, 1)
    return data.contiguous(), per_panel(scale), torch.empty(0) if low is None else per_panel(low)


def pack_blocks_bf16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``weight [N, K]`` float32 as exact GGUF Q4_1 or Q8_0 blocks (:func:`block_grid`) in the
    pair layout of the compiled ``linear_blocks_bf16`` (see ``linear_bf16.cpp``): ``(data,
    scale, mins)``, ``mins`` empty for 8-bit blocks; ``None`` when the weight is not such a
    grid. Its products use ``weight.to(torch.bfloat16)``, each weight decoded and rounded in
    registers: the bfloat16 mode's weights, read from a sixth of the bytes."""
    grid = block_grid(weight)
    if grid is None or not (_float16_values(grid[1]) and _float16_values(grid[2])):
        return None
    return _pair_layout(*grid)


def _pair_layout(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_grid`'s ``(q [N', K/32, 32], d [N', K/32], m or None)`` in the pair layout
    of ``linear_blocks_bf16`` (``N'`` a multiple of 16); the scales and minimums, float16 values
    (as GGUF keeps them), stored as float16."""
    panels, nb = q.shape[0] // 16, q.shape[1]
    # [panels, 16 columns, nb, 16 pairs, 2] -> per pair: columns 0-7 and 8-15, each (column, parity)
    q = q.reshape(panels, 16, nb, 16, 2)
    first = q[:, :8].permute(0, 2, 3, 1, 4).reshape(panels, nb, 16, 16)
    second = q[:, 8:].permute(0, 2, 3, 1, 4).reshape(panels, nb, 16, 16)

    def per_panel(t: torch.Tensor) -> torch.Tensor:  # [panels * 16, nb] -> [panels, nb, 16]
        return t.reshape(panels, 16, nb).transpose(1, 2).contiguous()

    if low is not None:  # 4-bit: the first half in the low nibbles, the second in the high ones
        data = (first.to(torch.uint8) | (second.to(torch.uint8) << 4)).contiguous()
        return data, per_panel(scale).half(), per_panel(low).half()
    data = torch.cat([first, second], dim=-1).to(torch.int8).contiguous()
    return data, per_panel(scale).half(), torch.empty(0, dtype=torch.float16)


def select_block_rows(blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``linear_blocks_bf16`` blocks of the weight rows ``rows [n]`` of the weight whose
    blocks are ``blocks`` (:func:`pack_blocks_bf16`): the same blocks, unpacked, picked and
    packed again (a draft head: the target head's rows of the draft vocabulary)."""
    data, scale, mins = blocks
    panels, nb = data.shape[0], data.shape[1]
    if data.dtype == torch.uint8:  # 4-bit: the first half of each pair row in the low nibbles
        first, second = (data & 0xF).to(torch.int16), (data >> 4).to(torch.int16)
    else:
        first, second = data[..., :16].to(torch.int16), data[..., 16:].to(torch.int16)

    def columns(t: torch.Tensor) -> torch.Tensor:  # [panels, nb, 16 pairs, 8 x 2] -> [panels, 8, nb, 16, 2]
        return t.reshape(panels, nb, 16, 8, 2).permute(0, 3, 1, 2, 4)

    q = torch.cat([columns(first), columns(second)], dim=1).reshape(panels * 16, nb, 32)

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [panels, nb, 16] -> [panels * 16, nb]
        return t.transpose(1, 2).reshape(panels * 16, nb)

    pad = -rows.numel() % 16
    pick = torch.cat([rows.long(), rows.new_zeros(pad, dtype=torch.long)]) if pad else rows.long()
    q, d = q[pick].clone(), per_row(scale)[pick].clone()
    low = per_row(mins)[pick].clone() if mins.numel() else None
    if pad:  # padding rows are zero weights, as block_grid pads
        q[-pad:], d[-pad:] = 0, 0
        if low is not None:
            low[-pad:] = 0
    return _pair_layout(q, d, low)


def q8_0_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 copy of the CPU weight ``weight [N, K]`` rounded to GGUF Q8_0 blocks
    (:func:`round_q8_0`), carrying those blocks (:data:`BF16_BLOCKS_ATTR`) so that a
    :class:`PackedLinear` of it runs ``linear_blocks_bf16`` from about half the bytes of the
    bfloat16 weight; ``None`` where that kernel does not run or ``K`` is not a multiple of 32.
    ``weight`` itself is left as it is."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if not bf16_blocks_supported():
        return None
    grid = round_q8_0(weight.detach().float(), width=16)
    if grid is None:
        return None
    q, d, _ = grid
    n, k = weight.shape
    copy = (q.float() * d[..., None]).reshape(-1, k)[:n].to(torch.bfloat16).contiguous()
    setattr(copy, BF16_BLOCKS_ATTR, (copy._version, _pair_layout(q, d, None)))
    return copy


def bf16_blocks_supported() -> bool:
    """Whether this machine runs the compiled ``linear_blocks_bf16`` (a CPU with AVX512-BF16
    and the kernels built); ``SOT_NO_BF16_BLOCKS=1`` says no."""
    kernel = cpu_kernels()
    return kernel is not None and not os.environ.get("SOT_NO_BF16_BLOCKS") and kernel.bf16_blocks_supported()


def amx_products() -> bool:
    """Whether the bfloat16 block products (``linear_blocks_bf16``) multiply with AMX tiles: a
    CPU with AMX and the kernels built; ``SOT_NO_AMX=1`` says no (they then take AVX512-BF16's
    pair dot products). The two chains round differently, so the switch is one for the process
    and is set here, when a model's products are packed: every product of a model takes the
    same chain, and plain decoding and tree verification stay bit-identical."""
    kernel = cpu_kernels()
    return kernel is not None and bool(kernel.set_amx_products(not os.environ.get("SOT_NO_AMX")))


#: the attribute of a bfloat16 parameter holding ``(version, blocks)``: its float32 weight's
#: blocks in the layout of ``linear_blocks_bf16`` and the parameter's ``_version`` when they
#: were attached (set at load by :func:`cast_keeping_blocks`)
BF16_BLOCKS_ATTR = "_sot_bf16_blocks"


def cast_keeping_blocks(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Cast a float32 CPU ``model`` to ``dtype``; for bfloat16, first find every linear weight
    (and the output layer) that is an exact grid of GGUF blocks and attach its blocks to the
    cast parameter (:data:`BF16_BLOCKS_ATTR`), so that the bfloat16 products read the blocks
    instead of the bfloat16 weights. Returns how many weights have them (0 where the kernel
    does not run here, or with ``SOT_NO_BLOCKS=1``)."""
    found: list[tuple[torch.nn.Parameter, tuple]] = []
    if dtype == torch.bfloat16 and not os.environ.get("SOT_NO_BLOCKS") and bf16_blocks_supported():
        weights = {id(m.weight): m.weight for m in model.modules()
                   if isinstance(m, torch.nn.Linear) and isinstance(m.weight, torch.nn.Parameter)}
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if out is not None and isinstance(getattr(out, "weight", None), torch.nn.Parameter):
            weights[id(out.weight)] = out.weight
        for weight in weights.values():
            if weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu":
                blocks = pack_blocks_bf16(weight.detach())
                if blocks is not None:
                    found.append((weight, blocks))
    model.to(dtype)  # (the parameters stay the same objects; their data is replaced)
    for weight, blocks in found:
        setattr(weight, BF16_BLOCKS_ATTR, (weight._version, blocks))
    return len(found)


def bf16_blocks_of(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The ``linear_blocks_bf16`` blocks of the weight ``torch.cat(parts)`` (bfloat16
    parameters stacked along their outputs), or ``None`` unless every part has them
    (:func:`cast_keeping_blocks`), unchanged since, and each but the last fills whole
    16-column panels."""
    kept = [getattr(p, BF16_BLOCKS_ATTR, None) for p in parts]
    if any(k is None or k[0] != p._version or p.dtype != torch.bfloat16 for k, p in zip(kept, parts)):
        return None  # (a weight changed in place since is no longer its blocks)
    found = [k[1] for k in kept]
    if any(p.shape[0] % 16 for p in parts[:-1]) or len({b[0].dtype for b in found}) != 1:
        return None  # (4-bit and 8-bit blocks do not stack)
    if len(found) == 1:
        return found[0]
    return tuple(torch.cat([b[i] for b in found]) for i in range(3))  # type: ignore[return-value]


def round_q8_0(weight: torch.Tensor, width: int = 8) -> tuple[torch.Tensor, torch.Tensor, None] | None:
    """``weight [N, K]`` rounded to GGUF Q8_0 blocks of 32 inputs, the way llama.cpp's q8_0
    conversion does it (scale ``d = max |w| / 127`` kept in float16; here ``q = round(w / d)``
    with that float16 ``d``, ties to even), in
    :func:`block_grid`'s form; ``None`` when ``K`` is not a multiple of 32."""
    n, k = weight.shape
    if k % 32 or n == 0:
        return None
    blocks = _blocks_of(weight.float(), width)
    d = (blocks.abs().amax(-1) / 127).half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int16)
    return q, d, None


def pack_int8(weight: torch.Tensor, quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``weight [N, K]`` float32 as exact GGUF Q4_1 or Q8_0 blocks (:func:`block_grid`) in the
    8-column panel layout of the compiled ``linear_int8`` (see ``linear_int8.cpp``):
    ``(data, scale, mins)``, ``mins`` empty for 8-bit blocks. A weight that is not such a grid
    gives ``None``, or with ``quantize`` its Q8_0 rounding (:func:`round_q8_0`; ``None`` when
    ``K`` is not a multiple of 32)."""
    grid = block_grid(weight, width=8)
    if grid is None and quantize:
        grid = round_q8_0(weight)
    if grid is None:
        return None
    q, scale, low = grid
    panels, nb = q.shape[0] // 8, q.shape[1]
    # [panels, 8 columns, nb, 32 inputs] -> [panels, nb, groups of 4 inputs, 8 columns, 4]
    q = q.reshape(panels, 8, nb, 8, 4).permute(0, 2, 3, 1, 4)

    def per_panel(t: torch.Tensor) -> torch.Tensor:  # [panels * 8, nb] -> [panels, nb, 8] float16 (exact)
        return t.reshape(panels, 8, nb).transpose(1, 2).to(torch.float16).contiguous()

    if low is not None:  # 4-bit: group 2j in the low nibbles, group 2j + 1 in the high ones
        q = q.to(torch.uint8)
        data = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(panels, nb, 128).contiguous()
        return data, per_panel(scale), per_panel(low)
    return q.to(torch.int8).reshape(panels, nb, 256).contiguous(), per_panel(scale), torch.empty(0)


class PackedLinear:
    """A weight ``[N, K]`` pre-packed once for a CPU kernel (bf16: SoT's block kernel, else
    oneDNN; fp32: SoT's own compiled kernel, else MKL or oneDNN).

    Packing removes the per-call weight reorder; the products are bit-identical to the
    unpacked kernel's (checked by the test suite). For float32 the kernel is chosen by probe,
    in this order, taking the first whose short blocks give each row the same bits as a full
    block: SoT's ``linear_f32`` (row-stable by construction, and on a 2-core AVX2 CPU about
    1.6-1.7x faster than oneDNN for 1 to 16 rows; ``scripts/linear_bench.py``), MKL, oneDNN; if none is, MKL with short
    blocks padded (on some AVX2 CPUs MKL's float32 kernels round short blocks differently, and
    padding every one-row product to ``ROW_UNIT`` rows makes plain decoding several times
    slower). Elsewhere it is plain ``F.linear``.

    With SoT's kernel, a float32 weight that is exactly a grid of GGUF Q4_1 or Q8_0 blocks (a
    model dequantized from a GGUF file) is kept in that form and decoded on the fly
    (:func:`pack_blocks`: a sixth of the memory traffic, each block's scale applied once to
    its sum, so the bits differ from the panels' by rounding only). Another weight whose values
    are all bfloat16 (or float16) values, as a 16-bit checkpoint's are in float32, is kept in
    16-bit panels (:func:`exact_16bit`): the float32 panels' bits from half the bytes.
    ``compress=False`` or the environment variable ``SOT_NO_BLOCKS=1`` keeps float32 panels;
    ``SOT_NO_FUSED_BLOCKS=1`` takes every block product through the L1 float block of wide
    products instead of registers.

    A bfloat16 weight whose float32 original was such a grid (a GGUF file's model loaded in
    bfloat16: :func:`cast_keeping_blocks`) is read from its blocks by ``linear_blocks_bf16``
    where the CPU has AVX512-BF16: each weight decoded and rounded to bfloat16 in registers,
    multiplied in pairs by one instruction, each row on its own (``SOT_NO_BF16_BLOCKS=1``
    keeps oneDNN's product on the bfloat16 weight). Such a product also keeps the blocks
    decoded once (:attr:`pairs`, bfloat16: four times the blocks' bytes), which calls of
    ``bf16_pairs_from_rows()`` rows or more read instead: the same chains of pair products,
    so the same bits, without decoding each weight again (``SOT_NO_BF16_PAIRS=1`` keeps the
    blocks only).

    A stack whose parts have file blocks of more than one kind (a Q4_K_M file's Q4_K query and
    key weights beside a Q6_K value weight) is one product per run of parts of one kind
    (:attr:`segments`), their outputs side by side: each run reads its own blocks, where the
    stack as one grid would be float32 panels.

    ``int8=True`` multiplies such a weight in 8-bit integers instead (``linear_int8``: each
    input row rounded to 8-bit blocks, llama.cpp's arithmetic; :func:`pack_int8`). Its rows are
    just as independent of each other, but its results are not float32's: the ``--dtype int8``
    mode. Another float32 weight is rounded to Q8_0 blocks first (:func:`round_q8_0`), like
    llama.cpp's q8_0 conversion; one whose input size is not a multiple of 32 keeps the
    float32 kernel.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, compress: bool = True,
                 int8: bool = False, parts: list[torch.Tensor] | None = None) -> None:
        """``parts``: the parameters ``weight`` was stacked from (``torch.cat(parts)``), whose
        blocks a bfloat16 weight is read from (:func:`bf16_blocks_of`; default ``[weight]``)."""
        self.compress = compress and not os.environ.get("SOT_NO_BLOCKS")
        self.int8_wanted = int8
        #: the products run in 8-bit integers (``linear_int8``)
        self.int8 = False
        #: the products run in bfloat16 over 4/8-bit blocks (``linear_blocks_bf16``)
        self.bf16_blocks = False
        #: the bfloat16 blocks decoded once (``[P, K/32, 16, 32]``), read by wide calls; or ``None``
        self.pairs: torch.Tensor | None = None
        #: block products of 1-6 rows convert the integers in registers (else in small L1 blocks)
        self.fused = os.environ.get("SOT_NO_FUSED_BLOCKS", "0") != "1"
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach()
        self.packed = None
        self.kind = ""
        self.kernel = None  # SoT's compiled module, for kind "sot"
        self.partial_ok = False
        #: the parameters the weight was stacked from (their loader's blocks, :func:`register_blocks`)
        self.parts = parts
        #: a stack of blocks of several kinds as one product per run of one kind, outputs in
        #: order (empty: one product)
        self.segments: list[PackedLinear] = []
        if self.weight.device.type != "cpu":
            return
        if self.weight.dtype == torch.bfloat16:
            blocks = bf16_blocks_of(parts or [weight]) if self.compress and bf16_blocks_supported() else None
            if blocks is not None:  # (row-stable by construction, like SoT's float32 kernels)
                self.kernel, self.packed, self.kind = cpu_kernels(), blocks, "sot"
                self.bf16_blocks = self.partial_ok = True
                # (AMX tiles decode the blocks at every row count: no pairs kept)
                if not amx_products() and not os.environ.get("SOT_NO_BF16_PAIRS"):
                    self.pairs = self.kernel.decode_blocks_bf16(*blocks)
                return
            kinds = ["mkldnn"] if torch.backends.mkldnn.is_available() else []
        elif self.weight.dtype == torch.float32:
            self.kernel = cpu_kernels()
            kinds = [k for k, ok in (("sot", self.kernel is not None),
                                     ("mkl", torch.backends.mkl.is_available()),
                                     ("mkldnn", torch.backends.mkldnn.is_available())) if ok]
        else:
            kinds = []
        first = None
        for kind in kinds:
            if not self._pack(kind):
                continue
            first = first or kind
            # SoT's kernels compute each row on its own by construction (tests hold them to it
            # for every row count); a library's kernel is probed
            if kind == "sot" or self._probe_partial_blocks():
                self.partial_ok = True
                return
        if first is not None and first != self.kind:  # no kernel is row-stable for short blocks: pad
            self._pack(first)

    def _pack(self, kind: str) -> bool:
        self.int8 = False
        try:
            if kind == "sot":
                blocks = int8 = None
                if self.int8_wanted and self.weight.dtype == torch.float32:
                    blocks = int8 = pack_int8(self.weight, quantize=True)
                if blocks is None and self.compress:
                    blocks = pack_blocks(self.weight, self.parts)
                    self.segments = [] if blocks is not None else self._split()
                if self.segments:
                    self.packed = None
                else:
                    self.packed = blocks if blocks is not None else pack_panels(
                        exact_16bit(self.weight) if self.compress else self.weight)
                self.int8 = int8 is not None
            elif kind == "mkldnn":
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, ROW_UNIT)
            else:
                self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, ROW_UNIT)
        except (RuntimeError, AttributeError):
            self.packed, self.kind = None, ""
            return False
        self.kind = kind
        return True

    def _split(self) -> list[PackedLinear]:
        """One product per run of :attr:`parts` whose file blocks are of one kind, each over its
        rows of the stacked weight (a view: no copy), where the runs are of more than one kind
        and some have blocks; else ``[]``."""
        if not self.parts or len(self.parts) < 2:
            return []
        kinds = [_grid_kind(p) for p in self.parts]
        if len(set(kinds)) < 2 or set(kinds) == {None}:
            return []
        runs: list[list[torch.Tensor]] = []
        for part, kind, before in zip(self.parts, kinds, [object()] + kinds[:-1]):
            if kind == before:
                runs[-1].append(part)
            else:
                runs.append([part])
        out, at = [], 0
        for run in runs:
            rows = sum(p.shape[0] for p in run)
            bias = None if self.bias is None else self.bias[at:at + rows]
            out.append(PackedLinear(self.weight[at:at + rows], bias, compress=self.compress, parts=run))
            at += rows
        return out

    def _probe_partial_blocks(self) -> bool:
        """Whether a block of fewer than ``ROW_UNIT`` rows gives each row the same bits as a
        full block. BLAS kernels are chosen by shape, not data, so one random probe per
        shape tells. When it holds, short passes (plain decoding) need no padding rows."""
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(ROW_UNIT, self.weight.shape[1], generator=gen).to(self.weight.dtype)
        full = self._block(x)
        return all(torch.equal(self._block(x[:m]), full[:m]) for m in range(1, ROW_UNIT))

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        if self.segments:
            return torch.cat([piece._block(x) for piece in self.segments], dim=1)
        if self.kind == "sot":
            if self.bf16_blocks:
                return self.kernel.linear_blocks_bf16(x, *self.packed, self.weight.shape[0], self.bias, self.pairs)
            if self.int8:
                return self.kernel.linear_int8(x, *self.packed, self.weight.shape[0], self.bias)
            if isinstance(self.packed, tuple):
                return self.kernel.linear_blocks_f32(x, *self.packed, self.weight.shape[0], self.bias, self.fused)
            return self.kernel.linear_f32(x, self.packed, self.weight.shape[0], self.bias)
        if self.kind == "mkldnn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.kind == "mkl":
            out = torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, ROW_UNIT)
            return out
        return F.linear(x, self.weight, self.bias)

    @property
    def pieces(self) -> list[PackedLinear]:
        """The products this one runs: its :attr:`segments`, or itself."""
        return self.segments or [self]

    @property
    def storage(self) -> tuple[str, int]:
        """How the product holds its weight, and the bytes a one-row product reads of it:
        ``("4-bit blocks" | "8-bit blocks" | "8-bit integer products" | "bfloat16 blocks" (``"... on
        AMX tiles"``) | "float32 panels" | "16-bit panels" | a library's name, bytes)``; for :attr:`segments`,
        their kinds joined by ``" + "``."""
        if self.segments:
            kinds = [piece.storage for piece in self.segments]
            return " + ".join(dict.fromkeys(kind for kind, _ in kinds)), sum(size for _, size in kinds)
        packed = self.packed if isinstance(self.packed, tuple) else (self.packed,)
        size = sum(t.nbytes for t in packed if isinstance(t, torch.Tensor))
        if self.int8:
            return "8-bit integer products", size
        if self.bf16_blocks:
            return ("bfloat16 blocks on AMX tiles" if self.kernel.amx_products() else "bfloat16 blocks"), size
        if isinstance(self.packed, tuple):
            bits = {torch.uint8: 4, torch.int8: 8}[self.packed[0].dtype]
            return f"{bits}-bit blocks", size
        if self.kind == "sot":
            return "float32 panels" if self.packed.dtype == torch.float32 else "16-bit panels", size
        return self.kind or "PyTorch", size or self.weight.nbytes

    def __call__(self, x: torch.Tensor, stable: bool) -> torch.Tensor:
        """``x [M, K] -> [M, N]``; with ``stable`` the product runs in ``ROW_UNIT``-row
        blocks (a short last block padded, unless every short block is row-stable). SoT's kernel runs every product,
        stable or not: any row count in one call, at the speed of BLAS on a prompt's chunk
        (and over the 4-bit blocks where the weight is one)."""
        if not stable and self.kind != "sot":
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if rows == ROW_UNIT or (rows < ROW_UNIT and self.partial_ok) or self.kind == "sot":
            # (SoT's kernel takes any row count in one call, so the weights stream once)
            return self._block(x)
        pad = 0 if self.partial_ok else -rows % ROW_UNIT
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        out = torch.cat([self._block(x[i : i + ROW_UNIT]) for i in range(0, x.shape[0], ROW_UNIT)])
        return out[:rows] if pad else out
