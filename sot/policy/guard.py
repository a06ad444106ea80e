"""The batch guard: speculation is kept only where the clock shows it beats plain steps.

The commit policy prices a step with a model: verify time by row count, measured on one
sequence and scaled online, and the predictor's measured pass. What the model does not see
(the bookkeeping of trees, attention over many contexts, a pass whose cost per row changes
with the batch, the machine's load) can make speculative steps slower than plain ones while
the model says they pay. On an AVX2 EPYC, where a 16-row pass costs 3.3 one-row passes,
HumanEval at batch 4 ran at 0.92x plain that way (``docs/batching.md``).

The guard measures instead, per batch size (live sequences): the wall time of whole steps
(planning, drafting, the verify pass, accepting and committing) and the tokens they commit,
for steps that speculated (a drafting call or a verified tree beyond its root) and for plain
ones. While speculation's tokens per second at a batch size stay at or above plain's (times
the policy's fallback threshold), it goes on; a few plain steps are interleaved now and then
to keep plain's figure current. When it falls below, that batch size decodes plainly for a
back-off (doubling after each retry that fails), then speculation is tried again. A back-off
judges the sequences that lost: once at least half of a batch's sequences joined after it began
(at batch 1, the next request), it ends, and the new sequences are judged on their own steps
(``docs/NOTEBOOK.md``, *The guard forgets the sequences that lost*).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: steps of each kind whose totals give the rates
SPEC_WINDOW = 16
PLAIN_WINDOW = 6
#: plain steps run to measure plain's rate (first after SPEC_WINDOW speculative steps)
PROBE = 3
#: speculative steps between plain measurements while speculation wins
REFRESH = 96
#: plain steps after a first failure; doubled after each failed retry, up to MAX_BACKOFF
FIRST_BACKOFF = 16
MAX_BACKOFF = 512


@dataclass
class _Size:
    """What one batch size measured, and what it does next."""

    spec: deque = field(default_factory=lambda: deque(maxlen=SPEC_WINDOW))  # (tokens, seconds)
    plain: deque = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))
    plain_left: int = 0  # plain steps still to run (a probe or a back-off)
    since_plain: int = 0  # speculative steps since plain's rate was last measured
    backoff: int = FIRST_BACKOFF
    holds: int = 0  # back-offs taken
    holding: bool = False  # plain_left counts a back-off (not a probe of plain's rate)
    joined: int = 0  # sequences that joined the engine since the back-off began

    @staticmethod
    def rate(steps: deque) -> float:
        return sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-9)


class BatchGuard:
    """Per batch size, speculative against plain steps on the wall clock (see the module)."""

    def __init__(self, threshold: float = 1.0) -> None:
        self.threshold = threshold
        self.sizes: dict[int, _Size] = {}

    def plain(self, batch: int) -> bool:
        """Whether a step of ``batch`` live sequences decodes plainly (a probe or a back-off)."""
        s = self.sizes.get(batch)
        if s is not None and s.holding and s.plain_left > 0 and 2 * s.joined >= batch:
            # most of the batch is new since speculation lost: judge the new sequences afresh
            s.plain_left, s.holding, s.backoff = 0, False, FIRST_BACKOFF
            s.spec.clear()
        return s is not None and s.plain_left > 0

    def joined(self) -> None:
        """A sequence joined the engine (a new request): it counts toward ending the back-offs
        running at every batch size."""
        for s in self.sizes.values():
            if s.holding:
                s.joined += 1

    def observe(self, batch: int, tokens: int, seconds: float, speculative: bool) -> None:
        """A step of ``batch`` live sequences committed ``tokens`` in ``seconds`` (wall clock);
        ``speculative``: it drafted or verified a tree beyond its root."""
        if self.threshold <= 0 or seconds <= 0:
            return
        s = self.sizes.setdefault(batch, _Size())
        if not speculative:
            s.plain.append((tokens, seconds))
            if s.plain_left > 0:
                s.plain_left -= 1
                if s.plain_left == 0:
                    s.since_plain, s.holding = 0, False
            return
        s.spec.append((tokens, seconds))
        s.since_plain += 1
        if len(s.spec) < SPEC_WINDOW:
            return
        if len(s.plain) < PROBE or s.since_plain >= REFRESH:
            s.plain_left = PROBE  # measure plain decoding at this batch size
            return
        if s.rate(s.spec) < self.threshold * s.rate(s.plain):
            s.plain_left, s.holding, s.joined = s.backoff, True, 0
            s.backoff = min(2 * s.backoff, MAX_BACKOFF)
            s.holds += 1
            s.spec.clear()  # the retry is judged on its own steps
        elif s.backoff > FIRST_BACKOFF:
            s.backoff = FIRST_BACKOFF  # a retry that wins resets the back-off

    def stats(self) -> dict[int, dict]:
        """Per batch size: measured rates (tokens/s) and back-offs taken."""
        return {b: {"speculative": s.rate(s.spec) if s.spec else None, "plain": s.rate(s.plain) if s.plain else None,
                    "holds": s.holds} for b, s in sorted(self.sizes.items())}
