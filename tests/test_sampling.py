"""Acceptance rules as pure functions, and sampling through the engine."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from helpers import RandomTreeDrafter, clone, random_prompts, tiny_model
from sot.acceptance import accept_coupled, accept_greedy, accept_rejection
from sot.drafters import NoDrafter, PromptLookupDrafter, SuffixDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel
from sot.policy import PolicyConfig
from sot.policy.cost import CostModel
from sot.sampling import SamplingMode, SamplingParams, processed_logits, target_probs
from sot.tree import tree_from_parents


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5


def test_gumbel_noise_is_drawn_once_per_position_and_its_store_is_bounded() -> None:
    """A position's noise is the same vector whether drawn or reused (a drafter and the verify
    walk read it in turn), it depends on every part of its key, and the store keeps the most
    recently used vectors within its byte cap."""
    from sot.sampling import _key, _NoiseCache, gumbel_noise

    gen = torch.Generator().manual_seed(_key(7, 2, 40))
    fresh = -torch.log(-torch.log(torch.rand(300, generator=gen, dtype=torch.float64).clamp_(min=1e-300)))
    first = gumbel_noise(7, 2, 40, 300)
    assert torch.equal(first, fresh) and gumbel_noise(7, 2, 40, 300) is first
    for other in ((8, 2, 40), (7, 3, 40), (7, 2, 41)):
        assert not torch.equal(gumbel_noise(*other, 300), first), other

    store = _NoiseCache(max_bytes=3 * 100 * 8)  # three vectors of 100 float64
    vectors = {k: torch.full((100,), float(k), dtype=torch.float64) for k in range(5)}
    for k in range(3):
        store.put((0, 0, k, 100), vectors[k])
    assert store.get((0, 0, 0, 100)) is vectors[0]  # (now the most recently used)
    store.put((0, 0, 3, 100), vectors[3])  # drops key 1, the least recently used
    assert store.get((0, 0, 1, 100)) is None and store.get((0, 0, 0, 100)) is vectors[0]
    assert store.bytes == 3 * 100 * 8
    store.put((0, 0, 4, 1000), torch.zeros(1000, dtype=torch.float64))  # larger than the cap: not kept
    assert store.get((0, 0, 4, 1000)) is None and store.bytes == 3 * 100 * 8


def test_greedy_keeps_exactly_the_argmax_prefix() -> None:
    logits = torch.full((4, 6), -5.0)
    logits[0, 3] = logits[2, 1] = logits[3, 4] = logits[1, 0] = 5.0
    # root -> {3 (node 1), 3? no: 2 (node 2)}; node 1 -> 1 (node 3)
    tree = tree_from_parents([9, 2, 3, 1], [-1, 0, 0, 2])
    acc = accept_greedy(tree, logits)
    assert acc.path == [0, 2, 3] and acc.tokens == [3, 1, 4]


def test_greedy_walks_give_each_sequence_its_own_greedy_path() -> None:
    """accept_all takes the argmax of the rows the walks reach, batched over sequences, and
    with logits left to compute (a head over hidden states) computes only those rows; each
    sequence must walk its tree exactly as its own full logits do, flat-packed or padded."""
    from sot.models.adapter import ForwardOutput
    from sot.verify import greedy_walks

    # tree 0: the root's most confident child is node 1, but the target takes node 2's branch
    trees = [tree_from_parents([9, 2, 3, 1, 4], [-1, 0, 0, 2, 1], [1.0, 0.9, 0.1, 0.1, 0.8]),
             tree_from_parents([5, 0, 1], [-1, 0, 1])]
    gen = torch.Generator().manual_seed(3)
    # (row k of the head: token k; integers, so every sum is exact whatever the product's row
    # count: a float32 product of 6 rows need not round like one of 8)
    hidden = torch.randint(-8, 9, (8, 6), generator=gen).float()
    weight = torch.eye(6) * 64 + torch.randint(-1, 2, (6, 6), generator=gen).float()
    hidden[0] = weight[3] * 4  # each root row's argmax is a child: the paths go past the root
    hidden[5] = weight[0] * 4
    hidden[2] = weight[1] * 4  # node 2 -> its child node 3
    calls: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ weight.T

    rows = hidden @ weight.T
    padded_hidden = torch.stack([hidden[0:5], torch.cat([hidden[5:8], hidden[7:8], hidden[7:8]])])
    outs = {
        "flat": ForwardOutput(rows, None, (0, 5, 8)),
        "padded": ForwardOutput(padded_hidden @ weight.T, None),
        "lazy flat": ForwardOutput(None, None, (0, 5, 8), hidden=hidden, head=head),
        "lazy padded": ForwardOutput(None, None, hidden=padded_hidden, head=head),
    }
    alone = [accept_greedy(tree, out_rows) for tree, out_rows in zip(trees, (rows[0:5], rows[5:8]))]
    assert alone[0].path == [0, 2, 3] and len(alone[1].path) > 1
    for name, out in outs.items():
        calls.clear()
        ids = greedy_walks(out, trees, [0, 1])
        for b, tree in enumerate(trees):
            assert accept_greedy(tree, None, ids[b]) == alone[b], name
        if out.lazy:
            # round 1: the confident chains (0, 1, 4 and all of tree 1); round 2: node 2's branch
            assert calls == [6, 2], name
            assert out.head_rows == 8 and out.lazy, name
            assert torch.equal(out.seq_logits(0), rows[0:5]), name  # a sequence's rows on demand
            assert torch.equal(out.logits.reshape(-1, 6)[: 5], rows[:5]), name
            assert not out.lazy


@pytest.mark.parametrize("arch", ["llama", "gemma", "gemma2", "gemma3", "qwen3", "phi3", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_head_computes_only_the_rows_the_walks_read(arch: str, dtype: torch.dtype) -> None:
    """Verify passes leave the LM head to the acceptance walks (SoT's CPU forward for Llama,
    Qwen3 and Gemma 3 in float32; transformers' forward with the head held back for the others,
    Gemma 2's soft cap included):
    greedy, rejection-sampled and coupled walks, alone and in a batch, commit the same tokens
    with the same logits rows as passes that compute every row, and for greedy walks the head
    computes fewer rows than the passes hold (sampled trees are computed whole)."""
    model = tiny_model(arch, seed=4)
    target = TargetModel(clone(model, dtype))
    lean = arch in ("llama", "qwen3") or (arch == "gemma3" and dtype == torch.float32)
    assert target.lazy_head and (target.fast is not None) == lean
    prompts = random_prompts((9, 33, 17), seed=8)
    settings = [GenerationParams(max_new_tokens=24),
                GenerationParams(max_new_tokens=24, sampling=SamplingParams(temperature=0.9, seed=5)),
                GenerationParams(max_new_tokens=24, logprobs=2, sampling=SamplingParams(
                    temperature=1.0, top_p=0.9, seed=6, mode=SamplingMode.COUPLED))]
    passes: list = []
    sizes: list[int] = []  # each pass's rows (a padded pass: its whole grid)
    verify = target.verify

    def watched(cache, ids, positions, layout):
        out = verify(cache, ids, positions, layout)
        passes.append(out)
        sizes.append(out.offsets[-1] if out.offsets is not None else ids.numel())
        return out

    target.verify = watched
    for params in settings:
        plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
        runs = {}
        for lazy in (True, False):
            target.lazy_head = lazy
            passes.clear()
            drafter = RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.8, seed=2)
            results = Engine(target, drafter, TreeBudget(16, 6), trace=True).generate(prompts, params, batch_size=3)
            runs[lazy] = results
            assert [r.token_ids for r in results] == plain
            if lazy and params.sampling.greedy:  # (sampled trees are computed whole, in one call)
                assert 0 < sum(out.head_rows for out in passes) < sum(sizes)
                assert all(out.head_rows >= 0 for out in passes)
        for a, b in zip(runs[True], runs[False]):
            assert len(a.logit_trace) == len(b.logit_trace)
            assert all(torch.equal(x, y) for x, y in zip(a.logit_trace, b.logit_trace))
            assert a.logprobs == b.logprobs


def test_greedy_rejects_everything_when_no_child_matches() -> None:
    logits = _logits(3, 8)
    best = int(logits[0].argmax())
    tree = tree_from_parents([0, (best + 1) % 8, (best + 2) % 8], [-1, 0, 0])
    acc = accept_greedy(tree, logits)
    assert acc.path == [0] and acc.tokens == [best]


def _tree_and_logits(vocab: int = 6):
    tree = tree_from_parents([0, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    return tree, _logits(5, vocab, seed=3)


def test_rejection_sampling_matches_the_target_distribution() -> None:
    """Chi-square on the first two committed tokens against the exact target joint."""
    vocab = 6
    tree, logits = _tree_and_logits(vocab)
    params = SamplingParams(temperature=1.0)
    probs = target_probs(logits, params)
    n = 6000
    node_of = {1: 1, 2: 2}  # first token -> tree node that holds it
    # First-token marginal.
    first_counts = np.zeros(vocab)
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        first_counts[accept_rejection(tree, logits, params, gen).tokens[0]] += 1
    expected = probs[0].numpy() * n
    assert chisquare(first_counts, expected).pvalue > 1e-3
    # Second token given first token 1 (tree node 1, whose children are 3 and 4).
    second_counts = np.zeros(vocab)
    gen = torch.Generator().manual_seed(2)
    while second_counts.sum() < 3000:
        acc = accept_rejection(tree, logits, params, gen)
        if acc.tokens[0] == 1 and len(acc.tokens) > 1:
            second_counts[acc.tokens[1]] += 1
    expected2 = probs[node_of[1]].numpy() * second_counts.sum()
    assert chisquare(second_counts, expected2).pvalue > 1e-3


def test_rejection_sampling_same_seed_repeats() -> None:
    tree, logits = _tree_and_logits()
    params = SamplingParams(temperature=0.8, top_k=4)
    a = [accept_rejection(tree, logits, params, torch.Generator().manual_seed(7)).tokens for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_identical_draft_and_target_accepts_everything() -> None:
    """A draft that always holds the target's only possible token is always accepted."""
    vocab = 5
    logits = torch.full((4, vocab), -1e9)
    chain = [2, 4, 1]
    for i, tok in enumerate(chain):
        logits[i, tok] = 0.0
    logits[3, 3] = 0.0
    tree = tree_from_parents([0, *chain], [-1, 0, 1, 2])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        acc = accept_rejection(tree, logits, SamplingParams(temperature=1.0), gen)
        assert acc.tokens == [2, 4, 1, 3]


def test_top_k_top_p_filtering() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = torch.isfinite(processed_logits(logits, SamplingParams(temperature=1.0, top_k=2)))
    assert kept.tolist() == [[True, True, False, False, False]]
    probs = torch.softmax(logits, -1)[0]
    p = float(probs[0] + probs[1]) - 1e-4
    kept = torch.isfinite(processed_logits(logits, SamplingParams(temperature=1.0, top_p=p)))
    assert kept.tolist() == [[True, True, False, False, False]]


def test_min_p_drops_what_transformers_drops() -> None:
    """min-p keeps the tokens at least ``min_p`` times as likely as the most likely one,
    after temperature and top-k, as transformers' warpers do (and at least that token)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

    logits = _logits(16, 50, seed=5) * 2
    for min_p in (0.01, 0.1, 0.5, 1.0):
        ours = torch.isfinite(processed_logits(logits, SamplingParams(temperature=0.7, top_k=20, min_p=min_p)))
        theirs = logits.clone()
        for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), MinPLogitsWarper(min_p)):
            theirs = warper(None, theirs)
        assert torch.equal(ours, torch.isfinite(theirs)), min_p
        assert ours.sum(-1).min() >= 1
    assert torch.isfinite(processed_logits(logits, SamplingParams(temperature=0.7, min_p=0.0))).all()


def test_coupled_acceptance_is_a_function_of_position_only() -> None:
    tree, logits = _tree_and_logits()
    params = SamplingParams(temperature=1.0, seed=3, mode=SamplingMode.COUPLED)
    a = accept_coupled(tree, logits, params, sequence=0, root_position=10)
    b = accept_coupled(tree, logits, params, sequence=0, root_position=10)
    assert a == b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_coupled_sampling_equals_seeded_plain_decoding(dtype: torch.dtype) -> None:
    model = tiny_model("llama", seed=4)
    target = TargetModel(clone(model, dtype))
    prompts = random_prompts((9, 33), seed=8)
    sp = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.02, seed=123, mode=SamplingMode.COUPLED)
    params = GenerationParams(max_new_tokens=30, sampling=sp)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    for drafter in (PromptLookupDrafter(), RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.8)):
        spec = Engine(target, drafter, TreeBudget(16, 6)).generate(prompts, params)
        assert [r.token_ids for r in spec] == plain
    other = GenerationParams(max_new_tokens=30, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=124, mode=SamplingMode.COUPLED))
    assert [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, other)] != plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logprobs_equal_plain_decoding_and_the_model(dtype: torch.dtype) -> None:
    """Each generated token's log probability and top alternatives: the same bits under
    speculation, alone or in a batch, as in plain decoding; one per token even when EOS or
    the length cut a step's accepted path; and (float32) the model's own log-softmax."""
    model = tiny_model("llama", seed=4)
    target = TargetModel(clone(model, dtype))
    prompts = random_prompts((9, 33), seed=8)
    greedy = GenerationParams(max_new_tokens=20, logprobs=3)
    plain = Engine(target, NoDrafter()).generate(prompts, greedy)
    eos = plain[0].token_ids[7]  # ends the first answer early, in the middle of a drafted path
    for params in (greedy, GenerationParams(max_new_tokens=20, logprobs=3, eos_token_ids=(eos,)),
                   GenerationParams(max_new_tokens=20, logprobs=0,
                                    sampling=SamplingParams(temperature=1.0, seed=5))):
        ref = Engine(target, NoDrafter()).generate(prompts, params)
        drafter = RandomTreeDrafter([r.token_ids for r in ref], [len(p) for p in prompts], hit=0.8)
        for batch in (1, 2):
            spec = Engine(target, drafter, TreeBudget(16, 6)).generate(prompts, params, batch_size=batch)
            assert any(n > 1 for r in spec for n in r.accept_lengths), "speculation should accept drafts"
            for s, r in zip(spec, ref):
                assert s.token_ids == r.token_ids and s.logprobs == r.logprobs
                assert [lp.token for lp in s.logprobs] == s.token_ids
                assert all(len(lp.top) == params.logprobs for lp in s.logprobs)
    if dtype == torch.float32:
        first = plain[0]
        ids = torch.tensor([prompts[0] + first.token_ids])
        with torch.no_grad():
            expect = torch.log_softmax(model(ids).logits[0, len(prompts[0]) - 1:-1].float(), -1)
        got = torch.tensor([lp.logprob for lp in first.logprobs])
        assert torch.allclose(got, expect[torch.arange(len(got)), torch.tensor(first.token_ids)], atol=1e-4)
        best = first.logprobs[0].top
        assert [t for t, _ in best] == expect[0].topk(3).indices.tolist() and best[0][1] >= best[1][1] >= best[2][1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_logprobs_equal_the_logprobs_decoding_gave(dtype: torch.dtype) -> None:
    """A prompt's log probabilities are those decoding assigned the same tokens, bit for bit:
    read an answer back as a prompt (whole, in parts under a prompt budget, beside a prefix
    cache that holds it) and its tokens get the figures they were generated with."""
    from sot.prefix_cache import PrefixCache

    model = tiny_model("llama", seed=4)
    target = TargetModel(clone(model, dtype))
    prompt = random_prompts((9,), seed=8)[0]
    answer = Engine(target, NoDrafter()).generate([prompt], GenerationParams(max_new_tokens=150, logprobs=2))[0]
    again = prompt + answer.token_ids[:-1]
    ask = GenerationParams(max_new_tokens=1, prompt_logprobs=2, logprobs=2)
    engines = [Engine(target, NoDrafter()), Engine(target, NoDrafter(), prefix_cache=PrefixCache(64 << 20))]
    engines[1].generate([again], GenerationParams(max_new_tokens=1))  # the cache now holds the whole prompt
    for engine in engines:
        res = engine.generate([again], ask)[0]
        assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(again)
        assert res.prompt_logprobs[len(prompt):] == answer.logprobs[:-1]
        assert res.logprobs == answer.logprobs[-1:] and res.cached_tokens == 0
    # in parts: a long prompt arrives while another sequence decodes, under a budget of 40 a step
    budget = Engine(target, NoDrafter(), prompt_budget=40)
    budget.add_request(prompt, GenerationParams(max_new_tokens=30))
    rid = budget.add_request(again, ask)
    done = []
    while budget.has_unfinished():
        done += [e.result for e in budget.step() if e.request_id == rid and e.finished]
    assert done[0].prompt_logprobs[len(prompt):] == answer.logprobs[:-1]


@pytest.mark.parametrize("drafter_kind,mode", [("oracle", SamplingMode.REJECTION), ("state", SamplingMode.REJECTION),
                                               ("suffix", SamplingMode.REJECTION), ("oracle", SamplingMode.COUPLED),
                                               ("suffix", SamplingMode.COUPLED)])
def test_engine_sampling_distribution(drafter_kind: str, mode: SamplingMode) -> None:
    """Through the whole engine, in both sampling modes: the second generated token under
    tree speculation follows the target's exact marginal ``sum_t1 p(t1) p(t2 | t1)``
    (chi-square, small vocabulary).
    ``oracle`` drafts 3 likely children; ``state`` is the state drafter (untrained predictor);
    ``suffix`` drafts from a store of likely answers, which grows with every sample."""
    from helpers import VOCAB
    from sot.drafters.state import StateDrafter, new_predictor

    model = tiny_model("llama", seed=6)
    with torch.no_grad():  # peakier, so drafts are accepted often
        model.lm_head.weight.mul_(4.0)
    layers = (0, 1, 2) if drafter_kind == "state" else ()
    target = TargetModel(clone(model, torch.float32), state_layers=layers)
    prompt = random_prompts((10,), seed=1)[0]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        both = torch.tensor([prompt + [t] for t in range(VOCAB)])
        p2 = torch.softmax(model(both).logits[:, -1].double(), -1)  # [V(t1), V(t2)]
    marginal = (p1[:, None] * p2).sum(0).numpy()
    top3 = p2.topk(3, dim=-1).indices.tolist()  # an oracle drafter: 3 likely children

    class Oracle(NoDrafter):
        def propose(self, inputs, budget):
            return [tree_from_parents([x.context[-1], *top3[x.context[-1]]], [-1, 0, 0, 0]) for x in inputs]

    if drafter_kind == "oracle":
        drafter = Oracle()
    elif drafter_kind == "state":
        drafter = StateDrafter(new_predictor(target.model, layers, None, seed=3), top_k=4)
    else:
        drafter = SuffixDrafter()
        for a in p1.topk(3).indices.tolist():
            drafter.remember(prompt, [a, top3[a][0], top3[a][1]])
    counts = np.zeros(VOCAB)
    accepted = 0
    trials = 2000 if drafter_kind == "state" else 1200
    # (the tiny model's verify pass costs about what a predictor pass does, so the default
    # policy would rightly stop drafting; threshold 0 keeps the drafts coming)
    engine = Engine(target, drafter, TreeBudget(8, 3), policy=PolicyConfig(fallback_threshold=0))
    # a fixed cost curve with nearly free rows: the policy prunes by it, and one measured on a
    # busy machine (kept for later runs) pruned enough suffix drafts to fail the count below
    engine.cost_model = lambda: CostModel([1, 16], [0.010, 0.011])
    for seed in range(trials):
        sp = SamplingParams(temperature=1.0, seed=seed, mode=mode)
        res = engine.generate([prompt], GenerationParams(max_new_tokens=3, sampling=sp))[0]
        counts[res.token_ids[1]] += 1
        accepted += res.accept_lengths[0] > 1 if res.accept_lengths else 0
    assert accepted > (5 if drafter_kind == "state" else trials // 20), "drafts should be accepted now and then"
    expected = marginal * trials
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    assert chisquare(obs, exp).pvalue > 1e-3


def test_draw_is_exact_and_skips_zero_weights(monkeypatch) -> None:
    """``draw`` samples an index in proportion to unnormalised weights (chi-square), never one
    of zero weight, and a uniform number that rounds up to the total picks the last index that
    has weight."""
    from sot.sampling import draw

    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 2.0, 0.0, 0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    counts = np.bincount([draw(weights, gen) for _ in range(6000)], minlength=weights.numel())
    assert counts[weights.numpy() == 0].sum() == 0
    keep = weights.numpy() > 0
    expected = weights.numpy()[keep] / weights.sum().item() * counts.sum()
    assert chisquare(counts[keep], expected).pvalue > 1e-3
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert draw(weights, gen) == 5


@pytest.mark.parametrize("mode", [SamplingMode.COUPLED, SamplingMode.REJECTION])
def test_extreme_settings_sample_without_failing_the_batch(mode: SamplingMode) -> None:
    """Settings at float32's edge (a temperature that overflows the scaled logits, a top_p that
    rounds to 0, a repetition penalty that overflows them) draw tokens, the same drafted and
    plain, instead of a NaN distribution that failed every sequence of the step; a temperature
    below GREEDY_BELOW decodes greedily."""
    from sot.sampling import GREEDY_BELOW

    target = TargetModel(tiny_model("llama", seed=2))
    prompts = random_prompts((6, 30), seed=5)
    greedy = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, GenerationParams(max_new_tokens=12))]
    for settings in ({"temperature": 1e-50}, {"temperature": GREEDY_BELOW / 2}, {"temperature": 1.0, "top_p": 1e-46},
                     {"temperature": 1.0, "repetition_penalty": 1e-50}):
        params = GenerationParams(max_new_tokens=12, sampling=SamplingParams(seed=3, mode=mode, **settings))
        plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
        drafted = Engine(target, PromptLookupDrafter(), TreeBudget(16, 6)).generate(prompts, params)
        assert all(len(p) == 12 for p in plain), settings
        if mode is SamplingMode.COUPLED:
            assert [r.token_ids for r in drafted] == plain, settings
        if "top_p" in settings or settings["temperature"] < GREEDY_BELOW:
            assert plain == greedy, settings  # (one token left, or argmax)


def test_the_compiled_row_argmax_is_torchs() -> None:
    """Greedy decoding's argmax (``row_argmax_f32``): torch.argmax's index on every row
    without NaNs (ties to the first, infinities, signed zeros, all -inf, short and odd
    vocabularies), and the first NaN of a row that has some."""
    from sot.kernels import cpu_kernels
    from sot.sampling import row_argmax

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("SoT's CPU kernels are not built here (row_argmax is torch.argmax)")
    gen = torch.Generator().manual_seed(0)
    for trial in range(400):
        rows = int(torch.randint(1, 12, (1,), generator=gen))
        vocab = 49152 if trial % 10 == 0 else int(torch.randint(1, 70, (1,), generator=gen))
        x = (torch.randint(-3, 4, (rows, vocab), generator=gen).float() if trial % 2  # many ties
             else torch.randn(rows, vocab, generator=gen))
        if trial % 3 == 0:
            x[torch.rand(rows, vocab, generator=gen) < 0.1] = float("inf")
        if trial % 7 == 0:
            x[0] = float("-inf")
        x[x == 0] = -0.0 if trial % 4 == 0 else 0.0
        assert torch.equal(kernels.row_argmax_f32(x), x.argmax(-1)), trial
        assert torch.equal(row_argmax(x), x.argmax(-1)), trial
        nan = torch.rand(rows, vocab, generator=gen) < 0.05
        x[nan] = float("nan")
        first = [int(r.nonzero()[0]) if r.any() else int(v.argmax()) for r, v in zip(nan, x)]
        assert kernels.row_argmax_f32(x).tolist() == first, trial
    logits = torch.randn(2, 3, 50, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    # any leading shape; bfloat16 compared in float32
    assert torch.equal(row_argmax(logits), logits.float().argmax(-1))


def test_the_compiled_top_log_softmax_is_torchs() -> None:
    """A draft node's children (``top_log_softmax``, ``row_top_logsoftmax_f32``): the same
    values as ``log_softmax`` then ``topk`` (to 1e-5) and the same indices, largest first,
    over short, odd and draft-sized vocabularies with -inf entries (forbidden tokens) and k
    from 1 to the whole row; ties go to the lower index, and a row with a NaN gives NaNs."""
    from sot.kernels import cpu_kernels
    from sot.sampling import TOP_KERNEL_MAX_K, top_log_softmax

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("SoT's CPU kernels are not built here (top_log_softmax is torch's topk)")
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        rows = int(torch.randint(1, 12, (1,), generator=gen))
        vocab = 16384 if trial % 10 == 0 else int(torch.randint(1, 70, (1,), generator=gen))
        k = min(vocab, int(torch.randint(1, 12, (1,), generator=gen)) if trial % 5 else vocab, TOP_KERNEL_MAX_K)
        x = 4 * torch.randn(rows, vocab, generator=gen)
        if trial % 3 == 0:
            x[torch.rand(rows, vocab, generator=gen) < 0.3] = float("-inf")
            x[:, 0] = 0.0  # (a row keeps a finite value)
        want_val, want_idx = torch.log_softmax(x, dim=-1).topk(k, dim=-1)
        finite = torch.isfinite(want_val)  # (past a row's finite values, any -inf entry is right)
        for val, idx in (kernels.row_top_logsoftmax_f32(x, k), top_log_softmax(x, k)):
            assert torch.equal(idx[finite], want_idx[finite]), trial
            assert torch.equal(torch.isfinite(val), finite), trial
            assert torch.allclose(val[finite], want_val[finite], atol=1e-5, rtol=0), trial
            assert all(len(set(r)) == k for r in idx.tolist()), trial
            assert torch.isinf(x.gather(1, idx)[~finite]).all(), trial
    ties = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 1.0, 0.0, 2.0, 1.0] * 3])
    assert kernels.row_top_logsoftmax_f32(ties, 6)[1].tolist() == [[1, 3, 4, 7, 10, 12]]
    nan = torch.randn(2, 40, generator=gen)
    nan[1, 17] = float("nan")
    val, _ = kernels.row_top_logsoftmax_f32(nan, 3)
    assert torch.isfinite(val[0]).all() and torch.isnan(val[1]).all()
    # a k past the kernel's takes torch's path, with the same answer
    wide = torch.randn(3, 200, generator=gen)
    val, idx = top_log_softmax(wide, TOP_KERNEL_MAX_K + 8)
    want_val, want_idx = torch.log_softmax(wide, dim=-1).topk(TOP_KERNEL_MAX_K + 8, dim=-1)
    assert torch.equal(idx, want_idx) and torch.allclose(val, want_val, atol=1e-5)
