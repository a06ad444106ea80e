"""Replaying logged decoding steps through a commit policy, with exact counterfactuals.

``sot train policy`` records every step of a decoding run that verified each drafted tree
whole, with the sequence's free drafts merged in (``Engine(record_policy=True)``). For each
sequence the step then knows the target's own continuation as far as that union tree reaches:
the tokens of the accepted path. Under greedy decoding, and under coupled sampling (whose
token at every position is fixed by the seed), a node is accepted exactly when its path
follows those tokens. So for *any* tree drawn from the union (a pruning of the drafted tree,
the free draft alone, a smaller budget) the accepted length is known without running the
model: the longest prefix of the target's tokens that is a path in it (:func:`accepted_path`).
With rejection sampling it is an approximation (which sibling is tried second depends on the
tree).

The step's time comes from the cost model: verify time by row count, and the predictor's
pass time as a ratio of a one-row verify pass (measured while recording). :func:`replay` runs
the real :class:`~sot.policy.CommitPolicy` (plan, select, observe) over the logged steps,
feeding it these simulated outcomes, so a policy's state (calibration, fallback, free-draft
choices) evolves as it would in the engine along the logged text. The sequences' text does
not change with the policy's choices (the logged steps are replayed as they came), which
makes it a contextual bandit: each step scores every candidate, not a path of them.
"""
from __future__ import annotations

import bisect
import copy
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sot.policy.record import from_dict, step_record, tree_dict, union_tree
from sot.tree import DraftTree, merge_trees

if TYPE_CHECKING:
    from sot.drafters.base import TreeBudget
    from sot.policy.acceptance_model import AcceptanceModel
    from sot.policy.commit import CommitPolicy
    from sot.policy.cost import CostModel
    from sot.policy.rl import RLPolicyModel


