"""The learned acceptance model of the ``learned`` policy: node features, the MLP, its file, decoding traces."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from sot.errors import ConfigError
from sot.policy.config import PolicyConfig, PolicyKind
from sot.policy.files import load_policy_model, predictor_mismatch, write_policy_file
from sot.policy.state import SequencePolicyState
from sot.tree import DraftTree

if TYPE_CHECKING:
    from sot.drafters.base import Drafter
    from sot.models.adapter import TargetModel

M = TypeVar("M", bound=torch.nn.Module)


FEATURES = ("log_conf", "log_cond", "depth", "sibling_rank", "calibration", "recent_tau", "temperature", "tree_size")


def node_features(tree: DraftTree, state: SequencePolicyState, temperature: float) -> torch.Tensor:
    """``[N - 1, len(FEATURES)]`` features of the non-root nodes of ``tree``: log draft
    confidence, log confidence given the parent, depth, rank among siblings, the sequence's
    calibration and recent tokens per step, the sampling temperature and the tree's size."""
    probs = tree.confidences()
    logs = [math.log(max(p, 1e-6)) for p in probs]
    rank = [0] * tree.size
    for kids in tree.children():
        for r, c in enumerate(sorted(kids, key=lambda c: -probs[c])):
            rank[c] = r
    rows = [
        [logs[i], logs[i] - logs[tree.parents[i]], tree.depths[i] / 8.0, rank[i] / 4.0,
         state.calibration, state.tau / 4.0, temperature, tree.size / 32.0]
        for i in range(1, tree.size)
    ]
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, len(FEATURES))


class AcceptanceModel(torch.nn.Module):
    """Predicts the probability that the target accepts a draft node (its whole path) from
    :func:`node_features`: a two-layer MLP over standardised features.

    ``forward(features [M, F]) -> probabilities [M]``.
    """

    FORMAT = "sot-commit-policy/1"

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        n = len(FEATURES)
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("std", torch.ones(n))
        # the range of each feature in the training data; inputs are clipped to it, so the
        # model never extrapolates (e.g. to larger trees than it was trained on)
        self.register_buffer("low", torch.full((n,), -1e9))
        self.register_buffer("high", torch.full((n,), 1e9))
        self.net = torch.nn.Sequential(torch.nn.Linear(n, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, 1))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        x = torch.maximum(torch.minimum(features, self.high), self.low)
        return self.net((x - self.mean) / self.std).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(features))

    def save(self, path: str | Path, meta: dict | None = None) -> None:
        info = {"format": self.FORMAT, "features": list(FEATURES), "hidden": self.net[0].out_features, **(meta or {})}
        write_policy_file(self, path, info)

    @classmethod
    def load(cls, path: str | Path, target: torch.nn.Module | None = None) -> "AcceptanceModel":
        """The model at ``path`` (checked against ``target`` when given)."""
        return load_policy_model(cls, path, "commit-policy model", "sot train policy", {"features": FEATURES}, target)


#: the acceptance model shipped for the default model
DEFAULT_ACCEPTANCE_MODEL = Path(__file__).resolve().parents[1] / "assets" / "smollm2-135m-instruct.policy.safetensors"


def load_acceptance_model(path: str | Path | None, target: torch.nn.Module | None = None) -> AcceptanceModel:
    """Load the ``learned`` policy's model (default: the shipped one); when the file names
    the target it was trained for, ``target`` must match it."""
    return AcceptanceModel.load(path or DEFAULT_ACCEPTANCE_MODEL, target)


@dataclass
class Trace:
    """Logged decisions: for the acceptance model, ``features [M, F]`` of every verified
    non-root node and ``accepted [M]`` (1 when the target accepted it); for the rl policy's
    simulator, ``steps``, one :func:`sot.policy.record.step_record` per verify step."""

    features: list[torch.Tensor] = field(default_factory=list)
    accepted: list[torch.Tensor] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)


def fitting_acceptance_model(model_path: str | None, drafter: Drafter, target: TargetModel) -> AcceptanceModel | None:
    """The learned policy's model when one is available for this target and drafter (the
    one at ``model_path``, or the one shipped for the default model)."""
    from sot.drafters.base import DrafterKind

    if drafter.kind is not DrafterKind.STATE:
        return None
    try:
        return checked_for(load_acceptance_model(model_path, target.model), drafter, model_path)
    except ConfigError:
        if model_path:  # asked for by name: its errors are the user's to see
            raise
        return None


def checked_for(model: M, drafter: Drafter, path: str | Path | None) -> M:
    """``model`` (a policy network with ``.info``), or a :class:`ConfigError` when it was
    trained on another predictor's drafts than ``drafter`` makes."""
    reason = predictor_mismatch(model.info, drafter)
    if reason:
        raise ConfigError(f"the policy model {path or 'shipped with SoT'} does not fit this drafter: {reason}; "
                          "train one with 'sot train policy --predictor ...' (--kind rl for the rl policy)")
    return model


def resolve_policy(config: PolicyConfig, drafter: Drafter, target: TargetModel,
                   acceptance_model: AcceptanceModel | None, record: bool
                   ) -> tuple[PolicyConfig, AcceptanceModel | None]:
    """The policy an engine runs and its acceptance model: ``auto`` becomes ``learned`` where
    a model fits this target and drafter, else ``heuristic``; ``learned`` loads its model
    (from ``config.model_path`` or the shipped one) unless given, recording, or plain."""
    from sot.drafters.base import DrafterKind

    if config.kind is PolicyKind.AUTO:
        acceptance_model = acceptance_model or fitting_acceptance_model(config.model_path, drafter, target)
        kind = PolicyKind.LEARNED if acceptance_model is not None else PolicyKind.HEURISTIC
        config = dataclasses.replace(config, kind=kind,
                                     model_path=config.model_path if kind is PolicyKind.LEARNED else None)
    if (config.kind is PolicyKind.LEARNED and acceptance_model is None and not record
            and drafter.kind is not DrafterKind.NONE):
        acceptance_model = checked_for(load_acceptance_model(config.model_path, target.model), drafter,
                                       config.model_path)
    return config, acceptance_model

