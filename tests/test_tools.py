"""Tool calling (:mod:`sot.tools`): tools checked, written into the prompt, the form a call
must take, and calls read back from an answer."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from sot.errors import ConfigError
from sot.models.loading import resolve_model_path
from sot.prompts import encode
from sot.structured import Grammars
from sot.tools import (
    CALL_CLOSE, CALL_OPEN, ToolChoice, call_format, chat_messages, parse_tool_choice, parse_tools, read_calls,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = parse_tools([WEATHER, CLOCK])


@pytest.mark.parametrize("raw,match", [
    ("get_weather", "must be a list"),
    ([{"type": "retrieval"}], r"tools\[0\]: only tools of type 'function'"),
    ([{"type": "function"}], "needs a 'function' object"),
    ([{"type": "function", "function": {"name": "has space"}}], "function name must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": "none"}}], "parameters must be a JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "nonsense"}}}}}],
     "parameters of 'f'"),
    ([WEATHER, WEATHER], "get_weather appear more than once"),
])
def test_bad_tools_are_refused_with_the_reason(raw, match) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        parse_tools(raw)
    assert str(err.value).startswith("tools")


def test_tool_choice() -> None:
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice("auto", ()) == ToolChoice("none")  # nothing to call
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS) == \
        ToolChoice("named", "get_time")
    for raw, match in (("required", "needs tools"), ("always", "must be 'none'"),
                       ({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
                       ({"function": "get_time"}, "must be 'none'")):
        with pytest.raises(ConfigError, match=match) as err:
            parse_tool_choice(raw, TOOLS if raw != "required" else ())
        assert str(err.value).startswith("tool_choice")


def test_calls_are_read_from_tagged_blocks_and_whole_json() -> None:
    auto = ToolChoice("auto")
    text = (f'Let me look.\n{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n{CALL_CLOSE}\n'
            f'{CALL_OPEN}{{"name": "get_time", "arguments": "{{\\"zone\\": \\"CET\\"}}"}}{CALL_CLOSE} done')
    read = read_calls(text, TOOLS, auto)
    assert [(c.name, json.loads(c.arguments)) for c in read.calls] == [("get_weather", {"city": "Oslo"}),
                                                                        ("get_time", {"zone": "CET"})]
    assert read.content == "Let me look.\n\n done" and all(c.id.startswith("call_") for c in read.calls)
    assert len({c.id for c in read.calls}) == 2
    assert [c.name for c in read_calls(text, TOOLS, auto, parallel=False).calls] == ["get_weather"]
    # Llama 3.x writes a call as the whole answer, with "parameters"
    whole = read_calls(' {"name": "get_time", "parameters": {"zone": "UTC"}}', TOOLS, auto)
    assert whole.content is None and json.loads(whole.calls[0].arguments) == {"zone": "UTC"}
    # Mistral writes a list of calls after its [TOOL_CALLS] special token (not in the text)
    listed = read_calls('[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", '
                        '"arguments": {"city": "Rome"}}]', TOOLS, auto)
    assert [c.name for c in listed.calls] == ["get_time", "get_weather"] and listed.content is None
    # what is not a call of a listed tool stays text
    for text in (f'{CALL_OPEN}{{"name": "launch", "arguments": {{}}}}{CALL_CLOSE}', f"{CALL_OPEN}{{broken",
                 '{"name": "get_time"', "Plain words.", '{"city": "Oslo"}', "[1, 2]", "[]",
                 '[{"name": "get_time", "arguments": {}}, {"name": "launch"}]'):
        read = read_calls(text, TOOLS, auto)
        assert read.calls == () and read.content == text
    # an unclosed block at the end of the answer is still a call
    read = read_calls(f'{CALL_OPEN}{{"name": "get_time", "arguments": {{"zone": "X"}}}}', TOOLS, auto)
    assert [c.name for c in read.calls] == ["get_time"] and read.content is None
    assert read_calls(text, TOOLS, ToolChoice("none")).calls == ()
    # the opening of one more call, cut by the length limit, is no content
    call = f'{CALL_OPEN}{{"name": "get_time", "arguments": {{"zone": "X"}}}}{CALL_CLOSE}'
    read = read_calls(call + "\n<tool_ca", TOOLS, auto)
    assert [c.name for c in read.calls] == ["get_time"] and read.content is None
    # and so is one more call cut short inside its block
    read = read_calls(f'Sure.{call}\n{CALL_OPEN}{{"name": "get_weather", "argu', TOOLS, auto)
    assert [c.name for c in read.calls] == ["get_time"] and read.content == "Sure.\n"


def test_required_and_named_answers() -> None:
    required = ToolChoice("required")
    answer = json.dumps([{"name": "get_time", "arguments": {"zone": "UTC"}},
                         {"name": "get_weather", "arguments": {"city": "Rome"}}])
    read = read_calls(answer, TOOLS, required)
    assert [c.name for c in read.calls] == ["get_time", "get_weather"] and read.content is None
    cut = answer[:30]  # cut short by max_tokens before a call ends: returned as text
    assert read_calls(cut, TOOLS, required).calls == () and read_calls(cut, TOOLS, required).content == cut
    for end in (answer.index("get_weather") - 10, answer.index("Rome") + 3):  # cut in the second call
        read = read_calls(answer[:end], TOOLS, required)  # the first call, and no JSON left as content
        assert [(c.name, json.loads(c.arguments)) for c in read.calls] == [("get_time", {"zone": "UTC"})]
        assert read.content is None
    named = read_calls('{"city": "Rome"}', TOOLS, ToolChoice("named", "get_weather"))
    assert [(c.name, c.arguments) for c in named.calls] == [("get_weather", '{"city": "Rome"}')]


def test_the_call_format_holds_answers_to_the_tools_schemas() -> None:
    """The grammar of ``required`` accepts a list of calls of the listed tools, each with
    its own parameters, and refuses an unknown tool or a wrong argument; ``parallel``
    false allows one call."""
    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])

    def accepts(spec, text: str) -> bool:
        m = grammars.matcher(spec)
        ok = m.consume_tokens(tok.encode(text)) and not m.is_error()
        return ok and m.is_accepting()

    assert call_format(TOOLS, ToolChoice("auto")) is None and call_format(TOOLS, ToolChoice("none")) is None
    spec = call_format(TOOLS, ToolChoice("required"))
    good = '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {"zone": "A"}}]'
    assert accepts(spec, good)
    assert not accepts(spec, '[{"name": "launch", "arguments": {}}]')
    assert not accepts(spec, '[{"name": "get_weather", "arguments": {"town": "Rome"}}]')
    assert not accepts(spec, "[]")
    assert not accepts(call_format(TOOLS, ToolChoice("required"), parallel=False), good)
    named = call_format(TOOLS, ToolChoice("named", "get_weather"))
    assert accepts(named, '{"city": "Rome"}') and not accepts(named, '{"zone": "A"}')
    # references stay with their tool: a nested model's $defs (as openai.pydantic_function_tool
    # writes it), old-style definitions, and a recursive schema's "#"
    nested = parse_tools([
        {"type": "function", "function": {"name": "weather", "parameters": {
            "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                              "additionalProperties": False}},
            "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
            "additionalProperties": False}}},
        {"type": "function", "function": {"name": "tree", "parameters": {
            "type": "object", "properties": {"v": {"type": "integer"},
                                             "kids": {"type": "array", "items": {"$ref": "#"}},
                                             "tag": {"$ref": "#/definitions/Tag"}},
            "definitions": {"Tag": {"enum": ["a", "b"]}}, "required": ["v"], "additionalProperties": False}}}])
    spec = call_format(nested, ToolChoice("required"))
    assert accepts(spec, '[{"name": "weather", "arguments": {"loc": {"city": "Oslo"}}}, '
                         '{"name": "tree", "arguments": {"v": 1, "kids": [{"v": 2, "kids": []}], "tag": "a"}}]')
    assert not accepts(spec, '[{"name": "weather", "arguments": {"loc": {"town": "Oslo"}}}]')
    assert not accepts(spec, '[{"name": "tree", "arguments": {"v": 1, "kids": [{"v": "x"}]}}]')
    assert not accepts(spec, '[{"name": "tree", "arguments": {"v": 1, "tag": "c"}}]')
    # arguments are an object: a schema of another type is refused, an empty one means an object
    with pytest.raises(ConfigError, match="must describe an object"):
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    empty = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert accepts(call_format(empty, ToolChoice("named", "f")), "{}")
    assert not accepts(call_format(empty, ToolChoice("named", "f")), "7")
    # ... also when the schema has no type of its own (a $ref or anyOf): no object fits, refused
    for params in ({"$ref": "#/$defs/A", "$defs": {"A": {"type": "string"}}},
                   {"anyOf": [{"type": "string"}, {"type": "integer"}]}):
        with pytest.raises(ConfigError, match="no JSON object fits it"):
            parse_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])
    mixed = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "string"}]}}}])
    assert accepts(call_format(mixed, ToolChoice("named", "f")), '{"a": 1}')
    assert not accepts(call_format(mixed, ToolChoice("named", "f")), '"text"')
    # a tool schema with an $id of its own keeps its references when moved under the list's $defs
    with_id = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "$id": "urn:example:a", "type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}, "required": ["a"],
        "$defs": {"B": {"type": "integer"}}}}}])
    assert accepts(call_format(with_id, ToolChoice("required")), '[{"name": "f", "arguments": {"a": 1}}]')
    # ... and only the schema's own: a property named "$id" stays
    named_id = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"$id": {"type": "integer"}}, "required": ["$id"],
        "additionalProperties": False}}}])
    required = call_format(named_id, ToolChoice("required"))
    assert accepts(required, '[{"name": "f", "arguments": {"$id": 3}}]')
    assert not accepts(required, '[{"name": "f", "arguments": {"$id": "x"}}]')


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    """The default model's template knows no tools: SoT writes them, earlier calls and their
    results in its own format, and the prompt ends where the assistant answers."""
    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo and Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "c2", "function": {
                    "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"},
                {"role": "tool", "tool_call_id": "c2", "content": "sun"}]
    out, extra = chat_messages(messages, TOOLS, tok)
    assert extra == {} and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_time"' in out[0]["content"]
    assert out[2]["content"].count(CALL_OPEN) == 2 and '"arguments": {"city": "Rome"}' in out[2]["content"]
    assert out[3]["content"] == "<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n</tool_response>"
    text = tok.decode(encode(tok, {"messages": messages, "tools": [WEATHER, CLOCK]}, chat=True))
    assert text.endswith("<|im_start|>assistant\n") and "<tools>" in text and "sun\n</tool_response>" in text
    no_tools, _ = chat_messages(messages[:2], (), tok)
    assert no_tools == messages[:2]


def test_a_template_with_tools_renders_them_itself() -> None:
    template = ("{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
                "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
                "{% endfor %}\n{% endfor %}")
    tok = SimpleNamespace(chat_template=template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    out, extra = chat_messages(messages, TOOLS, tok)
    assert [t["function"]["name"] for t in extra["tools"]] == ["get_weather", "get_time"]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object, as templates expect
    real = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    real.chat_template = template
    text = real.decode(encode(real, {"messages": messages, "tools": [WEATHER]}, chat=True))
    assert text.startswith("TOOLS get_weather\n") and "CALL get_weather Oslo" in text
    with pytest.raises(ConfigError, match="not JSON"):
        chat_messages([{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}], (), tok)


def test_the_library_reads_calls_and_stays_exact() -> None:
    """``SoT.generate(tools=..., tool_choice="required")`` with the default model and its
    drafter: the calls are read into ``tool_calls`` and the tokens are plain decoding's."""
    from sot import SoT

    ask = dict(max_new_tokens=60, tools=[WEATHER, CLOCK], tool_choice="required")
    prompt = ["What is the weather in Oslo?"]
    spec = SoT.load(dtype="float32").generate(prompt, **ask)[0]
    plain_sot = SoT.load(dtype="float32", drafter="none")
    plain = plain_sot.generate(prompt, **ask)[0]
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "stop"
    assert len(spec.tool_calls) >= 1 and spec.tool_calls == [
        {**c, "id": s["id"]} for c, s in zip(plain.tool_calls, spec.tool_calls)]
    for call in spec.tool_calls:
        assert call["function"]["name"] in ("get_weather", "get_time") and call["id"].startswith("call_")
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert "tool_calls" in spec.to_dict()
    with pytest.raises(ConfigError, match="fixes the answer's form"):
        plain_sot.generate(prompt, structured=call_format(TOOLS, ToolChoice("required")), **ask)
    with pytest.raises(ConfigError, match="through the chat template"):
        plain_sot.generate(prompt, chat=False, **ask)
