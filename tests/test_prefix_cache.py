"""The prefix cache: a later prompt that starts like an earlier one reuses its chunks, and the
output, logits and drafter states stay bit-identical to reading the whole prompt again."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import RandomTreeDrafter, clone, random_prompts, tiny_model
from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel
from sot.prefix_cache import PREFILL_CHUNK, PrefixCache
from sot.server.protocol import usage_of

NEW = 30
PARAMS = GenerationParams(max_new_tokens=NEW)


class Prefills:
    """An engine observer that keeps each prompt pass's states and first-token logits."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    def prefilled(self, seq, states, logits) -> None:
        self.seen.append((None if states is None else states.clone(), logits.clone()))

    def verified(self, *args) -> None:
        pass

    def finished(self, seq) -> None:
        pass

    def between_steps(self) -> None:
        pass


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_next_turn_reuses_the_last_answer_and_decodes_the_same(arch: str, dtype: torch.dtype) -> None:
    target = TargetModel(clone(tiny_model(arch), dtype), state_layers=(0, 1))
    first = random_prompts((150,), seed=4)[0]
    cache = PrefixCache(64 << 20)
    seen = Prefills()
    engine = Engine(target, NoDrafter(), trace=True, prefix_cache=cache, observers=[seen])
    answer = engine.generate([first], PARAMS)[0]
    # the prompt and the answer (but its last token, never fed back) in chunks 0-63, 64-127, 128-
    stored = len(first) + len(answer.token_ids) - 1
    assert answer.cached_tokens == 0 and len(cache) == 3
    second = first + answer.token_ids + random_prompts((20,), seed=5)[0]
    again = engine.generate([second], PARAMS)[0]
    assert again.cached_tokens == stored  # the first turn's prompt and its answer, written by decoding

    fresh_seen = Prefills()
    fresh = Engine(target, NoDrafter(), trace=True, observers=[fresh_seen]).generate([second], PARAMS)[0]
    assert again.token_ids == fresh.token_ids
    assert all(torch.equal(a, b) for a, b in zip(again.logit_trace, fresh.logit_trace))
    (states, logits), (fresh_states, fresh_logits) = seen.seen[1], fresh_seen.seen[0]
    assert states.shape[0] == len(second) and torch.equal(states, fresh_states)  # what a drafter reads
    assert torch.equal(logits, fresh_logits)

    # speculative decoding over the reused rows gives the same tokens
    for drafter in (PromptLookupDrafter(), RandomTreeDrafter([fresh.token_ids], [len(second)], hit=0.7, seed=1)):
        spec = Engine(target, drafter, TreeBudget(16, 6), prefix_cache=cache).generate([second], PARAMS)[0]
        assert spec.cached_tokens == len(second) - 1  # the second prompt is stored too
        assert spec.token_ids == fresh.token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_prompt_passs_rows_equal_decodings_rows_however_it_is_split(arch: str) -> None:
    """What makes answers reusable: a prompt pass computes each row as plain decoding does, so
    the KV rows and states of a decoded answer equal those of reading it as a prompt, in one
    pass or split anywhere."""
    target = TargetModel(tiny_model(arch), state_layers=(0, 1))
    prompt = random_prompts((90,), seed=8)[0]
    answer = Engine(target, NoDrafter()).generate([prompt], PARAMS)[0].token_ids
    text = prompt + answer[:-1]
    rows = {}
    for split in ((), (37,), (64, 100), (1, 2, 3)):
        cache = target.new_cache(1, len(text) + 64)
        bounds = [0, *split, len(text)]
        parts = [target.prefill(cache, 0, torch.tensor(text[s:e]), start=s) for s, e in zip(bounds, bounds[1:])]
        keys, values = cache.read_span(0, 0, len(text))
        rows[split] = (keys, values, torch.cat([p.states[0] for p in parts]), parts[-1].logits)
    decoded = Engine(target, NoDrafter(), prefix_cache=(store := PrefixCache(64 << 20)))
    decoded.generate([prompt], PARAMS)  # stores the prompt's rows and the answer's decoded ones
    hit = store.lookup(text + [0])
    assert hit.tokens == len(text)
    keys = torch.cat([c.keys for c in hit.chunks], dim=2)
    whole = rows[()]
    assert torch.equal(keys, whole[0]) and torch.equal(torch.cat([c.values for c in hit.chunks], dim=2), whole[1])
    assert torch.equal(torch.cat([c.states for c in hit.chunks]), whole[2])
    for split, got in rows.items():
        assert all(torch.equal(a, b) for a, b in zip(got, whole)), split


def test_a_repeated_prompt_reuses_all_but_its_last_token() -> None:
    target = TargetModel(tiny_model("llama"))
    prompt = random_prompts((2 * PREFILL_CHUNK,), seed=2)[0]
    engine = Engine(target, NoDrafter(), prefix_cache=PrefixCache(64 << 20))
    first, second = (engine.generate([prompt], PARAMS)[0] for _ in range(2))
    assert second.cached_tokens == len(prompt) - 1 and second.token_ids == first.token_ids


def test_a_prompt_takes_part_of_a_stored_chunk() -> None:
    target = TargetModel(tiny_model("llama"), state_layers=(0, 1))
    prompt = random_prompts((150,), seed=6)[0]
    store = PrefixCache(64 << 20)
    engine = Engine(target, PromptLookupDrafter(), TreeBudget(8, 4), prefix_cache=store)
    engine.generate([prompt], PARAMS)
    branch = prompt[:100] + random_prompts((30,), seed=9)[0]  # leaves chunk 64-127 after 36 tokens
    got = engine.generate([branch], PARAMS)[0]
    fresh = Engine(target, PromptLookupDrafter(), TreeBudget(8, 4)).generate([branch], PARAMS)[0]
    assert got.cached_tokens == 100 + (branch[100] == prompt[100]) and got.token_ids == fresh.token_ids
    assert len(store.lookup(branch).chunks) == 3  # the branch is stored beside the first chunk's other child


