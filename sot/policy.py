"""The commit policy: how much of each proposed tree to verify, per sequence and step.

Speculation pays only when the tokens a tree wins are worth more than the extra rows it costs
in the verify pass. The policy decides that per sequence, every step:

* **warm-up** - the first ``warmup`` tokens of a sequence are decoded plainly;
* **pruning by a cost model** - the tree's nodes are ranked by draft confidence (the
  cumulative draft probability of reaching them, scaled by a per-sequence calibration that
  tracks how often such nodes were really accepted); the policy keeps the best ``n`` nodes,
  where ``n`` maximises ``expected tokens / verify time(n + 1 rows)`` with verify time
  measured on this machine at start-up (:class:`CostModel`);
* **fallback** - when a sequence's measured speed over its recent steps stays below
  ``fallback_threshold`` times plain decoding's, it decodes plainly for a while and probes
  again, on an exponential back-off. This is per sequence: the others keep speculating.

``static`` verifies whatever the drafter proposes (the tree shape is fixed by the budget).
"""
from __future__ import annotations

import enum
import statistics
import time
from dataclasses import dataclass, field

import torch

from sot.errors import ConfigError
from sot.tree import DraftTree


class PolicyKind(str, enum.Enum):
    STATIC = "static"
    HEURISTIC = "heuristic"


@dataclass(frozen=True)
class PolicyConfig:
    """Commit-policy settings.

    Attributes:
        kind: ``heuristic`` (cost model, calibration, fallback) or ``static`` (verify as proposed).
        warmup: tokens decoded plainly at the start of every sequence.
        fallback_threshold: fall back when recent speed / plain speed drops below this.
        window: steps of history behind the fallback decision.
        first_backoff: plain steps after a first fallback; doubles on each failed probe.
        max_backoff: cap of the back-off, in steps.
    """

    kind: PolicyKind = PolicyKind.HEURISTIC
    warmup: int = 0
    fallback_threshold: float = 1.0
    window: int = 6
    first_backoff: int = 4
    max_backoff: int = 64

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.window < 1 or self.first_backoff < 1 or self.max_backoff < self.first_backoff:
            raise ConfigError("policy needs warmup >= 0, window >= 1 and 1 <= first_backoff <= max_backoff")
        if self.fallback_threshold < 0:
            raise ConfigError(f"fallback threshold must be >= 0, got {self.fallback_threshold}")


