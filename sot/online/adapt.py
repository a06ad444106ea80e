"""Test-time adaptation: the state predictor keeps learning from the verify passes while it serves.

:class:`Adapter` attaches to an :class:`~sot.engine.Engine` whose drafter is a state predictor.
A :class:`~sot.online.record.NodeRecorder` keeps what the verify passes computed for each
sequence; when one finishes, it joins a short queue. Between steps (never inside one), when the
time spent updating stays within ``budget`` of the engine's decoding time, the adapter takes
one optimiser step of the on-policy loss (:mod:`sot.online.loss`) on the last ``rows``
positions of the newest finished sequence, on a float32 copy of the predictor, and copies the
weights into the drafter.

Three guards keep it from drifting into nonsense:

- a trust region: an L2 pull towards the loaded weights (the anchor), and a reset to the anchor
  when the relative distance from it passes ``max_drift``;
- rollback: after each update, the mean accepted length of the next ``window`` drafted steps is
  compared with the ``window`` before it; when it falls by more than ``tolerance``, the weights
  from before the update come back;
- output never changes: only the drafter learns, and the target verifies every token.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from sot.errors import ConfigError
from sot.online.defaults import ADAPT_BUDGET
from sot.online.loss import OnlineLossConfig, online_loss
from sot.online.record import NodeRecorder, OnPolicySequence
from sot.requests import check_number

if TYPE_CHECKING:
    from sot.drafters.state.model import StatePredictor
    from sot.engine import Engine
    from sot.models.adapter import ForwardOutput
    from sot.requests import LiveRequest
    from sot.tree import DraftTree


@dataclass
class AdaptConfig:
    """Settings of test-time adaptation (one source for the CLI and the server)."""

    #: update time allowed, as a fraction of the engine's time in its steps
    budget: float = ADAPT_BUDGET
    lr: float = 3e-4
    #: positions of a finished sequence one update trains on (its last ones)
    rows: int = 160
    #: L2 pull towards the loaded weights, per parameter on average
    anchor: float = 10.0
    #: reset to the loaded weights when ``|w - w0| / |w0|`` passes this
    max_drift: float = 0.05
    #: drafted steps compared before and after an update
    window: int = 64
    #: roll an update back when the mean accepted length after it falls by more than this fraction
    tolerance: float = 0.25
    #: finished sequences kept for updates
    queue: int = 4
    #: the cost assumed for the first update, before one has been timed (seconds)
    first_guess: float = 0.5
    loss: OnlineLossConfig = field(default_factory=lambda: OnlineLossConfig(unroll=2, uniform=1.0))

    def check(self) -> None:
        """A :class:`ConfigError` naming the first setting out of its range (each a finite number)."""
        try:
            check_number("budget", self.budget, low=0.0, high=1.0, open_low=True)
        except ConfigError:
            raise ConfigError(f"the adaptation budget is a fraction of step time in (0, 1], "
                              f"got {self.budget!r}") from None
        for name, integer, low, open_low, high in (("lr", False, 0.0, True, None), ("rows", True, 8, False, None),
                                                   ("anchor", False, 0.0, False, None),
                                                   ("max_drift", False, 0.0, True, None),
                                                   ("window", True, 1, False, None),
                                                   ("tolerance", False, 0.0, True, 1.0),
                                                   ("queue", True, 1, False, None),
                                                   ("first_guess", False, 0.0, False, None)):
            check_number(f"adaptation {name}", getattr(self, name), integer=integer, low=low, high=high,
                         open_low=open_low)
        if self.tolerance >= 1:
            raise ConfigError(f"adaptation tolerance must be below 1, got {self.tolerance}")


class OnlineLearner:
    """A float32 copy of a predictor that learns from recorded sequences inside a trust region
    around the weights it started from, and copies what it learned into the live predictor.

    Args:
        live: the predictor a drafter uses (its dtype; packed weights are repacked).
        config: lr, rows, anchor, max_drift and the loss come from here.
    """

    def __init__(self, live: StatePredictor, config: AdaptConfig) -> None:
        self.live = live
        self.config = config
        self.model = _trainable_copy(live)
        self.anchor = self.snapshot()
        self._anchor_norm = math.sqrt(sum(float(a.pow(2).sum()) for a in self.anchor.values()))
        self._count = sum(a.numel() for a in self.anchor.values())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.resets = 0
        self.drift = 0.0

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def step(self, seq: OnPolicySequence) -> None:
        """One optimiser step of the on-policy loss on ``seq``'s last ``rows`` positions, plus
        the pull towards the anchor (no publishing: see :meth:`finish`)."""
        self.model.train()
        loss, _ = online_loss(self.model, self.model, seq.crop(self.config.rows), self.config.loss,
                              next(self.model.parameters()).device)
        pull = sum((p - self.anchor[n]).pow(2).sum() for n, p in self.model.named_parameters())
        loss = loss + self.config.anchor * pull / self._count
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def finish(self) -> None:
        """Check the trust region (reset to the anchor past ``max_drift``) and publish."""
        with torch.no_grad():
            dist = math.sqrt(sum(float((p - self.anchor[n]).pow(2).sum()) for n, p in self.model.named_parameters()))
        self.drift = dist / max(self._anchor_norm, 1e-12)
        if not math.isfinite(self.drift) or self.drift > self.config.max_drift:
            self.restore(self.anchor)
            self.resets += 1
            self.drift = 0.0
        self.publish()

    def restore(self, weights: dict[str, torch.Tensor]) -> None:
        """Load ``weights`` (a :meth:`snapshot`) and forget the optimiser's moments."""
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(weights[n])
        self.opt.state.clear()

    def publish(self) -> None:
        """Copy the trained weights into the live predictor (its dtype) and repack them."""
        with torch.no_grad():
            for (_, dst), (_, src) in zip(self.live.named_parameters(), self.model.named_parameters()):
                dst.copy_(src.to(dst.dtype))
        if "_packed" in self.live.__dict__:
            self.live.pack_for_inference()
        self.live.eval()


