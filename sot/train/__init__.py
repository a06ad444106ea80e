"""Training: state caches, the predictor's trainer, self-distillation data and the policies."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from sot.errors import ConfigError


def changed_settings(saved: dict, asked: dict, keys: Iterable[str]) -> list[str]:
    """``--flag old (now new)`` for each of ``keys`` whose value in ``asked`` differs from the
    one ``saved`` with earlier work (keys ``saved`` lacks are not compared)."""
    return [f"--{k.replace('_', '-')} {saved[k]!r} (now {asked.get(k)!r})" for k in keys
            if k in saved and saved[k] != asked.get(k)]


def check_run_folder(out: Path, keys: set[str], stage: str) -> None:
    """Refuse an ``--out`` that is a file, or a folder whose ``config.json`` is not a run of
    ``stage`` (one holding all of ``keys``): a model's ``config.json`` would be written over."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give the run's folder")
    config = out / "config.json"
    if not config.is_file():
        return
    try:
        saved = json.loads(config.read_text())
    except (OSError, ValueError):
        saved = None
    if not isinstance(saved, dict) or not keys <= set(saved):
        raise ConfigError(f"{out} holds a config.json that no {stage} run wrote (a model folder, or another "
                          f"stage's run?); give --out a new folder or an earlier {stage} run's")
