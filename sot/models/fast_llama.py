"""A lean forward for the Llama family (Llama, Qwen2, Mistral).

It computes exactly what the generic path computes through the transformers modules, with
fewer Python-level operations: Q/K/V and gate/up projections are fused into one matrix each
(the fused products are bit-identical to the separate ones), and there is no module
dispatch. A test checks that its logits equal the generic path's bit for bit.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sot.attention import PrefillLayout, TreeLayout, prefill_attention, tree_attention
from sot.kernels import tree_attention_kernel
from sot.models.rows import ROW_UNIT

FAST_FAMILIES = ("llama", "qwen2", "mistral")


def fused_rms_norm(dtype: torch.dtype, device: torch.device):
    """The compiled RMSNorm for bfloat16 or float32 rows on the CPU
    (``(x [..., D], weight [D], eps, residual [..., D] | None) -> [normed, x + residual]``),
    or ``None`` where it does not apply (other dtypes and devices, or no compiler)."""
    if dtype not in (torch.bfloat16, torch.float32) or device.type != "cpu":
        return None
    kernel = tree_attention_kernel()
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


def _fp16_candidates(approx: torch.Tensor) -> list[torch.Tensor]:
    """float16 values at and next to ``approx`` (as float32), nearest first."""
    bits = approx.to(torch.float16).view(torch.int16)
    return [(bits + off).view(torch.float16).float() for off in (0, -1, 1, -2, 2)]


def pack_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``weight [N, K]`` float32 as exact 4-bit (GGUF Q4_1: ``w = d * q + m``) or 8-bit (Q8_0:
    ``w = d * q``) blocks of 32 inputs, in the panel layout of the compiled
    ``linear_blocks_f32``: ``(data, scale, mins)`` (``mins`` empty for 8-bit), or ``None``
    when some block is not exactly of that form. Every decoded weight is checked to equal
    the float32 one bit for bit, so a product over the blocks equals ``linear_f32``'s.

    A model dequantized from a GGUF file (the default model) has such weights: it then reads
    an eighth (4-bit) or a quarter (8-bit) of the bytes per token."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % 32 or n == 0:
        return None
    panels = -(-n // 16)
    w = weight.detach()
    if panels * 16 != n:
        w = torch.cat([w, w.new_zeros(panels * 16 - n, k)])
    blocks = w.reshape(panels * 16, k // 32, 32)

    def solve(levels: range, offset: torch.Tensor | None, spread: torch.Tensor):
        # decoded exactly as the kernel does: d * q, then + m (4-bit), each step rounded
        found = torch.zeros(blocks.shape[:2], dtype=torch.bool)
        scale = torch.zeros(blocks.shape[:2])
        q = torch.zeros(blocks.shape, dtype=torch.int16)
        for d in _fp16_candidates(spread):
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

    def per_panel(t: torch.Tensor) -> torch.Tensor:  # [panels * 16, k // 32] -> [panels, k // 32, 16]
        return t.reshape(panels, 16, k // 32).transpose(1, 2).contiguous()

    low = blocks.min(-1).values
    if bool((low.to(torch.float16).float() == low).all()):
        ok, scale, q = solve(range(0, 16), low, (blocks.max(-1).values - low) / 15)
        if ok:  # 4-bit: byte j holds column j (low nibble) and column j + 8 (high nibble)
            q = q.to(torch.uint8).reshape(panels, 16, k // 32, 32).permute(0, 2, 3, 1)
            data = (q[..., :8] | (q[..., 8:] << 4)).contiguous()
            return data, per_panel(scale), per_panel(low)
    ok, scale, q = solve(range(-128, 128), None, blocks.abs().max(-1).values / 127)
    if ok:
        data = q.to(torch.int8).reshape(panels, 16, k // 32, 32).permute(0, 2, 3, 1).contiguous()
        return data, per_panel(scale), torch.empty(0)
    return None


class PackedLinear:
    """A weight ``[N, K]`` pre-packed once for a CPU kernel (bf16: oneDNN; fp32: SoT's own
    compiled kernel, else MKL or oneDNN).

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
    (:func:`pack_blocks`; same bits, a sixth of the memory traffic). ``compress=False`` or the
    environment variable ``SOT_NO_BLOCKS=1`` keeps float32 panels; ``SOT_NO_FUSED_BLOCKS=1``
    decodes every block product through a float32 panel copy instead of in registers.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, compress: bool = True) -> None:
        self.compress = compress and not os.environ.get("SOT_NO_BLOCKS")
        #: block products decode in registers or small L1 blocks (else through a float32 panel copy)
        self.fused = os.environ.get("SOT_NO_FUSED_BLOCKS", "0") != "1"
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach()
        self.packed = None
        self.kind = ""
        self.kernel = None  # SoT's compiled module, for kind "sot"
        self.partial_ok = False
        if self.weight.device.type != "cpu":
            return
        if self.weight.dtype == torch.bfloat16:
            kinds = ["mkldnn"] if torch.backends.mkldnn.is_available() else []
        elif self.weight.dtype == torch.float32:
            self.kernel = tree_attention_kernel()
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
            if self._probe_partial_blocks():
                self.partial_ok = True
                return
        if first is not None and first != self.kind:  # no kernel is row-stable for short blocks: pad
            self._pack(first)

    def _pack(self, kind: str) -> bool:
        try:
            if kind == "sot":
                blocks = pack_blocks(self.weight) if self.compress else None
                self.packed = blocks if blocks is not None else pack_panels(self.weight)
            elif kind == "mkldnn":
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, ROW_UNIT)
            else:
                self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, ROW_UNIT)
        except (RuntimeError, AttributeError):
            self.packed, self.kind = None, ""
            return False
        self.kind = kind
        return True

    def _probe_partial_blocks(self) -> bool:
        """Whether a block of fewer than ``ROW_UNIT`` rows gives each row the same bits as a
        full block. BLAS kernels are chosen by shape, not data, so one random probe per
        shape tells. When it holds, short passes (plain decoding) need no padding rows."""
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(ROW_UNIT, self.weight.shape[1], generator=gen).to(self.weight.dtype)
        full = self._block(x)
        return all(torch.equal(self._block(x[:m]), full[:m]) for m in (1, 2, 3, 5, 8, 13))

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "sot":
            if isinstance(self.packed, tuple):
                return self.kernel.linear_blocks_f32(x, *self.packed, self.weight.shape[0], self.bias, self.fused)
            return self.kernel.linear_f32(x, self.packed, self.weight.shape[0], self.bias)
        if self.kind == "mkldnn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.kind == "mkl":
            out = torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, ROW_UNIT)
            return out
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor, stable: bool) -> torch.Tensor:
        """``x [M, K] -> [M, N]``; with ``stable`` the product runs in ``ROW_UNIT``-row
        blocks (``M`` is then a multiple of ``ROW_UNIT``)."""
        if not stable:
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


