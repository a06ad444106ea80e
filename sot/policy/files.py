"""Policy networks' files: safetensors weights with a JSON description in the metadata."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

import torch

from sot.errors import ConfigError
from sot.files import replace_file

M = TypeVar("M", bound=torch.nn.Module)


def write_policy_file(model: torch.nn.Module, path: str | Path, info: dict) -> None:
    """Save a policy network's weights as safetensors with ``info`` in its metadata; the file
    is written beside ``path`` and renamed over it, so a run stopped meanwhile leaves the
    previous file whole."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    replace_file(path, lambda part: save_file(tensors, str(part), metadata={"sot_policy": json.dumps(info)}))


def read_policy_file(path: str | Path, what: str, command: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(info, weights)`` of a policy file written by :func:`write_policy_file`; a missing or
    unreadable file is a :class:`ConfigError` naming ``what`` it should be and the
    ``command`` that trains one."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder; give the file (train one with '{command}')")
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist (train one with '{command}')")
    try:
        with safe_open(str(path), "pt") as fh:
            info = json.loads((fh.metadata() or {}).get("sot_policy", "{}"))
        return info, load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse failure means a bad file
        raise ConfigError(f"{path} is not a {what}: {exc}") from None


def load_policy_model(cls: type[M], path: str | Path, what: str, command: str, features: dict[str, tuple[str, ...]],
                      target: torch.nn.Module | None = None) -> M:
    """An instance of ``cls`` (a policy network with a ``FORMAT`` and a ``hidden`` size) from
    ``path``, in eval mode, its metadata as ``.info``. The file must carry ``cls.FORMAT`` and,
    for each key of ``features``, exactly those feature names; when it names the target it was
    trained for (``embed_hash``), ``target`` must match. Errors name ``what`` the file should
    be and the ``command`` that trains one."""
    info, weights = read_policy_file(path, what, command)
    if not isinstance(info, dict) or info.get("format") != cls.FORMAT or any(
            not isinstance(info.get(k, ()), (list, tuple)) or tuple(info.get(k, ())) != v for k, v in features.items()):
        names = "; ".join(f"{k}: {', '.join(v)}" for k, v in features.items())
        raise ConfigError(f"{path} is not a {cls.FORMAT} file with this version's features ({names})")
    hidden = info.get("hidden", 32)
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
        raise ConfigError(f"{path} is not a {what}: its hidden size {hidden!r} is not a positive integer")
    model = cls(hidden)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:  # missing, extra or misshapen weights
        first = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path} is not a {what}: its weights do not fit ({first})") from None
    bad = [k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ConfigError(f"{path} is not a usable {what}: its weights {', '.join(bad[:3])} are not finite "
                          f"(a training run that diverged?); train one with '{command}'")
    model.info = info
    model.eval()
    expected = info.get("embed_hash")
    if expected and target is not None:
        from sot.fingerprint import embedding_hash

        found = embedding_hash(target.get_input_embeddings().weight)
        if found != expected:
            raise ConfigError(f"{what} {path} was trained for another target (embedding hash {expected}, this "
                              f"model has {found}); train one with '{command}'")
    return model


def predictor_mismatch(info: dict, drafter: object) -> str | None:
    """Why a policy file (its ``info``) was trained on another predictor's drafts than
    ``drafter``'s, or ``None`` (also when the file does not record its predictor, as files
    written before it did not, or the drafter has none)."""
    expected = info.get("predictor_hash")
    predictor = getattr(drafter, "predictor", None)
    if not expected or predictor is None:
        return None
    from sot.fingerprint import predictor_fingerprint

    found = predictor_fingerprint(predictor)
    if found == expected:
        return None
    return f"it was trained on the drafts of another predictor (fingerprint {expected}, this one's {found})"
