"""Speculation in batches: flat-packed verify passes, the batch planner, and an idle
predictor that costs nothing."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import clone, random_prompts, tiny_model
from sot.attention import build_tree_layout, flat_packing
from sot.drafters import NoDrafter, TreeBudget
from sot.drafters.state import StateDrafter, new_predictor
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel
from sot.policy import CommitPolicy, CostModel, PolicyConfig, StepPlan
from sot.tree import DraftTree, ancestor_table, tree_from_parents

LAYERS = (0, 1, 2)


def _verify(target: TargetModel, prompts: list[list[int]], trees: list[DraftTree], flat: bool) -> list[torch.Tensor]:
    """Logits rows ``[size, V]`` of each tree, verified together in one pass."""
    cache = target.new_cache(len(prompts), 256)
    for b, p in enumerate(prompts):
        target.prefill(cache, b, torch.tensor(p))
        cache.set_length(b, len(p))
    unit = target.row_multiple
    rows = -(-max(t.size for t in trees) // unit) * unit
    width = max(t.max_depth for t in trees) + 1
    ids = torch.zeros(len(trees), rows, dtype=torch.long)
    pos = torch.zeros(len(trees), rows, dtype=torch.long)
    for b, t in enumerate(trees):
        ids[b], pos[b] = t.tokens[0], cache.lengths[b]
        ids[b, : t.size] = torch.tensor(t.tokens)
        pos[b, : t.size] = torch.tensor(t.depths) + cache.lengths[b]
    layout = build_tree_layout(cache.lengths, [ancestor_table(t, width) for t in trees], rows, cache)
    if flat:
        index, offsets = flat_packing([t.size for t in trees], rows, unit)
        layout = dataclasses.replace(layout, flat_index=index, flat_offsets=offsets)
    out = target.verify(cache, ids, pos, layout)
    assert (out.offsets is not None) == flat
    return [out.seq_logits(b)[: t.size] for b, t in enumerate(trees)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flat_packed_pass_equals_each_tree_alone(dtype: torch.dtype) -> None:
    target = TargetModel(clone(tiny_model("llama", seed=3), dtype))
    prompts = random_prompts((9, 21, 14), seed=2)
    trees = [tree_from_parents([p[-1], 5, 6, 7, 8], [-1, 0, 1, 1, 0]) for p in prompts[:1]]
    trees += [DraftTree([prompts[1][-1]], [-1], [0]), tree_from_parents([prompts[2][-1], 9, 10], [-1, 0, 1])]
    together = _verify(target, prompts, trees, flat=True)
    padded = _verify(target, prompts, trees, flat=False)
    for b in range(3):
        alone = _verify(target, [prompts[b]], [trees[b]], flat=False)[0]
        assert torch.equal(together[b], alone), f"sequence {b}: flat rows differ from its tree alone"
        assert torch.equal(padded[b], alone)


def test_path_states_gather_each_sequences_rows_at_once() -> None:
    """``ForwardOutput.path_states``: per sequence, ``seq_states(b)[path]``, for padded
    ``[B, T, S, D]`` and flat ``[R, S, D]`` states alike, the same values in one gather."""
    from sot.models.adapter import ForwardOutput

    gen = torch.Generator().manual_seed(0)
    paths = [[0, 2, 3], [0], [0, 1]]
    padded = ForwardOutput(logits=torch.zeros(3, 4, 5), states=torch.randn(3, 4, 2, 6, generator=gen))
    flat = ForwardOutput(logits=torch.zeros(9, 5), states=torch.randn(9, 2, 6, generator=gen), offsets=(0, 4, 6, 9))
    for out in (padded, flat):
        got = out.path_states(paths)
        assert len(got) == 3
        for b, path in enumerate(paths):
            assert torch.equal(got[b], out.seq_states(b)[path]), b
    assert [t.shape[0] for t in flat.path_states([[], [1], []])] == [0, 1, 0]
    assert [t.shape[0] for t in padded.path_states([[], [], []])] == [0, 0, 0]


def _policy(verify: list[float], tau: float) -> CommitPolicy:
    policy = CommitPolicy(PolicyConfig(), CostModel([1, 4, 8, 16], verify))
    policy.flat = True
    for b in range(4):
        policy.add_sequence(b)
        policy.seqs[b].tau, policy.seqs[b].verified = tau, 4
    for _ in range(3):
        policy.observe_draft(0.006, 3)  # 2 ms a predictor pass, 3 passes a call
    return policy


def test_planner_drafts_nothing_when_a_root_only_step_is_fastest() -> None:
    # rows are dear (a 4-sequence pass with 3 extra rows each costs 3.5x a plain one) and
    # each draft wins half a token: nobody drafts
    dear = _policy([0.010, 0.020, 0.035, 0.060], tau=1.5)
    assert dear.worth_drafting([0, 1, 2, 3], 4) == []
    # rows are almost free and drafts win two tokens: everybody drafts
    cheap = _policy([0.010, 0.0105, 0.011, 0.012], tau=3.0)
    assert cheap.worth_drafting([0, 1, 2, 3], 4) == [0, 1, 2, 3]
    assert cheap.worth_drafting([0], 1) == [0], "alone as in a batch"


def test_the_rates_the_planner_weighs_are_its_choice() -> None:
    """``drafting_rates`` (what ``scripts/planner_view.py`` reports): a root-only step's
    tokens per second, and per sequence, best gain per extra row first, the rate with it and
    those before it drafting; ``worth_drafting`` takes the best prefix, or none."""
    policy = _policy([0.010, 0.012, 0.013, 0.030], tau=1.5)
    policy.seqs[2].tau = 4.0  # three extra tokens for its three extra rows: ranked first
    plain, ranked = policy.drafting_rates([0, 1, 2, 3], 4)
    assert plain == pytest.approx(4 / 0.012)
    assert [b for b, _ in ranked] == [2, 0, 1, 3]
    draft = 0.002 * 3
    want = [(4 + 3.0) / (policy.cost.verify(7) + draft), (4 + 3.5) / (policy.cost.verify(10) + draft),
            (4 + 4.0) / (policy.cost.verify(13) + draft), (4 + 4.5) / (policy.cost.verify(16) + draft)]
    assert [rate for _, rate in ranked] == pytest.approx(want)
    assert want[0] > plain and max(want[1:]) < want[0]  # (the first alone pays; adding more costs)
    assert policy.worth_drafting([0, 1, 2, 3], 4) == [2]


def test_a_closed_batch_warms_up_the_predictor_on_the_sequences_with_most_left() -> None:
    """A closed batch (an offline call with no prompt left to admit) times the predictor's pass
    on at most ``CLOSED_WARMUP`` sequences, those with the most tokens left, instead of
    drafting for all (each one's first call reads its whole prompt); an open batch's warm-up
    still drafts for everyone, and outputs are plain decoding's either way."""
    assert CommitPolicy.CLOSED_WARMUP == 2
    policy = CommitPolicy(PolicyConfig(), CostModel([1, 16], [0.01, 0.02]))
    left = {0: 5, 1: 9, 2: 9, 3: 1}
    assert policy.closed_warmup([3, 2, 1, 0], left) == [2, 1], "most left first, ties by key, order kept"
    for _ in range(3):
        policy.observe_draft(0.006, 3)
    assert policy.closed_warmup([3, 2, 1, 0], left) == [3, 2, 1, 0], "once the pass is timed, no limit"

    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.float32), state_layers=LAYERS)
    prompts = random_prompts((8, 12, 17, 10, 9), seed=4)
    params = GenerationParams(max_new_tokens=20)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]

    def calls(batch_size: int) -> list[int]:
        drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3)
        sizes: list[int] = []
        propose = drafter.propose
        drafter.propose = lambda inputs, budget: sizes.append(len(inputs)) or propose(inputs, budget)
        engine = Engine(target, drafter, TreeBudget(8, 4))
        assert [r.token_ids for r in engine.generate(prompts, params, batch_size=batch_size)] == plain
        return sizes

    closed = calls(5)  # every prompt admitted at once: closed from the first step
    assert closed[:3] == [2, 2, 2], "two sequences time the pass"
    opened = calls(4)  # a prompt waits: open at first, and everyone drafts while the pass is untimed
    assert opened[0] == 4