def _reader(nbytes: int = 1000):
    return lambda start, end: (torch.zeros(nbytes // 8), torch.zeros(nbytes // 8), None)


def test_eviction_keeps_the_cap_and_drops_chain_ends_first() -> None:
    cache = PrefixCache(max_bytes=4 * 1000, chunk=4)
    a = list(range(10, 22))  # 3 whole chunks
    assert cache.insert(a, None, _reader()) == 12
    assert len(cache.lookup(a + [0]).chunks) == 3 and cache.nbytes == 3000
    assert cache.insert(a, None, _reader()) == 0  # nothing new to store
    b = list(range(50, 62))
    cache.insert(b, None, _reader())
    assert cache.nbytes <= cache.max_bytes
    # a's chain lost its end first: what remains of it is its start, still reachable
    assert len(cache.lookup(b + [0]).chunks) == 3 and cache.lookup(a + [0]).tokens == 4
    # a chunk leaves with the chunks below it
    cache.insert(b[:4] + [7, 7, 7, 7], None, _reader())
    assert cache.nbytes <= cache.max_bytes and len(cache) == len(cache._chunks)
    off = PrefixCache(max_bytes=0, chunk=4)
    off.insert(a, None, _reader())
    assert len(off) == 0


def test_a_longer_sequence_replaces_the_partial_chunk_it_extends() -> None:
    cache = PrefixCache(max_bytes=1 << 20, chunk=4)
    cache.insert([1, 2, 3, 4, 5, 6], None, _reader())
    assert len(cache) == 2
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], None, _reader())  # 5 6 -> 5 6 7 8, then 9
    assert len(cache) == 3 and cache.nbytes == 3000
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).tokens == 9
    assert cache.insert([1, 2, 3, 4, 5], None, _reader()) == 0  # covered by 5 6 7 8


def test_tenants_are_kept_apart_when_asked() -> None:
    prompt = list(range(3, 20))
    for per_tenant, shared in ((True, 0), (False, 16)):
        cache = PrefixCache(max_bytes=1 << 20, per_tenant=per_tenant, chunk=4)
        cache.insert(prompt, "alice", _reader())
        assert cache.lookup(prompt, "alice").tokens == 16
        assert cache.lookup(prompt, "bob").tokens == shared
    # a different token in the second chunk stops the match there, at token granularity
    other = prompt[:5] + [90] + prompt[6:]
    assert cache.lookup(other, "alice").tokens == 5


def test_a_cache_salt_keeps_requests_apart() -> None:
    """vLLM's ``cache_salt``: stored chunks are found only by requests of the same salt (and
    of the same tenant when tenants are kept apart), so a request without the salt cannot
    learn from its reused tokens how another's prompt began; the answers stay the same."""
    prompt = list(range(3, 20))
    cache = PrefixCache(max_bytes=1 << 20, chunk=4)
    cache.insert(prompt, None, _reader(), salt="alice-salt")
    assert cache.lookup(prompt, None, "alice-salt").tokens == 16
    assert cache.lookup(prompt).tokens == 0 and cache.lookup(prompt, None, "other").tokens == 0
    apart = PrefixCache(max_bytes=1 << 20, per_tenant=True, chunk=4)
    apart.insert(prompt, "alice", _reader(), salt="s")
    assert apart.lookup(prompt, "alice", "s").tokens == 16 and apart.lookup(prompt, "bob", "s").tokens == 0
    target = TargetModel(tiny_model("llama"))
    prompt = random_prompts((100,), seed=3)[0]
    engine = Engine(target, NoDrafter(), prefix_cache=PrefixCache(64 << 20))
    salted = dataclasses.replace(PARAMS, cache_salt="alice")
    first = engine.generate([prompt], salted)[0]
    unsalted, other, same = (engine.generate([prompt], p)[0] for p in
                             (PARAMS, dataclasses.replace(PARAMS, cache_salt="bob"), salted))
    assert unsalted.cached_tokens == other.cached_tokens == 0 and same.cached_tokens == len(prompt) - 1
    assert first.token_ids == unsalted.token_ids == other.token_ids == same.token_ids


def test_usage_reports_cached_tokens() -> None:
    target = TargetModel(tiny_model("llama"))
    prompt = random_prompts((100,), seed=3)[0]
    engine = Engine(target, NoDrafter(), prefix_cache=PrefixCache(64 << 20))
    engine.generate([prompt], PARAMS)
    result = engine.generate([prompt + [5, 6, 7]], PARAMS)[0]
    usage = usage_of(prompt + [5, 6, 7], result, 0)
    assert usage["prompt_tokens_details"] == {"cached_tokens": result.cached_tokens} and result.cached_tokens >= 100


def test_a_bench_method_forgets_its_prompts_after_the_warm_up() -> None:
    """``sot bench`` gives each engine method its own prefix cache and empties it after the
    warm-up, so the first measured prompt reads its whole prompt."""
    from sot.bench.methods import EngineMethod, forget_answers

    method = EngineMethod("plain", TargetModel(tiny_model("llama")), NoDrafter(), TreeBudget(), prefix_cache_mb=16)
    prompt = random_prompts((100,), seed=7)[0]
    method.run(prompt, PARAMS)
    assert len(method.engine.prefix_cache) == 3  # 0-63, 64-127 and the answer's end
    forget_answers(method)
    assert len(method.engine.prefix_cache) == 0 and method.engine.prefix_cache.nbytes == 0
    assert method.engine.generate([prompt], PARAMS)[0].cached_tokens == 0
