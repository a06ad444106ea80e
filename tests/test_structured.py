"""Structured output: answers follow the JSON schema, regex, choice or grammar asked for,
and speculation keeps them exactly plain decoding's (each tree node masked for its own path)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from helpers import RandomTreeDrafter, tiny_model_dir
from sot import SoT
from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.sampling import SamplingParams
from sot.structured import OutputFormat, StructuredOutput

# (the tiny models' characters stop at "|": no "}", so the schema is an array)
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4,
          "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}  # compact
SPECS = {
    "regex": StructuredOutput(OutputFormat.REGEX, r"[a-e]{2,6}-\d{3}"),
    "choice": StructuredOutput.choice(["alpha", "beta", "gamma"]),
    "schema": StructuredOutput.json_schema(SCHEMA),
    "grammar": StructuredOutput(OutputFormat.GRAMMAR, 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> SoT:
    return SoT.load(str(tiny_model_dir(tmp_path_factory.mktemp("so") / "model")), drafter="none", dtype="float32")


def _engine(sot: SoT, drafter) -> Engine:
    engine = Engine(sot.target, drafter, TreeBudget(16, 6), decode=sot.engine.decode)
    engine.grammars = sot.engine.grammars
    return engine


def _run(engine: Engine, prompts: list[list[int]], params: GenerationParams) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_answers_take_the_form_and_speculation_stays_exact(tiny: SoT, name: str, temperature: float) -> None:
    spec = SPECS[name]
    prompts = [tiny.encode(p, chat=False) for p in ("abcabc", "hello hello", "x")]
    params = GenerationParams(max_new_tokens=60, sampling=SamplingParams(temperature=temperature, seed=4),
                              eos_token_ids=tiny.eos_ids(), structured=spec)
    done = _engine(tiny, NoDrafter()).generate(prompts, params)
    plain = [r.token_ids for r in done]
    assert all(r.finish_reason in ("stop", "eos") for r in done), [(r.finish_reason, r.text) for r in done]
    for text in (tiny.tokenizer.decode(t, skip_special_tokens=True) for t in plain):
        if name == "regex":
            assert re.fullmatch(r"[a-e]{2,6}-\d{3}", text), text
        elif name == "choice":
            assert text in ("alpha", "beta", "gamma")
        elif name == "schema":
            value = json.loads(text)
            assert 2 <= len(value) <= 4 and all(isinstance(v, int) and 0 <= v <= 99 for v in value), text
        else:
            assert re.fullmatch(r"\(\d+(\+\d+)*\)", text), text
    assert _run(_engine(tiny, PromptLookupDrafter()), prompts, params) == plain
    rnd = RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.8, seed=3)
    engine = _engine(tiny, rnd)
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == plain
    if name != "choice":  # (a choice is one or two tokens: nothing to draft)
        assert any(a > 1 for r in results for a in r.accept_lengths), "no draft was accepted"
    free = _run(_engine(tiny, NoDrafter()), prompts, GenerationParams(
        max_new_tokens=60, sampling=params.sampling, eos_token_ids=tiny.eos_ids()))
    assert free != plain, "the grammar changed nothing"


def test_invalid_specs_are_refused_with_the_reason(tiny: SoT) -> None:
    with pytest.raises(ConfigError, match="regex is not valid") as refused:
        tiny.params(structured=StructuredOutput(OutputFormat.REGEX, "[a-"))
    assert "\n" not in str(refused.value) and "unclosed character class" in str(refused.value), str(refused.value)
    with pytest.raises(ConfigError, match="regex is not valid: .* unclosed character class$"):  # (no model needed)
        StructuredOutput(OutputFormat.REGEX, "[a-").check()
    StructuredOutput(OutputFormat.REGEX, "[a-d]+").check()
    with pytest.raises(ConfigError, match="json_schema is not valid"):
        tiny.params(structured=StructuredOutput(OutputFormat.JSON_SCHEMA, "{not json"))
    with pytest.raises(ConfigError, match="grammar is not valid"):
        tiny.params(structured=StructuredOutput(OutputFormat.GRAMMAR, "root ::= ("))
    with pytest.raises(ConfigError, match="non-empty list of strings"):
        StructuredOutput.choice([])
    bare = Engine(tiny.target, NoDrafter())
    with pytest.raises(ConfigError, match="needs the tokenizer"):
        bare.add_request([5, 6], GenerationParams(max_new_tokens=4, structured=SPECS["regex"]))


def test_default_model_answers_a_schema_exactly_with_its_drafter() -> None:
    """The real tokenizer (byte-level BPE) and the shipped drafter: the answer parses, holds
    the required fields, and equals plain decoding's."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"]}
    ask = dict(max_new_tokens=60, structured=StructuredOutput.json_schema(schema))
    prompt = ["Give the largest city of France and its population as JSON."]
    spec = SoT.load(dtype="float32").generate(prompt, **ask)[0]
    plain = SoT.load(dtype="float32", drafter="none").generate(prompt, **ask)[0]
    assert spec.token_ids == plain.token_ids
    if spec.finish_reason == "stop":
        value = json.loads(spec.text)
        assert isinstance(value["city"], str) and isinstance(value["population"], int)
    else:
        assert spec.finish_reason == "length" and spec.text.startswith("{")
    assert torch.tensor(spec.accept_lengths).max() >= 1