def test_an_offline_call_reads_prompts_into_the_predictor_only_when_they_draft() -> None:
    """A server reads a joining prompt into the predictor at admission while others draft (so
    the next drafting step does not pay for it); an offline call never does: a prompt reaches
    the predictor on its sequence's first drafting step, so a batch that never drafts never
    reads it. Outputs are plain decoding's either way."""
    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.float32), state_layers=LAYERS)
    prompts = random_prompts((8, 12, 17), seed=4)
    params = GenerationParams(max_new_tokens=16)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]

    def engine_counting() -> tuple[Engine, list[int]]:
        drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3)
        read: list[int] = []
        prepare = drafter.prepare
        drafter.prepare = lambda inputs: read.append(len(inputs)) or prepare(inputs)
        return Engine(target, drafter, TreeBudget(8, 4), policy=PolicyConfig(warmup=100)), read

    engine, read = engine_counting()  # (no step drafts: warm-up)
    assert [r.token_ids for r in engine.generate(prompts, params, batch_size=2)] == plain
    assert read == [], "the third prompt joined while others decoded, and nothing drafted"
    engine, read = engine_counting()
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    engine.step()
    ids.append(engine.add_request(prompts[2], params))
    done = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                done[ev.request_id] = ev.result.token_ids
    assert [done[i] for i in ids] == plain
    assert read == [1], "a request joining a running batch is read at admission"


