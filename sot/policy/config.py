"""What the commit policy is set to do (see :mod:`sot.policy`)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


from sot.errors import ConfigError


class PolicyKind(str, enum.Enum):
    """How the commit policy chooses each step's tree (``--policy``)."""

    AUTO = "auto"  # learned when an acceptance model fits the target, else heuristic
    STATIC = "static"
    HEURISTIC = "heuristic"
    LEARNED = "learned"
    RL = "rl"  # verify size and draft-or-free chosen by a network trained on simulated speed

    @property
    def reads_model(self) -> bool:
        """Whether this policy reads a model file (``--policy-model``)."""
        return self in (PolicyKind.AUTO, PolicyKind.LEARNED, PolicyKind.RL)


@dataclass(frozen=True)
class PolicyConfig:
    """Commit-policy settings.

    Attributes:
        kind: ``heuristic`` (default: cost model, calibration, fallback), ``learned`` (the
            same with a trained acceptance predictor), ``auto`` (``learned`` when an
            acceptance model for the target is available, as for the default model, else
            ``heuristic``), ``rl`` (the heuristic's candidates, chosen by a network trained by
            reinforcement on tokens per second; see :mod:`sot.policy.rl`) or ``static`` (a
            fixed-shape tree, verified whole).
        warmup: tokens decoded plainly at the start of every sequence.
        fallback_threshold: fall back when recent speed / plain speed drops below this.
        window: steps of history behind the fallback decision.
        first_backoff: plain steps after a first fallback; doubles on each failed probe.
        max_backoff: cap of the back-off, in steps.
    """

    kind: PolicyKind = PolicyKind.HEURISTIC  # measured the faster one; see docs/DESIGN.md
    warmup: int = 0
    fallback_threshold: float = 1.0
    window: int = 6
    first_backoff: int = 8
    max_backoff: int = 128
    #: the acceptance model of ``learned``, or the network of ``rl`` (default: the one shipped
    #: for the default model)
    model_path: str | None = None
    #: a fixed rule instead of batch planning, as vLLM's ``speculative_disable_by_batch_size``:
    #: no speculation at all while more than this many sequences run (0: off)
    disable_above: int = 0

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.window < 1 or self.first_backoff < 1 or self.max_backoff < self.first_backoff:
            raise ConfigError("policy needs warmup >= 0, window >= 1 and 1 <= first_backoff <= max_backoff")
        if self.fallback_threshold < 0:
            raise ConfigError(f"fallback threshold must be >= 0, got {self.fallback_threshold}")
        if self.disable_above < 0:
            raise ConfigError(f"disable_above must be >= 0, got {self.disable_above}")
        if self.model_path and not self.kind.reads_model:
            raise ConfigError(f"the {self.kind.value} policy reads no model file, yet one was given "
                              f"({self.model_path}); it is for the learned, rl and auto policies")
