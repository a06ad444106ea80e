"""The commit policy: what the engine calls each step (``plan``, ``select``, ``observe_step``)."""
from __future__ import annotations

import heapq
import math
import statistics
from collections import Counter, deque
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from sot.errors import ConfigError
from sot.policy.acceptance_model import AcceptanceModel, Trace, node_features
from sot.policy.config import PolicyConfig, PolicyKind
from sot.policy.cost import CostModel
from sot.policy.guard import BatchGuard
from sot.policy.record import step_record, union_tree
from sot.policy.rl import STEP_FEATURES, RLPolicyModel, near_best, select_features
from sot.policy.state import BatchChoice, SequencePolicyState, StepOutcome, StepPlan, prune, ranked_nodes
from sot.tree import DraftTree

if TYPE_CHECKING:
    from sot.drafters.base import TreeBudget


class CommitPolicy:
    """Per-sequence decisions of the engine's steps (see the module docstring).

    The engine talks to it through three calls a step: :meth:`plan` (who drafts, with what
    budget), :meth:`select` (how much of each proposed tree to verify) and
    :meth:`observe_step` (what the verify pass found). Sequences join with
    :meth:`add_sequence` and leave with :meth:`drop_sequence`.

    Args:
        config: the settings.
        cost: verify time by row count (``None`` disables pruning and fallback).
        model: the acceptance model of ``learned``.
        record: keep every tree whole and log a :class:`Trace` (for ``sot train policy``).
        rl: the network of ``rl``.
    """

    #: nodes a tree may grow by from one step to the next (see :meth:`draft_budget`)
    SLACK = 2
    #: a closed batch is planned for its end (:meth:`plans_for_the_end`) where doubling its
    #: rows costs at least this factor
    ARITHMETIC_BOUND = 1.5
    #: fall back when drafting is slower than the free drafts, not only than plain decoding
    compare_free = True

    def __init__(self, config: PolicyConfig, cost: CostModel | None, model: AcceptanceModel | None = None,
                 record: bool = False, rl: RLPolicyModel | None = None) -> None:
        if config.kind is PolicyKind.LEARNED and model is None and cost is not None and not record:
            raise ConfigError("the learned policy needs its acceptance model")
        if config.kind is PolicyKind.RL and rl is None and cost is not None and not record:
            raise ConfigError("the rl policy needs its network")
        self.config = config
        self.cost = cost
        self.model = model
        self.rl = rl
        #: the candidates of the last :meth:`choose_batch` (``None`` before one)
        self.choice: BatchChoice | None = None
        #: rl: the network's inputs of the last choice, ``(candidates [K, F], step [S], their
        #: indices among the choice's candidates)``
        self.last_features: tuple[np.ndarray, np.ndarray, list[int]] | None = None
        #: rl: key -> the network's inputs of this step's draft-or-free choices
        self.last_draft_features: dict[int, np.ndarray] = {}
        self.record = record
        self.trace = Trace()
        self._record_free: dict[int, DraftTree] = {}  # recording: this step's free drafts
        self._recorded: dict[int, tuple[DraftTree, DraftTree | None]] = {}  # and its drafted trees
        self.seqs: dict[int, SequencePolicyState] = {}  # by sequence key (the engine's request id)
        self.pass_seconds: list[float] = []  # recent drafting time per predictor pass
        self.passes_per_call = 3.0  # predictor passes per drafting call, smoothed
        #: verify passes compute only the trees' real rows (flat packing) rather than padding
        #: every sequence to the largest tree; the engine sets it from its target and cache
        self.flat = False
        #: accepted / expected drafted tokens over the nodes the flat selection verified, all
        #: sequences and free drafts together, smoothed: it corrects the estimates' optimism
        self.gain_scale = 1.0
        self._expected: dict[int, float] = {}  # per sequence: expected tokens of the kept nodes
        #: per sequence of the last :meth:`choose_batch`: the tokens it expects the step to
        #: commit (1 + the estimated acceptance of the kept nodes)
        self.expected_tokens: dict[int, float] = {}
        #: share of the live sequences that drafted, over recent steps
        self.drafting_share = 1.0
        #: whether the drafter runs a model; without one (prompt lookup, suffix trees) an adaptive
        #: policy takes its trees as free drafts every step, priced by their own calibrated
        #: estimates and never put in fallback (falling back saves no model pass); the engine sets it
        self.model_drafts = True
        #: speculative against plain steps on the wall clock, per batch size (see :mod:`sot.policy.guard`)
        self.guard = BatchGuard(config.fallback_threshold)
        #: verify passes measured in this engine's batches, per batch size: ``(rows, seconds)``
        #: of passes of the roots only and of passes with drafts (:meth:`batch_doubling`)
        self._batch_passes: dict[int, tuple[deque, deque]] = {}
        #: closed batches planned for their end: the batch size these counts are for, steps in a
        #: row whose planning took nothing speculative, steps still to plan without asking the
        #: drafter for free drafts, and the last such pause (0: none yet); see :meth:`asks_offers`
        self._offers_batch = 0
        self._declined = 0
        self._offers_paused = 0
        self._offers_pause = 0
        self._asked = True

    @property
    def adaptive(self) -> bool:
        return self.config.kind is not PolicyKind.STATIC and self.cost is not None and not self.record

    def reset(self, batch_size: int, temperature: float = 0.0) -> None:
        """Forget every sequence and start ``batch_size`` new ones, keyed ``0 .. batch_size - 1``."""
        self.seqs = {}
        self._offers_batch = 0  # (the offers' pause starts over)
        for b in range(batch_size):
            self.add_sequence(b, temperature)

    def add_sequence(self, key: int, temperature: float = 0.0) -> None:
        """A new sequence joins (``temperature``: its sampling temperature, 0 for greedy)."""
        self.seqs[key] = SequencePolicyState(backoff=self.config.first_backoff, temperature=temperature)
        self.guard.joined()

    def drop_sequence(self, key: int) -> None:
        """Sequence ``key`` left (finished or aborted)."""
        self.seqs.pop(key, None)

    def fallbacks(self, key: int) -> int:
        """Fallbacks sequence ``key`` has taken so far."""
        return self.seqs[key].fallbacks

    # ------------------------------------------------------------ the engine's three calls
    def plan(self, generated: dict[int, int], free: dict[int, DraftTree], budget: "TreeBudget",
             left: dict[int, int] | None = None) -> StepPlan:
        """Decide one step: ``generated`` maps each live sequence's key to its tokens so far;
        ``free`` holds the free drafts the drafter offered (see :meth:`prefers_free`).
        ``left`` (key -> tokens the sequence may still commit) marks a closed batch, one whose
        caller waits for every sequence and whose freed slots nobody takes: where its pass is bound
        by arithmetic (:meth:`plans_for_the_end`) its drafts are then planned by
        :meth:`critical_path`, not by tokens per second."""
        self.last_draft_features = {}
        if self.record:
            self._record_free = dict(free)
        if self.holds_plain(len(generated)):  # the fixed rule, or the guard: all plain
            return StepPlan((), tuple(generated), {}, budget, len(generated))
        # (a drafter without a model offers its trees as free drafts instead, when the policy adapts)
        model = self.model_drafts or not self.adaptive
        drafting = [b for b, n in generated.items() if model and self.wants_draft(b, n)]
        taken = [b for b in drafting if b in free and self.prefers_free(b, free[b])]
        drafting = [b for b in drafting if b not in taken]
        if left is not None and self.plans_for_the_end(len(generated)):
            offered = {b: free[b] for b in generated if b in free and b not in drafting}
            allowed = self.critical_path(left, drafting, offered)
            self._note_closed_plan(bool(allowed))
            drafting = [b for b in drafting if b in allowed]
            free = {b: t for b, t in offered.items() if b in allowed}
        else:
            drafting = self.worth_drafting(drafting, len(generated))
            if left is not None:
                drafting = self.closed_warmup(drafting, left)
        plain = [b for b in generated if b not in drafting]
        if generated:
            self.drafting_share = 0.9 * self.drafting_share + 0.1 * len(drafting) / len(generated)
        return StepPlan(
            drafting=tuple(drafting),
            plain=tuple(plain),
            free={b: free[b] for b in plain if b in free},
            budget=self.draft_budget(budget, drafting, len(generated)),
            batch_rows=len(generated),
        )

    #: closed batches: steps whose planning takes nothing before the drafter's free drafts are
    #: paused, and the first and the longest pause (each pause after the first doubles; one
    #: step that takes nothing after a pause starts the next)
    OFFER_PATIENCE = 16
    OFFER_PAUSE = 16
    OFFER_PAUSE_MAX = 128

    def asks_offers(self, batch: int, closed: bool) -> bool:
        """Whether this step of ``batch`` live sequences asks the drafter for its free drafts.
        In a closed batch planned for its end (:meth:`critical_path`), the planning may turn
        every offer down step after step (16 sequences tied at 128 tokens left finish no sooner
        unless all of them gain), while finding the offers costs about 30 us a sequence each
        step. After :attr:`OFFER_PATIENCE` such steps in a row the offers pause for
        :attr:`OFFER_PAUSE` steps, then one step asks again, and the pause doubles while the
        offers keep being turned down. Any step that speculates, an open batch, a new batch,
        or a batch that has shrunk to where it is no longer planned for its end (its rows grew
        cheap, so tokens per second plans it and the tail's offers may pay) starts over. A
        sequence leaving a batch still planned for its end does not: those that leave early are
        off the critical path, whose offers were the ones turned down (on ShareGPT answers at
        batch 16, restarting there kept the offers asked for on about 2 steps in 5).
        Offers only ever add speculation, so pausing them changes no output."""
        if (not closed or self.record or batch > self._offers_batch
                or (batch < self._offers_batch and not self.plans_for_the_end(batch))):
            self._declined, self._offers_paused, self._offers_pause = 0, 0, 0
        self._offers_batch = batch
        self._asked = self._offers_paused == 0
        if not self._asked:
            self._offers_paused -= 1
        return self._asked

    def _note_closed_plan(self, speculates: bool) -> None:
        """A closed batch's step planned by :meth:`critical_path` took something speculative or
        nothing (see :meth:`asks_offers`)."""
        if speculates:
            self._declined, self._offers_pause = 0, 0
            return
        if not self._asked:
            return
        self._declined += 1
        if self._declined >= (self.OFFER_PATIENCE if self._offers_pause == 0 else 1):
            self._offers_pause = (self.OFFER_PAUSE if self._offers_pause == 0
                                  else min(2 * self._offers_pause, self.OFFER_PAUSE_MAX))
            self._offers_paused, self._declined = self._offers_pause, 0

    def holds_plain(self, batch: int) -> bool:
        """Whether a step of ``batch`` live sequences decodes plainly (nothing drafted or
        offered): above the fixed rule's batch size (``disable_above``), or where the guard
        measures plain steps or backs off from speculation that lost."""
        if self.config.disable_above and batch > self.config.disable_above:
            return True
        return self.adaptive and self.guard.plain(batch)

    def observe_wall(self, batch: int, tokens: int, seconds: float, speculative: bool) -> None:
        """A whole step of ``batch`` live sequences committed ``tokens`` in ``seconds`` of wall
        clock; ``speculative``: it drafted or verified more than the roots (for the guard)."""
        if self.adaptive:
            self.guard.observe(batch, tokens, seconds, speculative)

    def expects_drafting(self, decoding: int) -> bool:
        """Whether to read a joining sequence's prompt into the drafter at admission, so that
        the batch's next drafting step does not pay for it: when ``decoding`` sequences were
        already decoding and recent steps drafted for at least a tenth of the batch. Otherwise
        the prompt is read on the sequence's first drafting step, if it ever drafts."""
        return decoding > 0 and (not self.adaptive or self.drafting_share >= 0.1)

    def select(self, plan: StepPlan, proposed: dict[int, DraftTree]) -> dict[int, DraftTree]:
        """The trees to verify: the drafted trees of ``proposed`` pruned together with the
        plan's free drafts (:meth:`choose_batch`); sequences without a tree are absent."""
        if self.record:  # every drafted tree whole, with its free drafts: outcomes of both are logged
            self._recorded = {b: (t, self._record_free.get(b)) for b, t in proposed.items()}
            return {b: union_tree(t, f) for b, (t, f) in self._recorded.items()}
        trees = dict(proposed)
        trees.update(plan.free)
        return self.choose_batch(trees, plan.batch_rows, calibrated=frozenset(plan.plain))

    def observe_step(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Learn from one step: drafting time per pass, the verify cost (refined online),
        and per sequence its calibration, speed and fallback."""
        if plan.drafting:
            self.observe_draft(outcome.draft_seconds, outcome.draft_passes)
        if self.record:
            self.trace.steps.append(step_record(plan, outcome, self._recorded, self.seqs))
        if self.cost is not None and outcome.verify_seconds > 0 and not self.record:
            self.cost.observe(outcome.rows, outcome.verify_seconds)
            if plan.batch_rows > 1 and outcome.rows >= plan.batch_rows:
                roots, drafted = self._batch_passes.setdefault(plan.batch_rows, (deque(maxlen=8), deque(maxlen=8)))
                (roots if outcome.rows == plan.batch_rows else drafted).append((outcome.rows, outcome.verify_seconds))
        if self.flat:
            self._observe_gains(outcome.paths)
        share = outcome.draft_seconds / max(1, len(plan.drafting))
        for b in plan.drafting:
            tree = outcome.trees.get(b) or DraftTree.root_only(0)
            verify = self.cost.verify(tree.size) if self.cost is not None else 0.0
            self.observe(b, tree, outcome.paths[b], share + verify)
        for b, tree in plan.free.items():
            verified = outcome.trees.get(b, tree)
            self.observe_free(b, verified, outcome.paths[b])

    # ------------------------------------------------------------ the decisions behind them
    def pass_cost(self, rows: list[int]) -> float:
        """Modelled seconds of a verify pass whose sequences verify ``rows[b]`` rows each:
        their sum when packed flat, else every sequence padded to the largest."""
        if self.flat:
            return self.cost.verify(sum(rows))
        return self.cost.verify(len(rows) * max(rows))

    def worth_drafting(self, drafting: list[int], batch_rows: int) -> list[int]:
        """Batch-level planning: the sequences of ``drafting`` whose drafts are expected to
        pay for their verify rows and the predictor's passes in this batch of ``batch_rows``.

        Each sequence is scored by its recent drafting steps: ``tau - 1`` extra tokens for the
        ``verified - 1`` extra rows it last verified. Sequences are added best ratio first
        while the batch's expected tokens per second, ``(B + sum gains) / (pass(rows) +
        drafting time)``, rises; drafting time is one drafting call's predictor passes, shared.
        The rest cost nothing beyond their root row this step (their estimates wait, like the
        target states the predictor will read when they draft again). Until the predictor's
        pass time is measured, everyone drafts (in a closed batch, :meth:`closed_warmup` then
        keeps two), and with ``fallback_threshold`` 0 (speculate whatever it costs) always."""
        if (not drafting or not self.adaptive or len(self.pass_seconds) < 3
                or self.config.fallback_threshold <= 0):
            return drafting
        plain_rate, ranked = self.drafting_rates(drafting, batch_rows)
        best, best_rate = 0, plain_rate
        for k, (_, rate) in enumerate(ranked):
            if rate > best_rate:
                best, best_rate = k + 1, rate
        chosen = {b for b, _ in ranked[:best]}
        return [b for b in drafting if b in chosen]

    def drafting_rates(self, drafting: list[int], batch_rows: int) -> tuple[float, list[tuple[int, float]]]:
        """What :meth:`worth_drafting` weighs (once the predictor's pass is timed): the modelled
        tokens per second of a root-only step of ``batch_rows`` sequences, and the keys of
        ``drafting`` best ratio first, each with the modelled rate when it and those before it
        draft."""
        draft_time = statistics.median(self.pass_seconds) * self.passes_per_call
        scored = []
        for b in drafting:
            s = self.seqs[b]
            extra = max(1, (s.verified or 4) - 1)
            gain = max(0.0, s.tau - 1.0)
            scored.append((gain / extra, b, gain, extra))
        scored.sort(key=lambda x: (-x[0], x[1]))
        tokens, rows, ranked = float(batch_rows), [1] * batch_rows, []
        for k, (_, b, gain, extra) in enumerate(scored):
            tokens += gain
            rows[k] = 1 + extra
            ranked.append((b, tokens / (self.pass_cost(rows) + draft_time)))
        return batch_rows / self.pass_cost([1] * batch_rows), ranked

    #: sequences of a closed batch that draft while the predictor's pass is not yet timed
    CLOSED_WARMUP = 2

    def closed_warmup(self, drafting: list[int], left: dict[int, int]) -> list[int]:
        """In a closed batch whose predictor pass is not yet timed (its first drafting calls,
        which everyone joins in an open batch), only the :attr:`CLOSED_WARMUP` sequences of
        ``drafting`` with the most tokens ``left`` draft: each drafting sequence's first call
        reads its whole prompt into the predictor, and a closed batch planned for its end lets
        few sequences speculate anyway (at batch 16 on an AVX2 EPYC, warming up on all 16 cost
        about 2.5% of the call). Once timed, :meth:`worth_drafting` and
        :meth:`critical_path` plan as before."""
        if (not self.adaptive or self.config.fallback_threshold <= 0 or len(self.pass_seconds) >= 3
                or len(drafting) <= self.CLOSED_WARMUP):
            return drafting
        first = set(sorted(drafting, key=lambda b: (-left[b], b))[: self.CLOSED_WARMUP])
        return [b for b in drafting if b in first]

    def plans_for_the_end(self, batch: int) -> bool:
        """Whether a closed batch of ``batch`` sequences is planned by :meth:`critical_path`:
        where its verify pass is bound by arithmetic, a second batch's rows costing at least
        :attr:`ARITHMETIC_BOUND` times the pass (on the AVX-512 EPYC in bfloat16: 8 and 16
        sequences, 1.8x and 1.6x; 4 sequences 1.26x). There every row a draft adds is dear and
        the sequences that finish early leave a tail of small passes, so only the critical
        path's drafts pay; where rows are nearly free, drafts on any sequence cost little and
        tokens per second (:meth:`worth_drafting`) plans better. It needs two drafting calls
        timed (a warm-up's are enough: a closed batch's first step, which drafts for every
        sequence otherwise, reads every prompt into the predictor)."""
        if batch < 2 or not self.adaptive or len(self.pass_seconds) < 2:
            return False
        if self.cost.verify(2 * batch) >= self.ARITHMETIC_BOUND * self.cost.verify(batch):
            return True
        return self.batch_doubling(batch) >= self.ARITHMETIC_BOUND

    def batch_doubling(self, batch: int) -> float:
        """What doubling a pass's rows costs, as measured in this engine's passes of ``batch``
        sequences (or of the nearest size within two that has both kinds): the median pass of
        the ``n`` roots only, ``t``, and the median cost of a drafted row beyond them, ``r``,
        give ``1 + n * r / t``; 0 while either kind is missing. The one-sequence curve can call
        rows nearly free where a batch's are not (with AMX tiles a 32-row pass of one sequence
        costs about 1.2x its 16-row pass, while steps of 14 sequences with drafts took 1.9x
        the steps of their roots)."""
        for size in sorted(range(max(2, batch - 2), batch + 3), key=lambda n: (abs(n - batch), -n)):
            roots, drafted = self._batch_passes.get(size, ((), ()))
            if len(roots) >= 2 and len(drafted) >= 2:
                t = statistics.median(sec for _, sec in roots)
                per_row = statistics.median((sec - t) / (rows - size) for rows, sec in drafted)
                return 1.0 + size * max(per_row, 0.0) / t if t > 0 else 0.0
        return 0.0

    def critical_path(self, left: dict[int, int], drafting: list[int], free: dict[int, DraftTree]) -> set[int]:
        """Batch planning for a closed batch: the keys of ``drafting`` (model drafts) and of
        ``free`` (free drafts) that speculate this step, chosen to finish the whole batch
        soonest. ``left``: every live sequence's tokens still allowed (its cap; an EOS may
        come sooner).

        Such a batch lasts as long as its slowest sequence, and a draft commits fewer tokens
        than it verifies rows, so a sequence that finishes early saves only its rows, never a
        step. Speculation pays only on the critical path: the sequences with the most tokens
        left, which must all speed up for the batch to finish sooner (16 sequences tied at 128
        tokens finish no sooner unless the slowest drafter of them gains). For ``k = 0, 1, ..``
        the ``k`` sequences with the most left speculate: sequence ``i`` then finishes after
        ``left_i / tau_i`` steps of ``1 + extra_i`` rows (``tau``: its recent tokens per
        drafting step, or its free draft's estimate), the others after ``left_i`` steps of
        one row. The batch's time is the sum over steps of the verify cost of the rows still
        live, plus a drafting call per step while a model-drafting sequence lives; the ``k``
        with the least time wins (``k = 0``: plain decoding).

        Example: two sequences with 40 and 10 tokens left, both drafting at tau 2: at most the
        first speculates (20 steps instead of 40, if its rows and drafting cost less than the
        20 steps saved); the second's drafts would only add rows."""
        if not drafting and not free:
            return set()
        draft_time = self._pass_time() * self.passes_per_call
        speed: dict[int, tuple[float, int, bool]] = {}  # key -> tokens per step, extra rows, model pass
        for b in drafting:
            s = self.seqs[b]
            speed[b] = (max(1.0, s.tau), max(1, (s.verified or 4) - 1), True)
        # a free draft is priced at the nodes worth their rows (as choose_batch will prune it):
        # best estimate first, a node kept while its share of a step's tokens beats its row's
        # share of the step's cost
        n = len(left)
        row = (self.cost.verify(n + 8) - self.cost.verify(n)) / 8 if self.flat else self.cost.verify(2 * n) / n
        for b, tree in free.items():
            probs = tree.draft_probs or [1.0] + [0.0] * (tree.size - 1)
            tau, kept = 1.0, 0
            for i in ranked_nodes(tree, probs):
                p = self.gain_scale * probs[i]
                if p * self.cost.verify(n) <= row * tau:
                    break
                tau, kept = tau + p, kept + 1
            if kept:
                speed[b] = (tau, kept, False)
        keys = sorted(left, key=lambda b: (-left[b], b))
        cost = self.cost.verify if self.flat else None

        def batch_time(k: int) -> float:
            ends, model_until = [], 0.0  # (finishing step, rows per step) per sequence
            for j, b in enumerate(keys):
                tau, extra, model = speed.get(b, (1.0, 0, False)) if j < k else (1.0, 0, False)
                ends.append((max(left[b], 1) / tau, 1 + extra))
                if model:
                    model_until = max(model_until, ends[-1][0])
            ends.sort()
            total, now, live = 0.0, 0.0, sum(r for _, r in ends)
            widest = [0] * (len(ends) + 1)  # the widest tree among sequences j.. (padded passes)
            for j in range(len(ends) - 1, -1, -1):
                widest[j] = max(widest[j + 1], ends[j][1])
            for j, (end, rows) in enumerate(ends):
                if end > now:
                    pass_seconds = cost(live) if cost is not None else self.cost.verify((len(ends) - j) * widest[j])
                    total += (end - now) * pass_seconds
                    now = end
                live -= rows
            return total + model_until * draft_time

        # k only where the sequences left out have fewer tokens left than those taken
        cuts = [k for k in range(1, len(keys) + 1) if k == len(keys) or left[keys[k]] < left[keys[k - 1]]]
        best, best_time = 0, batch_time(0)
        for k in cuts:
            t = batch_time(k)
            if t < best_time:
                best, best_time = k, t
        return {b for b in keys[:best] if b in speed}

    def wants_draft(self, b: int, generated: int) -> bool:
        """False when sequence ``b`` decodes plainly this step (warm-up or fallback)."""
        if generated < self.config.warmup:
            return False
        if not self.adaptive:
            return True
        s = self.seqs[b]
        if s.plain_left > 0:
            s.plain_left -= 1
            if s.plain_left == 0:
                s.probing = True
                s.tau = max(s.tau, SequencePolicyState.tau)  # (the probe is planned from the prior, not the past)
                s.verified = 0
                s.speed.clear()
                s.calibration = max(s.calibration, 0.25)
            return False
        return True

    def draft_budget(self, budget: "TreeBudget", drafting: list[int], batch_rows: int = 1) -> "TreeBudget":
        """The tree budget to draft with this step (``drafting``: the sequences that draft;
        ``batch_rows``: sequences in the verify pass).

        - Size: drafting a node the policy will not verify is wasted work (each depth is a
          full pass of the predictor), so a tree is drafted at most ``SLACK`` nodes larger
          than the sequence's last verified tree; sequences just starting or probing get the
          full budget.
        - Depth: a node is expanded only while its draft confidence, counted in expected
          tokens, is worth the predictor pass it needs. The floor is the measured time of a
          pass (shared by the drafting sequences) over the time a plain step takes per token
          in this batch, ``verify(batch_rows) / batch_rows``.
        """
        if not self.adaptive or budget.width > 0 or not drafting:
            return budget
        out = budget
        last = [self.seqs[b].verified for b in drafting]
        if min(last) > 0:
            nodes = min(budget.grown_nodes, max(last) + self.SLACK)
            if nodes < budget.grown_nodes:
                out = replace(out, predictor_nodes=nodes, predictor_depth=min(budget.grown_depth, nodes - 1))
        if len(self.pass_seconds) >= 3:
            per_sequence = statistics.median(self.pass_seconds) / len(drafting)
            plain_token = self.cost.verify(batch_rows) / batch_rows
            out = replace(out, min_confidence=min(0.5, max(0.01, per_sequence / plain_token)))
        return out

    def _pass_time(self) -> float:
        """A predictor pass's time: the median of the recent calls' (from three), else the
        fastest (a first call also reads a prompt, which the median or the minimum discounts)."""
        ps = self.pass_seconds
        return statistics.median(ps) if len(ps) >= 3 else min(ps)

    def observe_draft(self, seconds: float, passes: int) -> None:
        """Time of one drafting call that ran ``passes`` predictor passes (for the floor of
        :meth:`draft_budget`; the median of recent calls discounts a first call that also
        read a prompt)."""
        if passes > 0:
            self.pass_seconds.append(seconds / passes)
            del self.pass_seconds[:-16]
            self.passes_per_call = 0.8 * self.passes_per_call + 0.2 * passes

    def acceptance(self, b: int, tree: DraftTree) -> list[float]:
        """``[N]`` estimated probability that each node is accepted (root: 1)."""
        s = self.seqs[b]
        if self.config.kind is PolicyKind.LEARNED and self.model is not None:
            with torch.no_grad():
                est = [1.0] + self.model(node_features(tree, s, s.temperature)).tolist()
            for i in range(1, tree.size):  # a node is never likelier than its parent
                est[i] = min(est[i], est[tree.parents[i]])
            return est
        probs = tree.confidences()
        return [1.0] + [min(1.0, s.calibration * probs[i]) for i in range(1, tree.size)]

    def choose_batch(self, trees: dict[int, DraftTree], batch_rows: int, live: int | None = None,
                     calibrated: frozenset[int] = frozenset()) -> dict[int, DraftTree]:
        """Prune the trees of the drafting sequences of one step together. Every sequence of
        the pass is padded to the largest tree, so the pass costs ``verify(batch_rows * n)``
        for ``n`` rows per sequence; the policy picks the ``n`` with the most expected tokens
        per second over the batch (``batch_rows``: sequences in the pass, drafting or not;
        ``live``: those not finished), and each drafting sequence keeps its best ``n - 1`` nodes.
        ``n`` may be 1: a plain step that still paid for drafting, which counts toward fallback.
        The trees of the sequences in ``calibrated`` (free drafts, see
        :meth:`~sot.drafters.base.Drafter.propose_free`) carry acceptance estimates as their
        ``draft_probs`` and are taken as they are. ``rl`` picks among the same candidates with
        its network (:class:`~sot.policy.rl.RLPolicyModel`)."""
        if not self.adaptive or not trees:
            return trees
        orders, gains, ests = {}, {}, {}
        for b, tree in trees.items():
            if tree.size <= 1:
                est = [1.0]
            elif b in calibrated:
                est = list(tree.draft_probs or [1.0] + [0.0] * (tree.size - 1))
            else:
                est = self.acceptance(b, tree)
            ests[b] = est
            orders[b] = ranked_nodes(tree, est)
            cum = [0.0]
            for i in orders[b]:
                cum.append(cum[-1] + est[i])
            gains[b] = cum
        base = batch_rows if live is None else live  # every live sequence commits at least one token
        self.expected_tokens = {}
        if self.flat:
            return self._choose_flat(trees, orders, ests, batch_rows, base, calibrated)
        sizes = range(1, max(t.size for t in trees.values()) + 1)
        expected = [base + sum(g[min(n - 1, len(g) - 1)] for g in gains.values()) for n in sizes]
        best_n = sizes[self._pick([batch_rows * n for n in sizes], expected, base, batch_rows, trees, calibrated)]
        self.choice = BatchChoice(orders, None, [batch_rows * n for n in sizes], best_n - 1)
        out = {}
        for b, tree in trees.items():
            if b not in calibrated:
                self.seqs[b].verified = best_n
            keep = orders[b][: best_n - 1]
            self.expected_tokens[b] = 1.0 + sum(ests[b][i] for i in keep)
            out[b] = tree if len(keep) == tree.size - 1 else prune(tree, keep)
        return out

    def _pick(self, rows: list[int], expected: list[float], base: float, batch_rows: int,
              trees: dict[int, DraftTree], calibrated: frozenset[int]) -> int:
        """Index of the candidate to verify: candidate ``k`` computes ``rows[k]`` rows and
        is expected to commit ``expected[k]`` tokens. ``heuristic`` and ``learned`` take the
        most expected tokens per second (the first of equals); ``rl`` asks its network which
        of the candidates within :data:`~sot.policy.rl.CANDIDATE_WINDOW` of that best to take."""
        costs = [self.cost.verify(r) for r in rows]
        rates = [e / c for e, c in zip(expected, costs)]
        best = max(range(len(rows)), key=lambda k: (rates[k], -k))
        if self.config.kind is PolicyKind.RL and self.rl is not None:
            idx = near_best(rates, best)
            feats = select_features(idx, rows, expected, costs, base, batch_rows)
            step = self.step_features(list(trees), calibrated, batch_rows)
            self.last_features = (feats, step, idx)
            return idx[self.rl.choose(feats, step)]
        return best

    def step_features(self, keys: list[int], calibrated: frozenset[int], batch_rows: int) -> np.ndarray:
        """``[len(STEP_FEATURES)]`` what the rl network knows about a step beyond its candidates."""
        states = [self.seqs[b] for b in keys if b in self.seqs]
        drafting = [self.seqs[b] for b in keys if b in self.seqs and b not in calibrated] or states
        if not states:
            return np.zeros(len(STEP_FEATURES), dtype=np.float32)
        return np.array([
            statistics.fmean(s.temperature for s in states), math.log2(max(1, batch_rows)) / 4.0,
            statistics.fmean(s.calibration for s in drafting), statistics.fmean(s.tau for s in drafting) / 4.0,
        ], dtype=np.float32)

    def _choose_flat(self, trees: dict[int, DraftTree], orders: dict[int, list[int]], ests: dict[int, list[float]],
                     batch_rows: int, base: int, calibrated: frozenset[int]) -> dict[int, DraftTree]:
        """Flat packing: every node costs one row whichever tree it is in, so the nodes of all
        trees are ranked together by estimated acceptance (each tree's own order kept, so
        every tree stays closed under parents) and the best ``k`` are verified, ``k``
        maximising ``(base + their estimates) / verify(batch_rows + k)``.

        Example: estimates ``{0: [.9, .5], 1: [.8]}`` merge as ``.9 (0), .8 (1), .5 (0)``;
        ``k = 2`` keeps one node of each tree."""
        ranked = list(heapq.merge(*[[(-ests[b][i], b) for i in orders[b]] for b in orders]))
        expected = [float(base)]
        for neg, _ in ranked:
            expected.append(expected[-1] - neg * self.gain_scale)
        rows = [batch_rows + k for k in range(len(ranked) + 1)]
        best_k = self._pick(rows, expected, base, batch_rows, trees, calibrated)
        self.choice = BatchChoice(orders, [b for _, b in ranked], rows, best_k)
        kept = Counter(b for _, b in ranked[:best_k])
        self._expected = Counter()
        for neg, b in ranked[:best_k]:
            self._expected[b] -= neg
        out = {}
        for b, tree in trees.items():
            keep = orders[b][: kept.get(b, 0)]
            self.expected_tokens[b] = 1.0 + self.gain_scale * sum(ests[b][i] for i in keep)
            if b not in calibrated:
                self.seqs[b].verified = 1 + len(keep)
            out[b] = tree if len(keep) == tree.size - 1 else prune(tree, keep)
        return out

    def _observe_gains(self, paths: dict[int, list[int]]) -> None:
        """Compare the flat selection's expected tokens with the accepted ones."""
        expected = sum(self._expected.values())
        if expected >= 0.5:
            accepted = sum(len(paths[b]) - 1 for b in self._expected if b in paths)
            ratio = min(2.0, accepted / expected)
            self.gain_scale = min(1.5, max(0.2, 0.9 * self.gain_scale + 0.1 * ratio))
        self._expected = {}

    def observe(self, b: int, tree: DraftTree, path: list[int], step_seconds: float) -> None:
        """Update sequence ``b`` after a step that verified ``tree`` and accepted the nodes of
        ``path`` (tree indices, root first); ``step_seconds`` is its share of the step (its
        draft time plus the modelled verify time of its rows)."""
        if not self.adaptive and not self.record:
            return
        s = self.seqs[b]
        accepted = len(path) - 1
        if tree.size <= 1:  # pruned to the root: nothing learned about acceptance, time lost to drafting
            if self.cost is not None and not self.record:
                self._observe_speed(s, accepted, step_seconds)
            return
        if self.record:
            feats = node_features(tree, s, s.temperature)
            label = torch.zeros(tree.size - 1)
            label[[i - 1 for i in path[1:]]] = 1.0
            self.trace.features.append(feats)
            self.trace.accepted.append(label)
        probs = tree.confidences()
        # E[accepted] = sum over nodes of P(node accepted); the draft probabilities estimate it
        expected = sum(min(1.0, probs[i]) for i in range(1, tree.size))
        ratio = (accepted + 0.1) / (expected + 0.1)
        s.calibration = min(2.0, max(0.05, 0.8 * s.calibration + 0.2 * ratio))
        s.tau = 0.8 * s.tau + 0.2 * (accepted + 1)
        if self.cost is None or self.record:
            return
        self._observe_speed(s, accepted, step_seconds)

    def prefers_free(self, b: int, free: DraftTree) -> bool:
        """True when sequence ``b``'s free draft ``free`` (its ``draft_probs`` estimate
        acceptance) promises a higher speed, relative to plain decoding, than its recent
        drafting steps measured: the drafter's model then stays idle for this step."""
        s = self.seqs[b]
        if not self.adaptive or not self.compare_free or free.size <= 1 or len(s.speed) < 2:
            return False
        probs = free.draft_probs or [1.0] + [0.0] * (free.size - 1)
        best, gain = 1.0, 1.0
        for n in range(2, free.size + 1):  # a chain: its first n nodes
            gain += probs[n - 1]
            best = max(best, gain * self.cost.verify(1) / self.cost.verify(n))
        if self.config.kind is PolicyKind.RL and self.rl is not None:
            x = self.draft_features(b, free, best)
            self.last_draft_features[b] = x
            return self.rl.prefers_free(x)
        return best >= statistics.fmean(s.speed)

    def draft_features(self, b: int, free: DraftTree, promise: float) -> np.ndarray:
        """``[len(DRAFT_FEATURES)]`` the rl network's inputs for sequence ``b``'s choice between
        drafting and its free draft ``free``, which promises ``promise`` times plain speed."""
        s = self.seqs[b]
        drafting = max(statistics.fmean(s.speed), 1e-3)
        probs = free.draft_probs or [1.0] + [0.0] * (free.size - 1)
        pass_ratio = (statistics.median(self.pass_seconds) / self.cost.verify(1)) if self.pass_seconds else 0.0
        return np.array([
            # (the shipped network saw free drafts of at most 16 nodes: larger ones read as 16)
            math.log(promise / drafting), math.log(drafting), math.log(max(promise, 1e-3)), sum(probs[1:]),
            min(free.size, 16) / 16.0, s.calibration, s.tau / 4.0, s.temperature, math.log2(max(1, len(self.seqs))) / 4.0,
            pass_ratio,
        ], dtype=np.float32)

    def observe_free(self, b: int, tree: DraftTree, path: list[int]) -> None:
        """Update sequence ``b`` after a step with its drafter's model idle, which verified the
        free draft ``tree`` (root-only: a plain step) and accepted ``path``."""
        if not self.adaptive:
            return
        s = self.seqs[b]
        speed = len(path) * self.cost.verify(1) / max(self.cost.verify(tree.size), 1e-9)
        s.free_speed = speed if s.free_speed is None else 0.9 * s.free_speed + 0.1 * speed

    def _observe_speed(self, s: SequencePolicyState, accepted: int, step_seconds: float) -> None:
        s.drafted += 1
        if s.drafted == 1:  # the first draft also reads the whole prompt into the drafter: not a step's cost
            return
        s.speed.append((accepted + 1) * self.cost.verify(1) / max(step_seconds, 1e-9))
        del s.speed[: -self.config.window]
        # drafting must beat what the sequence gets without it: plain decoding, or the free
        # drafts' measured speed where that is higher
        base = max(1.0, s.free_speed) if s.free_speed is not None and self.compare_free else 1.0
        n, mean, bar = len(s.speed), statistics.fmean(s.speed), self.config.fallback_threshold * base
        clearly_slow = mean < 0.8 * bar  # strong evidence needs fewer steps
        if s.probing:
            if n >= 2 or clearly_slow:
                if mean >= bar:
                    s.probing, s.backoff = False, self.config.first_backoff
                else:
                    self._fall_back(s)
        elif (n >= self.config.window and mean < bar) or (n >= 3 and clearly_slow):
            self._fall_back(s)

    def _fall_back(self, s: SequencePolicyState) -> None:
        s.plain_left = s.backoff
        s.backoff = min(2 * s.backoff, self.config.max_backoff)
        s.probing = False
        s.fallbacks += 1
        s.speed.clear()