def test_flat_selection_ranks_the_nodes_of_all_trees_together() -> None:
    policy = _policy([0.010, 0.011, 0.014, 0.030], tau=2.0)
    sure = tree_from_parents([1, 2, 3, 4], [-1, 0, 1, 2], draft_probs=[1.0, 0.95, 0.9, 0.85])
    unsure = tree_from_parents([1, 2, 3, 4], [-1, 0, 1, 2], draft_probs=[1.0, 0.05, 0.02, 0.01])
    policy.seqs[0].calibration = policy.seqs[1].calibration = 1.0
    chosen = policy.select(StepPlan.make_dummy([0, 1, 2, 3], TreeBudget(8, 4)), {0: sure, 1: unsure})
    assert chosen[0].size == 4 and chosen[1].size == 1, "rows go to the tree that will use them"
    assert policy.seqs[0].verified == 4 and policy.seqs[1].verified == 1
    dear = _policy([0.010, 0.040, 0.080, 0.160], tau=2.0)
    dear.seqs[0].calibration = 1.0
    assert dear.choose_batch({0: sure}, 4)[0].size == 1, "no node is worth a row this dear"


def test_an_idle_sequence_runs_no_predictor_pass() -> None:
    """While no sequence drafts (warm-up here), the predictor is never asked for a tree, and
    runs at most to read each prompt (one pass per request), however many steps."""
    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.float32), state_layers=LAYERS)

    class Counting(StateDrafter):
        proposals = 0

        def propose(self, inputs, budget):
            Counting.proposals += 1
            return super().propose(inputs, budget)

    drafter = Counting(new_predictor(model, LAYERS, None, seed=1), top_k=3)
    engine = Engine(target, drafter, TreeBudget(8, 4), policy=PolicyConfig(warmup=100))
    res = engine.generate(random_prompts((8, 12, 17), seed=4), GenerationParams(max_new_tokens=20), batch_size=2)
    assert all(r.steps > 5 and r.plain_steps == r.steps for r in res), "no step drafted"
    assert Counting.proposals == 0 and drafter.passes <= 3


def test_free_drafts_take_the_whole_budget_only_for_one_sequence() -> None:
    """One sequence's free drafts may reach ``max_nodes`` / ``max_depth``; in a batch every
    tree keeps to the predictor's limits (and a static beam keeps its shape)."""
    budget = TreeBudget(max_nodes=32, max_depth=24, predictor_nodes=16, predictor_depth=8)
    assert budget.for_batch(1) is budget
    assert (budget.for_batch(2).max_nodes, budget.for_batch(2).max_depth) == (16, 8)
    assert budget.for_batch(5).grown_nodes == 16 and budget.for_batch(5).grown_depth == 8
    beam = dataclasses.replace(budget, width=3)
    assert beam.for_batch(4) is beam
    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.float32), state_layers=LAYERS)
    asked: list[tuple[int, int, int]] = []

    class Watching(StateDrafter):
        def propose_free(self, inputs, budget):
            asked.append((len(inputs), budget.max_nodes, budget.max_depth))
            return super().propose_free(inputs, budget)

    drafter = Watching(new_predictor(model, LAYERS, None, seed=1), top_k=3)
    engine = Engine(target, drafter, budget, policy=PolicyConfig(fallback_threshold=0))
    prompts = random_prompts((8, 12, 30), seed=4)
    res = engine.generate(prompts, GenerationParams(max_new_tokens=20), batch_size=2)
    plain = Engine(target, NoDrafter()).generate(prompts, GenerationParams(max_new_tokens=20))
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    assert {(b > 1, n, d) for b, n, d in asked} == {(True, 16, 8), (False, 32, 24)}, "both kinds of step ran"


