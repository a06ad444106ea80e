"""The state predictor and its drafter: files, growth, batching, lookup, losslessness."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from helpers import clone, random_prompts, tiny_model, tiny_model_dir
from state_helpers import LAYERS, ROOT, chain_inputs, two_layer_predictor
from sot.drafters import NoDrafter, TreeBudget, make_drafter
from sot.drafters.state import (
    StateDrafter,
    check_compatible,
    load_predictor,
    new_predictor,
    read_predictor_config,
    save_predictor,
)
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError, DrafterCompatibilityError
from sot.sampling import SamplingMode
from sot.models.adapter import TargetModel
from sot.models.loading import load_model


def test_a_grown_predictor_drafts_what_the_file_did() -> None:
    """A one-layer predictor's weights in a two-layer predictor (second layer fresh, the
    identity) give the same predictions bit for bit, and the same trees."""
    from sot.drafters.base import DraftInput

    model = tiny_model("llama", seed=4)
    one = new_predictor(model, LAYERS, None, seed=2)
    two = new_predictor(model, LAYERS, None, seed=7, decoder_layers=2)
    missing, unexpected = two.load_state_dict(one.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("upper.0.") for k in missing)
    states = torch.randn(2, 14, len(LAYERS), 64, generator=torch.Generator().manual_seed(0))
    toks = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for a, b in zip(one.forward_unrolled(states, toks, 3), two.forward_unrolled(states, toks, 3)):
            assert torch.equal(a, b)
    (ctx, st), = chain_inputs(model, one, [15], seed=3)
    trees = []
    for pred in (one, two):
        drafter = StateDrafter(pred, top_k=3, lookup=False)
        drafter.reset(1)
        trees.append(drafter.propose([DraftInput(0, ctx, st)], TreeBudget(10, 4))[0])
    assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents
    assert trees[0].draft_probs == trees[1].draft_probs


def test_mismatched_target_is_refused(tiny_run, tmp_path) -> None:
    other = tiny_model("llama", seed=5)  # same shapes, different weights
    with pytest.raises(DrafterCompatibilityError, match=r"trained for another target.*embed_hash.*\(--model\)"):
        load_predictor(tiny_run["predictor"], other)
    run_folder = tiny_run["predictor"].parent  # (a training run's folder, not its predictor file)
    with pytest.raises(DrafterCompatibilityError, match="training run's folder; give its predictor file"):
        load_predictor(run_folder, other)
    from sot.drafters import make_drafter

    with pytest.raises(DrafterCompatibilityError, match="no state predictor fits this model: the one shipped"):
        make_drafter("state", other)  # (no file named: the shipped one's model is said, not its path)
    gpt2 = tiny_model("gpt2")
    with pytest.raises(DrafterCompatibilityError, match="architecture"):
        check_compatible(read_predictor_config(tiny_run["predictor"]), gpt2)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(DrafterCompatibilityError):
        read_predictor_config(junk)
    from safetensors.torch import save_file

    newer = json.loads(read_predictor_config(tiny_run["predictor"]).to_json()) | {"layer_kind": "moe"}
    save_file({"x": torch.zeros(1)}, str(tmp_path / "newer.safetensors"), metadata={"sot_config": json.dumps(newer)})
    with pytest.raises(DrafterCompatibilityError, match="not understood by this SoT version"):
        read_predictor_config(tmp_path / "newer.safetensors")
    other_dir = tiny_model_dir(tmp_path / "other", arch="qwen2")
    proc = subprocess.run(
        [sys.executable, "-m", "sot.cli", "generate", "hello", "--model", str(other_dir), "--drafter", "state",
         "--predictor", str(tiny_run["predictor"]), "--max-new-tokens", "4"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "trained for another target" in proc.stderr and "Traceback" not in proc.stderr


def test_trained_drafter_is_lossless_and_accepts(tiny_run) -> None:
    loaded = load_model(str(tiny_run["model_dir"]))
    target = TargetModel(loaded.model, state_layers=LAYERS)
    tok = loaded.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"say {w} please"}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for w in ("red", "blue", "cyan")]
    params = GenerationParams(max_new_tokens=40)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    drafter = make_drafter("state", loaded.model, tiny_run["predictor"], top_k=4)
    res = Engine(target, drafter, TreeBudget(12, 6)).generate(prompts, params)
    assert [r.token_ids for r in res] == plain
    assert sum(sum(r.accept_lengths) - r.steps for r in res) > 0, "some drafted tokens should be accepted"


def test_coupled_draws_are_drafted_by_their_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A coupled-sampled sequence's drafts are the tokens its draw gives under the predictor's
    distribution: at tree depth d, ``argmax(log_softmax(processed(q)) + g)`` over the draft
    vocabulary, ``g`` the noise of position root + d, down to the depth whose noise the store
    keeps; with ``follow_draws`` off, the predictor's likeliest tokens. Either way the sampled
    output is plain decoding's."""
    from sot.drafters import DraftInput
    import sot.sampling as sampling_module
    from sot.sampling import CoupledDraw, SamplingParams, gumbel_noise, processed_logits

    model = tiny_model("llama", seed=4)
    vocab = model.config.vocab_size
    draft_vocab = torch.arange(3, vocab, 2)  # (a part of the vocabulary: ids map back)
    pred = new_predictor(model, LAYERS, draft_vocab, seed=2)
    sampling = SamplingParams(temperature=0.6, top_k=6, seed=11)
    (ctx, st), = chain_inputs(model, pred, [15], seed=3)
    root = len(ctx) - 1

    def chain(follow: bool, draw_depth: int = 2) -> list[int]:
        drafter = StateDrafter(pred, top_k=1, lookup=False, min_confidence=0.0)
        drafter.follow_draws, drafter.record_states = follow, True
        drafter.reset(1)
        source = DraftInput(0, ctx, st, index=5, draw=CoupledDraw.of(sampling, 5, vocab))
        tree = drafter.propose([source], TreeBudget(3, 2))[0]
        assert tree.size == 3 and tree.parents == [-1, 0, 1]
        states = drafter.predicted_states(0)
        with torch.no_grad():  # the predictor's logits after the root and after the first token
            rows = [pred._linear("head", states[path]) for path in ((), (tree.tokens[1],))]
        for depth, row in enumerate(rows, start=1):
            own = torch.log_softmax(row.float(), -1)[None]
            scores = torch.log_softmax(processed_logits(own, sampling).double(), -1)
            if follow and depth <= draw_depth:
                scores = scores + gumbel_noise(sampling.seed, 5, root + depth, vocab)[draft_vocab]
            assert tree.tokens[depth] == int(draft_vocab[int(scores.argmax())]), (follow, depth)
            if follow and depth == 1:  # its confidence: the draw's chance under Gumbel errors of scale 1 / T
                weight = torch.softmax(scores * sampling.temperature, -1).max().item()
                assert tree.draft_probs[1] == pytest.approx(weight, rel=1e-4)
        return tree.tokens

    assert chain(True) != chain(False)
    # a store that keeps two positions' noise: the draw is drafted one deep (the verify walk
    # reads one position past it), the predictor's distribution below
    monkeypatch.setattr(sampling_module._noise_cache, "max_bytes", 2 * 8 * vocab)
    chain(True, draw_depth=1)
    monkeypatch.undo()
    assert CoupledDraw.of(SamplingParams(), 5, vocab) is None  # greedy
    assert CoupledDraw.of(dataclasses.replace(sampling, mode=SamplingMode.REJECTION), 5, vocab) is None

    target = TargetModel(model, state_layers=LAYERS)
    prompts = random_prompts((9, 40), seed=3)
    params = GenerationParams(max_new_tokens=30, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=3))
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    for batch in (1, 3):
        drafter = StateDrafter(new_predictor(model, LAYERS, draft_vocab, seed=1), top_k=3)
        out = Engine(target, drafter, TreeBudget(16, 6)).generate(prompts, params, batch_size=batch)
        assert [r.token_ids for r in out] == plain