def test_matchers_of_one_spec_are_independent_copies(tiny: SoT) -> None:
    grammars = tiny.engine.grammars
    first, second = grammars.matcher(SPECS["choice"]), grammars.matcher(SPECS["choice"])
    assert SPECS["choice"] in grammars._compiled, "the compiled spec is kept"
    token = tiny.encode("a", chat=False)[0]
    assert first.consume_token(token)
    vocab = tiny.target.vocab_size
    from sot.structured import allowed_tokens

    assert not torch.equal(allowed_tokens(first, vocab), allowed_tokens(second, vocab)), "a copy moved with another"


def test_forced_tokens_are_drafted_as_a_chain(tiny: SoT) -> None:
    """What the grammar forces (here a fixed word after the first character) is drafted as a
    chain and accepted whole; the answer is still plain decoding's."""
    spec = StructuredOutput(OutputFormat.GRAMMAR, 'root ::= [a-c] "=FORCED=" [0-9]+ "|"')
    prompts = [tiny.encode(p, chat=False) for p in ("zz", "qq")]
    params = GenerationParams(max_new_tokens=40, eos_token_ids=tiny.eos_ids(), structured=spec)
    plain = _run(_engine(tiny, NoDrafter()), prompts, params)
    results = _engine(tiny, PromptLookupDrafter()).generate(prompts, params)
    assert [r.token_ids for r in results] == plain
    for r in results:
        assert r.accept_lengths[0] >= 5, r.accept_lengths  # "=FORCED=" in one step after the first token


def test_a_traced_request_records_the_forced_chain(tiny: SoT) -> None:
    """With every step recorded (sot trace, the server's --trace), a forced chain is the
    step's proposed tree, a free draft."""
    spec = StructuredOutput(OutputFormat.GRAMMAR, 'root ::= [a-c] "=FORCED=" [0-9]+ "|"')
    engine = _engine(tiny, PromptLookupDrafter())
    engine.record_steps = True
    result = engine.generate([tiny.encode("zz", chat=False)], GenerationParams(
        max_new_tokens=40, eos_token_ids=tiny.eos_ids(), structured=spec))[0]
    forced = [r for r in result.step_records if r.mode == "free" and len(r.tokens) >= 5]
    assert forced and forced[0].accepted == list(range(len(forced[0].tokens)))


def test_a_grammar_dead_end_ends_its_request_alone_the_same_in_every_mode(tiny: SoT) -> None:
    """A grammar that needs a character no token spells ("~" is past the tiny vocabulary)
    reaches a dead end: that request ends there with ``finish_reason`` ``grammar``, with the
    same tokens plain and speculative, while the request beside it in the batch runs on as
    it runs alone."""
    dead = StructuredOutput(OutputFormat.REGEX, "ab~c")
    prompts = [tiny.encode(p, chat=False) for p in ("abcabc", "hello hello")]

    def params(spec: StructuredOutput) -> GenerationParams:
        return GenerationParams(max_new_tokens=30, eos_token_ids=tiny.eos_ids(), structured=spec)

    alone = _engine(tiny, NoDrafter()).generate([prompts[1]], params(SPECS["regex"]))[0].token_ids
    for drafter in (NoDrafter(), PromptLookupDrafter()):
        engine = _engine(tiny, drafter)
        rids = [engine.add_request(prompts[0], params(dead)), engine.add_request(prompts[1], params(SPECS["regex"]))]
        done = {}
        while engine.has_unfinished():
            done.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
        ended, other = (done[r] for r in rids)
        # (the end of sequence its mask offered, which the grammar refuses, is not the answer's)
        assert ended.finish_reason == "grammar" and tiny.tokenizer.decode(ended.token_ids) == "ab"
        assert other.finish_reason in ("stop", "eos") and other.token_ids == alone
        if isinstance(drafter, NoDrafter):
            plain = ended.token_ids
        assert ended.token_ids == plain


def test_rules_that_ban_every_token_the_grammar_allows_end_the_answer_before_it(tiny: SoT) -> None:
    """A choice of "ab" whose "b" is also a stop token under ``min_tokens``: after "a" every
    token is banned, and the answer ends there (``grammar``) rather than with a token outside
    its form, the same plain and speculative."""
    b = tiny.encode("b", chat=False)
    assert len(b) == 1
    params = GenerationParams(max_new_tokens=10, eos_token_ids=(*tiny.eos_ids(), b[0]), min_tokens=3,
                              structured=StructuredOutput.choice(["ab"]))
    for drafter in (NoDrafter(), PromptLookupDrafter()):
        res = _engine(tiny, drafter).generate([tiny.encode("abcabc", chat=False)], params)[0]
        assert res.finish_reason == "grammar" and tiny.tokenizer.decode(res.token_ids) == "a"


def test_a_grammar_past_the_engines_limits_fails_alike_every_time_with_its_reason(tiny: SoT) -> None:
    """A pattern that outgrows the grammar engine's lexer ends its answer with ``grammar`` and
    the engine's message (``error``), never as a silent dead end; the failure does not spoil
    the spec for the requests after it (each gets a freshly compiled matcher), so every
    request ends the same way."""
    huge = StructuredOutput(OutputFormat.REGEX, "((b{100}){100}){90}")
    runs = [tiny.generate(["say bbbb"], chat=False, structured=huge, max_new_tokens=40)[0] for _ in range(3)]
    assert all(r.finish_reason == "grammar" and "grammar engine stopped" in (r.error or "") for r in runs)
    assert all(r.token_ids == runs[0].token_ids for r in runs)  # (the refused token is not kept)
    dead = tiny.generate(["abc"], chat=False, structured=StructuredOutput(OutputFormat.REGEX, "ab~c"),
                         max_new_tokens=10)[0]
    assert dead.finish_reason == "grammar" and dead.error is None