def test_the_fixed_rule_turns_speculation_off_above_its_batch_size() -> None:
    policy = _policy([0.010, 0.0105, 0.011, 0.012], tau=3.0)
    policy.config = PolicyConfig(disable_above=3)
    free = {0: tree_from_parents([1, 2], [-1, 0], draft_probs=[1.0, 0.9])}
    plan = policy.plan({b: 10 for b in range(4)}, free, TreeBudget(8, 4))
    assert plan.drafting == () and plan.free == {} and plan.plain == (0, 1, 2, 3)
    # (the engine then asks its drafter for no free drafts either)
    assert policy.holds_plain(4) and not policy.holds_plain(3)
    policy.drop_sequence(3)
    assert policy.plan({b: 10 for b in range(3)}, free, TreeBudget(8, 4)).drafting == (0, 1, 2)


def test_the_joint_selection_learns_how_optimistic_its_estimates_are() -> None:
    """Nodes verified and never accepted lower the scale on the estimates; fewer rows follow."""
    from sot.policy import StepOutcome

    policy = _policy([0.010, 0.011, 0.014, 0.030], tau=2.0)
    policy.seqs[0].calibration = 1.0
    tree = tree_from_parents([1, 2, 3, 4], [-1, 0, 1, 2], draft_probs=[1.0, 0.9, 0.8, 0.7])
    plan = StepPlan.make_dummy([0], TreeBudget(8, 4))
    first = policy.select(plan, {0: tree})[0]
    assert first.size == 4
    for _ in range(30):
        chosen = policy.select(plan, {0: tree})
        policy.observe_step(plan, StepOutcome(trees=chosen, paths={0: [0]}, draft_seconds=0.0, draft_passes=0,
                                              verify_seconds=0.0, rows=chosen[0].size))
    assert policy.gain_scale < 0.5
    assert policy.select(plan, {0: tree})[0].size < first.size


@pytest.mark.guard
def test_the_guard_backs_off_where_speculation_loses_on_the_clock() -> None:
    from sot.policy.guard import FIRST_BACKOFF, PROBE, REFRESH, SPEC_WINDOW, BatchGuard

    guard = BatchGuard()

    def spec_steps(batch: int, n: int, tokens: int, seconds: float) -> None:
        for _ in range(n):
            assert not guard.plain(batch)
            guard.observe(batch, tokens, seconds, speculative=True)

    def plain_steps(batch: int) -> int:
        n = 0
        while guard.plain(batch):
            guard.observe(batch, batch, 0.010, speculative=False)  # one token each, 10 ms a step
            n += 1
        return n

    # batch 4: speculation commits 5 tokens in 12 ms (417 tok/s) against plain's 400: it stays,
    # with plain measured after the first window and again after REFRESH speculative steps
    spec_steps(4, SPEC_WINDOW, 5, 0.012)
    assert plain_steps(4) == PROBE
    spec_steps(4, REFRESH, 5, 0.012)
    assert plain_steps(4) == PROBE
    # it slows to 4.5 tokens in 12 ms (375 tok/s): the batch size backs off, and longer each time
    slow = 0
    while not guard.plain(4):
        guard.observe(4, 4.5, 0.012, speculative=True)
        slow += 1
    assert slow < SPEC_WINDOW  # as soon as the window's rate falls below plain's
    assert plain_steps(4) == FIRST_BACKOFF
    spec_steps(4, SPEC_WINDOW, 4.5, 0.012)
    assert plain_steps(4) == 2 * FIRST_BACKOFF
    # a retry that wins keeps speculating and resets the back-off
    spec_steps(4, SPEC_WINDOW, 5, 0.012)
    assert guard.sizes[4].backoff == FIRST_BACKOFF and guard.stats()[4]["holds"] == 2
    # a back-off judges the sequences that lost: it ends once half the batch joined since it
    # began (joins before it do not count), and the new sequences start from the first length
    guard.joined()
    while not guard.plain(4):
        guard.observe(4, 4.5, 0.012, speculative=True)
    guard.joined()
    assert guard.plain(4)  # one new sequence of four
    guard.joined()
    assert not guard.plain(4)
    spec_steps(4, SPEC_WINDOW - 1, 4.5, 0.012)  # judged on its own steps, a whole window
    guard.observe(4, 4.5, 0.012, speculative=True)
    assert plain_steps(4) == FIRST_BACKOFF
    solo = BatchGuard()  # at batch 1, the next request is judged afresh
    for _ in range(SPEC_WINDOW):
        solo.observe(1, 1, 0.010, speculative=False)
    while not solo.plain(1):
        solo.observe(1, 1.2, 0.015, speculative=True)
    solo.joined()
    assert not solo.plain(1)
    # through the policy: a sequence the engine adds is a join
    policy = _policy([0.010, 0.011, 0.012, 0.014], tau=2.0)
    for _ in range(SPEC_WINDOW):
        policy.observe_wall(1, 1, 0.010, speculative=False)
    while not policy.holds_plain(1):
        policy.observe_wall(1, 1.2, 0.015, speculative=True)
    policy.add_sequence(9)
    assert not policy.holds_plain(1)
    # other batch sizes keep their own measurements; threshold 0 speculates whatever it costs
    assert not guard.plain(2) and 2 not in guard.sizes
    off = BatchGuard(threshold=0.0)
    for _ in range(4 * SPEC_WINDOW):
        off.observe(4, 1, 1.0, speculative=True)
    assert not off.plain(4)


