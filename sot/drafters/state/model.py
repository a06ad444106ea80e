"""The state predictor as a ``torch.nn.Module`` (see :mod:`sot.drafters.state`)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sot.drafters.state.config import EAGLE3, StatePredictorConfig
from sot.errors import ConfigError


class RMSNorm(torch.nn.Module):
    """Root-mean-square normalisation over the last dimension, with a learned scale ``[dim]``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled():
            from sot.kernels.linear import fused_rms_norm

            fused = fused_rms_norm(torch.float32, x.device)  # the same formula in one compiled call
            if fused is not None:  # (bfloat16 rows: in float32, as below, in three calls instead of nine)
                return fused(x.float(), self.weight.float(), self.eps, None)[0].to(x.dtype)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class DecoderLayer(torch.nn.Module):
    """The modules of one Llama-style decoder layer of the predictor (norms, attention
    projections, gated MLP), at the target's width. The first layer's modules sit directly on
    :class:`StatePredictor` (the file layout of one-layer predictors); further layers are
    ``StatePredictor.upper[i]``."""

    def __init__(self, c: "StatePredictorConfig") -> None:
        super().__init__()
        add_layer_modules(self, c)


def add_layer_modules(owner: torch.nn.Module, c: "StatePredictorConfig", attn_in: int | None = None) -> None:
    """Register one decoder layer's modules on ``owner``: ``attn_norm``, ``q/k/v/o_proj``,
    ``mlp_norm``, ``gate/up/down_proj`` (no biases). With ``attn_in`` (EAGLE-3's first layer,
    whose attention reads ``2D`` already-normed inputs), q/k/v take that width and there is
    no ``attn_norm``."""
    d = c.hidden_size
    lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
    if attn_in is None:
        owner.attn_norm = RMSNorm(d, c.rms_eps)
    width = attn_in or d
    owner.q_proj = lin(width, c.num_heads * c.head_dim)
    owner.k_proj = lin(width, c.num_kv_heads * c.head_dim)
    owner.v_proj = lin(width, c.num_kv_heads * c.head_dim)
    owner.o_proj = lin(c.num_heads * c.head_dim, d)
    owner.mlp_norm = RMSNorm(d, c.rms_eps)
    owner.gate_proj = lin(d, c.intermediate_size)
    owner.up_proj = lin(d, c.intermediate_size)
    owner.down_proj = lin(c.intermediate_size, d)


