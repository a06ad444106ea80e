"""The ``rl`` commit policy's network: how much of a step's trees to verify, and whether a
sequence drafts or takes its free draft, trained on speed (``sot train policy --kind rl``).

Both decisions are choices among candidates the heuristic policy already enumerates, so the
network scores each candidate from the heuristic's own estimate plus learned corrections:

* **verify size** - the step's candidates are "verify the best ``k`` nodes" (flat packing:
  ``k`` nodes of all trees ranked together; padded: ``k`` rows per sequence). Candidate ``k``
  is scored ``alpha * gap_k + f(x_k)``, where ``gap_k`` is the log of the heuristic's expected
  tokens per second of ``k`` minus the best candidate's (``0`` for the heuristic's choice) and
  ``f`` an MLP over :data:`SELECT_FEATURES` and :data:`STEP_FEATURES`. The policy verifies the
  highest-scoring candidate.
* **draft or free** - a sequence that has a free draft (prompt lookup, suffix trees) either
  runs the drafter or verifies the free draft alone. The logit of "free" is
  ``beta * gap + g(x)``, with ``gap`` the log of the free draft's promised speed over the
  sequence's recent drafting speed (the heuristic takes the free draft when ``gap >= 0``) and
  ``g`` an MLP over :data:`DRAFT_FEATURES`.

``f`` and ``g`` start at zero, so an untrained network decides as the heuristic does; training
(:mod:`sot.train.rl`) moves it where the simulated reward says the heuristic is wrong.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sot.policy.config import PolicyConfig, PolicyKind
from sot.policy.files import load_policy_model, write_policy_file

if TYPE_CHECKING:
    from sot.drafters.base import Drafter
    from sot.models.adapter import TargetModel

#: per candidate verify size: heuristic gap, log verify-cost ratio to the smallest candidate,
#: expected extra tokens per sequence, the last node's estimate, extra rows per sequence, k = 0
SELECT_FEATURES = ("gap", "log_cost", "gain", "marginal", "rows", "none")
#: per step: mean sampling temperature, log2 batch size / 4, mean calibration, mean tau / 4
STEP_FEATURES = ("temperature", "batch", "calibration", "tau")
#: per sequence with a free draft: heuristic gap, log drafting speed, log free promise, free
#: draft's expected tokens, its size / 16, calibration, tau / 4, temperature, batch, predictor
#: pass time over a one-row verify pass
DRAFT_FEATURES = ("gap", "draft_speed", "free_speed", "free_gain", "free_size", "calibration", "tau",
                  "temperature", "batch", "pass_ratio")


def _mlp(inputs: int, hidden: int) -> torch.nn.Sequential:
    net = torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, 1))
    torch.nn.init.zeros_(net[2].weight)  # starts as the heuristic
    torch.nn.init.zeros_(net[2].bias)
    return net


class RLPolicyModel(torch.nn.Module):
    """Scores verify-size candidates and draft-or-free choices (see the module docstring).

    ``select_logits(cand [K, len(SELECT_FEATURES)], step [len(STEP_FEATURES)]) -> [K]``;
    ``free_logit(x [M, len(DRAFT_FEATURES)]) -> [M]`` (positive: take the free draft).
    """

    FORMAT = "sot-rl-policy/1"

    def __init__(self, hidden: int = 32, alpha: float = 10.0, beta: float = 10.0) -> None:
        super().__init__()
        self.select_net = _mlp(len(SELECT_FEATURES) + len(STEP_FEATURES), hidden)
        self.draft_net = _mlp(len(DRAFT_FEATURES), hidden)
        # sharpness of the heuristic prior: the argmax is the heuristic's choice whatever its
        # value; moderate values leave the softmax soft enough for gradients to flow
        self.alpha = torch.nn.Parameter(torch.tensor(float(alpha)))
        self.beta = torch.nn.Parameter(torch.tensor(float(beta)))

    def select_logits(self, cand: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        x = torch.cat([cand, step.expand(*cand.shape[:-1], step.shape[-1])], dim=-1)
        return self.alpha * cand[..., 0] + self.select_net(x).squeeze(-1)

    def free_logit(self, x: torch.Tensor) -> torch.Tensor:
        return self.beta * x[..., 0] + self.draft_net(x).squeeze(-1)

    def train(self, mode: bool = True) -> "RLPolicyModel":
        self._cached = None  # weights may change: the inference copy is rebuilt on next use
        return super().train(mode)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._cached = None
        return super().load_state_dict(*args, **kwargs)

    def _weights(self) -> dict:
        """NumPy copies of the weights for :meth:`choose` and :meth:`prefers_free`: the engine
        asks every step, and a few NumPy products cost far less than torch's per-op dispatch."""
        if getattr(self, "_cached", None) is None:
            with torch.no_grad():
                w = {k: v.detach().float().numpy().copy() for k, v in self.state_dict().items()}
            self._cached = w
        return self._cached

    @staticmethod
    def _mlp_np(w: dict, prefix: str, x: np.ndarray) -> np.ndarray:
        h = x @ w[f"{prefix}.0.weight"].T + w[f"{prefix}.0.bias"]
        h = h / (1.0 + np.exp(-h))  # SiLU
        return (h @ w[f"{prefix}.2.weight"].T + w[f"{prefix}.2.bias"])[..., 0]

    def choose(self, cand: np.ndarray, step: np.ndarray) -> int:
        """Index of the candidate to verify: ``select_logits``' argmax, computed in NumPy
        (``cand [K, len(SELECT_FEATURES)]``, ``step [len(STEP_FEATURES)]``)."""
        w = self._weights()
        x = np.empty((cand.shape[0], cand.shape[1] + step.shape[0]), dtype=np.float32)
        x[:, : cand.shape[1]] = cand
        x[:, cand.shape[1] :] = step
        return int(np.argmax(w["alpha"] * cand[:, 0] + self._mlp_np(w, "select_net", x)))

    def prefers_free(self, x: np.ndarray) -> bool:
        """Whether ``free_logit(x) > 0``, computed in NumPy (``x [len(DRAFT_FEATURES)]``)."""
        w = self._weights()
        return bool(w["beta"] * x[0] + self._mlp_np(w, "draft_net", x) > 0)

    def save(self, path: str | Path, meta: dict | None = None) -> None:
        info = {"format": self.FORMAT, "select_features": list(SELECT_FEATURES), "step_features": list(STEP_FEATURES),
                "draft_features": list(DRAFT_FEATURES), "hidden": self.select_net[0].out_features, **(meta or {})}
        write_policy_file(self, path, info)

    @classmethod
    def load(cls, path: str | Path, target: torch.nn.Module | None = None) -> "RLPolicyModel":
        """The network at ``path`` (checked against ``target`` when given)."""
        features = {"select_features": SELECT_FEATURES, "step_features": STEP_FEATURES,
                    "draft_features": DRAFT_FEATURES}
        return load_policy_model(cls, path, "commit-policy network of --policy rl", "sot train policy --kind rl",
                                 features, target)


