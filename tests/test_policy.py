"""The commit policy: cost model, pruning, warm-up, per-sequence fallback with back-off."""
from __future__ import annotations

import pytest
import torch

from helpers import VOCAB, clone, random_prompts, tiny_model
from sot.drafters import LookupDrafter, NoDrafter, PromptLookupDrafter, SuffixDrafter, TreeBudget
from sot.drafters.base import DraftInput, Drafter, DrafterKind
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.models.adapter import TargetModel
from sot.policy import CostModel, PolicyConfig, PolicyKind, prune, ranked_nodes
from sot.tree import DraftTree, tree_from_parents


def test_cost_model_interpolates_and_never_decreases() -> None:
    cost = CostModel([1, 8, 16], [0.010, 0.009, 0.020])  # a noisy dip at 8 rows
    assert cost.verify(1) == pytest.approx(0.010)
    assert cost.verify(8) == pytest.approx(0.010)
    assert cost.verify(12) == pytest.approx(0.015)
    assert cost.verify(24) > cost.verify(16)


def test_cost_model_measure_times_every_size_in_turn_and_keeps_the_fastest(monkeypatch) -> None:
    """Every size is timed once per round (sizes take turns, so a slow moment hits one round of
    each), the warm-up round is dropped, and each size keeps its fastest pass."""
    target = TargetModel(clone(tiny_model("llama", seed=2), torch.float32))
    calls: list[int] = []
    verify = target.verify

    def counted(cache, ids, pos, layout):
        calls.append(id(ids))  # each size's pass has its own input tensor
        return verify(cache, ids, pos, layout)

    monkeypatch.setattr(target, "verify", counted)
    sizes = [1, 2, 4, 8, 12, 16]
    per_round = [0.1, 0.7, 0.3, 0.5]  # seconds of every pass in round 0 (warm-up), 1, 2, 3
    clock = {"now": 0.0, "reads": 0}

    def fake_clock() -> float:  # read twice per pass: at its start and at its end
        if clock["reads"] % 2 == 1:
            clock["now"] += per_round[(len(calls) - 1) // len(sizes)]
        clock["reads"] += 1
        return clock["now"]

    monkeypatch.setattr("sot.policy.cost.time.perf_counter", fake_clock)
    cost = CostModel.measure(target, 16, context=32, repeats=3)
    first = calls[: len(sizes)]
    assert len(set(first)) == len(sizes) and calls == first * 4, "a warm-up round, then 3 rounds of all sizes in turn"
    assert cost.rows == sizes
    # the fastest measured round (0.3 s), not the warm-up (0.1 s) nor the median (0.5 s)
    assert cost.seconds == pytest.approx([0.3] * len(sizes))


def test_cost_model_measure_times_the_sizes_asked_for() -> None:
    """``sizes`` replaces the default row counts (``python -m sot.analysis.break_even`` times every count)."""
    target = TargetModel(clone(tiny_model("llama", seed=2), torch.float32))
    cost = CostModel.measure(target, 16, context=32, repeats=1, sizes=[1, 3, 5, 6])
    assert cost.rows == [1, 3, 5, 6]
    assert all(s > 0 for s in cost.seconds)


def test_a_model_with_a_short_context_times_its_curve_inside_it() -> None:
    """Learned positions end at the model's context: the curve's timed passes stay inside it
    (GPT-2 with 64 positions had failed at the first speculative call)."""
    target = TargetModel(clone(tiny_model("gpt2", seed=2, n_positions=64, max_position_embeddings=64), torch.float32))
    cost = CostModel.measure(target, 96, repeats=1)
    assert cost.rows[-1] == 96 and all(s > 0 for s in cost.seconds)
    prompt = random_prompts((40,), seed=1)
    params = GenerationParams(max_new_tokens=24)
    plain = Engine(target, NoDrafter()).generate(prompt, params)[0].token_ids
    assert Engine(target, PromptLookupDrafter()).generate(prompt, params)[0].token_ids == plain


def test_the_cost_curve_is_kept_per_machine_and_target_and_read_back(monkeypatch, tmp_path) -> None:
    """The first target measures and keeps its curve; a later load of the same weights reads
    it back without timing a pass; other weights, another dtype or ``SOT_COST_CACHE=0``
    measure their own."""
    from sot.policy import cost as cost_module

    monkeypatch.setattr("sot.models.loading.cache_root", lambda: tmp_path)  # (the kernels' build stays)
    measured: list[int] = []
    real = CostModel.measure.__func__

    def counted(cls, target, rows, *args, **kw):
        measured.append(rows)
        return real(cls, target, rows, *args, context=128, repeats=1, sizes=[1, 2, 4, 8, rows])

    monkeypatch.setattr(CostModel, "measure", classmethod(counted))
    first = CostModel.for_target(TargetModel(clone(tiny_model("llama", seed=2), torch.float32)), 16)
    assert measured == [96] and len(list((tmp_path / "costs").glob("*.json"))) == 1
    again = CostModel.for_target(TargetModel(clone(tiny_model("llama", seed=2), torch.float32)), 16)
    assert measured == [96], "the same weights on the same machine read the kept curve"
    assert again.rows == first.rows and again.seconds == first.seconds
    CostModel.for_target(TargetModel(clone(tiny_model("llama", seed=3), torch.float32)), 16)
    CostModel.for_target(TargetModel(clone(tiny_model("llama", seed=2), torch.bfloat16)), 16)
    assert measured == [96, 96, 96] and len(list((tmp_path / "costs").glob("*.json"))) == 3
    monkeypatch.setenv("SOT_COST_CACHE", "0")
    target = TargetModel(clone(tiny_model("llama", seed=2), torch.float32))
    assert cost_module.cost_cache_path(target, 96) is None
    CostModel.for_target(target, 16)
    assert measured == [96] * 4
    (tmp_path / "costs").rename(tmp_path / "unreadable")
    (tmp_path / "costs").write_text("not a folder")
    monkeypatch.delenv("SOT_COST_CACHE")
    CostModel.for_target(TargetModel(clone(tiny_model("llama", seed=2), torch.float32)), 16)
    assert measured == [96] * 5, "an unwritable cache only costs a measurement"


def test_ranked_prefixes_are_closed_under_parents() -> None:
    tree = tree_from_parents([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 3, 1], draft_probs=[1, 0.5, 0.4, 0.45, 0.3, 0.1])
    order = ranked_nodes(tree)
    assert order == [1, 3, 2, 4, 5]
    for n in range(len(order) + 1):
        sub = prune(tree, order[:n])
        assert sub.size == n + 1
        assert all(p < i for i, p in enumerate(sub.parents[1:], start=1))


def _plain_run(lengths: tuple[int, ...], new_tokens: int):
    """A tiny float32 Llama target, prompts of ``lengths``, the generation settings and
    plain decoding's tokens for each prompt (the reference every policy run must equal)."""
    target = TargetModel(clone(tiny_model("llama", seed=2), torch.float32))
    prompts = random_prompts(lengths, seed=4)
    params = GenerationParams(max_new_tokens=new_tokens)
    return target, prompts, params, [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]


class _Mixed(Drafter):
    """Sequence 0 gets its true continuation as a confident chain (always accepted);
    sequence 1 gets a confident chain of junk (never accepted)."""

    kind = DrafterKind.PLD

    def __init__(self, references: list[list[int]], prompt_lengths: list[int]) -> None:
        self.references = references
        self.prompt_lengths = prompt_lengths

    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        out = []
        for x in inputs:
            if budget.max_nodes < 2:
                out.append(DraftTree([x.context[-1]], [-1], [0]))
            elif x.index == 0:
                done = len(x.context) - self.prompt_lengths[0]
                toks = self.references[0][done : done + min(budget.max_depth, budget.max_nodes - 1)]
                out.append(tree_from_parents([x.context[-1], *toks], [-1, *range(len(toks))], [1.0] * (len(toks) + 1)))
            else:
                depth = min(budget.max_depth, budget.max_nodes - 1)
                toks = [(x.context[-1] + 7 * (i + 1)) % VOCAB for i in range(depth)]
                out.append(tree_from_parents([x.context[-1], *toks], [-1, *range(depth)], [1.0] + [0.9] * depth))
        return out


def test_fallback_is_per_sequence_and_lossless() -> None:
    target, prompts, params, plain = _plain_run((12, 20), 60)
    drafter = _Mixed(plain, [len(p) for p in prompts])
    # the tiny model's verify time barely grows with rows, so demand a clear gain to speculate
    policy = PolicyConfig(fallback_threshold=1.2, window=3, first_backoff=2)
    res = Engine(target, drafter, TreeBudget(8, 6), policy=policy).generate(prompts, params)
    assert [r.token_ids for r in res] == plain
    good, bad = res
    assert good.fallbacks == 0 and good.mean_accept_len > 3
    assert bad.fallbacks >= 2, "junk drafts should send the sequence to plain decoding, repeatedly"
    # (a drafting step may also verify its root only: flat packing prices each tree alone)
    assert bad.plain_steps > 0 and bad.tree_sizes.count(1) >= bad.plain_steps
    # exponential back-off: later fallbacks last longer, so plain steps outnumber probe steps
    assert bad.plain_steps > sum(1 for n in bad.tree_sizes if n > 1)


@pytest.mark.parametrize("make", [LookupDrafter, SuffixDrafter], ids=["pld", "suffix"])
def test_a_drafter_without_a_model_offers_free_drafts_and_never_falls_back(make) -> None:
    """Prompt lookup and suffix trees cost no model pass: the policy takes their trees as free
    drafts, priced by their calibrated estimates, and never sends a sequence to fallback for
    them, however eager the fallback settings (before, a few losing steps put them on plain
    steps for back-offs that doubled, and they learned nothing meanwhile)."""
    target, prompts, params, plain = _plain_run((12, 20), 60)
    drafter = make()
    assert drafter.runs_model is False
    engine = Engine(target, drafter, TreeBudget(8, 6), policy=PolicyConfig(fallback_threshold=1.2, window=3,
                                                                           first_backoff=2))
    res = engine.generate(prompts, params)
    assert [r.token_ids for r in res] == plain
    assert engine.policy.model_drafts is False
    assert all(r.fallbacks == 0 for r in res)
    assert sum(sum(r.accept_lengths) - r.steps for r in res) > 0, "some free drafts should be accepted"
    # a drafter that runs a model keeps the fallback (test_fallback_is_per_sequence_and_lossless)
    assert Engine(target, _Mixed(plain, [12, 20])).policy.model_drafts is True


def test_static_policy_verifies_the_whole_tree_and_warmup_is_plain() -> None:
    target, prompts, params, plain = _plain_run((12,), 30)
    drafter = _Mixed(plain, [12])
    res = Engine(target, drafter, TreeBudget(8, 6), policy=PolicyConfig(kind=PolicyKind.STATIC, warmup=5)).generate(prompts, params)[0]
    assert res.token_ids == plain[0]
    assert res.tree_sizes[:4] == [1, 1, 1, 1], "tokens 1-4 come from plain steps (token 0 from the prefill)"
    assert res.plain_steps == 4 and res.tree_sizes[4] > 1


def test_policy_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError):
        PolicyConfig(window=0)
    with pytest.raises(ConfigError):
        PolicyConfig(fallback_threshold=-1)


