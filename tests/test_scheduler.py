"""The step-level engine: requests join and leave between steps, each with its own
settings, and a request's output never depends on what else shares its steps."""
from __future__ import annotations

import random

import torch

from helpers import clone, random_prompts, tiny_model
from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget
from sot.drafters.state import StateDrafter, new_predictor
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel
from sot.sampling import SamplingMode, SamplingParams

LAYERS = (0, 1, 2)


def _alone(target, prompt, params) -> list[int]:
    return Engine(target, NoDrafter()).generate([prompt], params)[0].token_ids


def test_requests_arriving_between_steps_equal_decoding_alone() -> None:
    """Requests with their own settings join a running engine at random steps and one is
    aborted; every other request's tokens equal its plain decoding alone."""
    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.bfloat16), state_layers=LAYERS)
    prompts = random_prompts((7, 30, 12, 51, 19, 9), seed=3)
    greedy = GenerationParams(max_new_tokens=20)
    coupled = GenerationParams(max_new_tokens=14, sampling=SamplingParams(
        temperature=0.8, top_p=0.9, seed=11, mode=SamplingMode.COUPLED))
    settings = [greedy, coupled, GenerationParams(max_new_tokens=5), greedy, coupled, greedy]
    expected = [_alone(target, p, s) for p, s in zip(prompts, settings)]
    engine = Engine(target, StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3), TreeBudget(10, 4),
                    max_batch=3)
    rng = random.Random(0)
    pending = list(enumerate(zip(prompts, settings)))
    ids, tokens, finished = {}, {}, {}
    victim = None
    while pending or engine.has_unfinished():
        while pending and rng.random() < 0.5:
            i, (p, s) = pending.pop(0)
            ids[engine.add_request(p, s)] = i
        if victim is None and engine.num_running == 3:
            victim = next(r for r in ids if r not in finished)
            assert engine.abort(victim)
            assert not engine.abort(victim), "an aborted request is gone"
        for ev in engine.step():
            assert engine.num_running <= 3
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finished:
                finished[ev.request_id] = ev.finish_reason
    assert victim is not None
    for r, i in ids.items():
        if r == victim:
            assert r not in finished
            continue
        assert tokens[r] == expected[i], f"request {i} changed with its company"
        assert finished[r] == "length"
    assert not engine.drafter.seqs and not engine.policy.seqs, "nothing is kept of finished requests"
    assert engine.num_running == 0 and engine.num_waiting == 0


def test_finished_sequences_leave_the_verify_pass() -> None:
    """The verify pass holds the live sequences only: after a short request finishes, the
    passes have one sequence fewer."""
    target = TargetModel(clone(tiny_model("llama", seed=2), torch.float32))
    prompts = random_prompts((10, 14), seed=1)
    batches = []
    verify = target.verify

    def counted(cache, ids, pos, layout):
        batches.append(ids.shape[0])
        return verify(cache, ids, pos, layout)

    target.verify = counted
    engine = Engine(target, PromptLookupDrafter(), TreeBudget(6, 4))
    engine.add_request(prompts[0], GenerationParams(max_new_tokens=3))
    engine.add_request(prompts[1], GenerationParams(max_new_tokens=12))
    batches.clear()  # the cost model's passes, timed at the first request
    while engine.has_unfinished():
        engine.step()
    assert batches[0] == 2 and batches[-1] == 1
    assert batches == sorted(batches, reverse=True)


def test_the_cache_grows_with_the_answers() -> None:
    """The cache holds room for the first tokens only and grows while sequences decode; the
    tokens are those of an engine that never had to grow."""
    model = tiny_model("llama", seed=7)
    target = TargetModel(clone(model, torch.bfloat16), state_layers=LAYERS)
    prompts = random_prompts((9, 40, 17), seed=5)
    params = GenerationParams(max_new_tokens=150)
    roomy = Engine(target, PromptLookupDrafter(), TreeBudget(8, 4))
    expected = [r.token_ids for r in roomy.generate(prompts, params)]
    tight = Engine(target, StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3), TreeBudget(8, 4))
    tight.GROW_STEP = 4
    capacities = []
    step = tight._decode_step

    def watched():
        out = step()
        capacities.append(tight._cache.capacity)
        return out

    tight._decode_step = watched
    assert [r.token_ids for r in tight.generate(prompts, params)] == expected
    assert len(set(capacities)) >= 2, "the cache grew during decoding"