def layer_window(attention: torch.nn.Module, config: object) -> int | None:
    """The sliding window a transformers attention module applies (``None``: full
    attention): its own ``sliding_window`` where the family sets one per layer (Qwen2/3,
    Gemma 2/3, from the config's ``layer_types``), else the config's (Mistral, every layer)."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window or None
    return getattr(config, "sliding_window", None) or None


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    window: int | None = None


class FastLlama:
    """Forward of a transformers Llama-family model over rows with explicit positions."""

    def __init__(self, model: torch.nn.Module) -> None:
        core = model.model
        cfg = model.config
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.inter = cfg.intermediate_size
        self.embed = core.embed_tokens.weight
        self.norm = core.norm.weight
        self.lm_head = PackedLinear(model.lm_head.weight)
        self.rotary = core.rotary_emb
        self.layers = []
        for layer in core.layers:
            att, mlp = layer.self_attn, layer.mlp
            bias = None
            if att.q_proj.bias is not None:
                bias = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    qkv=PackedLinear(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]), bias),
                    o=PackedLinear(att.o_proj.weight),
                    gate_up=PackedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    down=PackedLinear(mlp.down_proj.weight),
                    window=layer_window(att, cfg),
                )
            )
        self.scaling = self.head_dim**-0.5
        self.fused_norm = fused_rms_norm(self.embed.dtype, self.embed.device)
        self.kernel = tree_attention_kernel() if self.embed.device.type == "cpu" else None
        linears = [self.lm_head] + [lin for lay in self.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        #: passes may have any row count when every product is exact for partial blocks
        self.row_multiple = 1 if all(lin.partial_ok for lin in linears) else ROW_UNIT

    def _add_rms(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = h + delta`` (when given), then RMSNorm of ``h``; returns ``(normed, h)``.

        On the CPU (bfloat16 or float32) one compiled call does both (the same function
        replaces the norm modules of the generic path, see
        :func:`sot.models.adapter.use_fused_norms`); otherwise this is transformers' own formula.
        """
        if self.fused_norm is not None:
            out = self.fused_norm(h, weight, self.eps, delta)
            return (out[0], out[1]) if delta is not None else (out[0], h)
        if delta is not None:
            h = h + delta
        return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=self.eps).to(h.dtype), h

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def flattens(self, layout: TreeLayout | PrefillLayout, cache) -> bool:
        """Whether :meth:`forward` runs ``layout`` flat-packed (the compiled kernel's path)."""
        return (isinstance(layout, TreeLayout) and layout.flat_index is not None and cache.transposed_keys
                and self.kernel is not None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        layout: TreeLayout | PrefillLayout,
        state_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids, positions [B, T]`` -> logits ``[B, T, V]`` and states ``[B, T, S, D]``;
        flat-packed (:meth:`flattens`): logits ``[R, V]`` and states ``[R, S, D]`` of the real rows."""
        if self.flattens(layout, cache):
            return self._forward_flat(input_ids, positions, cache, layout, state_layers)
        batch, rows = input_ids.shape
        stable = isinstance(layout, TreeLayout)
        h = F.embedding(input_ids, self.embed)  # [B, T, D]
        cos3, sin3 = self.rotary(h, positions)  # [B, T, hd]
        cos, sin = cos3[:, None], sin3[:, None]
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        states = [h] if 0 in state_layers else []
        delta = None  # the last residual branch, added to h lazily (fused with the next norm)
        for idx, layer in enumerate(self.layers):
            x, h = self._add_rms(h, delta, layer.ln1)
            if idx in state_layers and idx > 0:
                states.append(h)
            x = x.reshape(batch * rows, -1)
            qkv = layer.qkv(x, stable).view(batch, rows, nq + 2 * nkv, hd)
            if stable and cache.transposed_keys:  # the kernel's cache layout
                # One compiled call: rope on q and k, K/V into their cache slots.
                keys, values = cache.layer(idx)
                q = self.kernel.rope_write(qkv, cos3, sin3, keys, values, layout.write_slots, nq)
                att = tree_attention(q, cache, idx, layout, self.scaling, layer.window)
            else:
                qk = self._rope(qkv[:, :, : nq + nkv].transpose(1, 2), cos, sin)  # q and k heads at once
                q, k = qk[:, :nq], qk[:, nq:]
                v = qkv[:, :, nq + nkv :].transpose(1, 2)
                if stable:
                    cache.write(idx, layout.write_slots, k, v)
                    att = tree_attention(q, cache, idx, layout, self.scaling, layer.window)
                else:
                    cache.write_sequence(idx, layout.batch_index, layout.start, k[0], v[0])
                    att = prefill_attention(q, cache, idx, layout, self.scaling, layer.window)
            att = att.to(h.dtype).reshape(batch * rows, nq * hd)
            x, h = self._add_rms(h, layer.o(att, stable).view(batch, rows, -1), layer.ln2)
            gu = layer.gate_up(x.reshape(batch * rows, -1), stable)
            gate, up = gu[:, : self.inter], gu[:, self.inter :]
            delta = layer.down(F.silu(gate) * up, stable).view(batch, rows, -1)
        h, last = self._add_rms(h, delta, self.norm)
        if len(self.layers) in state_layers:
            states.append(last)
        logits = self.lm_head(h.reshape(batch * rows, -1), stable).view(batch, rows, -1)
        stacked = torch.stack(states, dim=2) if state_layers else None
        return logits, stacked

    def _forward_flat(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache, layout: TreeLayout,
        state_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The products over the ``R`` rows of ``layout.flat_index`` only; attention (rope, the
        K/V writes and the kernel) on the ``[B, T]`` grid, whose padding rows stay zero and
        unattended. Every row is computed as in a padded pass: the products are row-stable
        and attention is per row."""
        batch, rows = input_ids.shape
        flat = layout.flat_index  # [R]
        real = layout.flat_rows
        h = F.embedding(input_ids.reshape(-1).index_select(0, flat), self.embed)  # [R, D]
        cos3, sin3 = self.rotary(h, positions)  # [B, T, hd]
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        states = [h] if 0 in state_layers else []
        delta = None
        grid_index = flat[:real]
        for idx, layer in enumerate(self.layers):
            x, h = self._add_rms(h, delta, layer.ln1)
            if idx in state_layers and idx > 0:
                states.append(h)
            qkv = layer.qkv(x, True)  # [R, (nq + 2 nkv) hd]
            grid = qkv.new_zeros(batch * rows, qkv.shape[1]).index_copy_(0, grid_index, qkv[:real])
            keys, values = cache.layer(idx)
            q = self.kernel.rope_write(grid.view(batch, rows, nq + 2 * nkv, hd), cos3, sin3, keys, values,
                                       layout.write_slots, nq)
            att = tree_attention(q, cache, idx, layout, self.scaling, layer.window)  # [B, T, H, hd]
            att = att.to(h.dtype).reshape(batch * rows, nq * hd).index_select(0, flat)
            x, h = self._add_rms(h, layer.o(att, True), layer.ln2)
            gu = layer.gate_up(x, True)
            gate, up = gu[:, : self.inter], gu[:, self.inter :]
            delta = layer.down(F.silu(gate) * up, True)
        h, last = self._add_rms(h, delta, self.norm)
        if len(self.layers) in state_layers:
            states.append(last)
        logits = self.lm_head(h, True)[:real]
        stacked = torch.stack(states, dim=1)[:real] if state_layers else None
        return logits, stacked
