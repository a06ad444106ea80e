"""The state predictor: a small model (one decoder layer by default) that predicts the target's
next hidden states.

Inputs and outputs, for a row at position ``t`` (``D`` = target hidden size, ``S`` = input layers)::

    target states f_t [S, D] (layers low, mid, high)  --fuse-->  s_t [D]
    or, when rolling forward, its own previous output  ------>  s_t [D]
    [state_norm(s_t), embed_norm(E[x_{t+1}])] --inp--> decoder layer(s) (Llama-style, the
    target's width, heads and rope; ``decoder_layers``, default 1) --> g_t [D]: the
    predicted state of position t + 1
    out_norm(g_t) @ H[draft_vocab]^T --> logits [V_d] over x_{t+2}

``E`` and ``H`` are the target's own input embeddings and LM head, shared and frozen; only the
fuse/inp projections, the layer and the norms are trained and saved. ``draft_vocab`` is an
index map onto the target vocabulary (the most frequent tokens), or the whole vocabulary.

At inference (:class:`StateDrafter`) the predictor keeps its own KV cache of rows built from
real target states. A tree is grown depth by depth: the ``top_k`` candidates with the highest
cumulative log-probability are expanded, and the best ``max_nodes - 1`` nodes overall are
proposed. Expansion stops early once no frontier node can still enter the tree.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from sot.drafters.base import DraftInput, Drafter, DrafterKind, TreeBudget
from sot.drafters.pld import LookupRate, NgramIndex, PromptLookupDrafter
from sot.errors import ConfigError, DrafterCompatibilityError
from sot.tree import DraftTree

FORMAT = "sot-state-predictor/1"


# ---------------------------------------------------------------------------- config
def _rope_theta(config: Any) -> float:
    """The rope base of the target's last layer (the layer the predictor mirrors); models
    with sliding layers (Gemma 3) keep one set of rope parameters per layer type."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        types = getattr(config, "layer_types", None) or []
        params = params.get(types[-1] if types else "", next(iter(params.values())))
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", None) or 10000.0)


def _last_layer_window(model: torch.nn.Module) -> int:
    """The sliding window of the target's last decoder layer (0: full attention)."""
    from sot.models.fast_llama import layer_window

    layer = _last_decoder_layer(model)
    attention = getattr(layer, "self_attn", None)
    if attention is None:
        return 0
    return int(layer_window(attention, model.config) or 0)


def embedding_hash(weight: torch.Tensor) -> str:
    """A short fingerprint of an embedding matrix, independent of its storage dtype."""
    data = weight.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def target_fingerprint(model: torch.nn.Module) -> dict:
    """What a predictor checkpoint records about the target it was trained for."""
    cfg = model.config
    emb = model.get_input_embeddings().weight
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    return {
        "architecture": arch,
        "hidden_size": int(emb.shape[1]),
        "vocab_size": int(emb.shape[0]),
        "num_layers": int(cfg.num_hidden_layers),
        "embed_hash": embedding_hash(emb),
    }