def test_a_prompt_budget_reads_long_prompts_over_steps_and_changes_no_token() -> None:
    """With a prompt budget, a long prompt that arrives while another request decodes is read
    a part per step (the running request gets tokens on each of those steps), through the
    prefix cache's rows where it has them; every output equals decoding alone."""
    from sot.prefix_cache import PrefixCache

    model = tiny_model("llama", seed=6)
    target = TargetModel(model, state_layers=LAYERS)
    short, long_, other = random_prompts((9, 300, 140), seed=12)
    shared = long_[:200] + other
    params = {"short": GenerationParams(max_new_tokens=60), "long": GenerationParams(max_new_tokens=16),
              "shared": GenerationParams(max_new_tokens=16)}
    prompts = {"short": short, "long": long_, "shared": shared}
    expected = {name: _alone(target, prompts[name], params[name]) for name in prompts}
    engine = Engine(target, StateDrafter(new_predictor(model, LAYERS, None, seed=2), top_k=2), TreeBudget(8, 4),
                    prefix_cache=PrefixCache(64 << 20), prompt_budget=50)
    read: list[int] = []
    prefill = target.prefill

    def counted(cache, b, ids, start=0, **kw):
        if read:  # (not the cost model's own passes, timed when the first request comes)
            read[-1] += len(ids)
        return prefill(cache, b, ids, start, **kw)

    target.prefill = counted
    try:
        names = {engine.add_request(short, params["short"]): "short"}
        tokens: dict[str, list[int]] = {}
        results = {}
        shared_steps = 0
        while engine.has_unfinished():
            if len(read) == 2:  # the long prompt, then one that starts like it, arrive mid-answer
                names[engine.add_request(long_, params["long"])] = "long"
                names[engine.add_request(shared, params["shared"])] = "shared"
            running = engine.num_running
            read.append(0)
            events = engine.step()
            assert running == 0 or read[-1] <= 50, f"a step read {read[-1]} prompt tokens, past its budget"
            got = {names[ev.request_id] for ev in events}
            shared_steps += read[-1] > 0 and "short" in got and running > 0
            for ev in events:
                tokens.setdefault(names[ev.request_id], []).extend(ev.token_ids)
                if ev.finished:
                    results[names[ev.request_id]] = ev.result
    finally:
        target.prefill = prefill
    assert shared_steps >= 6, "the running request kept decoding while the long prompts were read"
    assert tokens == expected
    assert results["shared"].cached_tokens >= 200  # the long prompt's rows, staged or stored


def test_a_prompt_read_in_part_can_be_aborted() -> None:
    target = TargetModel(tiny_model("llama", seed=6))
    short, long_ = random_prompts((9, 120), seed=13)
    params = GenerationParams(max_new_tokens=12)
    engine = Engine(target, NoDrafter(), prompt_budget=16)
    kept = engine.add_request(short, params)
    tokens = [t for ev in engine.step() for t in ev.token_ids]
    gone = engine.add_request(long_, params)
    tokens += [t for ev in engine.step() for t in ev.token_ids]  # the long prompt is read in part
    assert engine.num_waiting == 1 and engine.num_running == 1
    assert engine.abort(gone) and engine.num_waiting == 0 and not engine.abort(gone)
    while engine.has_unfinished():
        tokens += [t for ev in engine.step() if ev.request_id == kept for t in ev.token_ids]
    assert tokens == _alone(target, short, params)
    # with nothing else decoding the budget holds too: the long prompt alone is read a part
    # per step (a server takes aborts and new requests between them), and its answer is the same
    idle = Engine(target, NoDrafter(), prompt_budget=16)
    read: list[int] = []
    prefill = target.prefill

    def counted(cache, b, ids, start=0, **kw):
        read[-1] += len(ids)
        return prefill(cache, b, ids, start, **kw)

    target.prefill = counted
    try:
        gone = idle.add_request(long_, params)
        read.append(0)
        assert idle.step() == [] and idle.num_waiting == 1 and idle.num_running == 0
        assert 0 < read[-1] <= 16, read
        assert idle.abort(gone) and not idle.has_unfinished()
        kept = idle.add_request(long_, params)
        tokens, steps = [], 0
        while idle.has_unfinished():
            read.append(0)
            tokens += [t for ev in idle.step() if ev.request_id == kept for t in ev.token_ids]
            steps += 1
            assert read[-1] <= 16, f"a step read {read[-1]} prompt tokens, past its budget"
    finally:
        target.prefill = prefill
    assert steps >= len(long_) // 16 and tokens == _alone(target, long_, params)


def test_a_request_that_ends_on_its_first_token_gets_no_more() -> None:
    """EOS as the first token, or max_new_tokens 1: one token and one event, whether the
    request arrives alone or beside a running sequence, which goes on undisturbed."""
    model = tiny_model("llama", seed=4)
    target = TargetModel(clone(model, torch.float32))
    prompt, other = random_prompts((9, 14), seed=8)
    first = _alone(target, prompt, GenerationParams(max_new_tokens=4))[0]
    long = GenerationParams(max_new_tokens=12)
    for params, reason in ((GenerationParams(max_new_tokens=1), "length"),
                           (GenerationParams(max_new_tokens=8, eos_token_ids=(first,)), "eos")):
        res = Engine(target, NoDrafter()).generate([prompt], params)[0]
        assert res.token_ids == [first] and res.finish_reason == reason
        engine = Engine(target, PromptLookupDrafter())
        running = engine.add_request(other, long)
        events = engine.step()
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            events += engine.step()
        mine = [e for e in events if e.request_id == rid]
        assert [e.token_ids for e in mine] == [[first]] and mine[0].finished and mine[0].finish_reason == reason
        assert sum((e.token_ids for e in events if e.request_id == running), []) == _alone(target, other, long)


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    """One slot: the waiting requests start lowest priority value first, in arrival order
    within a value; a running request is not preempted; each output is its own alone."""
    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.float32))
    prompts = random_prompts((7, 9, 11, 13, 15), seed=4)
    params = GenerationParams(max_new_tokens=3)
    engine = Engine(target, PromptLookupDrafter(), TreeBudget(8, 4), max_batch=1)
    first = engine.add_request(prompts[0], params, priority=5)
    engine.step()  # the first is running now
    order = {engine.add_request(p, params, priority=q): i
             for i, (p, q) in enumerate(zip(prompts[1:], (0, -2, 0, -2)), start=1)}
    started, tokens = [first], {first: []}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.request_id not in tokens:
                started.append(ev.request_id)
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
    assert [order.get(r, 0) for r in started] == [0, 2, 4, 1, 3]
    for r, i in order.items():
        assert tokens[r] == _alone(target, prompts[i], params)
