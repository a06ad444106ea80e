"""Logit bias, minimum length and the penalties: they change the output as defined, equal
Hugging Face's processors where it has them, and keep speculative output equal to plain
decoding's, alone and in a batch, greedy and sampled."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import RandomTreeDrafter, clone, random_prompts, tiny_model
from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.models.adapter import TargetModel
from sot.sampling import SamplingParams

NEW = 32
LENGTHS = (7, 30, 75)
EOS = 2


def run(target: TargetModel, drafter, prompts: list[list[int]], params: GenerationParams) -> list[list[int]]:
    return [r.token_ids for r in Engine(target, drafter, TreeBudget(16, 6)).generate(prompts, params)]


def with_rules(temperature: float = 0.0, **rules) -> GenerationParams:
    sp = SamplingParams(temperature=temperature, seed=5, **rules)
    return GenerationParams(max_new_tokens=NEW, sampling=sp, eos_token_ids=(EOS,), min_tokens=NEW // 2)


RULES = dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4, logit_bias=((7, 2.5), (11, -3.0)))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rules_keep_speculation_exact(temperature: float, dtype: torch.dtype) -> None:
    model = tiny_model("llama", seed=3)
    target = TargetModel(clone(model, dtype))
    prompts = random_prompts(LENGTHS, seed=1)
    params = with_rules(temperature, **RULES)
    plain = run(target, NoDrafter(), prompts, params)
    if temperature == 0:  # (a sample's noise is keyed to its index in the batch)
        assert plain == [run(target, NoDrafter(), [p], params)[0] for p in prompts], "a batch changed an answer"
    assert run(target, PromptLookupDrafter(), prompts, params) == plain
    rnd = RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.8, seed=2)
    engine = Engine(target, rnd, TreeBudget(16, 6))
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == plain
    assert sum(sum(r.accept_lengths) - len(r.accept_lengths) for r in results) > NEW, "drafts were accepted"
    bare = run(target, NoDrafter(), prompts, dataclasses.replace(params, sampling=SamplingParams(
        temperature=temperature, seed=5), min_tokens=0))
    assert bare != plain, "the rules changed nothing"


def test_repetition_penalty_and_min_tokens_equal_transformers() -> None:
    model = tiny_model("llama", seed=4)
    target = TargetModel(clone(model, torch.float32))
    prompts = random_prompts((9, 40), seed=3)
    params = GenerationParams(max_new_tokens=NEW, sampling=SamplingParams(repetition_penalty=1.4),
                              eos_token_ids=(EOS,), min_tokens=12)
    ours = run(target, NoDrafter(), prompts, params)
    rnd = RandomTreeDrafter(ours, [len(p) for p in prompts], hit=0.8, seed=4)
    assert run(target, rnd, prompts, params) == ours
    for p, got in zip(prompts, ours):
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, repetition_penalty=1.4,
                             min_new_tokens=12, eos_token_id=EOS, pad_token_id=0)
        want = out[0, len(p):].tolist()
        assert got == want[: len(got)] and (len(got) == len(want) or want[len(got):] == [0] * (len(want) - len(got)))


def test_bias_and_min_tokens_do_what_they_say() -> None:
    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.float32))
    prompt = random_prompts((20,), seed=6)
    forced = run(target, NoDrafter(), prompt, GenerationParams(
        max_new_tokens=8, sampling=SamplingParams(logit_bias=((9, 100.0),))))[0]
    assert forced == [9] * 8
    plain = run(target, NoDrafter(), prompt, GenerationParams(max_new_tokens=NEW))[0]
    top = max(set(plain), key=plain.count)
    banned = run(target, NoDrafter(), prompt, GenerationParams(
        max_new_tokens=NEW, sampling=SamplingParams(logit_bias=((top, -100.0),))))[0]
    assert top not in banned
    # EOS made the likeliest token by a bias: it ends the answer at once, unless a minimum holds it off
    eos_first = GenerationParams(max_new_tokens=NEW, sampling=SamplingParams(logit_bias=((EOS, 100.0),)),
                                 eos_token_ids=(EOS,))
    assert run(target, NoDrafter(), prompt, eos_first)[0] == [EOS]
    held = run(target, NoDrafter(), prompt, dataclasses.replace(eos_first, min_tokens=5))[0]
    assert len(held) == 6 and held[-1] == EOS and EOS not in held[:5]


@pytest.mark.parametrize("change, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be between -2 and 2"),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be between -2 and 2"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(logit_bias=((5, 101.0),)), "logit_bias of token 5 must be between -100 and 100"),
    (dict(logit_bias=((10**6, 1.0),)), "logit_bias names token 1000000, outside the vocabulary"),
])
def test_rules_out_of_range_are_refused(change: dict, message: str) -> None:
    target = TargetModel(tiny_model("llama"))
    engine = Engine(target, NoDrafter())
    with pytest.raises(ConfigError, match=message):
        engine.add_request([3, 4, 5], GenerationParams(max_new_tokens=4, sampling=SamplingParams(**change)))
    with pytest.raises(ConfigError, match="min_tokens must be between 0 and max_new_tokens"):
        engine.add_request([3, 4, 5], GenerationParams(max_new_tokens=4, min_tokens=5))


def test_a_batch_mixing_rules_and_none_gives_each_its_own_answer() -> None:
    """Requests with and without rules share the verify pass (the fast greedy path takes the
    ones without); each answer equals that request decoded alone."""
    model = tiny_model("qwen2", seed=6)
    target = TargetModel(clone(model, torch.float32))
    prompts = random_prompts((12, 33, 20), seed=8)
    params = [with_rules(**RULES), GenerationParams(max_new_tokens=NEW), with_rules(repetition_penalty=1.5)]
    alone = [run(target, NoDrafter(), [p], q)[0] for p, q in zip(prompts, params)]
    engine = Engine(target, RandomTreeDrafter(alone, [len(p) for p in prompts], hit=0.8, seed=1), TreeBudget(16, 6))
    ids = [engine.add_request(p, q, index=i) for i, (p, q) in enumerate(zip(prompts, params))]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for ev in engine.step():
            tokens[ev.request_id] += ev.token_ids
    assert [tokens[i] for i in ids] == alone


def test_only_the_walked_rows_are_adjusted(monkeypatch) -> None:
    """A step adjusts the rows of the root and of each accepted node, not the whole tree."""
    from sot.logit_rules import AdjustedRows

    model = tiny_model("llama", seed=2)
    target = TargetModel(clone(model, torch.float32))
    prompts = random_prompts((15, 26), seed=4)
    params = with_rules(**RULES)
    plain = run(target, NoDrafter(), prompts, params)
    made = []
    original = AdjustedRows._row
    monkeypatch.setattr(AdjustedRows, "_row", lambda self, node: made.append(node) or original(self, node))
    results = Engine(target, RandomTreeDrafter(plain, [15, 26], hit=0.8, seed=6), TreeBudget(16, 6)).generate(
        prompts, params)
    assert [r.token_ids for r in results] == plain
    # one row per walked node: a step's committed tokens (+ each first token's root row), and
    # at most a tree's depth more where the last step's tokens were cut at the length limit
    walked = sum(sum(r.accept_lengths) for r in results) + len(prompts)
    drafted = sum(sum(r.tree_sizes) for r in results)
    assert walked <= len(made) <= walked + 6 * len(prompts) and len(made) < drafted / 2


def test_stop_strings_count_after_min_tokens_in_every_mode() -> None:
    """A stop string ends the answer only where its last character comes from a token after
    the first ``min_tokens`` (vLLM's rule), the same plain and speculative."""
    target = TargetModel(clone(tiny_model("llama", seed=5), torch.float32))
    prompt = random_prompts((20,), seed=6)

    def decode(ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def answer(drafter, **kw) -> tuple[list[int], str]:
        engine = Engine(target, drafter, TreeBudget(16, 6), decode=decode)
        res = engine.generate(prompt, GenerationParams(max_new_tokens=NEW, **kw))[0]
        return res.token_ids, res.finish_reason

    free, _ = answer(NoDrafter())
    letters = decode(free)
    stop = max(set(letters[:NEW // 2]), key=letters.count)  # a letter seen early and again later
    first = letters.index(stop)
    later = letters.index(stop, first + 1)
    assert answer(NoDrafter(), stop=(stop,)) == (free[: first + 1], "stop")
    want = (free[: later + 1], "stop")
    for drafter in (NoDrafter(), PromptLookupDrafter(), RandomTreeDrafter([free], [len(prompt[0])], hit=0.8, seed=2)):
        assert answer(drafter, stop=(stop,), min_tokens=first + 1) == want, drafter