@pytest.mark.parametrize("rules", [dict(frequency_penalty=0.7), dict(repetition_penalty=1.4, presence_penalty=0.3),
                                   dict(logit_bias=((5, 2.5), (9, -1.0)), frequency_penalty=0.2)],
                         ids=["frequency", "repetition-presence", "bias"])
def test_draft_rows_follow_the_requests_rules_as_the_target_does(rules: dict) -> None:
    """A draft row, for a node deep in a tree, gets the penalties and bias the verify pass
    gives the target's row at that node (:class:`AdjustedRows`), bit for bit; and under the
    rules speculative output stays plain decoding's, following them or not."""
    from sot.drafters import DraftInput, DraftRules
    from sot.drafters.state.drafter import _Growth, _SeqState
    from sot.logit_rules import AdjustedRows
    from sot.requests import LiveRequest, SequenceResult
    from sot.sampling import SamplingParams
    from sot.tree import tree_from_parents

    model = tiny_model("llama")
    drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3)  # whole vocabulary
    params = GenerationParams(max_new_tokens=30, sampling=SamplingParams(**rules))
    prompt, answer = [3, 5, 7, 5, 11], [9, 9, 13, 5]
    source = DraftInput(0, prompt + answer, rules=DraftRules.of(params.sampling, len(prompt)))
    growth = _Growth(_SeqState(), answer[-1], len(prompt + answer) - 1, source)
    growth.tok, growth.par = [9, 21, 5], [-1, 0, 1]  # a path below the root: 9, then 21, then 5
    logits = torch.randn(4, model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    drafted = drafter._with_rules(logits, [(growth, -1), (growth, 0), (growth, 1), (growth, 2)], {})
    seq = LiveRequest(id=0, prompt=prompt, params=params, generator=None, arrived=0.0,
                      result=SequenceResult(index=0, token_ids=list(answer), prompt_tokens=len(prompt)))
    tree = tree_from_parents([answer[-1], 9, 21, 5], [-1, 0, 1, 2])
    verified = AdjustedRows(logits, tree, seq)
    for node in range(4):
        assert torch.equal(drafted[node], verified[node:node + 1][0]), node
    assert drafter._with_rules(logits, [(growth, 2)], None) is logits  # (no growth with rules: untouched)

    target = TargetModel(model, state_layers=LAYERS)
    prompts = random_prompts((9, 40), seed=3)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    for follow in (True, False):
        drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3)
        drafter.follow_rules = follow
        assert [r.token_ids for r in Engine(target, drafter, TreeBudget(16, 6)).generate(prompts, params)] == plain


