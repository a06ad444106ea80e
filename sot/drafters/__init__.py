"""Drafters: one interface (:class:`Drafter`), chosen by :class:`DrafterKind`."""
from __future__ import annotations

from sot.errors import ConfigError
from sot.drafters.base import DraftInput, Drafter, DrafterKind, NoDrafter, TreeBudget
from sot.drafters.pld import PromptLookupDrafter

__all__ = ["DraftInput", "Drafter", "DrafterKind", "NoDrafter", "PromptLookupDrafter", "TreeBudget", "make_drafter"]


def make_drafter(kind: DrafterKind | str) -> Drafter:
    """Build a drafter that needs no weights. The state drafter is loaded separately."""
    try:
        kind = DrafterKind(kind)
    except ValueError:
        raise ConfigError(f"unknown drafter {kind!r}; choose from {', '.join(k.value for k in DrafterKind)}") from None
    if kind is DrafterKind.NONE:
        return NoDrafter()
    if kind is DrafterKind.PLD:
        return PromptLookupDrafter()
    raise ConfigError(f"drafter {kind.value!r} (the learned state predictor) is not available in this release")