class Adapter:
    """Adapts an engine's state predictor between steps (see the module docstring).

    Args:
        engine: the engine; its drafter must be a state predictor's.
        config: the settings.
        train_step: replaces the optimiser step, ``fn(seq)`` (for tests that corrupt an update
            on purpose; :attr:`model` is the float32 copy it may change).
    """

    def __init__(self, engine: Engine, config: AdaptConfig | None = None,
                 train_step: Callable[[OnPolicySequence], None] | None = None) -> None:
        from sot.drafters.state.drafter import StateDrafter

        self.config = config or AdaptConfig()
        self.config.check()
        if not isinstance(engine.drafter, StateDrafter):
            raise ConfigError("--adapt adapts a state predictor: use --drafter state or auto with a predictor")
        self.engine = engine
        self.learner = OnlineLearner(engine.drafter.predictor, self.config)
        self.recorder = NodeRecorder(len(engine.drafter.state_layers), keep=False)
        self.recorder.on_finish = self._finished
        self.recorder.on_step = self._accepted
        self.queue: deque[OnPolicySequence] = deque(maxlen=self.config.queue)
        self.recent: deque[int] = deque(maxlen=self.config.window)  # accepted lengths of drafted steps
        self._since_update: list[int] = []
        self._pending: tuple[dict, float] | None = None  # (weights before, acceptance before)
        self._train_step = train_step or self.learner.step
        self.updates = self.rollbacks = 0
        self.update_seconds = 0.0
        self.longest_update = 0.0
        engine.observers += [self.recorder, self]
        engine.adapter = self

    @property
    def model(self) -> torch.nn.Module:
        """The float32 copy that learns."""
        return self.learner.model

    @property
    def resets(self) -> int:
        return self.learner.resets

    @property
    def drift(self) -> float:
        return self.learner.drift

    # -- accounting
    def step_seconds(self) -> float:
        """The engine's time in its steps so far (prompt passes, drafting, verifying, bookkeeping)."""
        t = self.engine.times
        return t.prefill + t.draft + t.verify + t.bookkeeping

    def stats(self) -> dict:
        """Counters for reports and ``/metrics``."""
        return {"updates": self.updates, "rollbacks": self.rollbacks, "resets": self.resets,
                "update_seconds": round(self.update_seconds, 4), "step_seconds": round(self.step_seconds(), 4),
                "drift": round(self.drift, 6)}

    # -- observer hooks
    def _finished(self, seq: OnPolicySequence) -> None:
        if seq.length > seq.prompt_len + 4:
            self.queue.append(seq)

    def _accepted(self, accepted: list[int]) -> None:
        self.recent.extend(accepted)
        if self._pending is not None:
            self._since_update.extend(accepted)

    def prefilled(self, seq: LiveRequest, states: torch.Tensor | None, logits: torch.Tensor) -> None:
        pass

    def verified(self, seqs: list[LiveRequest], trees: list[DraftTree], out: ForwardOutput,
                 paths: list[list[int]], drafted: set[int]) -> None:
        pass

    def finished(self, seq: LiveRequest) -> None:
        pass

    def between_steps(self) -> None:
        cfg = self.config
        if self._pending is not None:
            if len(self._since_update) < cfg.window:
                return  # judge the last update before taking another
            self._judge()
        if not self.queue:
            return
        estimate = self.longest_update if self.updates else self.config.first_guess
        if self.update_seconds + estimate > cfg.budget * self.step_seconds():
            return
        t0 = time.perf_counter()
        before = sum(self.recent) / len(self.recent) if len(self.recent) >= cfg.window else None
        saved = self.learner.snapshot()
        self._train_step(self.queue[-1])
        self.learner.finish()
        if before is not None:
            self._pending, self._since_update = (saved, before), []
        spent = time.perf_counter() - t0
        self.update_seconds += spent
        self.longest_update = max(self.longest_update, spent)
        self.updates += 1

    def _judge(self) -> None:
        saved, before = self._pending
        after = sum(self._since_update) / len(self._since_update)
        self._pending, self._since_update = None, []
        if after < before * (1.0 - self.config.tolerance):
            self.learner.restore(saved)
            self.learner.publish()
            self.rollbacks += 1

    def live_weights(self) -> dict[str, torch.Tensor]:
        """The drafter's current weights (for checks)."""
        return {n: p.detach().clone() for n, p in self.learner.live.named_parameters()}


def _trainable_copy(pred):
    """A float32 copy of ``pred``'s trained weights, sharing the target's embeddings."""
    import copy

    packed = pred.__dict__.pop("_packed", None)
    try:
        clone = copy.deepcopy(pred, memo={id(pred.embed): pred.embed})
    finally:
        if packed is not None:
            pred.__dict__["_packed"] = packed
    for p in clone.parameters():
        p.data = p.data.float()
        p.requires_grad_(True)
    clone.head = clone.head.float()
    return clone.train()