def test_children_are_the_top_of_the_whole_log_softmax() -> None:
    """The children a node gets (:meth:`StateDrafter._child_top`: its best logits less the
    row's log-sum-exp) are the top of the whole log-softmax, with and without request rules:
    the same draft ids and log-probabilities to float rounding, best first."""
    from sot.drafters import DraftInput, DraftRules
    from sot.drafters.state.drafter import _Growth, _SeqState
    from sot.sampling import SamplingParams

    model = tiny_model("llama")
    drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3)
    logits = 4 * torch.randn(5, model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    rules = DraftRules.of(SamplingParams(frequency_penalty=0.5, repetition_penalty=1.3), 3)
    for source in (DraftInput(0, [3, 5, 7, 9]), DraftInput(0, [3, 5, 7, 9, 7], rules=rules)):
        growth = _Growth(_SeqState(), 9, 3, source)
        growth.tok, growth.par = [7, 11], [-1, 0]
        rows = [(growth, -1), (growth, 0), (growth, 1), (growth, -1), (growth, 1)]
        bases = {} if source.rules is not None else None
        want_val, want_idx = drafter._child_logp(logits, rows, bases, 1, 0).topk(4, dim=-1)
        val, idx = drafter._child_top(logits, rows, {} if bases is not None else None, 1, 0, 4)
        assert torch.equal(idx, want_idx)
        torch.testing.assert_close(val, want_val, rtol=0, atol=1e-5)
        assert bool((val[:, :-1] >= val[:, 1:]).all()) and bool((val <= 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma", "gemma3"])
def test_untrained_state_drafter_is_lossless(arch: str, dtype: torch.dtype) -> None:
    """The core losslessness matrix, with the state drafter: batches of mixed prompt lengths."""
    model = clone(tiny_model(arch), dtype)
    target = TargetModel(model, state_layers=LAYERS)
    prompts = random_prompts((7, 30, 75), seed=2)
    params = GenerationParams(max_new_tokens=30)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3)
    batch = [r.token_ids for r in Engine(target, drafter, TreeBudget(16, 6)).generate(prompts, params)]
    assert batch == plain
    if arch == "llama":  # a two-layer predictor through the same engine
        two = StateDrafter(two_layer_predictor(model, seed=1), top_k=3)
        assert [r.token_ids for r in Engine(target, two, TreeBudget(16, 6)).generate(prompts, params)] == plain
    if arch == "gemma3":  # the EAGLE-3 layout on a target with sliding layers and (1 + w) norms
        e3 = StateDrafter(new_predictor(model, LAYERS, None, seed=1, arch="eagle3"), top_k=3)
        assert [r.token_ids for r in Engine(target, e3, TreeBudget(16, 6)).generate(prompts, params)] == plain
    alone = [Engine(target, drafter, TreeBudget(16, 6)).generate([p], params)[0].token_ids for p in prompts]
    assert alone == plain


def _predictor(model, decoder_layers: int, arch: str = "native"):
    if arch == "eagle3":
        return new_predictor(model, LAYERS, None, seed=2, arch="eagle3")
    return new_predictor(model, LAYERS, None, seed=2) if decoder_layers == 1 else two_layer_predictor(model, 2)


@pytest.mark.parametrize("decoder_layers,window,arch", [(1, 0, "native"), (2, 0, "native"), (1, 5, "native"),
                                                       (2, 5, "native"), (1, 0, "eagle3"), (1, 5, "eagle3")])
def test_drafted_chain_matches_the_training_unroll(decoder_layers: int, window: int, arch: str) -> None:
    """A top-1 chain drafted at inference follows the training unroll step for step: the depth
    ``d`` node's prediction is ``forward_unrolled`` step ``d`` at its row (with one decoder
    layer, and with two, each attending to its own cache; and with a sliding window, which
    the predictor takes from the target's last layer). The products are float32's here;
    drafting's default 8-bit integer products are held to them in
    ``test_int8_products_are_float32s_to_a_percent``."""
    import copy

    from sot.drafters.base import DraftInput

    model = tiny_model("mistral", seed=4, sliding_window=window) if window else tiny_model("llama", seed=4)
    pred = _predictor(model, decoder_layers, arch)
    assert pred.config.window == window
    exact = copy.deepcopy(pred)
    exact.int8_products = False
    drafter = StateDrafter(exact, top_k=1, lookup=False, min_confidence=0.0)
    (ctx, states), = chain_inputs(model, pred, [12], seed=0)
    drafter.reset(1)
    depth = 4
    tree = drafter.propose([DraftInput(0, ctx, states)], TreeBudget(1 + depth, depth))[0]
    assert tree.tokens[0] == ctx[-1] and tree.depths == list(range(depth + 1)), "top-1 gives a chain"
    n = states.shape[0]
    # rows 0..n-1 are real; rows n..n+depth-2 are the chain's; row t's next token is x_{t+1}
    tokens = ctx[1:] + tree.tokens[1:depth]
    full = torch.cat([states, torch.zeros(depth - 1, *states.shape[1:])]).unsqueeze(0)
    with torch.no_grad():
        outs = pred.forward_unrolled(full, torch.tensor([tokens]), depth)
        cum = 0.0
        for d in range(1, depth + 1):
            logp = torch.log_softmax(pred.logits(outs[d - 1][0, n - 2 + d]).float(), dim=-1)
            assert int(logp.argmax()) == tree.tokens[d]
            cum += float(logp.max())
            assert tree.draft_probs[d] == pytest.approx(math.exp(cum), rel=1e-4)


@pytest.mark.parametrize("arch", ["native", "eagle3"])
def test_int8_products_are_float32s_to_a_percent(arch: str) -> None:
    """A float32 predictor packed for drafting multiplies in 8-bit integers (each input row
    rounded to 8-bit blocks, the weights to Q8_0): every product, the head included, is
    float32's to about a percent of its outputs' scale, and each row's result is the same
    whatever rows share the call. In bfloat16 the products stay bfloat16's."""
    import copy

    from sot.kernels.linear import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels are not built on this machine")
    model = tiny_model("llama", seed=4)
    pred = _predictor(model, 1, arch).float()
    exact = copy.deepcopy(pred)
    exact.int8_products = False
    half = copy.deepcopy(pred).cast_for_inference(torch.bfloat16)
    for p in (pred, exact, half):
        p.pack_for_inference()
    packed = pred.__dict__["_packed"]
    assert packed and all(lin.int8 for lin in packed.values())
    assert not any(lin.int8 for lin in exact.__dict__["_packed"].values())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, lin in packed.items():
            x = torch.randn(5, lin.weight.shape[1], generator=gen)
            got, want = pred._linear(name, x), exact._linear(name, x)
            assert (got - want).abs().max() <= 0.02 * want.abs().max(), name
            alone = torch.cat([pred._linear(name, x[i : i + 1]) for i in range(5)])
            assert torch.equal(alone, got), f"{name}: a row's result depends on the rows beside it"
    assert not any(lin.int8 for lin in half.__dict__["_packed"].values())


@pytest.mark.parametrize("decoder_layers,arch", [(1, "native"), (2, "native"), (1, "eagle3")])
def test_batched_drafting_equals_drafting_alone(decoder_layers: int, arch: str) -> None:
    """Sequences drafted together (one predictor pass per depth) get the trees they get alone,
    across several steps, with states arriving in chunks of different sizes. (Without the
    free drafts: their match rates are learned over all of a drafter's sequences, so by
    design a sequence's lookup confidences depend on what the others measured.)"""
    from sot.drafters.base import DraftInput

    model = tiny_model("llama", seed=4)
    pred = _predictor(model, decoder_layers, arch)
    seqs = chain_inputs(model, pred, [9, 17, 30], seed=1)
    budget = TreeBudget(10, 5)
    together = StateDrafter(pred, top_k=3, lookup=False)
    together.reset(3)
    alone = [StateDrafter(pred, top_k=3, lookup=False) for _ in seqs]
    for a in alone:
        a.reset(1)
    cuts = [(0, 5), (5, 6), (6, 9)]  # rows absorbed before each of three steps
    for lo, hi in cuts:
        inputs = [DraftInput(b, ctx[: hi + 1], states[lo:hi]) for b, (ctx, states) in enumerate(seqs)]
        batch = together.propose(inputs, budget)
        for b, x in enumerate(inputs):
            one = alone[b].propose([DraftInput(0, x.context, x.states)], budget)[0]
            assert batch[b].tokens == one.tokens and batch[b].parents == one.parents
            assert batch[b].draft_probs == pytest.approx(one.draft_probs, rel=1e-4)


def test_budget_floor_limits_growth_and_passes_are_counted() -> None:
    """``TreeBudget.min_confidence`` overrides the drafter's floor (a floor above every
    confidence stops growth after the root's children), and ``passes`` counts the predictor
    passes, which the engine reports to the policy."""
    from sot.drafters.base import DraftInput
    from sot.policy import PolicyConfig

    model = tiny_model("llama", seed=4)
    pred = new_predictor(model, LAYERS, None, seed=2)
    (ctx, states), = chain_inputs(model, pred, [12], seed=0)
    drafter = StateDrafter(pred, top_k=2, lookup=False, min_confidence=0.0)
    drafter.reset(1)
    before = drafter.passes
    deep = drafter.propose([DraftInput(0, ctx, states)], TreeBudget(16, 5))[0]
    assert deep.max_depth == 5
    assert drafter.passes - before == 1 + 1 + 4, "absorb, the root's logits, then one pass per depth 2..5"
    drafter.reset(1)
    shallow = drafter.propose([DraftInput(0, ctx, states)], TreeBudget(16, 5, min_confidence=1.0))[0]
    assert shallow.max_depth == 1 and shallow.size == 3
    target = TargetModel(clone(model, torch.float32), state_layers=LAYERS)
    engine = Engine(target, StateDrafter(pred, top_k=2), TreeBudget(8, 4), policy=PolicyConfig())
    engine.generate(random_prompts((9,), seed=1), GenerationParams(max_new_tokens=12))
    assert engine._policy.pass_seconds and all(t > 0 for t in engine._policy.pass_seconds)


def test_lookup_rate_learns_from_committed_tokens_and_free_drafts_use_it() -> None:
    """The match rate of the prompt-lookup path is measured from what was committed after it
    (a path the policy pruned counts too); the free drafts are chains with confidence
    ``rate ** depth``."""
    from sot.drafters.base import DraftInput
    from sot.drafters.pld import LookupRate

    rate = LookupRate(decay=1.0)
    assert rate.rate == 0.5
    rate.proposed([1, 2, 3], [4, 5, 6])
    rate.update([1, 2, 3, 4, 5, 9])  # two matched, the third did not
    assert (rate.hits, rate.tries) == (2, 3)
    rate.update([1, 2, 3, 4, 5, 9, 7])  # nothing recorded since: no change
    assert (rate.hits, rate.tries) == (2, 3)
    rate.proposed([1, 2], [3, 4, 5])
    rate.update([1, 2, 3])  # only one token committed: one try, one hit
    assert (rate.hits, rate.tries) == (3, 4)
    assert rate.rate == pytest.approx(3.5 / 5)
    chain = rate.chain(7, [8, 9])
    assert chain.tokens == [7, 8, 9] and chain.parents == [-1, 0, 1]
    assert chain.draft_probs == pytest.approx([1.0, 0.7, 0.49])

    model = tiny_model("llama", seed=4)
    drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=2), top_k=2)
    drafter.reset(2)
    context = [5, 6, 7, 8, 9, 5, 6]  # "5 6" was followed by "7 8 9" before
    trees = drafter.propose_free([DraftInput(0, context), DraftInput(1, [1, 2, 3])], TreeBudget(4, 8))
    assert trees[0].tokens == [6, 7, 8, 9] and trees[0].draft_probs == pytest.approx([1.0, 0.5, 0.25, 0.125])
    assert trees[1].size == 1, "no match: a root-only tree"
    # the continuation matched twice, then missed: the sequence's rate rises above 1/2
    drafter.propose_free([DraftInput(0, context + [7, 8, 4])], TreeBudget(4, 8))
    assert drafter.free.rates[0].rate > 0.5
    assert StateDrafter(new_predictor(model, LAYERS, None, seed=2), lookup=False).propose_free([], TreeBudget()) is None


