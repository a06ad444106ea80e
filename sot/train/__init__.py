"""Training: state caches, the predictor's trainer, self-distillation data and the policies."""
from __future__ import annotations

from typing import Iterable


def changed_settings(saved: dict, asked: dict, keys: Iterable[str]) -> list[str]:
    """``--flag old (now new)`` for each of ``keys`` whose value in ``asked`` differs from the
    one ``saved`` with earlier work (keys ``saved`` lacks are not compared)."""
    return [f"--{k.replace('_', '-')} {saved[k]!r} (now {asked.get(k)!r})" for k in keys
            if k in saved and saved[k] != asked.get(k)]
