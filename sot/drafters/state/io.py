"""Predictor files, and new predictors started from the target's own weights."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sot.drafters.state.config import NATIVE, StatePredictorConfig, _last_decoder_layer, check_compatible
from sot.drafters.state.eagle3 import load_eagle3
from sot.drafters.state.model import DecoderLayer, StatePredictor
from sot.errors import ConfigError, DrafterCompatibilityError
from sot.files import replace_file


def save_predictor(model: StatePredictor, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the trainable weights and the draft vocabulary map to one safetensors file; the
    config (with the target fingerprint) goes into its metadata. The file is written beside
    ``path`` and renamed over it, so a process stopped while saving leaves the previous file,
    and it is readable by all (0644), as the checkpoints are."""
    tensors = {}
    for k, v in model.state_dict().items():
        tensors[k] = v.detach().to(dtype).contiguous() if v.is_floating_point() else v.detach().contiguous()
    replace_file(path, lambda part: save_file(tensors, str(part), metadata={"sot_config": model.config.to_json()}))


def read_predictor_config(path: str | Path) -> StatePredictorConfig:
    """The configuration stored in a predictor file's metadata, without reading its weights;
    :class:`ConfigError` for a missing file or one that is not a state predictor."""
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


def _init_from_target(pred: StatePredictor, model: torch.nn.Module) -> bool:
    """Start the predictor's first layer from the target's last decoder layer where the shapes
    match (Llama-style families), the fuse from the highest input layer, and the input
    projection from the state path. Returns whether the layer weights were copied.

    EAGLE-3's q/k/v read ``[embedding, state]``: the target layer's projections go to the
    state half (the embedding half keeps its small random start), and ``hidden_norm`` starts
    from that layer's input norm."""
    d = pred.config.hidden_size
    s = len(pred.config.state_layers)
    with torch.no_grad():
        pred.fuse.weight[:, (s - 1) * d :] += torch.eye(d)
        if not pred.eagle3:
            pred.inp.weight[:, :d] += torch.eye(d)
            return _copy_last_layer(pred, model)
        shadow = DecoderLayer(pred.config)  # the shapes of a plain layer, to copy into
        if not _copy_last_layer(shadow, model):
            return False
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(pred, name).weight[:, d:] = getattr(shadow, name).weight
        for name in ("o_proj", "gate_proj", "up_proj", "down_proj", "mlp_norm"):
            getattr(pred, name).weight.copy_(getattr(shadow, name).weight)
        pred.state_norm.weight.copy_(shadow.attn_norm.weight)
    return True


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
                  seed: int = 0, init: str = "target", decoder_layers: int = 1, arch: str = NATIVE,
                  like: StatePredictorConfig | None = None) -> StatePredictor:
    """A freshly initialised predictor for ``model`` (fp32 weights) of architecture ``arch``
    (``native`` or ``eagle3``, :class:`StatePredictor`). Its shape (heads, widths, norm
    epsilon, rope base) follows the target's, or ``like``'s where given (a predictor it starts
    from, whose settings may differ from the target's, as a published EAGLE-3 head's can).

    ``init="target"`` starts the first decoder layer from the target's last layer when the
    family allows it (the rest small random) and every further layer as the identity
    (:func:`_start_as_identity`); ``init="random"`` uses small random weights only.
    """
    if init not in ("target", "random"):
        raise ConfigError(f"init must be 'target' or 'random', got {init!r}")
    size = 0 if draft_vocab is None else int(draft_vocab.numel())
    cfg = StatePredictorConfig.for_target(model, state_layers, size, decoder_layers, arch)
    if like is not None:
        cfg = dataclasses.replace(like, state_layers=cfg.state_layers, draft_vocab_size=cfg.draft_vocab_size,
                                  decoder_layers=decoder_layers, arch=arch, target=cfg.target)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pred = StatePredictor(cfg, model.get_input_embeddings().weight, model.get_output_embeddings().weight, draft_vocab)
        for mod in pred.modules():
            if isinstance(mod, torch.nn.Linear) and mod is not getattr(pred, "lm_head", None):
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
    """Load a predictor for ``model``: a SoT predictor file, or a folder with an EAGLE-3
    checkpoint (:func:`sot.drafters.state.eagle3.load_eagle3`); fails with a clear message
    for another target."""
    device = model.get_input_embeddings().weight.device
    if Path(path).is_dir():
        return load_eagle3(path, model, dtype).to(device)
    cfg = read_predictor_config(path)
    check_compatible(cfg, model, path)
    with safe_open(str(path), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    vocab = tensors.get("draft_vocab")
    pred = StatePredictor(cfg, model.get_input_embeddings().weight, model.get_output_embeddings().weight, vocab)
    missing, unexpected = pred.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise DrafterCompatibilityError(f"{path} does not match the predictor layout (missing {missing}, unexpected {unexpected})")
    return pred.cast_for_inference(dtype).to(device)  # (on the target's device, as its states are)


def grow_predictor(path: str | Path, model: torch.nn.Module, state_layers: tuple[int, ...], decoder_layers: int,
                   recounted: tuple[torch.Tensor | None] | None = None, seed: int = 0, init: str = "target",
                   ) -> tuple[StatePredictor, set[str]]:
    """A predictor for ``model`` that starts from the file at ``path``: its weights, and, when
    ``decoder_layers`` exceeds the file's, further layers that start as the identity (with
    ``init="target"``), so the new predictor predicts exactly what the file did.
    ``recounted``, when given, holds the draft vocabulary that replaces the file's (``(None,)``:
    the whole vocabulary).

    Returns the predictor (float32) and the names of the parameters the file did not have
    (the added layers', which training may give a larger learning rate)."""
    start_from = load_predictor(path, model)
    if tuple(start_from.config.state_layers) != tuple(state_layers):
        raise ConfigError(f"{path} uses layers {start_from.config.state_layers}, the data {tuple(state_layers)}")
    if decoder_layers < start_from.config.decoder_layers:
        raise ConfigError(f"{path} has {start_from.config.decoder_layers} decoder layers; "
                          f"--decoder-layers {decoder_layers} cannot drop any")
    if recounted is not None and start_from.eagle3:
        raise ConfigError(f"{path} is an EAGLE-3 predictor, whose head is trained over its draft vocabulary; "
                          "it cannot be recounted (drop --recount-vocab)")
    vocab = start_from.draft_vocab if recounted is None else recounted[0]
    pred = new_predictor(model, state_layers, None if vocab is None else vocab.clone(), seed, init, decoder_layers,
                         start_from.config.arch, like=start_from.config)
    # layers beyond the file's keep their fresh start (the identity, with init "target")
    weights = {k: v for k, v in start_from.state_dict().items() if k != "draft_vocab"}
    missing, _ = pred.load_state_dict(weights, strict=False)
    if any(not k.startswith("upper.") and k != "draft_vocab" for k in missing):
        raise ConfigError(f"{path} lacks predictor weights {missing}")
    return pred.float(), {k for k in missing if k.startswith("upper.")}