def test_root_only_choice_falls_back_and_skips_the_drafter() -> None:
    """When no node is worth its verify cost, the sequence falls back: the drafter is not
    called again until the back-off ends."""
    target, prompts, params, plain = _plain_run((12,), 40)

    class _Unsure(_Mixed):
        calls = 0

        def propose(self, inputs, budget):
            type(self).calls += len(inputs)
            trees = super().propose(inputs, budget)
            return [DraftTree(t.tokens, t.parents, t.depths, [1.0] + [1e-4] * (t.size - 1)) for t in trees]

    drafter = _Unsure([[0] * 64], [12])  # junk drafts (sequence 0 here gets the reference of zeros)
    engine = Engine(target, drafter, TreeBudget(8, 6), policy=PolicyConfig(first_backoff=4))
    engine.cost_model = lambda: CostModel([1, 8], [0.010, 0.020])
    res = engine.generate(prompts, params)[0]
    assert res.token_ids == plain[0]
    assert res.fallbacks >= 2 and set(res.tree_sizes) == {1}
    assert _Unsure.calls < res.steps, "fallback steps must not call the drafter"
    assert res.plain_steps == res.steps - _Unsure.calls


def test_free_drafts_replace_worse_model_drafts_losslessly() -> None:
    """The drafter's free trees are verified whenever its model is idle, and a sequence takes
    them instead of drafting when they promise more than drafting measured: here the model's
    drafts are junk and the free drafts are the true continuation, so after two drafting
    steps the sequence commits several tokens per step without the model."""
    target, prompts, params, plain = _plain_run((12,), 40)

    class _FreeRight(_Mixed):
        free_calls = 0

        def propose(self, inputs, budget):  # the model's drafts: confident junk
            return super().propose([DraftInput(x.sequence, x.context, x.states, index=1) for x in inputs], budget)

        def propose_free(self, inputs, budget):
            type(self).free_calls += len(inputs)
            trees = super().propose(inputs, budget)  # sequence 0: the true continuation
            return [DraftTree(t.tokens, t.parents, t.depths, [0.9**d for d in t.depths]) for t in trees]

    drafter = _FreeRight(plain, [12])
    engine = Engine(target, drafter, TreeBudget(8, 6), policy=PolicyConfig(first_backoff=4))
    engine.cost_model = lambda: CostModel([1, 8], [0.010, 0.012])
    res = engine.generate(prompts, params)[0]
    assert res.token_ids == plain[0]
    assert _FreeRight.free_calls == res.steps, "free drafts are offered at every step"
    assert res.plain_steps >= res.steps - 3, "after the first drafting steps the model stays idle"
    assert all(a > 1 for a in res.accept_lengths[3:-1]), "free drafts of the true continuation are accepted"
    assert res.steps < len(res.token_ids) / 2


