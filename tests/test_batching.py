"""Continuous batching: at most ``batch_size`` sequences decode together, and a finished
sequence's slot is handed to the next waiting prompt."""
from __future__ import annotations

import pytest
import torch

from helpers import clone, random_prompts, tiny_model
from sot.drafters import LookupDrafter, NoDrafter, PromptLookupDrafter, TreeBudget
from sot.drafters.state import StateDrafter, new_predictor
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.models.adapter import TargetModel
from sot.sampling import SamplingMode, SamplingParams

LAYERS = (0, 1, 2)


class _Recording(StateDrafter):
    """The state drafter, noting the largest batch it drafted and the sequences released."""

    widest = 0
    released: list

    def reset(self, batch_size: int = 0) -> None:
        super().reset(batch_size)
        self.widest, self.released = 0, []

    def release(self, sequence: int) -> None:
        super().release(sequence)
        self.released.append(sequence)

    def propose(self, inputs, budget):
        self.widest = max(self.widest, len(inputs))
        return super().propose(inputs, budget)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_continuous_batch_equals_decoding_alone(dtype: torch.dtype) -> None:
    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, dtype), state_layers=LAYERS)
    prompts = random_prompts((7, 30, 12, 51, 19), seed=3)
    # different lengths per prompt come from EOS: pick a token plain decoding emits mid-way
    plain_long = Engine(target, NoDrafter()).generate(prompts, GenerationParams(max_new_tokens=24))
    eos = plain_long[1].token_ids[9]
    params = GenerationParams(max_new_tokens=24, eos_token_ids=(eos,))
    alone = [Engine(target, NoDrafter()).generate([p], params)[0].token_ids for p in prompts]
    assert len({len(a) for a in alone}) > 1, "the sequences should finish at different steps"
    drafter = _Recording(new_predictor(model, LAYERS, None, seed=1), top_k=3)
    engine = Engine(target, drafter, TreeBudget(12, 5))
    res = engine.generate(prompts, params, batch_size=2)
    assert [r.token_ids for r in res] == alone
    assert [r.index for r in res] == list(range(len(prompts)))
    assert drafter.widest == 2, "never more than two sequences at once"
    assert sorted(drafter.released) == [r.request_id for r in res], "every finished sequence was released"
    assert not drafter.seqs, "the drafter holds no state of finished sequences"
    assert all(r.seconds > 0 and 0 < r.first_token_seconds <= r.seconds for r in res)


def test_coupled_sampling_does_not_depend_on_the_batch() -> None:
    """Coupled noise is keyed to the prompt's index, so a seeded sample is the same at any
    batch size, with or without speculation."""
    target = TargetModel(clone(tiny_model("llama", seed=4), torch.float32))
    prompts = random_prompts((9, 33, 14), seed=8)
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=7, mode=SamplingMode.COUPLED)
    params = GenerationParams(max_new_tokens=20, sampling=sp)
    together = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    for width in (1, 2):
        for drafter in (NoDrafter(), PromptLookupDrafter(), LookupDrafter()):
            got = Engine(target, drafter, TreeBudget(8, 4)).generate(prompts, params, batch_size=width)
            assert [r.token_ids for r in got] == together


def test_bad_batch_size_is_refused() -> None:
    target = TargetModel(clone(tiny_model("llama", seed=4), torch.float32))
    with pytest.raises(ConfigError, match="batch_size"):
        Engine(target, NoDrafter()).generate(random_prompts((5,)), GenerationParams(max_new_tokens=2), batch_size=0)


def test_a_batch_admitted_a_sequence_at_a_time_makes_its_cache_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts read a piece a step join the batch one at a time. The cache is made at once for
    every queued request the batch limit lets in, long enough for every queued prompt and its
    answer (not grown, with a copy of all of it, at each admission), and never for more
    sequences; the answers stay those of each prompt alone."""
    from sot.cache import KVCache

    model = tiny_model("llama", seed=5)
    target = TargetModel(model)
    prompts = random_prompts((20, 9, 90, 14, 25, 11), seed=4)
    params = GenerationParams(max_new_tokens=10)
    alone = [Engine(target, NoDrafter()).generate([p], params)[0].token_ids for p in prompts]
    made: list[tuple[int, int]] = []
    resized = KVCache.resized
    monkeypatch.setattr(KVCache, "resized", lambda self, b, c: made.append((self.batch_size, b)) or resized(self, b, c))
    engine = Engine(target, NoDrafter(), prompt_budget=12)
    res = engine.generate(prompts, params, batch_size=4)
    assert [r.token_ids for r in res] == alone
    assert engine._cache.batch_size == 4, "made for the batch limit, no more"
    assert made == [], f"made once, never grown: {made}"
    made.clear()
    engine.prompt_budget = None  # all six at once, and no limit: one copy, doubled (requests may keep coming)
    more = engine.generate(prompts, params)
    assert [r.token_ids for r in more] == alone and engine._cache.batch_size == 8
    assert [m for m in made if m[0] != m[1]] == [(4, 8)], made


def test_a_sequence_reaches_no_further_than_its_answer_allows() -> None:
    """The cache's length is planned from where each sequence can get within the next
    ``GROW_STEP`` tokens: never past its prompt plus ``max_new_tokens``, however many of them
    it has already committed (so a running sequence is not counted as if its whole answer
    were still to come)."""
    from types import SimpleNamespace

    engine = Engine(TargetModel(tiny_model("llama", seed=5)), NoDrafter())

    def seq(prompt: int, done: int, max_new: int) -> SimpleNamespace:
        return SimpleNamespace(prompt=[0] * prompt, length=prompt + done, params=SimpleNamespace(max_new_tokens=max_new))

    assert engine._reach(seq(50, 8, 10)) == 60, "two tokens left, not ten"
    assert engine._reach(seq(50, 0, 10)) == 60
    assert engine._reach(seq(50, 8, 5000)) == 58 + Engine.GROW_STEP, "a long answer grows a step at a time"