def accepted_path(tree: DraftTree, target: list[int]) -> list[int]:
    """Tree indices (root first) of the longest prefix of ``target`` that is a path of ``tree``:
    what verifying ``tree`` accepts when the target's continuation starts with ``target``."""
    kids = tree.children()
    path, node = [0], 0
    for tok in target:
        nxt = next((c for c in kids[node] if tree.tokens[c] == tok), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def within_budget(tree: DraftTree, max_nodes: int, max_depth: int, min_confidence: float | None) -> DraftTree:
    """What a drafter grows under a smaller budget, taken from a tree grown under a larger
    one: nodes within ``max_depth`` whose parent is confident enough to expand, the best
    ``max_nodes - 1`` by confidence (closed under parents)."""
    from sot.policy.state import prune, ranked_nodes

    probs = tree.confidences()
    floor = min_confidence or 0.0
    ok = [True] * tree.size
    for i in range(1, tree.size):
        p = tree.parents[i]
        ok[i] = ok[p] and tree.depths[i] <= max_depth and (p == 0 or probs[p] >= floor)
    keep = [i for i in ranked_nodes(tree) if ok[i]][: max(0, max_nodes - 1)]
    return tree if len(keep) == tree.size - 1 else prune(tree, keep)


@dataclass
class SimCost:
    """The simulated machine: verify time by rows, and the predictor's pass time."""

    cost: CostModel
    pass_seconds: float

    def scaled(self, slope: float, passes: float) -> "SimCost":
        """Another machine: every row past the first costs ``slope`` times as much, and a
        predictor pass ``passes`` times as much."""
        c = copy.deepcopy(self.cost)
        first = c.seconds[0]
        c.seconds = [first + slope * (s - first) for s in c.seconds]
        return SimCost(c, self.pass_seconds * passes)


@dataclass
class SelectSample:
    """One step's verify-size choice: the network's inputs and each candidate's reward."""

    features: torch.Tensor  # [K, len(SELECT_FEATURES)]
    step: torch.Tensor  # [len(STEP_FEATURES)]
    reward: torch.Tensor  # [K]
    chosen: int
    heuristic: int  # the candidate the heuristic would take (gap 0)


@dataclass
class DraftSample:
    """One sequence's draft-or-free choice: the network's inputs and the two rewards."""

    features: torch.Tensor  # [len(DRAFT_FEATURES)]
    free: float
    draft: float


@dataclass
class ReplayResult:
    """Totals of a replay: tokens committed, simulated seconds, and in plain-step units (a
    step's time over the time per token of plain decoding at its batch size)."""

    tokens: float = 0.0
    seconds: float = 0.0
    units: float = 0.0
    steps: int = 0
    rows: int = 0
    plain_steps: int = 0  # sequence-steps verified without a drafted tree
    rewards: list[float] = field(default_factory=list)  # per step, (tokens - mu * units) / batch
    select: list[SelectSample] = field(default_factory=list)
    draft: list[DraftSample] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        """Tokens per plain-step unit: simulated speed over plain decoding's."""
        return self.tokens / max(self.units, 1e-12)



def _acc_counts(tree: DraftTree, order: list[int], target: list[int]) -> list[int]:
    """``prefmax``: candidate keeping the first ``c`` nodes of ``order`` accepts
    ``bisect_left(prefmax, c)`` of them (the positions in ``order`` of the target's path,
    running maximum)."""
    pos = {n: i for i, n in enumerate(order)}
    out, top = [], -1
    for n in accepted_path(tree, target)[1:]:
        top = max(top, pos[n])
        out.append(top)
    return out


def replay(policy: CommitPolicy, runs: list[list[dict]], machine: SimCost, flat: bool = True,
           mu: float = 1.0, collect: bool = False, budget: TreeBudget | None = None) -> ReplayResult:
    """Run ``policy`` over the recorded ``runs`` (each a list of :func:`step_record` dicts)
    on the simulated ``machine``. Returns the totals; with ``collect``, also every step's
    candidates with their exact rewards (``(tokens - mu * units) / batch``) and every
    draft-or-free choice with both rewards, for training."""
    from sot.drafters.base import TreeBudget
    from sot.policy.state import StepOutcome

    budget = budget or TreeBudget()
    policy.cost = machine.cost
    policy.flat = flat
    res = ReplayResult()
    for run in runs:
        policy.seqs, policy.pass_seconds, policy.passes_per_call = {}, [], 3.0
        policy.gain_scale, policy.drafting_share = 1.0, 1.0
        generated: dict[int, int] = {}
        for step in run:
            recs = {s["key"]: s for s in step["seqs"]}
            if not recs:
                continue
            for k in list(generated):
                if k not in recs:
                    policy.drop_sequence(k)
                    del generated[k]
            for k, s in recs.items():
                if k not in generated:
                    policy.add_sequence(k, s["temperature"])
                    generated[k] = 1
            batch = len(recs)
            drafted = {k: from_dict(s["drafted"]) for k, s in recs.items()}
            free = {k: from_dict(s["free"]) if s["free"] else DraftTree.root_only(drafted[k].tokens[0], confident=True)
                    for k, s in recs.items()}
            policy.last_draft_features = {}
            plan = policy.plan(dict(generated), free, budget.for_batch(batch))
            b = plan.budget
            own = {k: within_budget(drafted[k], b.grown_nodes, b.grown_depth, b.min_confidence) for k in plan.drafting}
            logged_depth = max((drafted[k].max_depth for k in plan.drafting), default=0)
            depth = max((t.max_depth for t in own.values()), default=0)  # (predictor passes)
            # as the engine does: the free drafts are merged into the drafted tree up to the whole budget
            proposed = {k: t if free[k].size <= 1 else
                        merge_trees([t, within_budget(free[k], b.max_nodes, b.max_depth, None)], b.max_nodes)
                        for k, t in own.items()}
            passes = 0
            if plan.drafting:
                logged = max(1, int(step["draft_passes"]))
                passes = max(1, round(logged * depth / logged_depth)) if logged_depth else 1
            draft_seconds = machine.pass_seconds * passes
            trees_in = dict(proposed)
            trees_in.update(plan.free)
            chosen = policy.select(plan, proposed)
            trees = {k: chosen.get(k) or DraftTree.root_only(drafted[k].tokens[0]) for k in recs}
            paths = {k: accepted_path(trees[k], recs[k]["target"]) for k in recs}
            rows = sum(t.size for t in trees.values()) if flat else batch * max(t.size for t in trees.values())
            policy.observe_step(plan, StepOutcome(trees=trees, paths=paths, draft_seconds=draft_seconds,
                                                  draft_passes=passes, verify_seconds=0.0, rows=rows))
            tokens = sum(len(p) for p in paths.values())
            seconds = draft_seconds + machine.cost.verify(rows)
            unit = machine.cost.verify(batch) / batch
            res.tokens += tokens
            res.seconds += seconds
            res.units += seconds / unit
            res.steps += 1
            res.rows += rows
            res.plain_steps += batch - len(plan.drafting)
            res.rewards.append((tokens - mu * seconds / unit) / batch)
            for k, p in paths.items():
                generated[k] += len(p)
            if collect:
                _collect(policy, trees_in, recs, machine, batch, draft_seconds, unit, mu, res)
                _collect_draft(policy, drafted, free, recs, machine, batch, passes or 1, unit, mu, res)
    return res


def _collect(policy: CommitPolicy, trees: dict[int, DraftTree], recs: dict, machine: SimCost,
             batch: int, draft_seconds: float, unit: float, mu: float, res: ReplayResult) -> None:
    """The step's candidates (``policy.choice``) with their exact rewards."""
    choice = policy.choice
    if choice is None or policy.last_features is None or not trees or len(choice.rows) < 2:
        return
    feats, step, idx = policy.last_features
    if len(idx) < 2:  # nothing to choose
        policy.choice, policy.last_features = None, None
        return
    prefmax = {k: _acc_counts(trees[k], choice.orders[k], recs[k]["target"]) for k in choice.orders}
    rewards = []
    for c in idx:
        kept = choice.kept(c)
        tokens = batch + sum(bisect.bisect_left(prefmax[k], kept[k]) for k in prefmax)
        seconds = draft_seconds + machine.cost.verify(choice.rows[c])
        rewards.append((tokens - mu * seconds / unit) / batch)
    res.select.append(SelectSample(torch.from_numpy(feats), torch.from_numpy(step), torch.tensor(rewards),
                                   idx.index(choice.chosen), int(feats[:, 0].argmax())))
    policy.choice, policy.last_features = None, None


def _best_alone(tree: DraftTree, est: list[float], target: list[int], batch: int,
                machine: SimCost) -> tuple[int, float]:
    """Tokens committed and verify seconds added when ``tree`` alone is verified with the
    heuristic's choice of its best nodes in a pass of ``batch`` rows."""
    from sot.policy.state import ranked_nodes

    order = ranked_nodes(tree, est)
    base = machine.cost.verify(batch)
    best, best_rate, gain = 0, 1.0 / base, 1.0
    for k, n in enumerate(order, start=1):
        gain += est[n]
        rate = gain / (base + machine.cost.verify(batch + k) - machine.cost.verify(batch))
        if rate > best_rate:
            best, best_rate = k, rate
    prefmax = _acc_counts(tree, order, target)
    tokens = 1 + bisect.bisect_left(prefmax, best)
    return tokens, machine.cost.verify(batch + best) - machine.cost.verify(batch)


def _collect_draft(policy: CommitPolicy, drafted: dict[int, DraftTree], free: dict[int, DraftTree], recs: dict,
                   machine: SimCost, batch: int, passes: int, unit: float, mu: float, res: ReplayResult) -> None:
    """Each draft-or-free choice made this step with both rewards: the sequence's tokens
    minus ``mu`` times its share of the step (its own rows, its root row's share, and for
    drafting a share of the predictor's passes)."""
    for k, x in policy.last_draft_features.items():
        f, d = free[k], drafted[k]
        s = policy.seqs.get(k)
        if s is None or f.size <= 1 or d.size <= 1:
            continue
        target = recs[k]["target"]
        est_f = list(f.draft_probs or [1.0] + [0.0] * (f.size - 1))
        tok_f, sec_f = _best_alone(f, est_f, target, batch, machine)
        est_d = [1.0] + [min(1.0, s.calibration * p) for p in d.confidences()[1:]]
        tok_d, sec_d = _best_alone(d, est_d, target, batch, machine)
        sec_d += machine.pass_seconds * passes / max(1, batch)
        res.draft.append(DraftSample(torch.from_numpy(x), tok_f - mu * (sec_f / unit + 1.0), tok_d - mu * (sec_d / unit + 1.0)))


def machine_from_traces(traces: dict) -> SimCost:
    """The machine the traces were recorded on: its cost model and the predictor's median
    pass time."""
    from sot.policy.cost import CostModel

    cost = CostModel(list(traces["cost_rows"]), list(traces["cost_seconds"]))
    per_pass = [s["draft_seconds"] / s["draft_passes"] for run in traces["runs"] for s in run if s["draft_passes"] > 0]
    return SimCost(cost, statistics.median(per_pass) if per_pass else 0.0)


def policy_for_replay(kind: str, rl: RLPolicyModel | None = None,
                      acceptance: AcceptanceModel | None = None) -> CommitPolicy:
    """A fresh adaptive policy of ``kind`` for :func:`replay` (its cost model is set there)."""
    from sot.policy.commit import CommitPolicy
    from sot.policy.config import PolicyConfig, PolicyKind
    from sot.policy.cost import CostModel

    return CommitPolicy(PolicyConfig(kind=PolicyKind(kind)), CostModel([1], [1.0]), acceptance, rl=rl)


def speed_ratio(a: ReplayResult, b: ReplayResult) -> float:
    """``a``'s simulated speed over ``b``'s on the same steps."""
    return a.speedup / b.speedup if b.speedup > 0 else math.nan


__all__ = ["DraftSample", "ReplayResult", "SelectSample", "SimCost", "accepted_path", "from_dict",
           "machine_from_traces", "policy_for_replay", "replay", "speed_ratio", "step_record", "tree_dict",
           "union_tree", "within_budget"]