def test_one_lookup_search_per_sequence_and_step() -> None:
    """On a drafting step the lookup path found for the free drafts is reused when the drafter
    merges it into its tree (cut to the drafting depth): the n-gram search runs once per
    sequence and step, and the merged tree equals the one a fresh search gives."""
    from sot.drafters.base import DraftInput

    model = tiny_model("llama", seed=4)
    pred = new_predictor(model, LAYERS, None, seed=2)
    (ctx, states), = chain_inputs(model, pred, [12], seed=0)
    ctx = ctx[:6] + ctx[4:9] + ctx[4:6]  # ends with a repeat: "ctx[4] ctx[5]" was followed before
    states = torch.cat([states, states])[: len(ctx) - 1]
    reused, fresh = StateDrafter(pred, top_k=2), StateDrafter(pred, top_k=2)
    calls = []
    for d in (reused, fresh):
        d.reset(1)
    index = reused.free.index(0)  # the sequence's n-gram index, whose searches are counted
    search = index.best
    index.best = lambda context, depth: calls.append(depth) or search(context, depth)
    free = reused.propose_free([DraftInput(0, ctx, states)], TreeBudget(8, 6))[0]
    assert free.size > 1, "the context repeats, so the lookup finds a path"
    budget = TreeBudget(6, 3)  # the policy drafts with a smaller budget than the free drafts'
    a = reused.propose([DraftInput(0, ctx, states)], budget)[0]
    b = fresh.propose([DraftInput(0, ctx, states)], budget)[0]
    assert calls == [6], "one search, at the free drafts' depth"
    assert (a.tokens, a.parents) == (b.tokens, b.parents)
    assert a.draft_probs == pytest.approx(b.draft_probs)
    assert any(a.tokens[i] == free.tokens[1] and a.depths[i] == 1 for i in range(a.size)), "the lookup path is merged"
    # the next step (a longer context) searches again
    reused.propose_free([DraftInput(0, ctx + [free.tokens[1]], None)], TreeBudget(8, 6))
    assert calls == [6, 6]


