"""The prefix cache: a later prompt that starts like an earlier one reuses its chunks, and the
output, logits and drafter states stay bit-identical to reading the whole prompt again."""
from __future__ import annotations

import pytest
import torch

from helpers import RandomTreeDrafter, clone, random_prompts, tiny_model
from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel
from sot.prefix_cache import PREFILL_CHUNK, PrefixCache, PrefixChunk
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
def test_a_next_turn_reads_only_its_new_chunks_and_decodes_the_same(arch: str, dtype: torch.dtype) -> None:
    target = TargetModel(clone(tiny_model(arch), dtype), state_layers=(0, 1))
    first = random_prompts((150,), seed=4)[0]
    cache = PrefixCache(64 << 20)
    seen = Prefills()
    engine = Engine(target, NoDrafter(), trace=True, prefix_cache=cache, observers=[seen])
    answer = engine.generate([first], PARAMS)[0]
    assert answer.cached_tokens == 0 and len(cache) == 2  # chunks 0-63 and 64-127
    second = first + answer.token_ids + random_prompts((20,), seed=5)[0]
    again = engine.generate([second], PARAMS)[0]
    assert again.cached_tokens == 2 * PREFILL_CHUNK  # the first turn's prompt chunks, not its answer

    fresh_seen = Prefills()
    fresh = Engine(target, NoDrafter(), trace=True, observers=[fresh_seen]).generate([second], PARAMS)[0]
    assert again.token_ids == fresh.token_ids
    assert all(torch.equal(a, b) for a, b in zip(again.logit_trace, fresh.logit_trace))
    (states, logits), (fresh_states, fresh_logits) = seen.seen[1], fresh_seen.seen[0]
    assert states.shape[0] == len(second) and torch.equal(states, fresh_states)  # what a drafter reads
    assert torch.equal(logits, fresh_logits)

    # speculative decoding over the reused chunks gives the same tokens
    for drafter in (PromptLookupDrafter(), RandomTreeDrafter([fresh.token_ids], [len(second)], hit=0.7, seed=1)):
        spec = Engine(target, drafter, TreeBudget(16, 6), prefix_cache=cache).generate([second], PARAMS)[0]
        assert spec.cached_tokens == 3 * PREFILL_CHUNK  # the second prompt's chunks are stored too
        assert spec.token_ids == fresh.token_ids


def test_a_prompt_of_whole_chunks_still_reads_its_last_chunk() -> None:
    target = TargetModel(tiny_model("llama"))
    prompt = random_prompts((2 * PREFILL_CHUNK,), seed=2)[0]
    engine = Engine(target, NoDrafter(), prefix_cache=PrefixCache(64 << 20))
    first, second = (engine.generate([prompt], PARAMS)[0] for _ in range(2))
    assert second.cached_tokens == PREFILL_CHUNK and second.token_ids == first.token_ids


def _chunk(tokens: list[int], nbytes: int = 1000) -> PrefixChunk:
    return PrefixChunk(tuple(tokens), torch.zeros(nbytes // 8), torch.zeros(nbytes // 8), None)


def test_eviction_keeps_the_cap_and_drops_chain_ends_first() -> None:
    cache = PrefixCache(max_bytes=4 * 1000, chunk=4)
    a = list(range(10, 23))  # 3 whole chunks before its last token
    cache.insert(a, None, 0, [_chunk(a[i * 4:(i + 1) * 4]) for i in range(3)])
    assert len(cache.lookup(a)) == 3 and cache.nbytes == 3000
    b = list(range(50, 63))
    cache.insert(b, None, 0, [_chunk(b[i * 4:(i + 1) * 4]) for i in range(3)])
    assert cache.nbytes <= cache.max_bytes
    # a's chain lost its end first: what remains of it is its start, still reachable
    assert len(cache.lookup(b)) == 3 and len(cache.lookup(a)) == 1
    off = PrefixCache(max_bytes=0, chunk=4)
    off.insert(a, None, 0, [_chunk(a[:4])])
    assert len(off) == 0


def test_tenants_are_kept_apart_when_asked() -> None:
    prompt = list(range(3, 20))
    for per_tenant, shared_hits in ((True, 0), (False, 4)):
        cache = PrefixCache(max_bytes=1 << 20, per_tenant=per_tenant, chunk=4)
        cache.insert(prompt, "alice", 0, [_chunk(prompt[i * 4:(i + 1) * 4]) for i in range(4)])
        assert len(cache.lookup(prompt, "alice")) == 4
        assert len(cache.lookup(prompt, "bob")) == shared_hits
    # a different token in the second chunk stops the match there
    other = prompt[:5] + [90] + prompt[6:]
    assert len(cache.lookup(other, "alice")) == 1


def test_usage_reports_cached_tokens() -> None:
    target = TargetModel(tiny_model("llama"))
    prompt = random_prompts((100,), seed=3)[0]
    engine = Engine(target, NoDrafter(), prefix_cache=PrefixCache(64 << 20))
    engine.generate([prompt], PARAMS)
    result = engine.generate([prompt + [5, 6, 7]], PARAMS)[0]
    usage = usage_of(prompt + [5, 6, 7], result, 0)
    assert usage["prompt_tokens_details"] == {"cached_tokens": PREFILL_CHUNK}


def test_a_bench_method_forgets_its_prompts_after_the_warm_up() -> None:
    """``sot bench`` gives each engine method its own prefix cache and empties it after the
    warm-up, so the first measured prompt reads its whole prompt."""
    from sot.bench.methods import EngineMethod, forget_answers

    method = EngineMethod("plain", TargetModel(tiny_model("llama")), NoDrafter(), TreeBudget(), prefix_cache_mb=16)
    prompt = random_prompts((100,), seed=7)[0]
    method.run(prompt, PARAMS)
    assert len(method.engine.prefix_cache) == 1
    forget_answers(method)
    assert len(method.engine.prefix_cache) == 0 and method.engine.prefix_cache.nbytes == 0
    assert method.engine.generate([prompt], PARAMS)[0].cached_tokens == 0