def test_free_draft_is_preferred_only_when_it_promises_more_than_drafting() -> None:
    from sot.policy import CommitPolicy

    policy = CommitPolicy(PolicyConfig(), CostModel([1, 8], [0.010, 0.017]))  # 1 ms per extra row
    policy.reset(1)
    chain = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2], [0, 1, 2, 3], [1.0, 0.9, 0.81, 0.729])
    assert not policy.prefers_free(0, chain), "no drafting speed measured yet"
    policy.seqs[0].speed = [1.2, 1.3]
    assert policy.prefers_free(0, chain)  # (1 + 0.9 + 0.81 + 0.729) / 1.3 = 2.6x plain
    policy.seqs[0].speed = [2.8, 2.9]
    assert not policy.prefers_free(0, chain)
    assert not policy.prefers_free(0, DraftTree([1], [-1], [0], [1.0]))
    policy.observe_free(0, chain, [0, 1, 2])
    assert policy.seqs[0].free_speed == pytest.approx(3 * 0.010 / 0.013)


def test_fallback_needs_drafting_to_beat_the_free_drafts() -> None:
    """Drafting steps at 1.5x plain keep a sequence drafting, unless its free drafts measured
    faster: then it falls back (and the free drafts take its steps)."""
    from sot.policy import CommitPolicy

    def falls_back(free_speed: float | None) -> bool:
        policy = CommitPolicy(PolicyConfig(window=3), CostModel([1, 8], [0.010, 0.017]))
        policy.reset(1)
        policy.seqs[0].free_speed = free_speed
        tree = DraftTree([1, 2], [-1, 0], [0, 1], [1.0, 0.9])
        for _ in range(5):  # accepted 1 drafted token in 0.0133 s: 1.5x a plain step's speed
            policy.observe(0, tree, [0, 1], 2 * 0.010 / 1.5)
        return policy.seqs[0].fallbacks > 0

    assert not falls_back(None)
    assert not falls_back(1.2)
    assert falls_back(2.0)


