"""Policy networks' files: safetensors weights with a JSON description in the metadata."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

import torch

from sot.errors import ConfigError

M = TypeVar("M", bound=torch.nn.Module)


def write_policy_file(model: torch.nn.Module, path: str | Path, info: dict) -> None:
    """Save a policy network's weights as safetensors with ``info`` in its metadata."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"sot_policy": json.dumps(info)})


def read_policy_file(path: str | Path, what: str, command: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(info, weights)`` of a policy file written by :func:`write_policy_file`; a missing or
    unreadable file is a :class:`ConfigError` naming ``what`` it should be and the
    ``command`` that trains one."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
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
    if info.get("format") != cls.FORMAT or any(tuple(info.get(k, ())) != v for k, v in features.items()):
        names = "; ".join(f"{k}: {', '.join(v)}" for k, v in features.items())
        raise ConfigError(f"{path} is not a {cls.FORMAT} file with this version's features ({names})")
    model = cls(int(info.get("hidden", 32)))
    model.load_state_dict(weights)
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
