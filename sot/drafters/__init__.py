"""Drafters: one interface (:class:`Drafter`), chosen by :class:`DrafterKind`."""
from __future__ import annotations

from sot.drafters.base import DraftInput, Drafter, DrafterKind, NoDrafter, TreeBudget
from sot.drafters.pld import PromptLookupDrafter

__all__ = ["DraftInput", "Drafter", "DrafterKind", "NoDrafter", "PromptLookupDrafter", "TreeBudget", "make_drafter"]


def make_drafter(kind: DrafterKind | str) -> Drafter:
    """Build a drafter that needs no weights. The state drafter is loaded separately."""
    kind = DrafterKind(kind)
    if kind is DrafterKind.NONE:
        return NoDrafter()
    if kind is DrafterKind.PLD:
        return PromptLookupDrafter()
    raise ValueError(f"drafter {kind.value!r} needs a checkpoint; it is not available yet")