def test_static_policy_grows_a_fixed_beam() -> None:
    from sot.drafters.state import StateDrafter, new_predictor

    model = tiny_model("llama", seed=3)
    layers = (0, 1, 2)
    target = TargetModel(clone(model, torch.float32), state_layers=layers)
    drafter = StateDrafter(new_predictor(model, layers, None, seed=1), top_k=3)
    prompts = random_prompts((9, 21), seed=5)
    params = GenerationParams(max_new_tokens=20)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    engine = Engine(target, drafter, TreeBudget(4, 5), policy=PolicyConfig(kind=PolicyKind.STATIC))
    b = engine.budget
    assert (b.max_nodes, b.max_depth, b.width, b.grown_nodes, b.grown_depth) == (1 + 3 * 5, 5, 3, 1 + 3 * 5, 5)
    res = engine.generate(prompts, params)
    assert [r.token_ids for r in res] == plain
    for r in res:  # every drafting step verifies 3 nodes at each of 5 depths (the last step may end early)
        assert set(r.tree_sizes[:-1]) == {16}
    chain = StateDrafter(new_predictor(model, layers, None, seed=1), top_k=1)
    engine = Engine(target, chain, TreeBudget(16, 4), policy=PolicyConfig(kind=PolicyKind.STATIC))
    b = engine.budget
    assert (b.max_nodes, b.max_depth, b.width, b.grown_nodes) == (5, 4, 1, 5), "width 1 is a chain of max_depth nodes"
    res = engine.generate(prompts, params)
    assert [r.token_ids for r in res] == plain and set(res[0].tree_sizes[:-1]) == {5}


