"""Policy networks' files: safetensors weights with a JSON description in the metadata."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from sot.errors import ConfigError


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
