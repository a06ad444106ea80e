"""What a recording engine logs per step for the rl policy's simulator
(:mod:`sot.policy.simulate`): the drafted tree, the free draft, and the target's tokens."""
from __future__ import annotations

from typing import TYPE_CHECKING

from sot.tree import DraftTree, merge_trees

if TYPE_CHECKING:
    from sot.policy.state import SequencePolicyState, StepOutcome, StepPlan


def union_tree(drafted: DraftTree, free: DraftTree | None) -> DraftTree:
    """``drafted`` with every node of ``free`` merged in (shared prefixes once), none dropped."""
    if free is None or free.size <= 1:
        return drafted
    if drafted.size <= 1:
        return free
    return merge_trees([drafted, free], drafted.size + free.size)


def tree_dict(tree: DraftTree | None) -> dict | None:
    """A tree as plain lists (for ``torch.save``)."""
    if tree is None:
        return None
    return {"tokens": list(tree.tokens), "parents": list(tree.parents), "depths": list(tree.depths),
            "probs": None if tree.draft_probs is None else [float(p) for p in tree.draft_probs]}


def from_dict(d: dict) -> DraftTree:
    """The :class:`DraftTree` a :func:`tree_dict` record describes."""
    return DraftTree(list(d["tokens"]), list(d["parents"]), list(d["depths"]), d["probs"])


def step_record(plan: StepPlan, outcome: StepOutcome, recorded: dict[int, tuple[DraftTree, DraftTree | None]],
                seqs: dict[int, SequencePolicyState]) -> dict:
    """One recorded step: its timing and, per drafting sequence, the drafted tree, the free
    draft, and the target's tokens along the accepted path of their union."""
    out = []
    for b in plan.drafting:
        tree, path = outcome.trees[b], outcome.paths[b]
        drafted, free = recorded.get(b, (DraftTree.root_only(tree.tokens[0]), None))
        out.append({"key": b, "temperature": seqs[b].temperature if b in seqs else 0.0,
                    "drafted": tree_dict(drafted), "free": tree_dict(free),
                    "target": [int(tree.tokens[i]) for i in path[1:]]})
    return {"batch": plan.batch_rows, "draft_seconds": outcome.draft_seconds, "draft_passes": outcome.draft_passes,
            "verify_seconds": outcome.verify_seconds, "rows": outcome.rows, "seqs": out}