def test_learned_policy_records_trains_and_stays_lossless(tmp_path) -> None:
    from sot.drafters.state import StateDrafter, new_predictor
    from sot.policy import FEATURES, AcceptanceModel, load_acceptance_model
    from sot.train.acceptance import fit_acceptance

    model = tiny_model("llama", seed=3)
    layers = (0, 1, 2)
    target = TargetModel(clone(model, torch.float32), state_layers=layers)
    drafter = StateDrafter(new_predictor(model, layers, None, seed=1), top_k=3)
    prompts = random_prompts((9, 21, 14, 30), seed=6)
    params = GenerationParams(max_new_tokens=24)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    # record: whole trees, one label per verified node; labels add up to the accepted tokens
    # (the last step of a sequence may accept more than max_new_tokens lets it commit)
    rec = Engine(target, drafter, TreeBudget(10, 4), record_policy=True)
    res = rec.generate(prompts, params)
    assert [r.token_ids for r in res] == plain
    trace = rec.policy_trace
    assert all(f.shape == (a.numel(), len(FEATURES)) for f, a in zip(trace.features, trace.accepted))
    drafted_steps = [a for r in res for a in r.accept_lengths]
    labelled, committed = sum(float(a.sum()) for a in trace.accepted), sum(drafted_steps) - len(drafted_steps)
    assert committed <= labelled <= committed + 4 * len(prompts)
    # fit on synthetic traces where acceptance depends on depth: the model must beat a constant
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(3000, len(FEATURES), generator=gen)
    y = (torch.rand(3000, generator=gen) < 0.9 - 0.8 * x[:, FEATURES.index("depth")]).float()
    fitted, report = fit_acceptance({"features": x, "accepted": y, "group": torch.arange(3000) % 20}, epochs=30)
    rate = float(y.mean())
    constant = -(rate * torch.log(torch.tensor(rate)) + (1 - rate) * torch.log(torch.tensor(1 - rate)))
    assert report["val_log_loss"]["learned"] < float(constant) - 0.02
    # save / load round trip, then decode with it: still lossless
    path = tmp_path / "policy.safetensors"
    fitted.save(path)
    loaded = load_acceptance_model(path)
    assert torch.equal(loaded(x[:5]), fitted(x[:5]))
    engine = Engine(target, drafter, TreeBudget(10, 4), policy=PolicyConfig(kind=PolicyKind.LEARNED), acceptance_model=loaded)
    assert [r.token_ids for r in engine.generate(prompts, params)] == plain
    # inputs outside the training range are clipped to it (no extrapolation to unseen trees)
    far = x[:1].clone()
    far[0, FEATURES.index("tree_size")] = 100.0
    farther = far.clone()
    farther[0, FEATURES.index("tree_size")] = 1000.0
    assert torch.equal(loaded(far), loaded(farther))
    # auto: learned with a fitting model, heuristic when none fits, an error for a named bad file
    auto = PolicyConfig(kind=PolicyKind.AUTO)
    assert Engine(target, drafter, policy=auto, acceptance_model=loaded).policy_config.kind is PolicyKind.LEARNED
    assert Engine(target, drafter, policy=auto).policy_config.kind is PolicyKind.HEURISTIC  # shipped model: other target
    with pytest.raises(ConfigError, match="does not exist"):
        Engine(target, drafter, policy=PolicyConfig(kind=PolicyKind.AUTO, model_path=str(tmp_path / "none")))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="not a commit-policy model"):
        AcceptanceModel.load(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        Engine(target, drafter, policy=PolicyConfig(kind=PolicyKind.LEARNED, model_path=str(tmp_path / "none")))


def test_batch_choice_pays_for_padding_rows() -> None:
    """Every sequence of a pass is padded to the largest tree, so the batch chooses one size;
    the more sequences share the pass, the dearer each extra row and the smaller the trees."""
    from sot.policy import CommitPolicy

    cost = CostModel([1, 16, 64], [0.010, 0.013, 0.040])  # rows are cheap at first, then not
    confident = tree_from_parents(list(range(9)), [-1, *range(8)], [1.0] + [0.95 ** d for d in range(1, 9)])
    unsure = tree_from_parents(list(range(9)), [-1, *range(8)], [1.0] + [0.02 ** d for d in range(1, 9)])
    policy = CommitPolicy(PolicyConfig(), cost)
    policy.reset(4)
    alone = policy.choose_batch({0: confident}, 1)[0]
    assert alone.size == 9, "one sequence: every confident node is worth a row"
    four = policy.choose_batch({b: confident for b in range(4)}, 4)
    sizes = {t.size for t in four.values()}
    assert len(sizes) == 1 and sizes.pop() < 9, "four sequences: the extra rows cost four times as much"
    mixed = policy.choose_batch({0: confident, 1: unsure}, 2)
    assert mixed[0].size == mixed[1].size > 1, "the unsure sequence fills the padding rows the confident one pays for"
    assert policy.choose_batch({0: unsure}, 1)[0].size == 1


def test_learned_policy_with_plain_decoding_needs_no_model() -> None:
    target = TargetModel(clone(tiny_model("llama", seed=2), torch.float32))
    prompts = random_prompts((12,), seed=4)
    engine = Engine(target, NoDrafter(), policy=PolicyConfig(kind=PolicyKind.LEARNED, model_path="/nonexistent"))
    assert engine.generate(prompts, GenerationParams(max_new_tokens=5))[0].new_tokens == 5


def test_draft_budget_follows_the_verified_trees() -> None:
    """Nodes the policy will not verify are not drafted: after a pass that verified ``n`` rows
    per sequence, the next draft may grow to ``n + SLACK`` nodes; a sequence without a
    verified tree yet (start, probe) gets the full budget."""
    from sot.policy import CommitPolicy

    cost = CostModel([1, 16, 64], [0.010, 0.013, 0.040])
    policy = CommitPolicy(PolicyConfig(), cost)
    policy.reset(3)
    full = TreeBudget(16, 8, predictor_nodes=16, predictor_depth=8)
    assert policy.draft_budget(full, [0, 1]) == full
    unsure = tree_from_parents(list(range(5)), [-1, 0, 1, 2, 3], [1.0, 0.3, 0.05, 0.01, 0.001])
    chosen = policy.choose_batch({0: unsure, 1: unsure}, 3)
    n = chosen[0].size
    assert n < 5
    small = policy.draft_budget(full, [0, 1])
    assert small.grown_nodes == n + CommitPolicy.SLACK and small.grown_depth == small.grown_nodes - 1
    assert (small.max_nodes, small.max_depth) == (16, 8), "the free drafts keep the whole budget"
    assert policy.draft_budget(full, [0, 2]) == full, "sequence 2 has verified nothing yet"
    assert small.min_confidence is None, "no pass timed yet: the drafter keeps its own floor"
    for _ in range(3):  # 1 ms per predictor pass against 10 ms per plain token alone
        policy.observe_draft(0.004, 4)
    assert policy.draft_budget(full, [0]).min_confidence == pytest.approx(0.1)
    # two drafting sequences share a pass; in a batch of 3, a plain token costs verify(3) / 3
    assert policy.draft_budget(full, [0, 1], 3).min_confidence == pytest.approx(0.0005 / (cost.verify(3) / 3))
    static = CommitPolicy(PolicyConfig(kind=PolicyKind.STATIC), None)
    static.reset(1)
    assert static.draft_budget(full, [0]) == full


def test_cost_model_follows_the_steps_timings() -> None:
    """Observed passes scale the curve toward them (a busy machine, or the extra cost of a
    batch of many sequences over the one-sequence passes timed at start-up)."""
    cost = CostModel([1, 8, 16], [0.010, 0.014, 0.020])
    for _ in range(60):  # the machine got twice as slow
        cost.observe(8, 0.028)
    assert cost.verify(8) == pytest.approx(0.028, rel=0.02)
    assert cost.seconds == pytest.approx([0.020, 0.028, 0.040], rel=0.02), "the whole curve follows"
    before = list(cost.seconds)
    cost.observe(12, 1.0)  # one wild pass moves the curve a little only
    assert all(a <= b <= a * 2 ** 0.1 + 1e-12 for a, b in zip(before, cost.seconds))


def test_policy_plans_selects_and_observes_a_step() -> None:
    """The engine's three calls: a sequence in warm-up decodes plainly, the others draft;
    the selected trees fit the cost model; the outcome updates the drafting sequence."""
    from sot.policy import CommitPolicy, StepOutcome

    policy = CommitPolicy(PolicyConfig(warmup=4), CostModel([1, 16], [0.010, 0.012]))
    policy.add_sequence(10)
    policy.add_sequence(11)
    plan = policy.plan({10: 8, 11: 2}, {}, TreeBudget(8, 4))
    assert plan.drafting == (10,) and plan.plain == (11,) and plan.batch_rows == 2
    tree = tree_from_parents([5, 6, 7], [-1, 0, 1], draft_probs=[1.0, 0.9, 0.8])
    chosen = policy.select(plan, {10: tree})
    assert chosen[10].size == 3, "cheap rows: the whole confident chain is verified"
    calibration = policy.seqs[10].calibration
    policy.observe_step(plan, StepOutcome(trees={10: chosen[10], 11: DraftTree([9], [-1], [0])},
                                          paths={10: [0, 1, 2], 11: [0]}, draft_seconds=0.002, draft_passes=2,
                                          verify_seconds=0.011, rows=16))
    assert policy.seqs[10].calibration > calibration, "both drafted tokens were accepted"
    assert policy.pass_seconds == [0.001]
    policy.drop_sequence(10)
    assert list(policy.seqs) == [11]


def test_policy_files_with_bad_contents_are_refused_by_name(tmp_path) -> None:
    """A file whose header reads but whose contents are wrong (a hidden size that is no
    number, a missing weight, a description that is not an object, weights that are not
    finite) is a ConfigError naming the file, not an exception from deep inside loading."""
    import json

    from safetensors.torch import load_file, save_file

    from sot.policy import AcceptanceModel

    good = tmp_path / "good.safetensors"
    AcceptanceModel(8).save(good)
    weights = load_file(str(good))
    from safetensors import safe_open

    with safe_open(str(good), "pt") as fh:
        info = json.loads(fh.metadata()["sot_policy"])
    some = next(iter(weights))
    for name, tensors, meta, message in (
            ("hidden", weights, {**info, "hidden": "abc"}, "hidden size 'abc'"),
            ("missing", {k: v for k, v in weights.items() if k != some}, info, "weights do not fit"),
            ("list", weights, [info], "not a commit-policy-model file|not a .* file"),
            ("nan", {**weights, some: torch.full_like(weights[some], float("nan"))}, info, "not finite")):
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path), metadata={"sot_policy": json.dumps(meta)})
        with pytest.raises(ConfigError, match=message):
            AcceptanceModel.load(path)
    assert AcceptanceModel.load(good).info["hidden"] == 8