#: the rl policy shipped for the default model and its shipped state predictor
DEFAULT_RL_POLICY = Path(__file__).resolve().parents[1] / "assets" / "smollm2-135m-instruct.rl-policy.safetensors"


def load_rl_policy(path: str | Path | None, target: torch.nn.Module | None = None) -> RLPolicyModel:
    """Load the ``rl`` policy's network (default: the shipped one); when the file names the
    target it was trained for, ``target`` must match it."""
    return RLPolicyModel.load(path or DEFAULT_RL_POLICY, target)


def resolve_rl_policy(config: PolicyConfig, drafter: Drafter, target: TargetModel, rl_model: RLPolicyModel | None,
                      record: bool) -> RLPolicyModel | None:
    """The network an engine's ``rl`` policy runs: ``rl_model`` when given, else loaded from
    ``config.model_path`` or the shipped one (checked against ``target``); ``None`` for any
    other policy, while recording, or for plain decoding."""
    from sot.drafters.base import DrafterKind

    if config.kind is not PolicyKind.RL or record or drafter.kind is DrafterKind.NONE:
        return None
    if rl_model is not None:
        return rl_model
    from sot.policy.acceptance_model import checked_for

    return checked_for(load_rl_policy(config.model_path, target.model), drafter, config.model_path)


#: the candidates the network chooses among: those whose modelled tokens per second are
#: within this log-ratio of the best (about 20% slower at most), at most ``MAX_CANDIDATES``
#: of them, nearest the best first; the rest are never worth their features' cost
CANDIDATE_WINDOW = 0.2
MAX_CANDIDATES = 12


def near_best(rates: list[float], best: int) -> list[int]:
    """Indices (ascending) of the candidates within :data:`CANDIDATE_WINDOW` of ``rates[best]``."""
    floor = rates[best] * math.exp(-CANDIDATE_WINDOW)
    near = sorted((k for k, r in enumerate(rates) if r >= floor), key=lambda k: abs(k - best))
    return sorted(near[:MAX_CANDIDATES])


def select_features(idx: list[int], rows: list[int], expected: list[float], costs: list[float], base: float,
                    batch_rows: int) -> np.ndarray:
    """``[len(idx), len(SELECT_FEATURES)]`` features of the candidates ``idx`` of a step whose
    candidate ``k`` computes ``rows[k]`` rows in ``costs[k]`` seconds and is expected to commit
    ``expected[k]`` tokens (``base`` of them without any draft)."""
    top = max(math.log(max(expected[k], 1e-9) / max(costs[k], 1e-12)) for k in idx)
    out = []
    for k in idx:
        marginal = expected[k] - expected[k - 1] if k else 0.0
        out.append([math.log(max(expected[k], 1e-9) / max(costs[k], 1e-12)) - top,
                    math.log(max(costs[k], 1e-12) / max(costs[0], 1e-12)), (expected[k] - base) / batch_rows,
                    # (the shipped network saw at most 15 extra rows a sequence: more read as 15)
                    marginal, min((rows[k] - rows[0]) / batch_rows, 15.0) / 8.0, float(k == 0)])
    return np.array(out, dtype=np.float32)