@dataclass
class StatePredictorConfig:
    """Shape of a state predictor and the target it belongs to."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    state_layers: tuple[int, ...]
    draft_vocab_size: int
    target: dict = field(default_factory=dict)
    format: str = FORMAT
    #: decoder layers in the predictor's body (files written before this field have one)
    decoder_layers: int = 1
    #: sliding window of the predictor's attention, the target's last layer's (0: none)
    window: int = 0

    @classmethod
    def for_target(cls, model: torch.nn.Module, state_layers: tuple[int, ...], draft_vocab_size: int,
                   decoder_layers: int = 1) -> "StatePredictorConfig":
        cfg = model.config
        d = int(model.get_input_embeddings().weight.shape[1])
        heads = int(getattr(cfg, "num_attention_heads", max(1, d // 64)))
        head_dim = int(getattr(cfg, "head_dim", None) or d // heads)
        if heads * head_dim != d:  # keep the layer's width equal to the target's hidden size
            heads, head_dim = max(1, d // 64), 64 if d % 64 == 0 else d
            heads = d // head_dim
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        if heads % kv:
            kv = heads
        inter = int(getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * d)
        eps = float(getattr(cfg, "rms_norm_eps", None) or 1e-6)
        vocab = int(model.get_input_embeddings().weight.shape[0])
        if decoder_layers < 1:
            raise ConfigError(f"a state predictor needs at least one decoder layer, got {decoder_layers}")
        return cls(d, heads, kv, head_dim, inter, eps, _rope_theta(cfg), tuple(int(x) for x in state_layers),
                   min(draft_vocab_size, vocab) if draft_vocab_size > 0 else 0, target_fingerprint(model),
                   decoder_layers=int(decoder_layers), window=_last_layer_window(model))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "StatePredictorConfig":
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise DrafterCompatibilityError(f"not a SoT state predictor checkpoint (format {data.get('format')!r})")
        data["state_layers"] = tuple(data["state_layers"])
        try:
            return cls(**data)
        except TypeError as exc:  # a field this version does not know
            raise DrafterCompatibilityError(f"state predictor config not understood by this SoT version: {exc}") from None


# ---------------------------------------------------------------------------- model
class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not torch.is_grad_enabled():
            from sot.models.fast_llama import fused_rms_norm

            fused = fused_rms_norm(x.dtype, x.device)  # the same formula in one compiled call
            if fused is not None:
                return fused(x, self.weight, self.eps, None)[0]
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


def add_layer_modules(owner: torch.nn.Module, c: "StatePredictorConfig") -> None:
    """Register one decoder layer's modules on ``owner``: ``attn_norm``, ``q/k/v/o_proj``,
    ``mlp_norm``, ``gate/up/down_proj`` (no biases)."""
    d = c.hidden_size
    lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
    owner.attn_norm = RMSNorm(d, c.rms_eps)
    owner.q_proj = lin(d, c.num_heads * c.head_dim)
    owner.k_proj = lin(d, c.num_kv_heads * c.head_dim)
    owner.v_proj = lin(d, c.num_kv_heads * c.head_dim)
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
        # one norm per input layer, started from the norm the target applies to that state
        # (hidden states carry a few huge outlier dimensions; the target's norms tame them)
        self.in_norms = torch.nn.ModuleList(RMSNorm(d, c.rms_eps) for _ in range(s))
        self.fuse = lin(s * d, d)
        self.state_norm = RMSNorm(d, c.rms_eps)
        self.embed_norm = RMSNorm(d, c.rms_eps)
        self.inp = lin(2 * d, d)
        add_layer_modules(self, c)  # the first decoder layer (the file layout of one-layer predictors)
        self.out_norm = RMSNorm(d, c.rms_eps)
        # decoder layers after the first (none in the default one-layer predictor)
        self.upper = torch.nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers - 1))
        if draft_vocab is None:
            draft_vocab = torch.arange(embed.shape[0])
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long), persistent=True)
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("head", head.detach()[self.draft_vocab], persistent=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def pack_for_inference(self) -> None:
        """Pre-pack the linear weights and the draft head for the CPU BLAS (about 1.5x faster
        small-row products in bfloat16). For inference only: later weight updates are not
        seen, so call it again after changing the weights."""
        from sot.models.fast_llama import PackedLinear

        packed = {"fuse": PackedLinear(self.fuse.weight), "inp": PackedLinear(self.inp.weight),
                  "head": PackedLinear(self.head)}
        # per layer, one product for q, k and v and one for gate and up (each row's outputs
        # unchanged); the separate projections are only used with gradients, never packed
        for i in range(self.config.decoder_layers):
            layer, prefix = self._layer(i)
            packed[prefix + "qkv"] = PackedLinear(
                torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
            packed[prefix + "gate_up"] = PackedLinear(torch.cat([layer.gate_proj.weight, layer.up_proj.weight]))
            packed[prefix + "o_proj"] = PackedLinear(layer.o_proj.weight)
            packed[prefix + "down_proj"] = PackedLinear(layer.down_proj.weight)
        self.__dict__["_packed"] = packed

    def _layer(self, i: int) -> tuple[torch.nn.Module, str]:
        """Decoder layer ``i`` (the module holding its weights) and its name prefix."""
        return (self, "") if i == 0 else (self.upper[i - 1], f"upper.{i - 1}.")

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` through the linear layer ``name`` (or the head), packed when
        :meth:`pack_for_inference` was called and no gradient is needed."""
        packed = self.__dict__.get("_packed")
        if packed is None or torch.is_grad_enabled():
            return (x @ self.head.to(x.dtype).T) if name == "head" else self.get_submodule(name)(x)
        lin = packed[name]
        return lin._block(x.reshape(-1, x.shape[-1]).to(lin.weight.dtype)).view(*x.shape[:-1], -1)

    def use_full_vocabulary(self, head: torch.Tensor) -> None:
        """Propose from the target's whole vocabulary (``head [V, D]``) instead of the draft
        vocabulary; for comparing the two at inference."""
        self.draft_vocab = torch.arange(head.shape[0], device=self.draft_vocab.device)
        self.head = head.detach().to(self.head.dtype)
        if "_packed" in self.__dict__:
            self.pack_for_inference()

    # -- pieces
    def fuse_states(self, states: torch.Tensor) -> torch.Tensor:
        """``[..., S, D]`` target states -> ``[..., D]``."""
        x = states.to(self.fuse.weight.dtype)
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

    def project(self, state: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """Input projection and the first layer's attention inputs for rows ``[B, T]``.

        Returns ``h [B, T, D]`` (the residual stream), ``q [B, H, T, hd]``, ``k, v [B, Hkv, T, hd]``.
        """
        e = self.embed[tokens].to(state.dtype)
        h = self._linear("inp", torch.cat((self.state_norm(state), self.embed_norm(e)), dim=-1))
        return (h, *self.layer_qkv(0, h, positions))

    def layer_qkv(self, i: int, h: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention inputs of decoder layer ``i`` for the residual stream ``h [B, T, D]`` at
        ``positions [B, T]``: ``q [B, H, T, hd]``, ``k, v [B, Hkv, T, hd]`` (rope applied)."""
        c = self.config
        layer, prefix = self._layer(i)
        a = layer.attn_norm(h)
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
        """Predicted states ``[..., D]`` -> draft-vocabulary logits ``[..., V_d]``."""
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


# ---------------------------------------------------------------------------- files
def save_predictor(model: StatePredictor, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the trainable weights and the draft vocabulary map to one safetensors file; the
    config (with the target fingerprint) goes into its metadata."""
    tensors = {}
    for k, v in model.state_dict().items():
        tensors[k] = v.detach().to(dtype).contiguous() if v.is_floating_point() else v.detach().contiguous()
    save_file(tensors, str(path), metadata={"sot_config": model.config.to_json()})


def read_predictor_config(path: str | Path) -> StatePredictorConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"state predictor file {p} does not exist")
    try:
        with safe_open(str(p), framework="pt") as fh:
            meta = fh.metadata() or {}
    except Exception as exc:  # noqa: BLE001
        raise DrafterCompatibilityError(f"{p} is not a safetensors state predictor: {exc}") from exc
    if "sot_config" not in meta:
        raise DrafterCompatibilityError(f"{p} has no SoT state predictor config in its metadata")
    return StatePredictorConfig.from_json(meta["sot_config"])


def check_compatible(config: StatePredictorConfig, model: torch.nn.Module, path: str | Path = "checkpoint") -> None:
    """Raise :class:`DrafterCompatibilityError` unless the predictor was trained for ``model``."""
    have = target_fingerprint(model)
    want = config.target
    diffs = [f"{k}: trained for {want.get(k)!r}, target has {have[k]!r}" for k in
             ("architecture", "hidden_size", "vocab_size", "num_layers", "embed_hash") if want.get(k) != have[k]]
    if diffs:
        raise DrafterCompatibilityError(
            f"state predictor {path} was trained for another target model ({'; '.join(diffs)}); "
            "train one for this model with 'sot train'"
        )


def _final_norm_weight(model: torch.nn.Module) -> torch.Tensor | None:
    for name in ("model.norm", "model.final_layernorm", "transformer.ln_f", "gpt_neox.final_layer_norm", "model.final_norm"):
        mod = model
        for part in name.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        w = getattr(mod, "weight", None) if mod is not None else None
        if isinstance(w, torch.Tensor):
            return w
    return None


def _state_norm_weight(model: torch.nn.Module, index: int) -> torch.Tensor | None:
    """The weight of the norm the target applies to ``hidden_states[index]``: the input norm
    of layer ``index``, or none for the last entry (it is already normed)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or index >= len(layers):
        return None
    norm = getattr(layers[index], "input_layernorm", None)
    w = getattr(norm, "weight", None)
    return w if isinstance(w, torch.Tensor) else None


def _last_decoder_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers[-1] if layers is not None and len(layers) else None


def _init_from_target(pred: StatePredictor, model: torch.nn.Module) -> bool:
    """Start the predictor's first layer from the target's last decoder layer where the shapes
    match (Llama-style families), the fuse from the highest input layer, and the input
    projection from the state path. Returns whether the layer weights were copied."""
    d = pred.config.hidden_size
    s = len(pred.config.state_layers)
    with torch.no_grad():
        pred.fuse.weight[:, (s - 1) * d :] += torch.eye(d)
        pred.inp.weight[:, :d] += torch.eye(d)
    return _copy_last_layer(pred, model)


def _start_as_identity(layer: DecoderLayer, model: torch.nn.Module | None) -> None:
    """A further decoder layer starts as the identity: its attention and MLP outputs are
    zero (``o_proj`` and ``down_proj``), so a predictor grown by a layer first predicts what
    it did before; its other weights come from the target's last layer where they fit."""
    if model is not None:
        _copy_last_layer(layer, model)
    with torch.no_grad():
        layer.o_proj.weight.zero_()
        layer.down_proj.weight.zero_()


def _copy_last_layer(ours: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Copy the target's last decoder layer into ``ours`` (a module with the
    :class:`DecoderLayer` attributes) where every shape matches."""
    with torch.no_grad():
        layer = _last_decoder_layer(model)
        if layer is None:
            return False
        pairs = {
            "q_proj": getattr(getattr(layer, "self_attn", None), "q_proj", None),
            "k_proj": getattr(getattr(layer, "self_attn", None), "k_proj", None),
            "v_proj": getattr(getattr(layer, "self_attn", None), "v_proj", None),
            "o_proj": getattr(getattr(layer, "self_attn", None), "o_proj", None),
            "gate_proj": getattr(getattr(layer, "mlp", None), "gate_proj", None),
            "up_proj": getattr(getattr(layer, "mlp", None), "up_proj", None),
            "down_proj": getattr(getattr(layer, "mlp", None), "down_proj", None),
            "attn_norm": getattr(layer, "input_layernorm", None),
            "mlp_norm": getattr(layer, "post_attention_layernorm", None),
        }
        mods = {k: getattr(ours, k) for k in pairs}
        if any(src is None or getattr(src, "weight", None) is None or src.weight.shape != mods[k].weight.shape
               or getattr(src, "bias", None) is not None for k, src in pairs.items()):
            return False
        for k, src in pairs.items():
            mods[k].weight.copy_(src.weight.float())
    return True


def new_predictor(model: torch.nn.Module, state_layers: tuple[int, ...], draft_vocab: torch.Tensor | None,
                  seed: int = 0, init: str = "target", decoder_layers: int = 1) -> StatePredictor:
    """A freshly initialised predictor for ``model`` (fp32 weights).

    ``init="target"`` starts the first decoder layer from the target's last layer when the
    family allows it (the rest small random) and every further layer as the identity
    (:func:`_start_as_identity`); ``init="random"`` uses small random weights only.
    """
    if init not in ("target", "random"):
        raise ConfigError(f"init must be 'target' or 'random', got {init!r}")
    size = 0 if draft_vocab is None else int(draft_vocab.numel())
    cfg = StatePredictorConfig.for_target(model, state_layers, size, decoder_layers)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pred = StatePredictor(cfg, model.get_input_embeddings().weight, model.get_output_embeddings().weight, draft_vocab)
        for mod in pred.modules():
            if isinstance(mod, torch.nn.Linear):
                torch.nn.init.normal_(mod.weight, std=0.02)
        w = _final_norm_weight(model)
        if w is not None and w.shape == pred.out_norm.weight.shape:
            pred.out_norm.weight.data.copy_(w.float())
        for norm, layer in zip(pred.in_norms, cfg.state_layers):
            src = _state_norm_weight(model, layer)
            if src is not None and src.shape == norm.weight.shape:
                norm.weight.data.copy_(src.float())
        if init == "target":
            _init_from_target(pred, model)
            for layer in pred.upper:
                _start_as_identity(layer, model)
    return pred.float()


def load_predictor(path: str | Path, model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> StatePredictor:
    """Load a predictor for ``model``; fails with a clear message for another target."""
    cfg = read_predictor_config(path)
    check_compatible(cfg, model, path)
    with safe_open(str(path), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    vocab = tensors.get("draft_vocab")
    pred = StatePredictor(cfg, model.get_input_embeddings().weight, model.get_output_embeddings().weight, vocab)
    missing, unexpected = pred.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise DrafterCompatibilityError(f"{path} does not match the predictor layout (missing {missing}, unexpected {unexpected})")
    for param in pred.parameters():
        param.data = param.data.to(dtype)
    pred.head = pred.head.to(dtype)  # the draft-vocabulary rows only; the embeddings stay shared
    return pred.eval()


# ---------------------------------------------------------------------------- drafter
class _SeqState:
    """One sequence's predictor KV cache and last predicted state.

    Rows ``[0, length)`` are real (built from target states); rows after them are scratch
    space for the draft tree being grown and are overwritten by the next tree.
    """

    def __init__(self, layers: int = 1) -> None:
        self.layers = layers
        self.k: list[torch.Tensor] = []  # per decoder layer [Hkv, cap, hd]
        self.v: list[torch.Tensor] = []
        self.length = 0
        self.last: torch.Tensor | None = None  # [D] prediction for the root's position

    def reserve(self, n: int, like: torch.Tensor | None = None) -> None:
        """Make room for ``n`` rows after ``length`` in every layer's cache (``like``: a
        ``[Hkv, *, hd]`` tensor, needed before the first rows)."""
        if self.k and self.length + n <= self.k[0].shape[1]:
            return
        like = like if like is not None else self.k[0]
        cap = max(256, 2 * (self.length + n))
        for store in (self.k, self.v):
            for i in range(self.layers):
                grown = like.new_zeros(like.shape[0], cap, like.shape[2])
                if i < len(store):
                    grown[:, : self.length] = store[i][:, : self.length]
                    store[i] = grown
                else:
                    store.append(grown)

    def write(self, layer: int, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store decoder layer ``layer``'s rows ``k, v [Hkv, n, hd]`` at ``length + at``
        (reserved beforehand)."""
        n = k.shape[1]
        self.k[layer][:, self.length + at : self.length + at + n] = k
        self.v[layer][:, self.length + at : self.length + at + n] = v

    def attend(self, layer: int, q: torch.Tensor, extra: int, mask: torch.Tensor,
               first: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder layer ``layer``'s ``q [H, m, hd]`` over the real rows plus the first
        ``extra`` scratch rows, which are visible per ``mask [m, extra]``. Real rows are all
        visible, or (a sliding window) from ``first [m]`` on per query. Returns ``[H, m, hd]``."""
        n = self.length + extra
        full = torch.ones(q.shape[1], n, dtype=torch.bool, device=q.device)
        full[:, self.length :] = mask
        if first is not None:
            full[:, : self.length] = torch.arange(self.length, device=q.device) >= first[:, None]
        return F.scaled_dot_product_attention(q.unsqueeze(0), self.k[layer][None, :, :n], self.v[layer][None, :, :n],
                                              attn_mask=full, enable_gqa=True).squeeze(0)


class _Growth:
    """A tree being grown for one sequence: candidate nodes and the draft rows behind them."""

    def __init__(self, seq: _SeqState, root: int, root_pos: int) -> None:
        self.seq, self.root, self.root_pos = seq, root, root_pos
        # candidate nodes: token, parent (-1 = root), depth, cumulative log-prob
        self.tok: list[int] = []
        self.par: list[int] = []
        self.dep: list[int] = []
        self.score: list[float] = []
        self.frontier: list[int] = []
        self.row_of: dict[int, int] = {}  # expanded node -> its scratch row
        self.anc_rows: list[list[int]] = []  # scratch row -> scratch rows it may see
        self.state: dict[int, torch.Tensor] = {}  # expanded node -> predicted state [D]

    def add(self, parent: int, depth: int, base: float, logp: list[float], ids: list[int], vocab: list[int]) -> list[int]:
        new = []
        for s, i in zip(logp, ids):
            self.tok.append(vocab[i]), self.par.append(parent), self.dep.append(depth), self.score.append(base + s)
            new.append(len(self.tok) - 1)
        return new


class StateDrafter(Drafter):
    """Proposes trees from a :class:`StatePredictor` rolled forward on its own states.

    All sequences of a batch are drafted together: at every depth one predictor pass runs
    over the frontier nodes of every tree (attention alone is per sequence, over its own
    cache).

    Args:
        predictor: the loaded predictor.
        top_k: children considered per expanded node, and nodes expanded per depth.
        lookup: merge the best prompt-lookup continuation into each tree, and offer it alone
            (:meth:`propose_free`) on the steps the policy keeps the predictor idle.
        lookup_confidence: the confidence of the ``d``-th lookup token is this to the ``d``;
            ``None`` (default) uses the sequence's measured lookup match rate
            (:class:`~sot.drafters.pld.LookupRate`).
        min_confidence: nodes below this cumulative draft probability are not expanded.
    """

    kind = DrafterKind.STATE

    def __init__(self, predictor: StatePredictor, top_k: int = 8, lookup: bool = True,
                 lookup_confidence: float | None = None, min_confidence: float = 0.05) -> None:
        if top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {top_k}")
        self.lookup = PromptLookupDrafter() if lookup else None
        self.lookup_confidence = lookup_confidence
        self.min_confidence = min_confidence
        self.predictor = predictor.eval()
        self.predictor.pack_for_inference()
        self.state_layers = tuple(predictor.config.state_layers)
        self.layers = predictor.config.decoder_layers
        self.top_k = top_k
        self.seqs: dict[int, _SeqState] = {}  # by DraftInput.sequence
        self.rates: dict[int, LookupRate] = {}
        self.indexes: dict[int, NgramIndex] = {}  # each sequence's n-grams, for the lookup
        # per sequence: (context length, best lookup continuation, whether it reached the
        # context's end) of this step's search
        self._found: dict[int, tuple[int, list[int], bool]] = {}
        self.dtype = next(predictor.parameters()).dtype
        self._vocab = predictor.draft_vocab.tolist()

    @property
    def static_width(self) -> int:  # the static policy's beam: top_k nodes per depth
        return self.top_k

    def reset(self, batch_size: int = 0) -> None:
        self.seqs.clear()
        self.rates.clear()
        self.indexes.clear()
        self._found.clear()

    def release(self, sequence: int) -> None:
        self.seqs.pop(sequence, None)
        self.rates.pop(sequence, None)
        self.indexes.pop(sequence, None)
        self._found.pop(sequence, None)

    def _seq(self, sequence: int) -> _SeqState:
        if sequence not in self.seqs:
            self.seqs[sequence] = _SeqState(self.layers)
        return self.seqs[sequence]

    def _index(self, sequence: int) -> NgramIndex:
        if sequence not in self.indexes:
            self.indexes[sequence] = NgramIndex(self.lookup.max_ngram, self.lookup.min_ngram)
        return self.indexes[sequence]

    def _rate(self, sequence: int) -> LookupRate:
        if sequence not in self.rates:
            self.rates[sequence] = LookupRate()
        return self.rates[sequence]

    def prepare(self, inputs: list[DraftInput]) -> None:
        """Absorb the given states (a new sequence's prompt) into the predictor caches."""
        self._absorb_inputs(inputs)

    def _lookup(self, x: DraftInput, depth: int) -> list[int]:
        """The best prompt-lookup continuation of ``x.context``, at most ``depth`` tokens (empty
        when nothing matches), recorded with the sequence's :class:`LookupRate`. A step searches
        once per sequence: a second call on the same context (the drafter merging the path
        that :meth:`propose_free` found) reuses the first search, cut to ``depth``; the best
        match is the same, since it is the most recent occurrence of the longest n-gram."""
        rate = self._rate(x.sequence)
        rate.update(x.context)
        known = self._found.get(x.sequence)
        if known is not None and known[0] == len(x.context) and (len(known[1]) >= depth or known[2]):
            best = known[1][:depth]
        else:
            best = self._index(x.sequence).best(x.context, depth)
            # a continuation shorter than asked for ends at the context's end: it is complete
            self._found[x.sequence] = (len(x.context), best, len(best) < depth)
        if best:
            rate.proposed(x.context, best)
        return best

    def propose_free(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree] | None:
        """The best prompt-lookup continuation of each sequence as a chain, node ``d`` with
        confidence ``rate ** d`` (the sequence's measured match rate); root-only trees where
        nothing matches. ``None`` without lookup."""
        if self.lookup is None:
            return None
        out = []
        for x in inputs:
            best = self._lookup(x, min(budget.max_depth, budget.max_nodes - 1))
            root = x.context[-1]
            out.append(self._rate(x.sequence).chain(root, best) if best else DraftTree([root], [-1], [0], [1.0]))
        return out

    @torch.no_grad()
    def _absorb(self, items: list[tuple[_SeqState, torch.Tensor, list[int], int]]) -> None:
        """Add real rows to the sequences' predictor caches in one pass. Each item is
        ``(seq, states [n, S, D], next_tokens [n], first_pos)``."""
        p = self.predictor
        self.passes += 1
        x = p.fuse_states(torch.cat([it[1] for it in items]).to(self.dtype)).unsqueeze(0)
        tokens = torch.tensor([[t for it in items for t in it[2]]])
        pos = torch.tensor([[it[3] + i for it in items for i in range(it[1].shape[0])]])
        h, q, k, v = p.project(x, tokens, pos)
        window = p.config.window
        for i in range(self.layers):
            if i > 0:
                q, k, v = p.layer_qkv(i, h, pos)
            outs, at = [], 0
            for seq, states, _, _ in items:
                n = states.shape[0]
                seq.reserve(n, k[0])
                seq.write(i, 0, k[0, :, at : at + n], v[0, :, at : at + n])
                causal = torch.ones(n, n, dtype=torch.bool).tril()
                first = None
                if window:  # row at position r sees rows after r - window, new ones included
                    causal &= torch.ones(n, n, dtype=torch.bool).triu(1 - window)
                    first = pos[0, at : at + n] - window + 1
                outs.append(seq.attend(i, q[0, :, at : at + n], n, causal, first))
                at += n
            h = p.finish(h, torch.cat(outs, dim=1).unsqueeze(0), i)
        g, at = h[0], 0
        for seq, states, _, _ in items:
            seq.length += states.shape[0]
            at += states.shape[0]
            seq.last = g[at - 1]

    def _absorb_inputs(self, inputs: list[DraftInput]) -> None:
        """Absorb the states the inputs carry, all sequences in one pass."""
        fresh = []
        for x in inputs:
            if x.states is not None and x.states.shape[0] > 0:
                n = x.states.shape[0]
                first = len(x.context) - 1 - n
                fresh.append((self._seq(x.sequence), x.states, x.context[first + 1 :], first))
        if fresh:
            self._absorb(fresh)

    @torch.no_grad()
    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        self._absorb_inputs(inputs)
        growths: dict[int, _Growth] = {}
        for j, x in enumerate(inputs):
            seq = self._seq(x.sequence)
            if seq.last is not None and budget.max_nodes >= 2 and budget.max_depth >= 1:
                growths[j] = _Growth(seq, x.context[-1], len(x.context) - 1)
        if growths:
            self._grow(list(growths.values()), budget)
        out = []
        if self.record_states:
            self._predicted = {x.sequence: self._node_states(growths[j]) for j, x in enumerate(inputs) if j in growths}
        for j, x in enumerate(inputs):
            if j not in growths:
                out.append(DraftTree([x.context[-1]], [-1], [0]))
                continue
            tree = self._finish_tree(growths[j], budget)
            if self.lookup is not None and budget.width == 0:
                tree = self._merge_lookup(tree, x, budget)
            out.append(tree)
        return out

    def _node_states(self, gr: _Growth) -> dict[tuple[int, ...], torch.Tensor]:
        """The predicted state (after the output norm) of the root and of every expanded
        candidate, keyed by token path."""
        norm = self.predictor.out_norm
        paths: dict[int, tuple[int, ...]] = {}
        for c in range(len(gr.tok)):  # parents come before their children
            paths[c] = (paths[gr.par[c]] if gr.par[c] >= 0 else ()) + (gr.tok[c],)
        out = {(): norm(gr.seq.last).float()}
        out.update({paths[c]: norm(g).float() for c, g in gr.state.items()})
        return out

    def predicted_states(self, sequence: int) -> dict[tuple[int, ...], torch.Tensor] | None:
        return getattr(self, "_predicted", {}).get(sequence)

    def _merge_lookup(self, tree: DraftTree, x: DraftInput, budget: TreeBudget) -> DraftTree:
        """Merge the best prompt-lookup path into ``tree``; the best ``max_nodes - 1`` nodes of
        both, by confidence, are kept (shared prefixes count once)."""
        best = self._lookup(x, budget.max_depth)
        if not best:
            return tree
        r = self.lookup_confidence if self.lookup_confidence is not None else self._rate(x.sequence).rate
        probs = tree.draft_probs or [1.0] * tree.size
        paths: list[tuple[float, tuple[int, ...]]] = []
        node_path: list[tuple[int, ...]] = [()]
        for i in range(1, tree.size):
            node_path.append(node_path[tree.parents[i]] + (tree.tokens[i],))
            paths.append((probs[i], node_path[i]))
        paths += [(r**d, tuple(best[:d])) for d in range(1, len(best) + 1)]
        # a prefix is never less confident than its extension, so this order inserts parents first
        paths.sort(key=lambda x: (-x[0], len(x[1])))
        tokens, parents, depths, conf = [tree.tokens[0]], [-1], [0], [1.0]
        index: dict[tuple[int, ...], int] = {(): 0}
        for p, path in paths:
            if path in index:
                conf[index[path]] = max(conf[index[path]], p)
                continue
            if len(tokens) >= budget.max_nodes or path[:-1] not in index:
                continue
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(index[path[:-1]])
            depths.append(len(path))
            conf.append(p)
        return DraftTree(tokens, parents, depths, conf)

    def _grow(self, growths: list[_Growth], budget: TreeBudget) -> None:
        """Grow every tree by cumulative confidence, all sequences in one predictor pass per
        depth: at every depth the ``top_k`` best new nodes of a tree are expanded, until its
        budget is filled, confidence falls below ``min_confidence`` or ``max_depth`` is
        reached. With ``budget.width``, a fixed beam of that many nodes per depth."""
        p = self.predictor
        fixed = budget.width > 0
        keep = budget.max_nodes - 1
        k_top = budget.width if fixed else self.top_k
        least = self.min_confidence if budget.min_confidence is None else budget.min_confidence
        floor = math.log(least) if least > 0 and not fixed else -math.inf
        self.passes += 1
        last = torch.stack([gr.seq.last for gr in growths])  # [B, D]
        logp = torch.log_softmax(p.logits(last).float(), dim=-1)
        val, idx = logp.topk(min(k_top, logp.shape[-1]), dim=-1)
        for gr, vs, ids in zip(growths, val.tolist(), idx.tolist()):
            gr.frontier = gr.add(-1, 1, 0.0, vs, ids, self._vocab)
            gr.seq.reserve(k_top * budget.max_depth)
        for depth in range(1, budget.max_depth):
            live = []
            for gr in growths:
                front = [n for n in gr.frontier if gr.score[n] >= floor]
                if front and not fixed and len(gr.score) >= keep:
                    bar = sorted(gr.score, reverse=True)[keep - 1]
                    front = [n for n in front if gr.score[n] > bar]
                gr.frontier = front
                if front:
                    live.append(gr)
            if not live:
                break
            states, tokens, positions = [], [], []
            for gr in live:
                for n in gr.frontier:
                    states.append(gr.seq.last if gr.par[n] == -1 else gr.state[gr.par[n]])
                    tokens.append(gr.tok[n])
                    positions.append(gr.root_pos - 1 + depth)
            self.passes += 1
            pos = torch.tensor([positions])
            h, q, k, v = p.project(torch.stack(states).unsqueeze(0), torch.tensor([tokens]), pos)
            masks = []  # per live tree: (first scratch row, visibility [m, base + m])
            for gr in live:
                m = len(gr.frontier)
                base = len(gr.anc_rows)
                for j, n in enumerate(gr.frontier):
                    parent_rows = gr.anc_rows[gr.row_of[gr.par[n]]] if gr.par[n] in gr.row_of else []
                    gr.anc_rows.append(parent_rows + [base + j])
                    gr.row_of[n] = base + j
                mask = torch.zeros(m, base + m, dtype=torch.bool)
                for j in range(m):
                    mask[j, gr.anc_rows[base + j]] = True
                masks.append((base, mask))
            for i in range(self.layers):
                if i > 0:
                    q, k, v = p.layer_qkv(i, h, pos)
                outs, at = [], 0
                for gr, (base, mask) in zip(live, masks):
                    m = mask.shape[0]
                    gr.seq.write(i, base, k[0, :, at : at + m], v[0, :, at : at + m])
                    first = pos[0, at : at + m] - p.config.window + 1 if p.config.window else None
                    outs.append(gr.seq.attend(i, q[0, :, at : at + m], base + m, mask, first))
                    at += m
                h = p.finish(h, torch.cat(outs, dim=1).unsqueeze(0), i)
            g = h[0]  # [M, D]
            logp = torch.log_softmax(p.logits(g).float(), dim=-1)
            val, idx = logp.topk(min(k_top, logp.shape[-1]), dim=-1)
            vals, ids = val.tolist(), idx.tolist()
            at = 0
            for gr in live:
                cand = []
                for n in gr.frontier:
                    gr.state[n] = g[at]
                    cand += gr.add(n, depth + 1, gr.score[n], vals[at], ids[at], self._vocab)
                    at += 1
                cand.sort(key=lambda c: -gr.score[c])
                gr.frontier = cand[:k_top]

    @staticmethod
    def _finish_tree(gr: _Growth, budget: TreeBudget) -> DraftTree:
        """The proposed tree: the best ``max_nodes - 1`` candidates (a parent always scores at
        least as high as its child and ties go to the shallower node, so the set is closed
        under ancestors), or with ``budget.width`` the whole beam."""
        n_cand = len(gr.tok)
        if budget.width > 0:  # the beam: the frontier of every depth, whatever its score
            last = set(gr.frontier)
            chosen = [c for c in range(n_cand) if c in gr.row_of or c in last]
        else:
            chosen = sorted(range(n_cand), key=lambda c: (-gr.score[c], gr.dep[c], c))[: budget.max_nodes - 1]
        chosen.sort(key=lambda c: (gr.dep[c], c))
        index = {c: i + 1 for i, c in enumerate(chosen)}
        tokens = [gr.root] + [gr.tok[c] for c in chosen]
        parents = [-1] + [0 if gr.par[c] == -1 else index[gr.par[c]] for c in chosen]
        depths = [0] + [gr.dep[c] for c in chosen]
        probs = [1.0] + [math.exp(gr.score[c]) for c in chosen]
        return DraftTree(tokens, parents, depths, probs)