def test_a_diverged_fit_writes_over_nothing(tmp_path, monkeypatch) -> None:
    """``sot train policy`` checks the fit before it writes: a run that diverged leaves the
    folder's earlier model as it was."""
    import sot.train.acceptance as acc
    from sot.policy import AcceptanceModel

    out = tmp_path / "run"
    out.mkdir()
    AcceptanceModel(8).save(out / "policy.safetensors")
    before = (out / "policy.safetensors").read_bytes()
    broken = AcceptanceModel(8)
    with torch.no_grad():
        next(broken.parameters()).fill_(float("nan"))
    monkeypatch.setattr(acc, "load_or_collect", lambda cfg: {"config": {}})
    monkeypatch.setattr(acc, "fit_acceptance", lambda *a: (broken, {"val_log_loss": {"learned": float("nan")}}))
    with pytest.raises(ConfigError, match="diverged"):
        acc.train_policy(acc.PolicyTrainConfig(out=str(out)))
    assert (out / "policy.safetensors").read_bytes() == before


def test_a_sequence_that_fell_back_drafts_again_when_its_text_turns_predictable() -> None:
    """After rejected drafts a sequence falls back; its estimates change only when it drafts,
    so batch planning, scoring it by them, left it out of its back-off's probe for good. The
    probe starts from the prior, so a text that turned predictable is drafted again."""
    from sot.policy import CommitPolicy, StepOutcome

    cost = CostModel([1, 8, 32], [0.010, 0.012, 0.020])
    policy = CommitPolicy(PolicyConfig(), cost)
    policy.add_sequence(7)

    def chain(n: int) -> DraftTree:
        return DraftTree(list(range(n + 1)), [-1] + list(range(n)), list(range(n + 1)), [1.0] + [0.9] * n)

    generated, drafted_late = 10, 0
    for step in range(30 + 128):
        predictable = step >= 30  # hard text first, then text every draft of which is accepted
        plan = policy.plan({7: generated}, {}, TreeBudget())
        if 7 in plan.drafting:
            tree = policy.select(plan, {7: chain(4)})[7]
            path = list(range(tree.size)) if predictable else [0]
            policy.observe_step(plan, StepOutcome({7: tree}, {7: path}, 0.003, 3, cost.verify(tree.size), tree.size))
            generated += len(path)
            drafted_late += predictable and tree.size > 1
        else:
            policy.observe_step(plan, StepOutcome({}, {7: [0]}, 0.0, 0, cost.verify(1), 1))
            generated += 1
    assert drafted_late >= 32, "the sequence drafts again once its text is predictable"