class CostModel:
    """Seconds of one verify pass as a function of its row count (batch of one sequence),
    interpolated linearly between measured points."""

    def __init__(self, rows: list[int], seconds: list[float]) -> None:
        if not rows or len(rows) != len(seconds):
            raise ValueError("a cost model needs matching rows and seconds")
        order = sorted(range(len(rows)), key=lambda i: rows[i])
        self.rows = [rows[i] for i in order]
        # verify time never decreases with more rows; measurement noise can make it look so
        self.seconds = []
        for i in order:
            self.seconds.append(max([seconds[i]] + self.seconds[-1:]))

    def verify(self, rows: int) -> float:
        r, s = self.rows, self.seconds
        if rows <= r[0]:
            return s[0]
        for i in range(1, len(r)):
            if rows <= r[i]:
                f = (rows - r[i - 1]) / (r[i] - r[i - 1])
                return s[i - 1] + f * (s[i] - s[i - 1])
        slope = (s[-1] - s[-2]) / (r[-1] - r[-2]) if len(r) > 1 else 0.0
        return s[-1] + slope * (rows - r[-1])

    @classmethod
    def measure(cls, target, max_rows: int, context: int = 256, repeats: int = 3) -> "CostModel":
        """Time verify passes of chain trees of growing size after a ``context``-token prefill."""
        from sot.attention import build_tree_layout
        from sot.tree import ancestor_table, chain_tree

        sizes = sorted({1, 2, 4, 8, 12, 16, 24, 32, 48, 64} & set(range(1, max_rows + 1)) | {max_rows})
        unit = target.row_multiple
        cache = target.new_cache(1, context + max(sizes) + unit + 16)
        gen = torch.Generator().manual_seed(0)
        vocab = target.model.get_input_embeddings().weight.shape[0]
        prompt = torch.randint(0, vocab, (context,), generator=gen)
        target.prefill(cache, 0, prompt)
        cache.set_length(0, context)
        timings: dict[int, float] = {}
        for n in sizes:
            tree = chain_tree(int(prompt[-1]), prompt[-n:-1].tolist()) if n > 1 else DraftTree([int(prompt[-1])], [-1], [0])
            rows = -(-n // unit) * unit
            ids = torch.full((1, rows), int(tree.tokens[0]))
            ids[0, :n] = torch.tensor(tree.tokens)
            pos = torch.full((1, rows), context)
            pos[0, :n] = torch.tensor(tree.depths) + context
            layout = build_tree_layout(cache.lengths, [ancestor_table(tree, tree.max_depth + 1)], rows, cache)
            runs = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                target.verify(cache, ids, pos, layout)
                runs.append(time.perf_counter() - t0)
            timings[n] = statistics.median(runs[1:])
        return cls(list(timings), list(timings.values()))


@dataclass
class SequencePolicyState:
    """What the policy remembers about one sequence."""

    calibration: float = 1.0  # accepted / expected drafted tokens, smoothed
    speed: list[float] = field(default_factory=list)  # recent step speed / plain speed
    plain_left: int = 0  # fallback steps still to decode plainly
    backoff: int = 0  # length of the next fallback
    probing: bool = False
    fallbacks: int = 0


def ranked_nodes(tree: DraftTree) -> list[int]:
    """Non-root nodes by draft confidence, best first; every prefix is closed under parents
    (a child is never more probable than its parent; ties go to the shallower node)."""
    probs = tree.draft_probs or [1.0 / (d + 1) for d in tree.depths]
    return sorted(range(1, tree.size), key=lambda i: (-probs[i], tree.depths[i], i))


def prune(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The subtree of the root and the nodes ``keep`` (closed under parents), in tree order."""
    chosen = sorted(keep)
    index = {0: 0}
    for j, i in enumerate(chosen, start=1):
        index[i] = j
    tokens = [tree.tokens[0]] + [tree.tokens[i] for i in chosen]
    parents = [-1] + [index[tree.parents[i]] for i in chosen]
    depths = [0] + [tree.depths[i] for i in chosen]
    probs = None if tree.draft_probs is None else [1.0] + [tree.draft_probs[i] for i in chosen]
    return DraftTree(tokens, parents, depths, probs)


class CommitPolicy:
    """Per-sequence decisions of one generation call (see the module docstring)."""

    def __init__(self, config: PolicyConfig, cost: CostModel | None) -> None:
        self.config = config
        self.cost = cost
        self.seqs: list[SequencePolicyState] = []

    def reset(self, batch_size: int) -> None:
        self.seqs = [SequencePolicyState(backoff=self.config.first_backoff) for _ in range(batch_size)]

    def wants_draft(self, b: int, generated: int) -> bool:
        """False when sequence ``b`` decodes plainly this step (warm-up or fallback)."""
        if generated < self.config.warmup:
            return False
        if self.config.kind is PolicyKind.STATIC:
            return True
        s = self.seqs[b]
        if s.plain_left > 0:
            s.plain_left -= 1
            if s.plain_left == 0:
                s.probing = True
                s.speed.clear()
            return False
        return True

    def choose(self, b: int, tree: DraftTree) -> DraftTree:
        """Keep the part of ``tree`` with the best expected tokens per second."""
        if self.config.kind is PolicyKind.STATIC or self.cost is None or tree.size <= 1:
            return tree
        s = self.seqs[b]
        probs = tree.draft_probs or [1.0] * tree.size
        order = ranked_nodes(tree)
        best_n, best_rate, expected = 0, 1.0 / self.cost.verify(1), 1.0
        for n, i in enumerate(order, start=1):
            expected += min(1.0, s.calibration * probs[i])
            rate = expected / self.cost.verify(n + 1)
            if rate > best_rate:
                best_n, best_rate = n, rate
        if best_n == len(order):
            return tree
        return prune(tree, order[:best_n])

    def observe(self, b: int, tree: DraftTree, accepted: int, step_seconds: float) -> None:
        """Update sequence ``b`` after a step that verified ``tree`` and accepted ``accepted``
        drafted tokens; ``step_seconds`` is its share of the step (its draft time plus the
        modelled verify time of its rows)."""
        if self.config.kind is PolicyKind.STATIC or self.cost is None or tree.size <= 1:
            return
        s = self.seqs[b]
        probs = tree.draft_probs or [1.0] * tree.size
        # E[accepted] = sum over nodes of P(node accepted); the draft probabilities estimate it
        expected = sum(min(1.0, probs[i]) for i in range(1, tree.size))
        ratio = (accepted + 0.1) / (expected + 0.1)
        s.calibration = min(2.0, max(0.05, 0.8 * s.calibration + 0.2 * ratio))
        s.speed.append((accepted + 1) * self.cost.verify(1) / max(step_seconds, 1e-9))
        del s.speed[: -self.config.window]
        if s.probing and len(s.speed) >= 2:
            if statistics.fmean(s.speed) >= self.config.fallback_threshold:
                s.probing, s.backoff = False, self.config.first_backoff
            else:
                self._fall_back(s)
        elif len(s.speed) >= self.config.window and statistics.fmean(s.speed) < self.config.fallback_threshold:
            self._fall_back(s)

    def _fall_back(self, s: SequencePolicyState) -> None:
        s.plain_left = s.backoff
        s.backoff = min(2 * s.backoff, self.config.max_backoff)
        s.probing = False
        s.fallbacks += 1
        s.speed.clear()