@pytest.mark.guard
def test_a_held_batch_size_decodes_plainly_without_drafts_and_identically() -> None:
    """While the guard holds a batch size, its steps draft nothing and take no free drafts, and
    the output stays identical; the engine reports every step's wall time to the guard."""
    from sot.drafters import DrafterKind, make_drafter
    from sot.policy.guard import _Size

    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.float32), state_layers=LAYERS)
    prompts = random_prompts((8, 12, 17, 9), seed=4)  # the fourth runs alone at the end
    params = GenerationParams(max_new_tokens=24)
    plain = Engine(target, make_drafter(DrafterKind.NONE), TreeBudget(8, 4)).generate(prompts, params, batch_size=3)
    drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3)
    offered: list[int] = []
    propose_free = drafter.propose_free
    drafter.propose_free = lambda inputs, budget: offered.append(len(inputs)) or propose_free(inputs, budget)
    engine = Engine(target, drafter, TreeBudget(8, 4))
    held = engine.policy.guard.sizes[3] = _Size(plain_left=10**6)
    seen: list[int] = []
    observe = engine.policy.observe_wall
    engine.policy.observe_wall = lambda batch, *rest: seen.append(batch) or observe(batch, *rest)
    res = engine.generate(prompts, params, batch_size=3)
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    at_three = seen.count(3)
    assert at_three > 3 and held.plain_left == 10**6 - at_three, "every step at batch 3 was held plain"
    assert not held.spec and len(held.plain) == min(at_three, held.plain.maxlen)
    assert 3 not in offered and offered, "no free drafts at batch 3; the smaller batches of the tail speculate"


def test_idle_states_are_handed_over_once_in_order() -> None:
    """A sequence that does not draft keeps its target states in pieces; drafting again takes
    them all, joined in the order they were committed, and leaves nothing behind."""
    from sot.requests import LiveRequest, SequenceResult

    seq = LiveRequest(0, [1, 2], GenerationParams(), SequenceResult(0, []), None, 0.0)
    assert seq.take_states() is None
    pieces = [torch.full((n, 3, 4), float(i)) for i, n in enumerate((5, 1, 2))]
    for p in pieces:
        seq.add_states(p)
    taken = seq.take_states()
    assert torch.equal(taken, torch.cat(pieces)) and seq.take_states() is None
    seq.add_states(pieces[1])
    assert seq.take_states() is pieces[1]  # a single piece is handed over without a copy


def _closed_policy(taus: list[float]) -> CommitPolicy:
    """Four sequences drafting at ``taus``; a pass of 4 rows costs 10 ms, 16 rows 16 ms; a
    drafting call 6 ms."""
    policy = _policy([0.010, 0.010, 0.012, 0.016], tau=2.0)
    for b, tau in enumerate(taus):
        policy.seqs[b].tau = tau
    return policy


