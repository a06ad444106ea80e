"""The state predictor's shape and the target it belongs to (see :mod:`sot.drafters.state`)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sot.errors import ConfigError, DrafterCompatibilityError
from sot.fingerprint import target_fingerprint
from sot.models.support import text_config

FORMAT = "sot-state-predictor/1"
#: predictor architectures: SoT's own (a norm per input layer, an input projection in front of
#: a standard decoder layer) and EAGLE-3's draft layer (:mod:`sot.drafters.state.eagle3`)
NATIVE, EAGLE3 = "native", "eagle3"
ARCHES = (NATIVE, EAGLE3)


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


def default_state_layers(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 choice of a low, a middle and a high layer: 2, L/2 and L-3 (indices into
    ``hidden_states``, where 0 is the embeddings). Where those are not three distinct layers
    (fewer than 7), 1, L/2 and L-1, which are from 4 layers on; below that, clamped."""
    chosen = (2, num_layers // 2, num_layers - 3)
    if 1 <= chosen[0] < chosen[1] < chosen[2] < num_layers:
        return chosen
    if num_layers >= 4:
        return (1, num_layers // 2, num_layers - 1)
    low = min(2, num_layers)
    return (low, max(low, num_layers // 2), max(low, num_layers - 3))


def _last_layer_window(model: torch.nn.Module) -> int:
    """The sliding window of the target's last decoder layer (0: full attention)."""
    from sot.models.fast_llama import layer_window

    layer = _last_decoder_layer(model)
    attention = getattr(layer, "self_attn", None)
    if attention is None:
        return 0
    return int(layer_window(attention, text_config(model.config)) or 0)


def _last_decoder_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    return layers[-1] if layers is not None and len(layers) else None


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
    #: ``native`` or ``eagle3`` (files written before this field are native)
    arch: str = NATIVE
    #: EAGLE-3 only: the residual stream starts from the normed state (``hidden_norm(h)``)
    #: instead of the state itself, as some published heads do
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ConfigError(f"unknown predictor architecture {self.arch!r}; choose from {', '.join(ARCHES)}")
        if self.arch == EAGLE3 and self.decoder_layers != 1:
            raise ConfigError(f"an EAGLE-3 predictor has one decoder layer, not {self.decoder_layers}")

    @classmethod
    def for_target(cls, model: torch.nn.Module, state_layers: tuple[int, ...], draft_vocab_size: int,
                   decoder_layers: int = 1, arch: str = NATIVE) -> "StatePredictorConfig":
        cfg = text_config(model.config)
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
                   decoder_layers=int(decoder_layers), window=_last_layer_window(model), arch=arch)

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


def check_compatible(config: StatePredictorConfig, model: torch.nn.Module, path: str | Path = "checkpoint") -> None:
    """Raise :class:`DrafterCompatibilityError` unless the predictor was trained for ``model``."""
    have = target_fingerprint(model)
    want = config.target
    diffs = [f"{k}: trained for {want.get(k)!r}, target has {have[k]!r}" for k in
             ("architecture", "hidden_size", "vocab_size", "num_layers", "embed_hash") if want.get(k) != have[k]]
    if diffs:
        raise DrafterCompatibilityError(
            f"state predictor {path} was trained for another target model ({'; '.join(diffs)}); "
            "give the model it was trained for (--model), or train one for this model with 'sot train'"
        )