def test_the_predictor_grows_within_its_limits_and_free_drafts_reach_further() -> None:
    """The predictor's own tree keeps to ``predictor_nodes`` / ``predictor_depth`` (each level
    is a pass), while a lookup path, which costs no pass, is merged in down to ``max_depth``."""
    from sot.drafters.base import DraftInput

    model = tiny_model("llama", seed=4)
    pred = new_predictor(model, LAYERS, None, seed=2)
    (ctx, _), = chain_inputs(model, pred, [30], seed=0)
    ctx = ctx[:30] + ctx[:6]  # ends with "ctx[0..5]", which was followed by 24 more tokens before
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(len(ctx) - 1, len(LAYERS), model.config.hidden_size, generator=gen)
    budget = TreeBudget(max_nodes=32, max_depth=20, predictor_nodes=6, predictor_depth=3)
    alone = StateDrafter(pred, top_k=2, lookup=False)
    alone.reset(1)
    own = alone.propose([DraftInput(0, ctx, states)], budget)[0]
    assert 1 < own.size <= 6 and own.max_depth <= 3
    merged = StateDrafter(pred, top_k=2)
    merged.reset(1)
    tree = merged.propose([DraftInput(0, ctx, states)], budget)[0]
    assert tree.max_depth == 20 and tree.size <= 32, "the lookup path reaches max_depth"
    path, node = [], 0
    while node is not None:  # the deepest chain is the earlier continuation
        kids = [i for i, p in enumerate(tree.parents) if p == node and tree.tokens[i] == ctx[6 + len(path)]]
        node = kids[0] if kids else None
        if node is not None:
            path.append(tree.tokens[node])
    assert path == ctx[6:26]
    # a predictor held to no levels still offers the free drafts
    idle = StateDrafter(pred, top_k=2)
    idle.reset(1)
    chain = idle.propose([DraftInput(0, ctx, states)], dataclasses.replace(budget, predictor_depth=0))[0]
    assert chain.tokens == [ctx[5], *ctx[6:26]] and chain.parents == list(range(-1, 20))
    with pytest.raises(ConfigError, match="predictor_nodes"):
        TreeBudget(predictor_nodes=0).check(64, 256)


