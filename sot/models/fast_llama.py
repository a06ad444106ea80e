"""A lean forward for the Llama family (Llama, Qwen2, Mistral).

It computes exactly what the generic path computes through the transformers modules, with
fewer Python-level operations: Q/K/V and gate/up projections are fused into one matrix each
(the fused products are bit-identical to the separate ones), and there is no module
dispatch. A test checks that its logits equal the generic path's bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sot.attention import PrefillLayout, TreeLayout, prefill_attention, tree_attention
from sot.models.adapter import ROW_UNIT

FAST_FAMILIES = ("llama", "qwen2", "mistral")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stable: bool) -> torch.Tensor:
    """``x [M, K] -> [M, N]``; with ``stable`` the product runs in ``ROW_UNIT``-row blocks
    (``M`` is then already a multiple of ``ROW_UNIT``)."""
    if not stable or x.shape[0] == ROW_UNIT:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[i : i + ROW_UNIT], weight, bias) for i in range(0, x.shape[0], ROW_UNIT)])


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


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
        self.lm_head = model.lm_head.weight
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
                    qkv=torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).contiguous(),
                    qkv_bias=bias,
                    o=att.o_proj.weight,
                    gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous(),
                    down=mlp.down_proj.weight,
                )
            )
        self.scaling = self.head_dim**-0.5

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        layout: TreeLayout | PrefillLayout,
        state_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids, positions [B, T]`` -> logits ``[B, T, V]`` and states ``[B, T, S, D]``."""
        batch, rows = input_ids.shape
        stable = isinstance(layout, TreeLayout)
        h = F.embedding(input_ids, self.embed)  # [B, T, D]
        cos, sin = self.rotary(h, positions)  # [B, T, hd]
        cos, sin = cos[:, None], sin[:, None]
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        states = [h] if 0 in state_layers else []
        for idx, layer in enumerate(self.layers):
            x = self._rms(h, layer.ln1).reshape(batch * rows, -1)
            qkv = _linear(x, layer.qkv, layer.qkv_bias, stable).view(batch, rows, nq + 2 * nkv, hd)
            q = qkv[:, :, :nq].transpose(1, 2)
            k = qkv[:, :, nq : nq + nkv].transpose(1, 2)
            v = qkv[:, :, nq + nkv :].transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            if stable:
                cache.write(idx, layout.write_slots, k, v)
                att = tree_attention(q, cache, idx, layout, self.scaling)
            else:
                cache.write_sequence(idx, layout.batch_index, layout.start, k[0], v[0])
                att = prefill_attention(q, cache, idx, layout, self.scaling)
            att = att.to(h.dtype).reshape(batch * rows, nq * hd)
            h = h + _linear(att, layer.o, None, stable).view(batch, rows, -1)
            x = self._rms(h, layer.ln2).reshape(batch * rows, -1)
            gu = _linear(x, layer.gate_up, None, stable)
            gate, up = gu[:, : self.inter], gu[:, self.inter :]
            h = h + _linear(F.silu(gate) * up, layer.down, None, stable).view(batch, rows, -1)
            if idx + 1 in state_layers:
                states.append(h)
        h = self._rms(h, self.norm)
        logits = _linear(h.reshape(batch * rows, -1), self.lm_head, None, stable).view(batch, rows, -1)
        stacked = torch.stack(states, dim=2) if state_layers else None
        return logits.float(), stacked
