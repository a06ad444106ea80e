"""EAGLE-3 checkpoints: SoT's ``eagle3`` predictors written in, and read from, the folder layout
that vLLM and SGLang serve as draft heads (``config.json`` + ``model.safetensors``).

The folder holds one decoder layer (``midlayer.*``), ``fc [D, 3D]``, ``norm``, ``lm_head
[V_d, D]`` and the vocabulary maps ``d2t`` (int64 ``[V_d]``, the offset ``target_id -
draft_id``) and ``t2d`` (bool ``[V]``). The token embeddings are the target's and are not
stored.

The input layers are named twice in ``config.json``, because the two engines count them
differently: ``eagle_aux_hidden_state_layer_ids`` (vLLM) lists the layers whose *input* is
taken, which are Hugging Face ``hidden_states`` indices and SoT's ``state_layers``;
``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang) lists the layers whose *output* is
taken, one less.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sot.drafters.state.config import EAGLE3, StatePredictorConfig, check_compatible, default_state_layers
from sot.drafters.state.model import StatePredictor
from sot.errors import ConfigError, DrafterCompatibilityError
from sot.fingerprint import target_fingerprint
from sot.models.support import text_config

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: what SoT adds to ``config.json`` (the engines ignore it): the target's fingerprint
SOT_KEY = "sot"

#: SoT's parameter names -> EAGLE-3's tensor names
NAMES = {
    "fuse.weight": "fc.weight",
    "embed_norm.weight": "midlayer.input_layernorm.weight",
    "state_norm.weight": "midlayer.hidden_norm.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "mlp_norm.weight": "midlayer.post_attention_layernorm.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "out_norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
#: tensors some published heads carry that SoT does not use (the target's embeddings are shared)
IGNORED = ("embed_tokens.weight",)


def served_layers_problem(state_layers: tuple[int, ...], num_layers: int) -> str | None:
    """Why vLLM and SGLang could not serve a head reading ``state_layers`` (Hugging Face
    ``hidden_states`` indices) of a ``num_layers``-layer target, or ``None``. Both capture each
    listed layer once and join them in ascending order, so the list must be three distinct
    layers in that order; and both take the input of a decoder layer after the first, so each
    must be in ``1..num_layers - 1`` (0, the embeddings, and ``num_layers``, the last layer's
    output, are never captured)."""
    layers = list(state_layers)
    if len(layers) != 3:
        return f"EAGLE-3 takes three input layers, not {len(layers)} ({layers})"
    if layers != sorted(set(layers)):
        return (f"input layers {layers} must be distinct and ascending: the engines capture each layer once "
                "and join them in ascending order")
    if layers[0] < 1 or layers[-1] > num_layers - 1:
        return (f"input layers {layers} must lie in 1..{num_layers - 1} for a {num_layers}-layer target: the "
                "engines take the inputs of decoder layers after the first")
    return None


def layer_ids(state_layers: tuple[int, ...]) -> dict[str, list[int]]:
    """The input layers (Hugging Face ``hidden_states`` indices) in each engine's convention:
    ``{"vllm": [...], "sglang": [...]}`` (SGLang's are one less)."""
    return {"vllm": [int(i) for i in state_layers], "sglang": [int(i) - 1 for i in state_layers]}


def export_eagle3(pred: StatePredictor, out_dir: str | Path, model: torch.nn.Module,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``pred`` (an ``eagle3`` predictor trained for ``model``) as an EAGLE-3 folder.

    Args:
        pred: the predictor; its weights are written in ``dtype``.
        out_dir: the folder to write (created; existing files of the same names are replaced).
        model: the target (for ``max_position_embeddings``, token ids and its fingerprint).
        dtype: the weights' dtype in the file (bfloat16, as the predictor files are).

    Returns the folder.
    """
    c = pred.config
    if not pred.eagle3:
        raise ConfigError("this is a native SoT predictor: EAGLE-3 has no place for its per-layer input norms "
                          "and input projection. Train one in EAGLE-3's layout with 'sot train fit --arch eagle3'")
    problem = served_layers_problem(c.state_layers, int(text_config(model.config).num_hidden_layers))
    if problem:
        raise ConfigError(f"{problem}; train the predictor on a state cache prepared with such --layers")
    if c.window:
        raise ConfigError(f"this predictor attends within a sliding window of {c.window} tokens, which "
                          f"{ARCHITECTURE} cannot express")
    check_compatible(c, model)
    tcfg = text_config(model.config)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    draft = pred.draft_vocab.to(torch.long).cpu()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft] = True
    if int(t2d.sum()) != draft.numel():
        raise ConfigError("the predictor's draft vocabulary lists a token twice")
    params = dict(pred.named_parameters())
    tensors = {NAMES[k]: params[k].detach().to(dtype).cpu().contiguous() for k in NAMES}
    tensors["d2t"] = (draft - torch.arange(draft.numel())).contiguous()
    tensors["t2d"] = t2d
    ids = layer_ids(c.state_layers)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(f"{c.rms_eps:.7g}"),  # (as the target wrote it: 1e-05, not float32's 9.9999997e-06)
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": int(getattr(tcfg, "max_position_embeddings", 0) or 2048),
        "vocab_size": vocab,
        "draft_vocab_size": int(draft.numel()),
        "target_hidden_size": c.hidden_size,
        "tie_word_embeddings": False,
        "norm_before_residual": bool(c.norm_before_residual),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": getattr(tcfg, "bos_token_id", None) or getattr(model.config, "bos_token_id", None),
        "eos_token_id": getattr(tcfg, "eos_token_id", None) or getattr(model.config, "eos_token_id", None),
        "eagle_aux_hidden_state_layer_ids": ids["vllm"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids["sglang"], "use_aux_hidden_state": True},
        SOT_KEY: {"target": c.target},
    }
    out = Path(out_dir)
    check_export_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    # both files are written beside their names and renamed last, so an export stopped midway
    # leaves the folder's earlier head whole rather than new weights under an old config
    staged_weights, staged_config = out / f".{WEIGHTS_FILE}.{os.getpid()}", out / f".{CONFIG_FILE}.{os.getpid()}"
    save_file(tensors, str(staged_weights), metadata={"format": "pt"})
    os.chmod(staged_weights, 0o644)  # (written owner-only) readable by a server running as another user
    staged_config.write_text(json.dumps(config, indent=2) + "\n")
    staged_weights.replace(out / WEIGHTS_FILE)
    staged_config.replace(out / CONFIG_FILE)
    return out


def check_export_folder(out: Path) -> None:
    """A :class:`ConfigError` unless ``out`` is a new or empty folder, or one holding only an
    EAGLE-3 head (which an export replaces): never a model's folder or anything else."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; give a folder to write the head into")
    if not out.is_dir():
        return
    staged = (f".{WEIGHTS_FILE}.", f".{CONFIG_FILE}.")  # an earlier export's, stopped before its renames
    others = sorted(p.name for p in out.iterdir()
                    if p.name not in (CONFIG_FILE, WEIGHTS_FILE) and not p.name.startswith(staged))
    head = True
    if (out / CONFIG_FILE).is_file():
        try:
            head = ARCHITECTURE in (json.loads((out / CONFIG_FILE).read_text()).get("architectures") or [])
        except (ValueError, AttributeError):
            head = False
    if others or not head:
        what = f"holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}" if others else \
            f"holds a {CONFIG_FILE} that is not an EAGLE-3 head's"
        raise ConfigError(f"{out} {what}; give a new or empty folder (an export writes {CONFIG_FILE} and "
                          f"{WEIGHTS_FILE})")


def _state_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """SoT's ``state_layers`` from an EAGLE-3 config: vLLM's ids as they are, else SGLang's
    plus one, else EAGLE-3's default (the inputs of layers 2, L/2 and L-3)."""
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"])
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(int(i) + 1 for i in nested)
    return default_state_layers(num_layers)


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if (path / "predictor.safetensors").is_file() and (path / "checkpoint.pt").is_file():
        raise DrafterCompatibilityError(f"{path} is a training run's folder; give its predictor file, "
                                        f"{path / 'predictor.safetensors'}")
    if not cfg_file.is_file():
        raise DrafterCompatibilityError(f"{path} has no {CONFIG_FILE}: not an EAGLE-3 checkpoint folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise DrafterCompatibilityError(f"{cfg_file} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise DrafterCompatibilityError(f"{cfg_file} is not a JSON object, so not a model configuration")
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise DrafterCompatibilityError(
            f"{cfg_file} names architectures {cfg.get('architectures')}, not {ARCHITECTURE}; "
            "a folder given as a predictor must hold an EAGLE-3 head")
    index = path / (WEIGHTS_FILE + ".index.json")
    if weights.is_file():
        files = [weights]
    elif index.is_file():  # a sharded checkpoint
        try:
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError) as exc:
            raise DrafterCompatibilityError(f"{index} is not a safetensors index: {exc}") from None
    else:
        raise DrafterCompatibilityError(f"{path} has no {WEIGHTS_FILE} (EAGLE-3 heads are read from safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise DrafterCompatibilityError(f"{file}, named by {index.name}, is missing")
        with safe_open(str(file), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    return cfg, tensors


def eagle3_config(cfg: dict, model: torch.nn.Module, path: Path) -> StatePredictorConfig:
    """SoT's config for the EAGLE-3 head described by ``cfg`` (its ``config.json``) on
    ``model``; refuses, with the sizes that differ, a head made for another target, and names
    a field that cannot be read."""
    try:
        return _eagle3_config(cfg, model, path)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        what = f"lacks {exc}" if isinstance(exc, KeyError) else f"has a field SoT cannot read ({exc})"
        raise DrafterCompatibilityError(f"{path}/{CONFIG_FILE} {what}") from None


def _eagle3_config(cfg: dict, model: torch.nn.Module, path: Path) -> StatePredictorConfig:
    emb = model.get_input_embeddings().weight
    vocab, d = int(emb.shape[0]), int(emb.shape[1])
    num_layers = int(text_config(model.config).num_hidden_layers)
    hidden = int(cfg.get("hidden_size", -1))
    heads = int(cfg.get("num_attention_heads", 0) or 0)
    problems = []
    if hidden != d:
        problems.append(f"hidden_size {hidden}, target {d}")
    if int(cfg.get("target_hidden_size") or hidden) != d:
        problems.append(f"target_hidden_size {cfg.get('target_hidden_size')}, target {d}")
    if int(cfg.get("vocab_size", -1)) != vocab:
        problems.append(f"vocab_size {cfg.get('vocab_size')}, target {vocab}")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        problems.append(f"num_hidden_layers {cfg.get('num_hidden_layers')} (SoT reads one-layer heads)")
    state_layers = _state_layers(cfg, num_layers)
    named = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    shown = f"input layers {list(state_layers)}" + (
        "" if named else f" (EAGLE-3's default for a {num_layers}-layer target: the config names none)")
    if any(not 0 <= i <= num_layers for i in state_layers):
        problems.append(f"{shown}, target has {num_layers} layers")
    elif len(state_layers) != 3 or list(state_layers) != sorted(set(state_layers)):
        problems.append(f"{shown}: EAGLE-3 reads three distinct layers, in ascending order as the engines join them")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads > 0 and (kv_heads <= 0 or heads % kv_heads):
        problems.append(f"num_key_value_heads {cfg.get('num_key_value_heads')} does not divide "
                        f"num_attention_heads {heads}")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg.get('hidden_act')!r} (EAGLE-3 heads, as vLLM and SGLang run them, use silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            problems.append(f"{flag} true (SoT reads EAGLE-3 heads without biases, as the engines do)")
    if cfg.get("norm_output") is False or cfg.get("fc_norm"):
        problems.append("norm_output false or fc_norm (SoT reads heads whose output is normed and whose fc is not)")
    # rope settings: ``rope_theta`` / ``rope_scaling``, or transformers 5's ``rope_parameters``
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        problems.append(f"rope_scaling {scaling} (SoT's predictor uses plain rope)")
    rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    if heads <= 0:
        problems.append("no num_attention_heads")
    if problems:
        raise DrafterCompatibilityError(f"EAGLE-3 head {path} does not fit this target: " + "; ".join(problems))
    sot = cfg.get(SOT_KEY) or {}
    target = sot.get("target") or target_fingerprint(model)  # a foreign head: checked by sizes only
    return StatePredictorConfig(
        hidden_size=d, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or d // heads), intermediate_size=int(cfg["intermediate_size"]),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        state_layers=state_layers, draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab), target=target,
        arch=EAGLE3, norm_before_residual=bool(cfg.get("norm_before_residual", False)))


def load_eagle3(path: str | Path, model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> StatePredictor:
    """Read the EAGLE-3 folder at ``path`` as a SoT ``eagle3`` predictor for ``model`` (weights
    in ``dtype``). A head whose sizes do not fit the target is refused with a clear message."""
    path = Path(path)
    cfg, tensors = _read(path)
    c = eagle3_config(cfg, model, path)
    if SOT_KEY in cfg:
        check_compatible(c, model, path)
    embed = model.get_input_embeddings().weight
    vocab = int(embed.shape[0])
    if "d2t" not in tensors and c.draft_vocab_size == vocab:  # a head over the whole vocabulary
        tensors["d2t"] = torch.zeros(vocab, dtype=torch.long)
    wanted = set(NAMES.values()) | {"d2t"}
    # a head over the whole vocabulary may leave its output layer to the target's (as both
    # engines allow); the predictor's own starts as the target's head
    shares_head = "lm_head.weight" not in tensors and c.draft_vocab_size == vocab
    missing = sorted(wanted - set(tensors) - ({"lm_head.weight"} if shares_head else set()))
    unexpected = sorted(set(tensors) - wanted - {"t2d", *IGNORED})
    if missing or unexpected:
        hint = ("; a head over part of the vocabulary (draft_vocab_size < vocab_size) needs its own lm_head.weight"
                if missing == ["lm_head.weight"] else "")
        raise DrafterCompatibilityError(f"{path}/{WEIGHTS_FILE} does not have the EAGLE-3 layout "
                                        f"(missing {missing}, unexpected {unexpected}){hint}")
    draft = _draft_vocab(path, tensors, cfg, c.draft_vocab_size, vocab)
    _check_own_embeddings(path, tensors.get("embed_tokens.weight"), embed)
    pred = StatePredictor(c, embed, model.get_output_embeddings().weight, draft)
    names = {k: v for k, v in NAMES.items() if not (shares_head and k == "lm_head.weight")}
    own = dict(pred.named_parameters())
    for name, theirs in names.items():
        if tuple(tensors[theirs].shape) != tuple(own[name].shape):
            raise DrafterCompatibilityError(f"{path}: {theirs} has shape {tuple(tensors[theirs].shape)}, this "
                                            f"target needs {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, theirs in names.items():
            own[name].copy_(tensors[theirs].float())
    return pred.cast_for_inference(dtype)


def _draft_vocab(path: Path, tensors: dict[str, torch.Tensor], cfg: dict, size: int, vocab: int) -> torch.Tensor:
    """The target ids of the head's draft vocabulary, ``[V_d]`` int64, from ``d2t`` (offsets:
    ``target id = draft id + d2t[draft id]``), checked against ``t2d`` where the file has it."""
    d2t = tensors["d2t"]
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or d2t.dim() != 1:
        raise DrafterCompatibilityError(f"{path}: d2t is {d2t.dtype} of shape {tuple(d2t.shape)}; it holds one "
                                        "integer offset per draft id")
    if d2t.numel() != size:
        stated = (f"draft_vocab_size {cfg['draft_vocab_size']}" if cfg.get("draft_vocab_size")
                  else f"no draft_vocab_size, which means the whole vocabulary ({vocab})")
        raise DrafterCompatibilityError(f"{path}: d2t has {d2t.numel()} entries, but config.json has {stated}")
    draft = torch.arange(d2t.numel()) + d2t.to(torch.long)
    inside = not draft.numel() or (int(draft.min()) >= 0 and int(draft.max()) < vocab)
    t2d = tensors.get("t2d")
    if t2d is not None:
        if t2d.dim() != 1 or t2d.numel() != vocab:
            raise DrafterCompatibilityError(f"{path}: t2d has shape {tuple(t2d.shape)}, the target has {vocab} tokens")
        if not inside or not bool(t2d.bool()[draft].all()) or int(t2d.bool().sum()) != draft.numel():
            raise DrafterCompatibilityError(
                f"{path}: d2t and t2d disagree on the draft vocabulary (d2t should hold offsets, target id minus "
                "draft id, not target ids)")
    if not inside:
        raise DrafterCompatibilityError(f"{path}: d2t maps draft ids outside the target's {vocab} tokens "
                                        f"(to {int(draft.min())}..{int(draft.max())})")
    if torch.unique(draft).numel() != draft.numel():
        raise DrafterCompatibilityError(f"{path}: d2t maps two draft ids onto the same target token")
    return draft


def _check_own_embeddings(path: Path, theirs: torch.Tensor | None, embed: torch.Tensor) -> None:
    """Warn when a head carries token embeddings other than the target's: SoT drafts with the
    target's (the output is the same either way; only how often drafts are accepted can differ)."""
    if theirs is None:
        return
    same = theirs.shape == embed.shape and torch.equal(theirs, embed.detach().cpu().to(theirs.dtype))
    if not same:
        warnings.warn(f"{path} carries its own embed_tokens ({tuple(theirs.shape)}), which differ from the "
                      f"target's {tuple(embed.shape)}; SoT drafts with the target's embeddings, so drafts may be "
                      "accepted less often than where an engine uses the head's own", stacklevel=3)