def _add_noise(states: torch.Tensor, relative: float) -> torch.Tensor:
    """Gaussian noise with std ``relative`` times each state vector's RMS."""
    rms = states.float().pow(2).mean(-1, keepdim=True).sqrt()
    return states + (torch.randn(states.shape, device=states.device) * rms * relative).to(states.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class StatePredictor(torch.nn.Module):
    """The trainable predictor plus references to the target's frozen embeddings and head.

    Two architectures (``config.arch``), with the same interface, trees and training:

    - ``native``: ``s = fuse(cat(in_norm_i(f_i)))``; ``h = inp(cat(state_norm(s),
      embed_norm(E[x])))``; then standard decoder layers on ``h``; logits from the target's
      own head rows.
    - ``eagle3`` (EAGLE-3's draft layer): ``s = fuse(cat(f_i))`` (EAGLE-3's ``fc``), no norms
      before it; the residual stream is ``h = s``; q/k/v read ``cat(embed_norm(E[x]),
      state_norm(s))`` (EAGLE-3's ``input_layernorm`` and ``hidden_norm``; embedding first,
      width ``2D``); then the attention output, ``mlp_norm`` (``post_attention_layernorm``)
      and MLP as in any decoder layer; logits from a trained ``lm_head [V_d, D]``.

    In both, the next depth feeds back the layer's pre-norm output ``g`` in place of ``s``.

    Args:
        config: shapes and target fingerprint.
        embed: ``[V, D]`` the target's input embeddings (not copied, not saved).
        head: ``[V, D]`` the target's LM head weight (not saved).
        draft_vocab: ``[V_d]`` target token ids the predictor may propose, or ``None`` (all).
    """

    def __init__(self, config: StatePredictorConfig, embed: torch.Tensor, head: torch.Tensor,
                 draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        c = config
        self.config = c
        d, s = c.hidden_size, len(c.state_layers)
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.eagle3 = c.arch == EAGLE3
        # native: one norm per input layer, started from the norm the target applies to that
        # state (hidden states carry a few huge outlier dimensions; the target's norms tame them)
        self.in_norms = torch.nn.ModuleList(RMSNorm(d, c.rms_eps) for _ in range(0 if self.eagle3 else s))
        self.fuse = lin(s * d, d)
        self.state_norm = RMSNorm(d, c.rms_eps)
        self.embed_norm = RMSNorm(d, c.rms_eps)
        if not self.eagle3:
            self.inp = lin(2 * d, d)
        # the first decoder layer (the file layout of one-layer predictors)
        add_layer_modules(self, c, 2 * d if self.eagle3 else None)
        self.out_norm = RMSNorm(d, c.rms_eps)
        # decoder layers after the first (none in the default one-layer predictor)
        self.upper = torch.nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers - 1))
        if draft_vocab is None:
            draft_vocab = torch.arange(embed.shape[0])
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long), persistent=True)
        self.register_buffer("embed", embed.detach(), persistent=False)
        # the target's head rows of the draft vocabulary: the native predictor's output layer,
        # and the training target of both
        self.register_buffer("head", head.detach()[self.draft_vocab], persistent=False)
        self.__dict__["_head_source"] = head  # (its GGUF blocks, if any, for pack_for_inference)
        if self.eagle3:  # EAGLE-3 trains its own head over the draft vocabulary, started from the target's
            self.lm_head = lin(d, int(self.draft_vocab.numel()))
            with torch.no_grad():
                self.lm_head.weight.copy_(self.head.float())
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def cast_for_inference(self, dtype: torch.dtype) -> "StatePredictor":
        """Cast the trained weights and the head rows to ``dtype`` (the shared embeddings stay
        as they are); returns the predictor in eval mode."""
        for param in self.parameters():
            param.data = param.data.to(dtype)
        self.head = self.head.to(dtype)  # the draft-vocabulary rows only
        return self.eval()

    def pack_for_inference(self) -> None:
        """Pre-pack the linear weights and the draft head for the CPU kernels (about 1.5x faster
        small-row products in bfloat16). For inference only: later weight updates are not
        seen, so call it again after changing the weights. In bfloat16 where the block kernel
        runs, the products read the weights rounded to Q8_0 blocks (:attr:`q8_0_weights`; a
        predictor pass 1.5x faster on the default model, drafts as often accepted) and the draft
        head the target head's own blocks (:meth:`_head_blocks`); in float32 they run in 8-bit
        integers (:attr:`int8_products`)."""
        from sot.kernels.linear import PackedLinear, q8_0_copy

        if not self.eagle3:
            self._head_blocks()

        int8 = self.int8_products

        def read(weight: torch.Tensor) -> torch.Tensor:  # what a packed product multiplies by
            rounded = q8_0_copy(weight) if self.q8_0_weights else None
            return weight if rounded is None else rounded

        def packed_of(*weights: torch.Tensor) -> PackedLinear:  # (stacked along the outputs)
            parts = [read(w) for w in weights]
            return PackedLinear(parts[0] if len(parts) == 1 else torch.cat(parts), parts=parts, int8=int8)

        packed = {"fuse": packed_of(self.fuse.weight),
                  "head": packed_of(self.lm_head.weight) if self.eagle3 else PackedLinear(self.head, int8=int8)}
        if not self.eagle3:
            packed["inp"] = packed_of(self.inp.weight)
        # per layer, one product for q, k and v and one for gate and up (each row's outputs
        # unchanged); the separate projections are only used with gradients, never packed
        for i in range(self.config.decoder_layers):
            layer, prefix = self._layer(i)
            packed[prefix + "qkv"] = packed_of(layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight)
            packed[prefix + "gate_up"] = packed_of(layer.gate_proj.weight, layer.up_proj.weight)
            packed[prefix + "o_proj"] = packed_of(layer.o_proj.weight)
            packed[prefix + "down_proj"] = packed_of(layer.down_proj.weight)
        self.__dict__["_packed"] = packed

    #: packed products in bfloat16 multiply by the trained weights rounded to Q8_0 blocks, read
    #: by the block kernel from about half the bytes (:meth:`pack_for_inference`; the
    #: parameters themselves stay as trained)
    q8_0_weights = True

    #: float32 packed products run in 8-bit integers (``linear_int8``, llama.cpp's arithmetic:
    #: each input row rounded to 8-bit blocks, the weights to Q8_0 where they are not GGUF
    #: blocks already). Drafts need no exact arithmetic, only rows independent of each other,
    #: which these products keep
    int8_products = True

    def _head_blocks(self) -> None:
        """Where the target's head is read from its GGUF blocks (bfloat16 mode), give the draft
        head the blocks of its rows, so its products read them too (Q8_0: about half the bytes
        of the bfloat16 rows, through the target's own block kernel). The draft head's weights
        are the same; only the order of the sums differs from oneDNN's, which moves draft
        confidences in their last bits and never the output."""
        from sot.kernels.linear import BF16_BLOCKS_ATTR, bf16_blocks_of, select_block_rows

        source = self.__dict__.get("_head_source")
        if source is None or self.head.dtype != torch.bfloat16 or self.head.device.type != "cpu":
            return
        blocks = bf16_blocks_of([source])
        if blocks is not None and source.shape[1] == self.head.shape[1]:
            picked = select_block_rows(blocks, self.draft_vocab.cpu())
            setattr(self.head, BF16_BLOCKS_ATTR, (self.head._version, picked))

    def _layer(self, i: int) -> tuple[torch.nn.Module, str]:
        """Decoder layer ``i`` (the module holding its weights) and its name prefix."""
        return (self, "") if i == 0 else (self.upper[i - 1], f"upper.{i - 1}.")

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` through the linear layer ``name`` (or the head), packed when
        :meth:`pack_for_inference` was called and no gradient is needed."""
        packed = self.__dict__.get("_packed")
        if packed is None or torch.is_grad_enabled():
            if name == "head":
                return self.lm_head(x) if self.eagle3 else x @ self.head.to(x.dtype).T
            return self.get_submodule(name)(x)
        lin = packed[name]
        return lin._block(x.reshape(-1, x.shape[-1]).to(lin.weight.dtype)).view(*x.shape[:-1], -1)

    def use_full_vocabulary(self, head: torch.Tensor) -> None:
        """Propose from the target's whole vocabulary (``head [V, D]``) instead of the draft
        vocabulary; for comparing the two at inference. Native predictors only: an EAGLE-3
        head is trained over its draft vocabulary."""
        if self.eagle3:
            raise ConfigError("an EAGLE-3 predictor proposes from its own draft vocabulary only (no full vocabulary)")
        self.draft_vocab = torch.arange(head.shape[0], device=self.draft_vocab.device)
        self.head = head.detach().to(self.head.dtype)
        if "_packed" in self.__dict__:
            self.pack_for_inference()

    # -- pieces
    def fuse_states(self, states: torch.Tensor) -> torch.Tensor:
        """``[..., S, D]`` target states -> ``[..., D]``."""
        x = states.to(self.fuse.weight.dtype)
        if self.eagle3:  # EAGLE-3's fc reads the raw states
            return self._linear("fuse", x.flatten(-2))
        return self._linear("fuse", torch.cat([norm(x[..., i, :]) for i, norm in enumerate(self.in_norms)], dim=-1))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor,
              angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x [..., H, T, hd]``, ``positions [..., T]``; ``angles``: :meth:`_rope_angles`
        of ``positions``, when already computed."""
        cos, sin = angles or self._rope_angles(positions, x.dtype)
        return x * cos + _rotate_half(x) * sin

    def _rope_angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [..., 1, T, hd]`` for ``positions [..., T]``."""
        ang = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((ang, ang), dim=-1)
        return emb.cos().unsqueeze(-3).to(dtype), emb.sin().unsqueeze(-3).to(dtype)

    def project(self, state: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input projection and the first layer's attention inputs for rows ``[B, T]``.

        Returns ``h [B, T, D]`` (the residual stream), ``q [B, H, T, hd]``, ``k, v [B, Hkv, T, hd]``.
        """
        e = self.embed[tokens].to(state.dtype)
        if self.eagle3:
            normed = self.state_norm(state)
            h = normed if self.config.norm_before_residual else state
            return (h, *self._qkv("", torch.cat((self.embed_norm(e), normed), dim=-1), positions))
        h = self._linear("inp", torch.cat((self.state_norm(state), self.embed_norm(e)), dim=-1))
        return (h, *self.layer_qkv(0, h, positions))

    def layer_qkv(self, i: int, h: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention inputs of decoder layer ``i`` for the residual stream ``h [B, T, D]`` at
        ``positions [B, T]``: ``q [B, H, T, hd]``, ``k, v [B, Hkv, T, hd]`` (rope applied)."""
        layer, prefix = self._layer(i)
        return self._qkv(prefix, layer.attn_norm(h), positions)

    def _qkv(self, prefix: str, a: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections and rope of the layer at ``prefix`` for its normed input
        ``a [B, T, K]``: ``q [B, H, T, hd]``, ``k, v [B, Hkv, T, hd]``."""
        c = self.config
        b, t = positions.shape
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self._fused_ready():
            q, k, v = self._linear(prefix + "qkv", a).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = (self._linear(prefix + n, a) for n in ("q_proj", "k_proj", "v_proj"))
        q = q.reshape(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        angles = self._rope_angles(positions, q.dtype)
        return self._rope(q, positions, angles), self._rope(k, positions, angles), v

    def _fused_ready(self) -> bool:
        """True when the packed q/k/v and gate/up products apply (inference, packed)."""
        return "_packed" in self.__dict__ and not torch.is_grad_enabled()

    def finish(self, h: torch.Tensor, attn: torch.Tensor, i: int = 0) -> torch.Tensor:
        """Residual stream ``h [B, T, D]`` and decoder layer ``i``'s attention output
        ``[B, H, T, hd]`` -> the stream after the layer ``[B, T, D]`` (after the last layer:
        the predicted state ``g``)."""
        layer, prefix = self._layer(i)
        b, _, t, _ = attn.shape
        h = h + self._linear(prefix + "o_proj", attn.transpose(1, 2).reshape(b, t, -1))
        m = layer.mlp_norm(h)
        if self._fused_ready():
            gate, up = self._linear(prefix + "gate_up", m).chunk(2, dim=-1)
        else:
            gate, up = self._linear(prefix + "gate_proj", m), self._linear(prefix + "up_proj", m)
        return h + self._linear(prefix + "down_proj", F.silu(gate) * up)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Predicted states ``[..., D]`` -> draft-vocabulary logits ``[..., V_d]`` (the target's
        head rows, or EAGLE-3's own ``lm_head``)."""
        return self._linear("head", self.out_norm(g))

    def _groups(self) -> int:
        return self.config.num_heads // self.config.num_kv_heads

    # -- training: unrolled on its own predictions ("training-time test")
    def forward(self, states: torch.Tensor, next_tokens: torch.Tensor, steps: int, state_noise: float = 0.0,
                perturb: float = 0.0) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """:meth:`forward_unrolled`, plus (when ``perturb > 0``) the step-0 prediction
        ``[B, T, D]`` from the same input states moved by a small random perturbation of
        relative size ``perturb`` (for the stability penalty). One call, so DDP sees one graph."""
        if state_noise > 0:
            states = _add_noise(states, state_noise)
        outs = self.forward_unrolled(states, next_tokens, steps)
        moved = None
        if perturb > 0:
            moved = self.forward_unrolled(_add_noise(states, perturb), next_tokens, 1)[0]
        return outs, moved

    def forward_unrolled(self, states: torch.Tensor, next_tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Roll the predictor forward ``steps`` times over whole sequences.

        Args:
            states: ``[B, T, S, D]`` target states of positions ``0..T-1``.
            next_tokens: ``[B, T]`` the token at position ``t + 1`` for each row ``t``.
            steps: unroll depth ``K``.

        Returns ``K`` tensors ``g_k [B, T, D]``. At step ``k``, row ``t`` starts from the step
        ``k - 1`` prediction of row ``t - 1`` and attends to real rows ``<= t - k`` plus its own
        chain of predicted rows, exactly as a depth ``k + 1`` draft node does at inference.
        All steps predict the same target: the state of position ``t + 1``. Rows ``t < k``
        have no valid chain and must be masked out of the loss.
        """
        b, t = next_tokens.shape
        positions = torch.arange(t, device=next_tokens.device).expand(b, t)
        scale = 1.0 / math.sqrt(self.config.head_dim)
        g_rep = self._groups()
        causal = torch.ones(t, t, dtype=torch.bool, device=next_tokens.device).tril()
        if self.config.window:  # row t sees real rows after t - window only
            causal = causal & torch.ones_like(causal).triu(1 - self.config.window)
        # per decoder layer, the keys and values of every step so far
        keys: list[list[torch.Tensor]] = [[] for _ in range(self.config.decoder_layers)]
        values: list[list[torch.Tensor]] = [[] for _ in range(self.config.decoder_layers)]
        outs: list[torch.Tensor] = []
        x = self.fuse_states(states)
        for k in range(steps):
            if k > 0:
                x = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # row t takes row t-1's prediction
            h, q, kk, vv = self.project(x, next_tokens, positions)
            allowed = causal if k == 0 else causal.tril(-k)
            for i, (ks, vs) in enumerate(zip(keys, values)):
                if i > 0:
                    q, kk, vv = self.layer_qkv(i, h, positions)
                ks.append(kk.repeat_interleave(g_rep, dim=1))
                vs.append(vv.repeat_interleave(g_rep, dim=1))
                s0 = (q @ ks[0].transpose(-1, -2)) * scale  # [B, H, T, T]
                s0 = s0.float().masked_fill(~allowed, float("-inf"))
                diag, vals = [], []
                for j in range(1, k + 1):
                    shift = k - j
                    kj = F.pad(ks[j][:, :, : t - shift], (0, 0, shift, 0)) if shift else ks[j]
                    vj = F.pad(vs[j][:, :, : t - shift], (0, 0, shift, 0)) if shift else vs[j]
                    diag.append(((q * kj).sum(-1, keepdim=True) * scale).float())
                    vals.append(vj)
                scores = torch.cat([s0] + diag, dim=-1)
                # rows with no allowed real key (t < k) still have their own chain entry, so
                # the softmax is finite everywhere
                p = torch.softmax(scores, dim=-1).to(q.dtype)
                attn = p[..., :t] @ vs[0]
                for j, vj in enumerate(vals):
                    attn = attn + p[..., t + j : t + j + 1] * vj
                h = self.finish(h, attn, i)
            outs.append(h)
        return outs