def test_checkpoint_round_trip(tiny_run, tmp_path) -> None:
    model = load_model(str(tiny_run["model_dir"])).model
    pred = load_predictor(tiny_run["predictor"], model)
    again = tmp_path / "again.safetensors"
    save_predictor(pred, again)
    back = load_predictor(again, model)
    for (k, a), (_, b) in zip(pred.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    states = torch.randn(1, 12, len(LAYERS), 64)
    toks = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        assert torch.equal(pred.forward_unrolled(states, toks, 2)[1], back.forward_unrolled(states, toks, 2)[1])
    cfg = read_predictor_config(again)
    assert cfg.state_layers == LAYERS and cfg.target["hidden_size"] == 64
    assert cfg.decoder_layers == 1
    two = two_layer_predictor(model, seed=3)
    save_predictor(two, tmp_path / "two.safetensors", dtype=torch.float32)
    back = load_predictor(tmp_path / "two.safetensors", model)
    assert back.config.decoder_layers == 2 and len(back.upper) == 1
    for k, a in two.state_dict().items():
        assert torch.equal(a, back.state_dict()[k]), k


def test_predictor_norm_of_bfloat16_rows_is_the_float32_formula_rounded() -> None:
    """The predictor's RMSNorm on bfloat16 rows (the compiled float32 kernel where it is
    built): the float32 formula over the widened rows, rounded once to bfloat16."""
    from sot.drafters.state.model import RMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(5, 64, generator=gen) * 3).to(torch.bfloat16)
    with torch.no_grad():
        got = norm(x)
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # one rounding of a float32 value that may differ from the formula's in its last bits
    assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=0)
