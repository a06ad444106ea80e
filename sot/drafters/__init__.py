"""Drafters: one interface (:class:`Drafter`), chosen by :class:`DrafterKind`."""
from __future__ import annotations

from pathlib import Path

import torch

from sot.drafters.base import DRAFT_TOP_K, DraftInput, Drafter, DrafterKind, DraftRules, NoDrafter, TreeBudget
from sot.drafters.free import FreeDrafts, LookupDrafter, SuffixDrafter
from sot.drafters.pld import PromptLookupDrafter
from sot.drafters.suffix import SuffixConfig, SuffixStore, SuffixStores
from sot.errors import ConfigError

__all__ = ["DRAFT_TOP_K", "DraftInput", "Drafter", "DrafterKind", "DraftRules", "FreeDrafts",
           "LookupDrafter", "NoDrafter", "PromptLookupDrafter", "SuffixConfig", "SuffixDrafter",
           "SuffixStore", "SuffixStores", "TreeBudget", "auto_drafter_kind", "default_predictor_path",
           "make_drafter"]

#: the trained state predictor shipped for the default model (SmolLM2-135M-Instruct)
DEFAULT_PREDICTOR = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-instruct.state.safetensors"


def default_predictor_path() -> Path:
    """The state predictor shipped for the default model (in ``sot/assets``)."""
    return DEFAULT_PREDICTOR


def auto_drafter_kind(model: torch.nn.Module, predictor: str | Path | None = None) -> DrafterKind:
    """What drafter ``auto`` means for ``model``: ``state`` (merged with suffix trees and
    prompt lookup) when a predictor file is given or the shipped one fits it, else ``suffix``."""
    from sot.drafters.state import check_compatible, read_predictor_config
    from sot.errors import DrafterCompatibilityError

    if predictor is not None:
        return DrafterKind.STATE
    path = default_predictor_path()
    if not path.is_file():
        return DrafterKind.SUFFIX
    try:
        check_compatible(read_predictor_config(path), model, path)
    except DrafterCompatibilityError:
        return DrafterKind.SUFFIX
    return DrafterKind.STATE


def make_drafter(
    kind: DrafterKind | str,
    model: torch.nn.Module | None = None,
    predictor: str | Path | None = None,
    top_k: int = DRAFT_TOP_K,
    full_vocab: bool = False,
    lookup: bool = True,
    suffix: SuffixStores | None = None,
) -> Drafter:
    """Build a drafter.

    Args:
        kind: ``none``, ``pld``, ``suffix`` or ``state``.
        model: the target (a Hugging Face causal LM); needed by ``state``, whose predictor
            shares the target's embeddings and LM head.
        predictor: a state predictor file; default: the one shipped for the default model.
        top_k: children per expanded node of a state-predictor tree.
        full_vocab: let the state predictor propose from the whole target vocabulary rather
            than its reduced draft vocabulary.
        lookup: merge the best prompt-lookup continuation into state-predictor and suffix trees.
        suffix: global stores of earlier answers: ``suffix`` drafts from them (a new store
            when ``None``), and ``state`` merges suffix trees into its own when given.
    """
    try:
        kind = DrafterKind(kind)
    except ValueError:
        raise ConfigError(f"unknown drafter {kind!r}; choose from {', '.join(k.value for k in DrafterKind)}") from None
    if kind is DrafterKind.NONE:
        return NoDrafter()
    if kind is DrafterKind.PLD:
        return LookupDrafter()
    if kind is DrafterKind.SUFFIX:
        return SuffixDrafter(suffix, lookup=lookup)
    from sot.drafters.state import StateDrafter, load_predictor

    if model is None:
        raise ConfigError("the state drafter needs the target model")
    path = Path(predictor) if predictor is not None else DEFAULT_PREDICTOR
    if predictor is None and not path.is_file():
        raise ConfigError(f"the default state predictor {path} is missing from this installation")
    # bf16 halves the weight traffic of the small draft matmuls (they are memory-bound on
    # CPU); float32 targets keep a float32 predictor
    dtype = torch.bfloat16 if model.get_input_embeddings().weight.dtype == torch.bfloat16 else torch.float32
    if predictor is None:  # (the user named no file: say what the shipped one is for)
        from sot.drafters.state import check_compatible, read_predictor_config
        from sot.errors import DrafterCompatibilityError
        from sot.models.loading import DEFAULT_MODEL_NAME

        try:
            check_compatible(read_predictor_config(path), model, path)
        except DrafterCompatibilityError:
            raise DrafterCompatibilityError(
                "no state predictor fits this model: the one shipped is for the default model "
                f"({DEFAULT_MODEL_NAME}); give one trained for it (--predictor, predictor=), train one with "
                "'sot train', or draft from earlier text alone (drafter suffix)") from None
    pred = load_predictor(path, model, dtype=dtype)
    if full_vocab:
        pred.use_full_vocabulary(model.get_output_embeddings().weight)
    return StateDrafter(pred, top_k=top_k, lookup=lookup, suffix=suffix)