def test_a_closed_batch_speculates_only_on_its_critical_path() -> None:
    """In a closed batch only the sequences with the most tokens left may speculate: the
    others' drafts would add rows without ending the batch a step sooner."""
    policy = _closed_policy([2.0, 2.0, 2.0, 2.0])
    assert policy.critical_path({0: 10, 1: 40, 2: 10, 3: 10}, [0, 1, 2, 3], {}) == {1}
    # two tied at the most left must both speed up for the batch to end sooner
    assert policy.critical_path({0: 10, 1: 40, 2: 40, 3: 10}, [0, 1, 2, 3], {}) == {1, 2}
    # a leader that cannot speculate (falling back: not drafting) holds the batch's end, so nobody does
    assert policy.critical_path({0: 10, 1: 40, 2: 10, 3: 10}, [0, 2, 3], {}) == set()
    # three sequences drafting well and one barely: per step the drafts pay (tokens per second
    # rise), but the batch still lasts as long as the fourth's 38 steps, so nobody speculates
    policy = _closed_policy([3.0, 3.0, 3.0, 1.05])
    assert policy.worth_drafting([0, 1, 2, 3], 4) == [0, 1, 2], "an open batch drafts for throughput"
    assert policy.critical_path({b: 40 for b in range(4)}, [0, 1, 2, 3], {}) == set()
    policy = _closed_policy([3.0, 3.0, 3.0, 3.0])
    assert policy.critical_path({b: 40 for b in range(4)}, [0, 1, 2, 3], {}) == {0, 1, 2, 3}


def test_a_closed_batch_is_planned_for_its_end_where_its_own_rows_are_dear() -> None:
    """The one-sequence curve can call rows nearly free where a batch's are not: the passes
    this engine measured in its batches (roots only, and with drafted rows) also open the
    planning for the end, from a neighbouring batch size too."""
    from sot.policy.state import StepOutcome, StepPlan

    policy = _closed_policy([2.0, 2.0, 2.0, 2.0])
    assert not policy.plans_for_the_end(4), "on the curve, 8 rows cost 1.2x 4 rows"
    plan = StepPlan((), (0, 1, 2, 3), {}, TreeBudget(8, 4), 4)

    def passes(rows: int, seconds: float, n: int = 2) -> None:
        for _ in range(n):
            policy.observe_step(plan, StepOutcome(trees={}, paths={b: [0] for b in range(4)}, draft_seconds=0.0,
                                                  draft_passes=0, verify_seconds=seconds, rows=rows))

    passes(4, 0.010)  # the roots only
    assert policy.batch_doubling(4) == 0.0 and not policy.plans_for_the_end(4), "no drafted pass yet"
    passes(8, 0.0125)  # 4 drafted rows: 0.625 ms a row, so doubling costs 1.25x
    assert policy.batch_doubling(4) == pytest.approx(1.25) and not policy.plans_for_the_end(4)
    passes(8, 0.016, n=8)  # 1.5 ms a row: 1.6x
    assert policy.batch_doubling(4) == pytest.approx(1.6) and policy.plans_for_the_end(4)
    assert policy.batch_doubling(5) == pytest.approx(1.6) and policy.plans_for_the_end(5)
    assert policy.batch_doubling(8) == 0.0 and not policy.plans_for_the_end(1)


def test_a_closed_plan_takes_free_drafts_only_on_the_critical_path() -> None:
    policy = _closed_policy([2.0, 2.0, 2.0, 2.0])
    assert not policy.plans_for_the_end(4), "8 rows cost 1.2x 4 rows: tokens per second plans"
    policy.cost = CostModel([1, 4, 8, 16], [0.010, 0.010, 0.016, 0.028])  # rows now dear
    assert policy.plans_for_the_end(4) and not policy.plans_for_the_end(1)
    timed = policy.pass_seconds
    policy.pass_seconds = timed[:1]
    assert not policy.plans_for_the_end(4), "one drafting call timed: not yet"
    policy.pass_seconds = [0.020, timed[0]]  # (a first call that also read a prompt, then a plain one)
    assert policy.plans_for_the_end(4) and policy._pass_time() == timed[0]
    policy.pass_seconds = timed
    sure = tree_from_parents([1, 2, 3], [-1, 0, 1], draft_probs=[1.0, 0.9, 0.8])
    free = {0: sure, 3: sure}
    open_plan = policy.plan({b: 10 for b in range(4)}, free, TreeBudget(8, 4))
    assert open_plan.drafting == () and set(open_plan.free) == {0, 3}, "an open batch verifies every free draft"
    policy.seqs[0].speed = policy.seqs[3].speed = [0.5, 0.5]  # drafting was slow: the free drafts win
    plan = policy.plan({b: 10 for b in range(4)}, free, TreeBudget(8, 4), left={0: 30, 1: 5, 2: 5, 3: 5})
    assert plan.drafting == () and set(plan.free) == {0}, "the free draft of the sequence with the most left only"
    assert plan.plain == (0, 1, 2, 3)


