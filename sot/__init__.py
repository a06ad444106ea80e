"""SoT (State over Tokens): lossless tree-speculative decoding for causal language models.

The names below load on first use (``from sot import SoT`` works as ever), so that ``import
sot`` does not import torch: the ``sot`` command's entry point (:mod:`sot._entry`) loads the
command line, which does, inside its own Ctrl-C handler."""
from __future__ import annotations

import importlib
from typing import Any

#: each public name and the module that defines it
_EXPORTS = {
    "Completion": "sot.api", "Score": "sot.api", "SoT": "sot.api", "StreamEvent": "sot.api",
    "DrafterKind": "sot.drafters", "TreeBudget": "sot.drafters",
    "Engine": "sot.engine", "GenerationParams": "sot.engine",
    "SoTError": "sot.errors", "TextAssembler": "sot.detokenize",
    "SamplingMode": "sot.sampling", "SamplingParams": "sot.sampling",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sot' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (later lookups skip this function)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
