"""A lean forward for the Llama family (Llama, Qwen2, Qwen3, Mistral) and Gemma 3.

It computes exactly what the generic path computes through the transformers modules, with
fewer Python-level operations: Q/K/V and gate/up projections are fused into one matrix each
(the fused products are bit-identical to the separate ones), and there is no module
dispatch. A test checks that its logits equal the generic path's bit for bit.

Qwen3's layers add RMS norms of each query and key head, before the rotary embedding.
Gemma 3's add those too, and: ``(1 + w)`` norms, also on the attention's and the
MLP's outputs before each residual add; embeddings scaled by ``sqrt(hidden)``; a GELU-gated MLP; and a rotary
embedding per layer type (local and global bases).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sot.attention import TreeLayout, tree_attention
from sot.kernels import cpu_kernels
from sot.kernels.linear import PackedLinear, fused_rms_norm
from sot.models.rows import ROW_UNIT

if TYPE_CHECKING:
    from sot.cache import KVCache

#: families whose layers are Gemma 3's (see the module's docstring)
GEMMA_FAMILIES = ("gemma3_text",)
FAST_FAMILIES = ("llama", "qwen2", "qwen3", "mistral") + GEMMA_FAMILIES
#: the MLP activations the lean forward computes, by the config's name
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _activation(config: object) -> str:
    """The config's MLP activation (Gemma names it ``hidden_activation``)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def fast_path_gap(model: torch.nn.Module) -> str | None:
    """What of ``model`` :class:`FastLlama` does not compute (``None``: nothing, it may run
    the model). Its layers have Q/K/V biases at most (Qwen2) and a SiLU-gated MLP (GELU for
    Gemma 3); a Llama configured with ``attention_bias`` (an output-projection bias),
    ``mlp_bias`` or another ``hidden_act`` runs on the generic path, which computes what
    transformers does. Gemma 3 runs it in float32 on the CPU, where its norms go through the
    compiled kernel on both paths (its bfloat16 norms round once, after the ``(1 + w)``
    product, which the bfloat16 kernel does not), without soft caps."""
    act = _activation(model.config)
    gemma = getattr(model.config, "model_type", "") in GEMMA_FAMILIES
    if ACTIVATIONS.get(act) != ("gelu_tanh" if gemma else "silu"):
        return f"hidden_act {act!r}"
    if gemma:
        weight = model.model.embed_tokens.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or cpu_kernels() is None:
            return "Gemma 3 in another dtype than float32, or off the CPU"
        if getattr(model.config, "attn_logit_softcapping", None) or getattr(model.config, "final_logit_softcapping",
                                                                            None):
            return "logit soft caps"
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        if att.o_proj.bias is not None:
            return "an output-projection bias"
        if any(lin.bias is not None for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "MLP biases"
    return None


def layer_window(attention: torch.nn.Module, config: object) -> int | None:
    """The sliding window a transformers attention module applies (``None``: full
    attention): its own ``sliding_window`` where the family sets one per layer (Qwen2/3,
    Gemma 2/3, from the config's ``layer_types``), else the config's (Mistral, every layer)."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window or None
    return getattr(config, "sliding_window", None) or None


def _stacked(parts: list[torch.Tensor], bias: torch.Tensor | None, int8: bool) -> PackedLinear:
    """One product over weights stacked along their outputs (q, k and v; gate and up)."""
    return PackedLinear(torch.cat(parts), bias, int8=int8, parts=parts)


def _product_kind(lin: PackedLinear) -> str:
    """How the compiled layer call runs a product (``layers.cpp``): on SoT's float32 panels,
    4/8-bit blocks (float32 products scaled per block, or weights decoded to bfloat16), 8-bit
    integer products, oneDNN, or its :attr:`~PackedLinear.segments` (``add_segment``)."""
    if lin.segments:
        return "segments"
    if lin.kind == "mkldnn":
        return "onednn"
    if lin.int8:
        return "int8"
    if lin.bf16_blocks:
        return "bf16blocks"
    return "blocks" if isinstance(lin.packed, tuple) else "panels"


def _packed_tensors(lin: PackedLinear) -> list[torch.Tensor]:
    """A product's packed tensors as ``LlamaLayers.add`` takes them (bfloat16 blocks: their
    decoded pairs fourth, where the product keeps them; none for segments)."""
    if lin.segments:
        return []
    if not isinstance(lin.packed, tuple):
        return [lin.packed]
    return list(lin.packed) + ([lin.pairs] if lin.bf16_blocks and lin.pairs is not None else [])


@dataclass
class _Layer:
    ln1: torch.Tensor  # the norm before attention
    ln2: torch.Tensor  # the norm before the MLP (after the attention's residual add)
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    window: int | None = None
    # Qwen3 and Gemma 3: the norms of each query and key head; Gemma 3: the norms of the
    # attention's and the MLP's outputs, and the rotary table (an index into FastLlama.ropes)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    rope: int = 0


class RopeTable:
    """A model's rotary embedding as rows of a table: ``(h, positions [B, T]) -> (cos, sin)``,
    each ``[B, T, head_dim]`` in ``h``'s dtype, the same bits as calling ``rotary(h,
    positions)`` (every entry is an elementwise function of its position alone: a product of
    the position and an inverse frequency, then ``cos`` or ``sin``, a scale and a cast).

    Calling the module costs about 45 us a pass on a CPU, a lookup about 10. The table is
    filled by the module itself, :attr:`CHUNK` positions a call (so every entry comes from the
    vectorized body of one single-threaded elementwise loop, as in a pass), and grows as
    positions do. Rotary embeddings whose frequencies change with the sequence length
    (``dynamic``, ``longrope``), and tensors off the CPU, call the module."""

    #: positions filled per call of the module
    CHUNK = 256
    #: rope types whose frequencies are fixed at load
    STATIC = ("default", "linear", "llama3", "yarn")

    def __init__(self, rotary: torch.nn.Module, layer_type: str | None = None) -> None:
        """``layer_type``: the layer type whose frequencies to take, for a module that keeps one
        set per type (Gemma 3's local and global bases)."""
        self.rotary = rotary
        self.layer_type = layer_type
        kind = getattr(rotary, "rope_type", None)
        if isinstance(kind, dict):
            kind = kind.get(layer_type)
        self.static = kind in self.STATIC
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _module(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_type is None:
            return self.rotary(h, positions)
        return self.rotary(h, positions, self.layer_type)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.static or h.device.type != "cpu" or positions.numel() == 0:
            return self._module(h, positions)
        cos, sin = self._tables.get(h.dtype, (None, None))
        need = int(positions.max()) + 1
        if cos is None or cos.shape[0] < need:
            cos, sin = self._grow(h, cos, sin, need)
        return cos[positions], sin[positions]

    def _grow(self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
              need: int) -> tuple[torch.Tensor, torch.Tensor]:
        have = 0 if cos is None else cos.shape[0]
        size = max(need, 2 * have, self.CHUNK)
        size = -(-size // self.CHUNK) * self.CHUNK
        probe = h.reshape(-1, h.shape[-1])[:1]
        parts_c, parts_s = ([cos], [sin]) if cos is not None else ([], [])
        for start in range(have, size, self.CHUNK):
            c, s = self._module(probe, torch.arange(start, start + self.CHUNK)[None])
            parts_c.append(c[0])
            parts_s.append(s[0])
        table = (torch.cat(parts_c), torch.cat(parts_s))
        self._tables[h.dtype] = table
        return table


class FastLlama:
    """Forward of a transformers Llama-family (or Gemma 3) model over rows with explicit
    positions."""

    def __init__(self, model: torch.nn.Module, int8: bool = False) -> None:
        """``int8``: products in 8-bit integers over the GGUF blocks (``--dtype int8``)."""
        core = model.model
        cfg = model.config
        self.gemma = getattr(cfg, "model_type", "") in GEMMA_FAMILIES
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.inter = cfg.intermediate_size
        #: the MLP's activation: ``silu`` or ``gelu_tanh``
        self.act = ACTIVATIONS[_activation(cfg)]
        self.embed = core.embed_tokens.weight
        #: Gemma's embedding scale (``sqrt(hidden)`` as a tensor, as its embedding module multiplies)
        self.embed_scale = core.embed_tokens.embed_scale if self.gemma else None
        self.norm = self._norm_weight(core.norm)
        self.lm_head = PackedLinear(model.lm_head.weight, int8=int8)
        #: the rotary tables: one, or one per layer type (Gemma 3)
        types = sorted(set(cfg.layer_types)) if self.gemma else [None]
        self.ropes = [RopeTable(core.rotary_emb, t) for t in types]
        self.layers = []
        for idx, layer in enumerate(core.layers):
            att, mlp = layer.self_attn, layer.mlp
            bias = None
            if att.q_proj.bias is not None:
                bias = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
            extra = {}
            if hasattr(att, "q_norm"):
                extra.update(q_norm=self._norm_weight(att.q_norm), k_norm=self._norm_weight(att.k_norm))
            if self.gemma:
                extra.update(attn_out_norm=self._norm_weight(layer.post_attention_layernorm),
                             mlp_out_norm=self._norm_weight(layer.post_feedforward_layernorm),
                             rope=types.index(cfg.layer_types[idx]))
            self.layers.append(
                _Layer(
                    ln1=self._norm_weight(layer.input_layernorm),
                    ln2=self._norm_weight(layer.pre_feedforward_layernorm if self.gemma
                                          else layer.post_attention_layernorm),
                    qkv=_stacked([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight], bias, int8),
                    o=PackedLinear(att.o_proj.weight, int8=int8),
                    gate_up=_stacked([mlp.gate_proj.weight, mlp.up_proj.weight], None, int8),
                    down=PackedLinear(mlp.down_proj.weight, int8=int8),
                    window=layer_window(att, cfg),
                    **extra,
                )
            )
        # (Gemma scales by its query_pre_attn_scalar, as its attention modules do)
        self.scaling = core.layers[0].self_attn.scaling if self.gemma else self.head_dim**-0.5
        self.fused_norm = fused_rms_norm(self.embed.dtype, self.embed.device)
        self.kernel = cpu_kernels() if self.embed.device.type == "cpu" else None
        linears = [self.lm_head] + [lin for lay in self.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        #: how many products run in 8-bit integers (``int8``: those whose weights are GGUF blocks)
        self.int8_products = sum(lin.int8 for lin in linears)
        #: passes may have any row count when every product is exact for partial blocks
        self.row_multiple = 1 if all(lin.partial_ok for lin in linears) else ROW_UNIT
        #: the decoder layers as one compiled call (the same kernels, in the same order), where
        #: every product is on SoT's kernels or oneDNN's; ``None``: the Python loop runs them
        self.layer_call = self._compile_layers(cfg)

    def _norm_weight(self, norm: torch.nn.Module) -> torch.Tensor:
        """An RMSNorm module's weight as the norm multiplies by it: Gemma's ``1 + w`` (computed
        in float32, as its module computes it), else ``w``."""
        if self.gemma:
            return (1.0 + norm.weight.float()).to(norm.weight.dtype)
        return norm.weight

    def _compile_layers(self, cfg) -> object | None:
        """The compiled layer loop (``layers.cpp``) over this model's packed weights, or ``None``
        where a pass would leave the compiled kernels (other devices, products outside SoT's
        kernels and oneDNN's, attention-logit soft caps) or ``SOT_NO_LAYER_CALL=1`` asks for
        the Python loop."""
        if (self.kernel is None or self.fused_norm is None or os.environ.get("SOT_NO_LAYER_CALL")
                or getattr(cfg, "attn_logit_softcapping", None) or not hasattr(self.kernel, "LlamaLayers")):
            return None
        linears = [lin for lay in self.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        if any(lin.kind not in ("sot", "mkldnn") for lin in linears):
            return None
        call = self.kernel.LlamaLayers(self.eps, self.num_heads, self.num_kv_heads, self.head_dim, self.inter,
                                       self.scaling, self.act)
        for lay in self.layers:
            products = (lay.qkv, lay.o, lay.gate_up, lay.down)
            call.add(lay.ln1, lay.ln2,
                     [_packed_tensors(lin) for lin in products],
                     [lin.weight.shape[0] for lin in products], [lin.bias for lin in products],
                     [_product_kind(lin) for lin in products],
                     [lin.partial_ok for lin in products], all(lin.fused for lin in products), ROW_UNIT,
                     lay.window or 0, [lay.attn_out_norm, lay.mlp_out_norm, lay.q_norm, lay.k_norm], lay.rope)
            for index, lin in enumerate(products):
                for piece in lin.segments:
                    call.add_segment(index, _packed_tensors(piece), piece.weight.shape[0], piece.bias,
                                     _product_kind(piece), piece.partial_ok, piece.fused, ROW_UNIT)
        return call

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

    def _normed(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """RMSNorm of ``x``'s last dimension by ``weight`` (``None``: ``x`` as it is)."""
        return x if weight is None else self._add_rms(x, None, weight)[0]

    def _qk_normed(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """``qkv [..., nq + 2 nkv, hd]`` with each query and key head normed (Qwen3, Gemma 3), as a
        new tensor; unchanged where the layer has no such norms."""
        if layer.q_norm is None:
            return qkv
        nq, nkv = self.num_heads, self.num_kv_heads
        q = self._normed(qkv[..., :nq, :], layer.q_norm)
        k = self._normed(qkv[..., nq:nq + nkv, :], layer.k_norm)
        return torch.cat([q, k, qkv[..., nq + nkv:, :]], dim=-2)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The MLP branch of ``x [M, D]``, normed where the layer norms it (Gemma 3)."""
        gu = layer.gate_up(x, True)
        gate, up = gu[:, : self.inter], gu[:, self.inter :]
        act = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self._normed(layer.down(act * up, True), layer.mlp_out_norm)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (scaled as Gemma's embedding module scales them)."""
        h = F.embedding(ids, self.embed)
        return h if self.embed_scale is None else h * self.embed_scale.to(h.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def flattens(self, layout: TreeLayout, cache: KVCache) -> bool:
        """Whether :meth:`forward` runs ``layout`` flat-packed (the compiled kernel's path)."""
        return layout.flat_index is not None and cache.tiled_keys and self.kernel is not None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        layout: TreeLayout,
        state_layers: tuple[int, ...],
        last_row: int | None = None,
        head: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids, positions [B, T]`` -> logits ``[B, T, V]`` and states ``[B, T, S, D]``;
        flat-packed (:meth:`flattens`): logits ``[R, V]`` and states ``[R, S, D]`` of the real
        rows. With ``last_row`` (one sequence), only that row's logits: ``[1, V]``. With
        ``head=False``, the final normed states in place of the logits (``[B, T, D]``,
        ``[R, D]``; with ``last_row`` ``[1, 1, D]`` or ``[1, D]``), for :meth:`logits` to compute
        the rows that are read."""
        if self.flattens(layout, cache):
            return self._forward_flat(input_ids, positions, cache, layout, state_layers, last_row, head)
        batch, rows = input_ids.shape
        h = self._embed(input_ids)  # [B, T, D]
        tables = [rope(h, positions) for rope in self.ropes]  # (cos, sin) [B, T, hd] each
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        states = [h] if 0 in state_layers else []
        delta = None  # the last residual branch, added to h lazily (fused with the next norm)
        if self.layer_call is not None and cache.tiled_keys and layout.kernel is not None:
            h, delta, more = self._run_compiled(h.reshape(batch * rows, -1), tables, cache, layout, None, 0,
                                                state_layers)
            h, delta = h.view(batch, rows, -1), delta.view(batch, rows, -1)
            states += [s.view(batch, rows, -1) for s in more]
        for idx, layer in enumerate(self.layers if delta is None else ()):
            x, h = self._add_rms(h, delta, layer.ln1)
            if idx in state_layers and idx > 0:
                states.append(h)
            x = x.reshape(batch * rows, -1)
            qkv = self._qk_normed(layer.qkv(x, True).view(batch, rows, nq + 2 * nkv, hd), layer)
            cos3, sin3 = tables[layer.rope]
            if cache.tiled_keys:  # the kernel's cache layout
                # One compiled call: rope on q and k, K/V into their cache slots.
                keys, values = cache.layer(idx)
                q = self.kernel.rope_write(qkv, cos3, sin3, keys, values, layout.write_slots, nq)
            else:
                qk = self._rope(qkv[:, :, : nq + nkv].transpose(1, 2), cos3[:, None], sin3[:, None])  # q, k at once
                q, k = qk[:, :nq], qk[:, nq:]
                cache.write(idx, layout.write_slots, k, qkv[:, :, nq + nkv :].transpose(1, 2), layout.write_rows)
            att = tree_attention(q, cache, idx, layout, self.scaling, layer.window)
            att = att.to(h.dtype).reshape(batch * rows, nq * hd)
            o = self._normed(layer.o(att, True), layer.attn_out_norm)
            x, h = self._add_rms(h, o.view(batch, rows, -1), layer.ln2)
            delta = self._mlp(layer, x.reshape(batch * rows, -1)).view(batch, rows, -1)
        h, _ = self._add_rms(h, delta, self.norm)
        if len(self.layers) in state_layers:  # the last layer's state is the normed one, as transformers returns it
            states.append(h)
        if last_row is not None:
            h = h[:1, last_row:last_row + 1]
        stacked = torch.stack(states, dim=2) if state_layers else None
        if not head:
            return h, stacked
        logits = self.lm_head(h.reshape(-1, h.shape[-1]), True)
        logits = logits if last_row is not None else logits.view(batch, rows, -1)
        return logits, stacked

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h [n, D]`` final normed states -> logits ``[n, V]``, each row's bits the same
        whichever rows share the call."""
        return self.lm_head(h, True)

    def _run_compiled(
        self, h: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], cache, layout: TreeLayout,
        flat: torch.Tensor | None, real: int, state_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Every decoder layer in one compiled call: ``h [M, D]`` (the embedded rows) and each
        rotary table's ``(cos, sin)`` ``[B, T, hd]`` -> ``(h, delta, states)``, the residual
        stream, the last branch still to add, and the residual stream entering each state
        layer after the first (``[M, D]`` each)."""
        k = layout.kernel
        out = self.layer_call.forward(h, [c for c, _ in tables], [s for _, s in tables], cache.keys, cache.values,
                                      layout.write_slots, k.lengths, k.ancestors, k.rows, flat, real,
                                      [i for i in state_layers if i > 0])
        return out[0], out[1], list(out[2:])

    def _forward_flat(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache, layout: TreeLayout,
        state_layers: tuple[int, ...], last_row: int | None = None, head: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The products over the ``R`` rows of ``layout.flat_index`` only; attention (rope, the
        K/V writes and the kernel) on the ``[B, T]`` grid, whose padding rows stay zero and
        unattended. Every row is computed as in a padded pass: the products are row-stable
        and attention is per row."""
        batch, rows = input_ids.shape
        flat = layout.flat_index  # [R]
        real = layout.flat_rows
        h = self._embed(input_ids.reshape(-1).index_select(0, flat))  # [R, D]
        tables = [rope(h, positions) for rope in self.ropes]  # (cos, sin) [B, T, hd] each
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        states = [h] if 0 in state_layers else []
        delta = None
        grid_index = flat[:real]
        if self.layer_call is not None:
            # every grid row real (plain decoding, one sequence's tree, trees of one size): the
            # packed rows are the grid's in order, and the layers need not scatter or gather them
            same = flat.shape[0] == real == batch * rows
            h, delta, more = self._run_compiled(h, tables, cache, layout, None if same else flat, real, state_layers)
            states += more
        for idx, layer in enumerate(self.layers if delta is None else ()):
            x, h = self._add_rms(h, delta, layer.ln1)
            if idx in state_layers and idx > 0:
                states.append(h)
            qkv = self._qk_normed(layer.qkv(x, True).view(-1, nq + 2 * nkv, hd), layer).flatten(1)  # [R, width]
            grid = qkv.new_zeros(batch * rows, qkv.shape[1]).index_copy_(0, grid_index, qkv[:real])
            keys, values = cache.layer(idx)
            cos3, sin3 = tables[layer.rope]
            q = self.kernel.rope_write(grid.view(batch, rows, nq + 2 * nkv, hd), cos3, sin3, keys, values,
                                       layout.write_slots, nq)
            att = tree_attention(q, cache, idx, layout, self.scaling, layer.window)  # [B, T, H, hd]
            att = att.to(h.dtype).reshape(batch * rows, nq * hd).index_select(0, flat)
            x, h = self._add_rms(h, self._normed(layer.o(att, True), layer.attn_out_norm), layer.ln2)
            delta = self._mlp(layer, x)
        h, _ = self._add_rms(h, delta, self.norm)
        if len(self.layers) in state_layers:  # the last layer's state is the normed one, as transformers returns it
            states.append(h)
        stacked = torch.stack(states, dim=1)[:real] if state_layers else None
        if not head:
            return (h[last_row:last_row + 1] if last_row is not None else h[:real]), stacked
        logits = self.lm_head(h[last_row:last_row + 1] if last_row is not None else h, True)[:real]
        return logits, stacked