def test_a_closed_batch_pauses_the_offers_its_planning_keeps_turning_down() -> None:
    """Four sequences tied at 40 tokens left, rows dear, weak free drafts: the closed batch's
    planning turns every offer down, so after OFFER_PATIENCE such steps the offers pause, one
    step asks again after each pause, and the pauses double; a step that speculates, an open
    batch, a larger batch or one shrunk to where it is no longer planned for its end asks at
    once, while a batch that shrinks and is still planned for its end stays paused."""
    policy = _closed_policy([2.0, 2.0, 2.0, 2.0])
    policy.cost = CostModel([1, 4, 8, 16], [0.010, 0.010, 0.016, 0.028])  # rows dear: planned for the end
    policy.model_drafts = False  # (free drafts only)
    weak = tree_from_parents([1, 2], [-1, 0], draft_probs=[1.0, 0.05])
    left = {b: 40 for b in range(8)}

    def step(batch: int = 4, closed: bool = True, tree: DraftTree = weak) -> bool:
        ask = policy.asks_offers(batch, closed)
        free = {b: tree for b in range(batch)} if ask else {}
        plan = policy.plan({b: 10 for b in range(batch)}, free, TreeBudget(8, 4),
                           left={b: left[b] for b in range(batch)} if closed else None)
        if closed and batch == 4 and tree is weak:
            assert plan.drafting == () and not plan.free
        return ask

    asked = [step() for _ in range(120)]
    patience, first = CommitPolicy.OFFER_PATIENCE, CommitPolicy.OFFER_PAUSE
    assert all(asked[:patience]) and not any(asked[patience:patience + first])
    assert asked[patience + first] and not any(asked[patience + first + 1:patience + 3 * first + 1])
    assert sum(asked) == patience + 2, "after the first pause one step asks before each longer one"
    assert policy.plans_for_the_end(4) and not policy.plans_for_the_end(3)
    assert step(batch=3), "shrunk to where rows are cheap: ask again"
    assert step(batch=8), "a larger batch asks"
    for _ in range(patience):
        step(batch=8)
    assert policy.plans_for_the_end(6) and not step(batch=6), "sequences left a batch still planned for its end"
    assert step(closed=False), "an open batch always asks"
    for _ in range(patience):
        step()
    assert not step()
    policy.reset(4)
    assert step(), "a new batch asks"
    # offers the planning takes keep being asked for
    sure = tree_from_parents([1, 2, 3], [-1, 0, 1], draft_probs=[1.0, 0.99, 0.98])
    assert all(step(tree=sure) for _ in range(3 * patience))


def test_the_engine_tells_the_policy_when_its_batch_is_closed() -> None:
    """An offline call's batch is closed once nothing waits to take a freed slot; requests added
    one by one (as a server adds them) never make a closed batch."""
    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.float32), state_layers=LAYERS)
    prompts = random_prompts((8, 12, 17), seed=4)
    params = GenerationParams(max_new_tokens=12)
    engine = Engine(target, StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3), TreeBudget(8, 4))
    seen: list[dict | None] = []
    plan = engine.policy.plan
    engine.policy.plan = lambda generated, free, budget, left=None: seen.append(left) or plan(generated, free,
                                                                                               budget, left)
    engine.generate(prompts, params, batch_size=2)
    assert seen[0] is None, "the third prompt waits for a slot"
    closed = [left for left in seen if left is not None]
    assert closed and all(n >= 1 for left in closed for n in left.values())
    assert seen.index(closed[0]) > 0 and all(left is not None for left in seen[seen.index(closed[0]):])
    seen.clear()
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished():
        engine.step()
    assert seen and all(left is None for left in seen)
