"""What the policy keeps and exchanges: a sequence's policy state, a step's plan and outcome,
and ranking and pruning a tree's nodes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sot.tree import DraftTree

if TYPE_CHECKING:
    from sot.drafters.base import TreeBudget


@dataclass
class SequencePolicyState:
    """What the policy remembers about one sequence."""

    # accepted / expected drafted tokens, smoothed; it starts at 0.6, about what greedy
    # decoding with the shipped predictor settles at (draft confidence overstates acceptance)
    calibration: float = 0.6
    tau: float = 2.0  # committed tokens per drafting step, smoothed
    speed: list[float] = field(default_factory=list)  # recent step speed / plain speed
    plain_left: int = 0  # fallback steps still to decode plainly
    backoff: int = 0  # length of the next fallback
    probing: bool = False
    fallbacks: int = 0
    drafted: int = 0  # drafting steps so far
    verified: int = 0  # rows per sequence of the last verify pass it drafted for (0: none yet)
    #: speed of the steps with the drafter's model idle (free drafts), relative to plain
    #: decoding, smoothed; ``None`` until such a step was verified
    free_speed: float | None = None
    temperature: float = 0.0  # the sequence's sampling temperature (0: greedy)


def ranked_nodes(tree: DraftTree, scores: list[float] | None = None) -> list[int]:
    """Non-root nodes by ``scores`` (default: draft confidence), best first; every prefix is
    closed under parents when no child scores above its parent (ties go to the shallower node)."""
    probs = scores or tree.confidences()
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


#: per-node inputs of the learned acceptance model, in order


@dataclass(frozen=True)
class StepPlan:
    """The commit policy's decisions for one step, taken before drafting (keys are the
    engine's sequence keys; ``n`` sequences are in the step).

    Attributes:
        drafting: ``[n_draft]`` keys of the sequences whose drafter model runs.
        plain: ``[n - n_draft]`` keys of the sequences that keep the model idle (warm-up,
            fallback, or a free draft that promises more): they verify their free tree, if
            any, else decode plainly.
        free: key -> the free draft (no model pass) such a sequence verifies.
        budget: the tree budget the drafter grows this step's trees with.
        batch_rows: ``n``, sequences in the verify pass.
    """

    drafting: tuple[int, ...]
    plain: tuple[int, ...]
    free: dict[int, DraftTree]
    budget: "TreeBudget"
    batch_rows: int

    @classmethod
    def make_dummy(cls, keys: list[int], budget: "TreeBudget") -> "StepPlan":
        """Every sequence drafts with ``budget`` (for tests)."""
        return cls(tuple(keys), (), {}, budget, len(keys))


@dataclass(frozen=True)
class BatchChoice:
    """The candidates of one :meth:`CommitPolicy.choose_batch` and the one taken (what the
    simulator scores, :mod:`sot.policy.simulate`).

    Attributes:
        orders: key -> the tree's non-root nodes, best first.
        merged: flat packing: the key of each node of the step's merged ranking (candidate
            ``k`` keeps the first ``k``); ``None`` when padded (candidate ``k`` keeps the first
            ``k`` nodes of every tree).
        rows: ``[K]`` rows of each candidate's verify pass.
        chosen: the candidate verified.
    """

    orders: dict[int, list[int]]
    merged: list[int] | None
    rows: list[int]
    chosen: int

    def kept(self, k: int) -> dict[int, int]:
        """key -> how many of its best nodes candidate ``k`` keeps."""
        if self.merged is None:
            return {b: min(k, len(o)) for b, o in self.orders.items()}
        out = dict.fromkeys(self.orders, 0)
        for b in self.merged[:k]:
            out[b] += 1
        return out


@dataclass(frozen=True)
class StepOutcome:
    """What one step's verify pass found, for :meth:`CommitPolicy.observe_step`.

    Attributes:
        trees: key -> the tree verified (root first), as :meth:`CommitPolicy.select` chose it.
        paths: key -> tree indices of the accepted nodes, root first.
        draft_seconds: wall time of planning, free drafts, drafting and selection.
        draft_passes: predictor passes drafting ran.
        verify_seconds: wall time of the verify pass.
        rows: rows the verify pass computed, all sequences together.
    """

    trees: dict[int, DraftTree]
    paths: dict[int, list[int]]
    draft_seconds: float
    draft_passes: int
    verify_seconds: float
    rows: int