def test_a_policy_trained_on_another_predictors_drafts_is_not_used(tmp_path) -> None:
    """A policy file records the predictor whose drafts it learned from: with another
    predictor, ``auto`` takes the heuristic policy and a named file is refused; the files
    shipped with SoT record the shipped predictor."""
    from sot.drafters.state import StateDrafter, new_predictor
    from sot.fingerprint import predictor_fingerprint
    from sot.policy import AcceptanceModel
    from sot.policy.acceptance_model import DEFAULT_ACCEPTANCE_MODEL
    from sot.policy.rl import DEFAULT_RL_POLICY, RLPolicyModel

    model = tiny_model("llama", seed=3)
    layers = (0, 1, 2)
    target = TargetModel(clone(model, torch.float32), state_layers=layers)
    drafter = StateDrafter(new_predictor(model, layers, None, seed=1), top_k=3)
    other = StateDrafter(new_predictor(model, layers, None, seed=2), top_k=3)
    path = tmp_path / "policy.safetensors"
    AcceptanceModel(8).save(path, {"predictor_hash": predictor_fingerprint(drafter.predictor)})
    for kind in (PolicyKind.AUTO, PolicyKind.LEARNED):
        config = PolicyConfig(kind=kind, model_path=str(path))
        assert Engine(target, drafter, policy=config).policy_config.kind is PolicyKind.LEARNED
        with pytest.raises(ConfigError, match="trained on the drafts of another predictor"):
            Engine(target, other, policy=config)
    with_model = Engine(target, other, policy=PolicyConfig(kind=PolicyKind.AUTO))  # (shipped: another target too)
    assert with_model.policy_config.kind is PolicyKind.HEURISTIC
    for kind in (PolicyKind.HEURISTIC, PolicyKind.STATIC):  # a model file they would not read is refused
        with pytest.raises(ConfigError, match=f"the {kind.value} policy reads no model file"):
            PolicyConfig(kind=kind, model_path=str(path))
    # auto with a model, on a drafter no acceptance model serves, is the heuristic (its file unread)
    plain = Engine(target, NoDrafter(), policy=PolicyConfig(kind=PolicyKind.AUTO, model_path=str(path)))
    assert plain.policy_config.kind is PolicyKind.HEURISTIC and plain.policy_config.model_path is None
    from sot.drafters import DEFAULT_PREDICTOR
    from sot.drafters.state import load_predictor
    from sot.models.loading import load_model

    shipped = predictor_fingerprint(load_predictor(DEFAULT_PREDICTOR, load_model("default").model))
    assert AcceptanceModel.load(DEFAULT_ACCEPTANCE_MODEL).info["predictor_hash"] == shipped
    assert RLPolicyModel.load(DEFAULT_RL_POLICY).info["predictor_hash"] == shipped
